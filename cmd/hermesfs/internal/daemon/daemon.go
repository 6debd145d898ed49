package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/lazy"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
	"path"
)

// The daemon of `hermesfs mount`. The README section "hermesfs mount" says
// what it does; this is how.
//
// Life: boot (lock the state dir, open the store, take the lease, decide the
// lower layer, mount) -> serve (ready line, READY=1, control socket, timer)
// -> stop (final snapshot, which seals the mount, unmount, rebase, release:
// stop.go).
// A signal during boot aborts it; once ready, a signal starts stop, which
// runs to its end on its own deadline (--stop-timeout).
//
// Goroutines: the main one runs the serve loop and then stop; each periodic
// snapshot and each control request runs on its own goroutine; the lease
// heartbeats on another. Lock order: snapMu (one snapshot at a time), then
// mu (the fields status reads). Nothing holds mu across I/O.
//
// What survives a crash is on disk, never only in memory: state.json says
// which archive the upper layer sits on and whether the upper layer may hold
// unpublished changes (true from boot until a clean stop), so a restart
// publishes whatever a crash left, and refuses rather than guesses when
// another host published in between.

// daemon is one running `hermesfs mount`.
type daemon struct {
	cfg   *Config
	e     *env
	root  *slog.Logger // the process logger, for parts that add their own attributes
	base  *slog.Logger // root with the mountpoint; parts add their component
	log   *slog.Logger // component=daemon
	parts parts
	sd    *stateDir
	cat   catalog
	lease lease
	host  string // hostname-<random>, one per state dir: names this writer in snapshot ids, manifests and the lease
	// encryption is how new snapshots are encrypted (nil: plaintext);
	// set when the catalog opens.
	encryption *encryptionInfo

	ov overlay

	met *daemonMetrics // nil without --metrics-addr

	// snapMu serialises snapshots: the periodic tick, `hermesfs snapshot`
	// and the final one never overlap.
	snapMu sync.Mutex

	mu sync.Mutex // guards everything below
	st persistedState
	// publishedGen is the overlay generation of the last published view;
	// pending is true while the upper layer holds changes from before this
	// mount that no snapshot has (a crash, a failed final upload).
	publishedGen uint64
	pending      bool
	// adopted is what this boot took in from the mountpoint directory
	// (underneath.go), for status.
	adopted []fs.Adopted
	// expect is the LATEST value the next publish must replace: our last
	// published id normally, another host's with --on-conflict keep-local.
	expect     string
	last       *snapshotRecord
	count      int
	nextDue    time.Time
	inProgress bool
	lastErr    string
	lastErrAt  time.Time
	// lastErrStore: the last error was the store's or a publish's;
	// lastErrOver is when something (lastErrOverBy) showed it over.
	lastErrStore  bool
	lastErrOver   time.Time
	lastErrOverBy string
	leaseState    string
	// leaseGone: the lease was lost and another host has published
	// since; it is never taken again (reacquireLease).
	leaseGone bool
	started   time.Time
	// changes and sched: when the changes not in the store were made,
	// and the snapshots the serve loop starts (writeback.go).
	changes changeLog
	sched   scheduler

	// roBase is the snapshot a read-only mount shows.
	roBase string
	// lastPrune is when the last prune after a snapshot started.
	lastPrune time.Time
	// imgs are the snapshot images open (daemon_images.go); the lower
	// layer is lowerImage, read through lowerReader. lazyBoot: the base
	// was not complete in the cache at boot; verifyBase: it was fetched
	// whole at boot, and is verified block by block once the mount is
	// ready.
	imgs        *images
	lowMu       sync.Mutex // guards lowerImage and lowerReader
	lowerImage  *openImage
	lowerReader *archive.Reader
	lazyBoot    bool
	verifyBase  bool
	// hot records the chunks the mount reads first (daemon_lazy.go).
	hot *lazy.HotFiles
	// bgCtx bounds snapshots other than the final one; stop cancels it
	// when the stop timeout is near.
	bgCtx    context.Context
	bgCancel context.CancelFunc

	// newStoreDir is the local store directory this boot creates, named
	// explicitly but missing (checkStoreConfig).
	newStoreDir string

	// relet passes the serve loop the Lost channel of a lease taken again.
	relet chan (<-chan struct{})

	// compact is the background compaction (daemon_compact.go); d.mu.
	compact compactState

	// The stop (stop.go): what it does now and since when (status shows
	// it), when it gives up, and whether a second signal abandoned its
	// final snapshot.
	stopStep  stopStep
	stopPhase string
	stopSince time.Time
	stopBy    time.Time
	abandoned atomic.Bool

	// While the lease is awaited at boot (leasewait.go): booting until
	// the mount is ready (status then reports waiting alone, snapshots
	// are refused); waiting is what it waits for; the mount shown
	// meanwhile is d.ov over the lower layer shown (showing says what
	// it is, offline: the state dir's, the store not answering).
	// previewing: decideBase decides what to show, not what to write
	// on; refuseWrites: the next mount refuses changes. ctl is the
	// control socket, listening from the wait on.
	booting      bool
	waiting      *waitReport
	shown        string
	showing      string
	offline      bool
	previewing   bool
	previewErr   string
	refuseWrites bool
	ctl          *controlServer
	// underneath: the mountpoint directory, opened before the mount
	// shown while waiting covered it (underneathWaits).
	underneath *os.File

	stopOnce  sync.Once
	stopCh    chan struct{}
	result    shutdownResult // set before resultSet is closed
	resultSet chan struct{}
}

// runDaemon runs the daemon in the foreground until a signal (ctx),
// `hermesfs umount` or the mount going away; it returns the exit error.
func runDaemon(ctx context.Context, e *env, cfg *Config, p parts) error {
	d := &daemon{
		cfg: cfg, e: e, parts: p,
		stopCh:    make(chan struct{}),
		resultSet: make(chan struct{}),
		started:   time.Now(),
		booting:   true,
	}
	d.root = e.Logger
	if d.root == nil {
		d.root = newLogger(os.Stderr, cfg.LogFormat, cfg.LogLevel)
	}
	d.base = d.root.With("mountpoint", cfg.Mountpoint)
	d.log = d.base.With("component", "daemon")

	var err error
	if d.met, err = newDaemonMetrics(d, cfg.MetricsAddr); err != nil {
		return err
	}
	defer d.met.close()
	err = d.boot(ctx)
	d.clearBootStatus()
	if err != nil {
		d.cleanupBoot(true)
		return d.endBoot(err)
	}
	d.met.ready()
	return d.serve(ctx)
}

// listen starts the control socket and registers the mount for `hermesfs
// status`, once: at the wait for the lease, else once the mount is ready.
func (d *daemon) listen() error {
	if d.ctl != nil {
		return nil
	}
	ctl, err := listenControl(d.sd.socket(), d, d.log)
	if err != nil {
		return err
	}
	d.ctl = ctl
	rdir := RuntimeDir(os.Getuid(), d.e.Getenv)
	if err := registerMount(rdir, registryEntry{Mountpoint: d.cfg.Mountpoint, StateDir: d.sd.path, Socket: d.sd.socket(), PID: os.Getpid(), Store: d.st.Store}); err != nil {
		d.log.Warn("cannot register the mount for 'hermesfs status'", "err", err)
	}
	return nil
}

// endBoot finishes a boot that failed or was stopped (err) once it is
// cleaned up: a `hermesfs umount` waiting on the control socket gets the
// outcome, the registry records the stop. A stop while waiting for the
// lease is no failure: its code is the outcome's.
func (d *daemon) endBoot(err error) error {
	res := shutdownResult{Code: ExitCode(err), Error: err.Error()}
	var stopped *errStoppedWaiting
	if errors.As(err, &stopped) {
		res.Code = stopped.code
		if res.Code == exitOK {
			d.log.Info("stopped", "why", stopped.why)
			err = nil
		} else {
			err = withCode(res.Code, errors.New(stopped.why))
		}
	}
	if d.ctl != nil {
		d.result = res
		close(d.resultSet)
		d.ctl.close(5 * time.Second)
		markStopped(RuntimeDir(os.Getuid(), d.e.Getenv), d.cfg.Mountpoint, os.Getpid())
	}
	return err
}

// notify puts status on the systemd status line (STATUS=).
func (d *daemon) notify(status string) {
	sdNotify(d.e.Getenv, "STATUS="+status)
}

func (d *daemon) setErr(err error) {
	d.mu.Lock()
	d.lastErr, d.lastErrAt = err.Error(), time.Now()
	d.lastErrStore, d.lastErrOver, d.lastErrOverBy = false, time.Time{}, ""
	d.mu.Unlock()
}

// setStoreErr records an error of the store or of publishing, which the
// next snapshot that publishes (or the lease taken again) ends: status
// then shows it as over (resolveStoreErr).
func (d *daemon) setStoreErr(err error) {
	d.setErr(err)
	d.mu.Lock()
	d.lastErrStore = true
	d.mu.Unlock()
}

// resolveStoreErr marks the last error over, if it is the store's, by
// what ended it.
func (d *daemon) resolveStoreErr(by string) {
	d.mu.Lock()
	if d.lastErrStore && d.lastErrOver.IsZero() {
		d.lastErrOver, d.lastErrOverBy = time.Now(), by
	}
	d.mu.Unlock()
}

// boot goes from nothing to a ready mount.
func (d *daemon) boot(ctx context.Context) error {
	cfg := d.cfg
	mp, err := ResolveMountpoint(cfg.Mountpoint)
	if err != nil {
		return err
	}
	if mp != cfg.Mountpoint {
		d.log.Info("the mountpoint is a symlink: mounting on the directory it names", "symlink", cfg.Mountpoint, "target", mp)
		cfg.Mountpoint = mp
		d.base = d.root.With("mountpoint", mp)
		d.log = d.base.With("component", "daemon")
	}
	if cfg.StateDir == "" {
		sd, err := DefaultStateDir(cfg.Mountpoint, os.Getuid(), d.e.Getenv)
		if err != nil {
			return err
		}
		cfg.StateDir = sd
	}
	if err := d.checkStoreConfig(); err != nil {
		return err
	}
	if err := checkFUSE(); err != nil {
		return err
	}
	if fs.IsMountpoint(cfg.Mountpoint) {
		if err := d.clearMountpoint(ctx); err != nil {
			return err
		}
	}
	fi, err := os.Stat(cfg.Mountpoint)
	if err != nil {
		return fmt.Errorf("mountpoint: %w (create the directory first)", err)
	}
	if !fi.IsDir() {
		return fmt.Errorf("mountpoint %s: not a directory", cfg.Mountpoint)
	}

	sd, err := d.lockStateDir(cfg.StateDir)
	if err != nil {
		return err
	}
	d.sd = sd
	d.st, err = sd.load()
	if err != nil {
		return err
	}
	if d.st.Mountpoint != "" && d.st.Mountpoint != cfg.Mountpoint {
		return usageError("state dir %s belongs to mountpoint %s, not %s", sd.path, d.st.Mountpoint, cfg.Mountpoint)
	}
	if d.st.Host == "" {
		d.st.Host = newHostID()
	}
	d.host = d.st.Host
	d.st.Mountpoint = cfg.Mountpoint
	d.st.Store = d.parts.storeURL(d)

	// Temporary files of a pack or download a crash interrupted. (A
	// segment a crash left in pack/ stays until the base is decided: it
	// may be the proof that an unrecorded snapshot in the store is ours.)
	for _, pat := range []string{"pack/.*.tmp*", "cache/download.sqfs*", "cache/.*.tmp*", "cache/segments/.*.tmp*"} {
		olds, _ := filepath.Glob(filepath.Join(sd.path, pat))
		for _, o := range olds {
			os.Remove(o)
		}
	}

	d.notify("opening the store " + d.st.Store)
	d.cat, err = d.parts.openCatalog(ctx, d)
	if err != nil {
		return fmt.Errorf("store %s: %w", d.st.Store, err)
	}
	if d.newStoreDir != "" {
		d.log.Warn("NEW EMPTY STORE: the store directory did not exist and was created; if you meant an existing store, stop now and check --store (a typo?)", "store", d.newStoreDir)
	}

	if cfg.ReadOnly {
		d.leaseState = "none"
	} else if err := d.takeLease(ctx); err != nil {
		// Waited for (leasewait.go) if it may be.
		return err
	}

	lower, err := d.decideBase(ctx)
	if d.ov != nil && (errors.Is(err, errRemount) || err == nil && lower != d.shown) {
		// The tree shown while waiting for the lease is not the one to
		// write on (LATEST moved, or the local changes go aside):
		// replace it, deciding again with the upper layer free.
		d.log.Info("the tree shown while waiting is not the one to write on: replacing it before any write", "shown", OrNone(d.showing), "latest", OrNone(d.expect))
		d.dropPreview()
		lower, err = d.decideBase(ctx)
	} else if d.ov != nil && err == nil && d.underneathWaits(ctx) {
		// Files written into the mountpoint directory before the home
		// was shown over it: a mount takes them in before it covers
		// the directory (underneath.go).
		d.log.Info("the mountpoint directory underneath the tree shown while waiting holds files to take in: mounting again before any write", "shown", OrNone(d.showing))
		d.dropPreview()
		lower, err = d.decideBase(ctx)
	}
	if err != nil {
		return err
	}
	if l, ok := d.lease.(interface{ SetBase(string) }); ok && d.st.Base != "" {
		l.SetBase(d.st.Base) // the lease names it: prune keeps it
	}
	shown := d.ov != nil // the tree shown while waiting is the one decided
	if !shown {
		d.notify("mounting " + cfg.Mountpoint)
		ov, err := d.parts.mount(ctx, d, lower)
		if err != nil {
			return fmt.Errorf("mount %s: %w", cfg.Mountpoint, err)
		}
		d.mu.Lock()
		d.ov = ov
		d.mu.Unlock()
	}
	d.publishedGen = d.ov.Generation()
	d.st.CleanShutdown = false
	if !cfg.ReadOnly {
		// While the daemon runs the upper layer may hold anything: a
		// crash from here on must publish it at the next start.
		d.st.Unpublished = true
		if err := sd.save(d.st); err != nil {
			return err
		}
		// Only now that the state (and what decideBase made of them) is
		// saved: next.sqfs may be the proof that LATEST is ours, needed
		// again if this boot fails before the save. A read-only mount
		// saves nothing and leaves it to the writer.
		os.Remove(filepath.Join(d.sd.packDir(), "next.seg"))
	}
	if shown {
		// Writable as it is, with no remount; only now that state.json
		// says the upper layer may hold unpublished changes.
		d.ov.AllowWrites()
		d.log.Info("the writer lease is ours: the mount is writable", "snapshot", OrNone(d.st.Base), "waited", time.Since(d.started).Round(time.Millisecond))
	}
	return nil
}

// checkStoreConfig refuses, before anything is created, a store URL that
// cannot be right (a usage error, exit 2) and encryption settings that
// cannot be used (Options.Encryption's error, as it is).
func (d *daemon) checkStoreConfig() error {
	raw, o, err := d.e.Store(nil)
	if err != nil {
		return err
	}
	loc, err := storeurl.Parse(raw, o)
	if err != nil {
		return usageError("%v", err)
	}
	if loc.Scheme == "file" && raw != "" && !d.cfg.ReadOnly {
		// A store named by a path that does not exist is most likely a
		// typo: a new store is made only where its parent exists, and
		// said loudly (newStoreDir).
		if _, err := os.Stat(loc.Dir); errors.Is(err, iofs.ErrNotExist) {
			parent := filepath.Dir(loc.Dir)
			if _, err := os.Stat(parent); err != nil {
				return usageError("store %s: the directory does not exist, nor its parent %s (a typo?); to start a new store there, create the parent first (mkdir -p %s)", loc.Dir, parent, parent)
			}
			d.newStoreDir = loc.Dir
		}
	}
	var co uploader.CatalogOptions
	return d.e.Encryption(&co)
}

// cleanupBoot undoes what a failed boot set up; refused: the boot did
// not go ahead, so the parts of the state dir it created and left empty
// go too (a refused mount changes nothing in the state dir).
func (d *daemon) cleanupBoot(refused bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if d.underneath != nil {
		d.underneath.Close()
		d.underneath = nil
	}
	if d.ov != nil {
		d.ov.Unmount(ctx)
	}
	d.closeImages()
	if d.lease != nil {
		d.lease.Release(ctx)
	}
	if d.cat != nil {
		d.cat.Close()
	}
	if d.sd != nil {
		if refused {
			// A state dir this boot made goes whole unless a seed
			// published from it.
			d.sd.removeCreated(d.st.LastPublished == "")
		}
		d.sd.close()
	}
}

// decideBase chooses the lower archive and whether the upper layer must
// be published, and returns the archive's path ("" = empty lower).
func (d *daemon) decideBase(ctx context.Context) (string, error) {
	cfg, st := d.cfg, &d.st
	latest, err := d.cat.Latest(ctx)
	if err != nil {
		return "", fmt.Errorf("store %s: read LATEST: %w", st.Store, err)
	}
	if cfg.ReadOnly {
		// A read-only mount shows the newest snapshot, nothing local, and
		// leaves the state (base, cache, upper) of a writer untouched.
		if latest.ID == "" {
			return "", nil
		}
		dir := filepath.Join(d.sd.path, "ro-cache")
		os.RemoveAll(dir)
		if err := d.newImages(dir); err != nil {
			return "", err
		}
		got, err := d.bootNewest(ctx, latest.ID)
		if err != nil {
			return "", fmt.Errorf("open the newest snapshot: %w", err)
		}
		d.roBase = got
		return d.sd.cached(got), nil
	}
	if err := d.openCache(); err != nil {
		return "", err
	}
	// Decided anew: a decision made while the lease was awaited (what to
	// show) may have found local changes that this one sets aside.
	d.pending = false
	// inUse: the mount shown while the lease was awaited (leasewait.go)
	// serves the upper layer: nothing may move it; a decision that
	// would is errRemount, taken before anything changes.
	inUse := d.ov != nil

	changed, err := fs.UpperHasChanges(d.sd.upper())
	if err != nil {
		return "", fmt.Errorf("state dir: %w", err)
	}
	upperEmpty := !changed
	if empty, _ := DirEmpty(d.sd.upper()); upperEmpty && !empty && !inUse {
		// Only the overlay's bookkeeping: start the new mount without it.
		if err := d.clearUpper("unchanged"); err != nil {
			return "", err
		}
	}
	local := !upperEmpty && (st.Unpublished || !st.CleanShutdown)
	if !upperEmpty && !local {
		// A clean stop that could not rebase: everything in the upper
		// layer is published (in LastPublished, or it holds nothing but
		// the overlay's own bookkeeping when LastPublished is empty).
		mine := st.LastPublished
		if mine == "" {
			mine = st.Base
		}
		if mine != "" && latest.ID == mine {
			// Base + upper is LATEST: no download.
			d.expect = latest.Pointer
			return d.baseFile(ctx, st.Base)
		}
		// LATEST moved on. The upper layer is dropped only if the store
		// still holds the snapshot it went into: an emptied prefix, a
		// different --store or a pruned snapshot must not cost the only
		// copy left.
		stored := false
		if mine != "" && latest.ID != "" {
			if stored, err = d.cat.Has(ctx, mine); err != nil {
				return "", fmt.Errorf("store %s: %w", st.Store, err)
			}
		}
		if stored {
			if inUse {
				return "", errRemount
			}
			if err := d.clearUpper("published"); err != nil {
				return "", err
			}
			st.LastPublished = ""
		} else {
			d.log.Warn("the store does not hold the snapshot the local changes went into; treating them as unpublished", "snapshot", OrNone(mine), "latest", OrNone(latest.ID))
			local = true
		}
	}
	if local {
		ours := st.LastPublished
		if ours == "" {
			ours = st.Base
		}
		// A crash between a publish and the state.json update leaves
		// LATEST on a snapshot of ours that state.json does not name: its
		// manifest says this host made it on top of what we know.
		// The first snapshot has no parent to go by; its archive, still
		// in the pack dir, proves it is ours.
		oursUnrecorded := latest.Host == d.host && (latest.Parent != "" &&
			(latest.Parent == st.LastPublished || latest.Parent == st.Base) ||
			latest.Parent == "" && st.Base == "" && st.LastPublished == "" && d.packedHere(latest))
		switch {
		case latest.ID == "" || latest.ID == st.Base || latest.ID == st.LastPublished || oursUnrecorded:
			d.pending, d.expect = true, latest.Pointer
			if oursUnrecorded {
				// The next snapshot's parent. A compaction of our last
				// one keeps its inode numbers; how another snapshot
				// numbers the lower layer's inodes is not known: the
				// next pack extends the lower image (daemon_extend.go).
				numbers := ""
				if latest.Compacts != "" && latest.Compacts == st.LastPublished && keepsLowerNumbers(st, st.LastPublished) {
					numbers = st.Base
				}
				st.LastPublished, st.LastNumbersOf = latest.ID, numbers
			}
			d.log.Info("local changes found in the state dir; mounting them over their base and publishing them", "base", OrNone(st.Base), "latest", OrNone(latest.ID))
			return d.baseFile(ctx, st.Base)
		case cfg.OnConflict == "keep-local":
			d.pending, d.expect = true, latest.Pointer
			d.log.Warn("another host published since our changes; keeping ours (--on-conflict keep-local): the next snapshot replaces theirs as LATEST", "ours", OrNone(ours), "theirs", latest.ID)
			return d.baseFile(ctx, st.Base)
		case cfg.OnConflict == "discard-local":
			if inUse {
				return "", errRemount
			}
			to, err := setAside(d.sd.upper(), "discarded")
			if err != nil {
				return "", err
			}
			if err := os.MkdirAll(d.sd.upper(), 0o700); err != nil {
				return "", err
			}
			d.log.Warn("another host published since our changes; discarding ours (--on-conflict discard-local): moved aside, not deleted", "ours", OrNone(ours), "theirs", latest.ID, "moved_to", to)
			st.LastPublished, st.Unpublished = "", false
		default:
			return "", withCode(exitConflict, fmt.Errorf(
				"the state dir %s holds local changes based on snapshot %s, but another host has published %s since; "+
					"choose with --on-conflict keep-local (publish ours over theirs) or --on-conflict discard-local (set ours aside and mount theirs)",
				d.sd.path, OrNone(ours), latest.ID))
		}
	}

	d.expect = latest.Pointer
	if latest.ID != "" {
		return d.fetchBase(ctx, latest.ID)
	}
	// An empty store. A non-empty directory at the mountpoint (a user's
	// real home) becomes the first snapshot, so nothing is hidden by the
	// mount and the original stays untouched underneath.
	empty, err := DirEmpty(cfg.Mountpoint)
	if err != nil {
		return "", fmt.Errorf("mountpoint: %w", err)
	}
	if d.previewing {
		// Nothing published to show, and a seed publishes: that waits
		// for the lease. The mountpoint directory stays in view.
		return "", errNothingToShow
	}
	if empty {
		d.log.Info("empty store and empty mountpoint: starting from an empty tree")
		st.Base = ""
		return "", nil
	}
	return d.seed(ctx)
}

// openCache migrates what an older hermesfs left in the state dir and
// opens the image pool over its cache, once: the images of a mount shown
// while the lease was awaited stay open in it.
func (d *daemon) openCache() error {
	if d.imgs != nil {
		return nil
	}
	if err := d.migrateCache(); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	return d.newImages(d.sd.segmentsDir())
}

// seed publishes the mountpoint directory's contents as the first snapshot
// and makes it the base.
func (d *daemon) seed(ctx context.Context) (string, error) {
	t0 := time.Now()
	d.notify("seeding the store: packing " + d.cfg.Mountpoint + " as the first snapshot")
	d.log.Info("seeding the store: packing the mountpoint directory as the first snapshot", "dir", d.cfg.Mountpoint)
	// What the pack reads is in the snapshot; what changes from now on
	// is taken in at this boot's look underneath (underneath.go).
	d.st.UnderneathChecked = d.underneathMark()
	out := filepath.Join(d.sd.packDir(), "next.seg")
	progress := newSeedProgress(d)
	progress.started()
	ps, err := d.parts.packDir(ctx, d.cfg.Mountpoint, out, progress.packed)
	if err != nil {
		return "", fmt.Errorf("seed from %s: %w", d.cfg.Mountpoint, err)
	}
	progress.packDone(ps)
	packTime := time.Since(t0)
	t1 := time.Now()
	d.notify(fmt.Sprintf("seeding the store: uploading the first snapshot (%s, %d files)", HumanBytes(ps.Segment), ps.Files))
	var pr uploader.Published
	err = contain(func() (err error) {
		in := uploader.ImageInput{Segment: out, Extents: ps.Extents, Files: ps.Files, MetaOffset: ps.MetaOffset, Progress: progress.uploaded}
		if d.cfg.Standalone {
			// The first image is its one segment.
			f, err := os.Open(out)
			if err != nil {
				return err
			}
			defer f.Close()
			in.Standalone, in.Image = true, f
		}
		pr, err = d.cat.PublishImage(ctx, in)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("seed from %s: publish: %w", d.cfg.Mountpoint, err)
	}
	d.met.seedPublished(ps, pr, time.Since(t0))
	if err := d.adoptSegment(out, pr); err != nil {
		return "", err
	}
	if _, _, err := d.bootImage(ctx, pr.ID, &pr.Manifest); err != nil {
		return "", err
	}
	d.log.Info("seeded the store from the existing directory", "id", pr.ID, "files", ps.Files,
		"bytes_packed", ps.BytesPacked, "size", ps.Size, "pack", packTime.Round(time.Millisecond), "upload", time.Since(t1).Round(time.Millisecond))
	d.st.Base, d.st.LastPublished, d.st.PublishedAt, d.st.CompactedExtents = pr.ID, pr.ID, time.Now().UTC(), pr.ExtentCount
	d.expect = pr.ID
	return d.sd.cached(pr.ID), d.sd.save(d.st)
}

// adoptSegment moves the segment just published from the file out into
// the cache (cache/segments, under the name the store gives it), with its
// digests, the extents list and the manifest: the image reads from there
// without asking the store.
func (d *daemon) adoptSegment(out string, p uploader.Published) error {
	dir := d.sd.segmentsDir()
	if p.Segment != "" {
		if err := os.Rename(out, filepath.Join(dir, image.PlainName(p.Segment))); err != nil {
			return fmt.Errorf("cache the new segment: %w", err)
		}
		if err := uploader.WriteFileAtomic(filepath.Join(dir, image.PlainName(p.Segment)+uploader.SumsExt), p.SegmentSums, 0o600); err != nil {
			return err
		}
		if len(p.SegmentHeader) > 0 {
			// The identities are checked against it at the next boot,
			// which may find the store silent (Image.CheckIdentities).
			if err := uploader.WriteFileAtomic(filepath.Join(dir, image.PlainName(p.Segment)+image.HeaderExt), p.SegmentHeader, 0o600); err != nil {
				return err
			}
		}
	} else {
		os.Remove(out)
	}
	if err := uploader.WriteFileAtomic(filepath.Join(dir, path.Base(p.Extents)), p.ExtentsList, 0o600); err != nil {
		return err
	}
	if err := d.saveManifest(p.Manifest); err != nil {
		return err
	}
	return uploader.SyncDir(dir)
}

// baseFile opens the image of base, the snapshot the upper layer's
// changes are relative to: from the cache, else through the store. "" is
// the empty lower layer.
func (d *daemon) baseFile(ctx context.Context, base string) (string, error) {
	if base == "" {
		return "", nil
	}
	if _, err := d.openBase(ctx, base); err != nil {
		return "", fmt.Errorf("base snapshot %s (the upper layer's changes are relative to it): %w", base, err)
	}
	return d.sd.cached(base), nil
}

// openBase opens snapshot id's image as the base to mount (see bootImage).
// A snapshot whose manifest has no chunk digests (format 1, an older
// hermesfs's) is downloaded whole into the cache first.
func (d *daemon) openBase(ctx context.Context, id string) (*openImage, error) {
	t0 := time.Now()
	d.notify("opening snapshot " + id)
	o, complete, err := d.bootImage(ctx, id, nil)
	if errors.Is(err, image.ErrNoDigests) {
		m, merr := d.cachedManifest(ctx, id)
		if merr != nil {
			return nil, merr
		}
		d.log.Info("the snapshot has no chunk digests (an older hermesfs made it); downloading it whole", "id", id)
		d.notify("downloading snapshot " + id + " whole (an older hermesfs made it)")
		dst := filepath.Join(d.sd.segmentsDir(), image.PlainName(m.Archive))
		if _, err := d.cat.Fetch(ctx, id, dst); err != nil {
			return nil, err
		}
		d.verifyBase = true
		o, complete, err = d.bootImage(ctx, id, &m)
	}
	if err == nil {
		// An encrypted snapshot complete in the cache reads without a
		// key: the identities are checked against it all the same, so
		// that a wrong or missing --identity is refused (exit 6) here,
		// not on the next host.
		err = o.im.CheckIdentities(ctx)
	}
	if err != nil {
		return nil, bootError(err)
	}
	st := o.im.Stats()
	man := o.im.Manifest()
	d.lazyBoot = !complete
	if !d.cfg.Lazy && d.lazyBoot {
		d.verifyBase = true
	}
	d.lowMu.Lock()
	d.lowerImage = o
	d.lowMu.Unlock()
	if d.lazyBoot && d.cfg.Lazy {
		d.log.Info("booting lazily: data is fetched as it is read and filled in the background", "id", id, "size", o.im.Size(),
			"segments", len(man.Segments), "present_bytes", st.PresentBytes, "metadata_fetch", time.Since(t0).Round(time.Millisecond),
			"hot_chunks", len(man.Hot), "encrypted", man.Encryption != nil)
	} else {
		d.log.Info("base snapshot open", "id", id, "size", o.im.Size(), "in_cache", complete, "took", time.Since(t0).Round(time.Millisecond))
	}
	return o, nil
}

// bootNewest opens the newest snapshot that opens, starting at id: a
// damaged one is skipped, loudly, for the next older one. A snapshot the
// identities do not open stops the boot (never a fallback to older data
// it could read), as does a failure of the store itself.
func (d *daemon) bootNewest(ctx context.Context, id string) (string, error) {
	ids, err := d.cat.Older(ctx, id)
	if err != nil {
		return "", err
	}
	var skipped []error
	for _, cand := range append([]string{id}, ids...) {
		_, err := d.openBase(ctx, cand)
		if err == nil {
			for _, s := range skipped {
				d.log.Error("snapshot is corrupt in the store; fell back to an older one", "corrupt", s, "using", cand)
			}
			if len(skipped) > 0 {
				d.setErr(fmt.Errorf("snapshot %s is corrupt in the store; booted from %s: %w", id, cand, skipped[0]))
			}
			return cand, nil
		}
		if isKeyError(err) || !errors.Is(err, uploader.ErrCorrupt) && !errors.Is(err, archive.ErrCorrupt) {
			return "", bootError(err)
		}
		d.closeImage(cand)
		skipped = append(skipped, err)
	}
	return "", withCode(exitCorrupt, fmt.Errorf("every snapshot failed verification: %w", errors.Join(skipped...)))
}

// fetchBase makes snapshot id (or an older one that verifies) the base.
func (d *daemon) fetchBase(ctx context.Context, id string) (string, error) {
	st := &d.st
	got, err := d.bootNewest(ctx, id)
	if err != nil {
		return "", fmt.Errorf("restore newest snapshot: %w", err)
	}
	st.Base = got
	if st.LastPublished != got {
		st.LastPublished = "" // published by another host, or long ago
	}
	d.cleanCache(got)
	return d.sd.cached(got), d.sd.save(*st)
}

func newHostID() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		h = "host"
	}
	var b [4]byte
	rand.Read(b[:])
	return strings.ReplaceAll(h, "/", "_") + "-" + hex.EncodeToString(b[:])
}

// serve runs a ready mount until it is told to stop, then shuts down.
func (d *daemon) serve(ctx context.Context) error {
	cfg := d.cfg
	// What the boot decided, read before the control socket lets requests
	// (and so snapshots) run on other goroutines.
	d.bgCtx, d.bgCancel = context.WithCancel(context.Background())
	defer d.bgCancel()
	base, store, pending, lastPub := d.st.Base, d.st.Store, d.pending, d.st.LastPublished
	d.initSchedule()
	d.startCompaction()
	if err := d.listen(); err != nil {
		d.cleanupBoot(false)
		return err
	}
	ctl := d.ctl
	defer markStopped(RuntimeDir(os.Getuid(), d.e.Getenv), cfg.Mountpoint, os.Getpid())
	d.mu.Lock()
	d.booting = false
	d.mu.Unlock()

	if cfg.ReadOnly {
		base = d.roBase
	}
	shown := base
	if pending && lastPub != "" {
		// Recovered changes sit over the base, and they include what
		// was published from them before the crash: the mount shows the
		// newest snapshot published, and more.
		shown = lastPub
	}
	if shown == "" {
		shown = "none"
	}
	// With recovered local changes the mount shows more than that
	// snapshot: say so (they are published right after).
	fmt.Fprintf(d.e.Stdout, "ready %s snapshot=%s store=%s%s\n", cfg.Mountpoint, shown, store, recoveredNote(pending))
	if f, ok := d.e.Stdout.(interface{ Sync() error }); ok {
		f.Sync()
	}
	if err := sdNotify(d.e.Getenv, fmt.Sprintf("READY=1\nSTATUS=mounted %s from snapshot %s\nMAINPID=%d", cfg.Mountpoint, OrNone(base), os.Getpid())); err != nil {
		d.log.Warn("sd_notify", "err", err)
	}
	d.log.Info("ready", "snapshot", OrNone(base), "store", store, "state_dir", d.sd.path, "interval", cfg.Interval.String(), "write_back", cfg.WriteBack.String(), "read_only", cfg.ReadOnly)

	var tick, poll <-chan time.Time
	if !cfg.ReadOnly {
		// Changes are looked for between snapshots (writeback.go).
		t := time.NewTicker(pollEvery(cfg.WriteBack))
		defer t.Stop()
		poll = t.C
	}
	if cfg.Interval > 0 && !cfg.ReadOnly {
		t := time.NewTicker(cfg.Interval)
		defer t.Stop()
		tick = t.C
		d.mu.Lock()
		d.nextDue = time.Now().Add(cfg.Interval)
		d.mu.Unlock()
	}
	var wd <-chan time.Time
	if iv := watchdogInterval(d.e.Getenv, os.Getpid()); iv > 0 {
		t := time.NewTicker(iv)
		defer t.Stop()
		wd = t.C
	}
	var lost <-chan struct{}
	if d.lease != nil {
		lost = d.lease.Lost()
	}
	// A lease taken again after it lapsed (reacquireLease) is watched
	// from then on.
	d.relet = make(chan (<-chan struct{}), 1)
	if d.verifyBase {
		// Blocks are checked as they are read; this pass finds damage
		// (a packer bug, bit rot in the cache) before the agent does.
		bg0 := d.bgCtx
		go func(path string) {
			t := time.Now()
			if err := contain(func() error { return d.parts.verify(bg0, path) }); err != nil && bg0.Err() == nil {
				err = fmt.Errorf("the base snapshot failed verification: %w", err)
				if stack := panicStack(err); stack != nil {
					d.log.Error("base snapshot verification failed on a panic", "err", err, "stack", string(stack))
				} else {
					d.log.Error("base snapshot is corrupt; reads of damaged blocks fail with EIO", "err", err)
				}
				d.setErr(err)
				return
			}
			d.log.Info("base snapshot verified", "took", time.Since(t).Round(time.Millisecond))
		}(d.sd.cached(d.lowerID()))
	}
	d.startLazyFill()
	// Changes left by a crash or a failed final upload go out right away.
	kick := make(chan struct{}, 1)
	if pending {
		kick <- struct{}{}
	}
	// Periodic snapshots run on their own goroutine so that a signal
	// arriving mid-pack is seen at once; the final snapshot waits for it.
	var bg sync.WaitGroup
	runSnap := func(reason string) {
		if !d.startScheduled(reason) {
			return // one is running; the next tick catches up
		}
		bg.Add(1)
		go func() {
			defer bg.Done()
			if !d.snapMu.TryLock() {
				d.scheduledSkipped() // a requested one is running
				return
			}
			defer d.snapMu.Unlock()
			_, err := d.snapshotLocked(d.bgCtx, reason)
			d.snapshotEnded(err)
		}()
	}

	why := ""
loop:
	for {
		select {
		case <-ctx.Done():
			why = "signal"
			break loop
		case <-d.stopCh:
			why = "hermesfs umount"
			break loop
		case <-d.ov.Done():
			why = "the mount went away (unmounted from outside?)"
			break loop
		case l := <-d.relet:
			lost = l
		case <-lost:
			lost = nil
			d.leaseLost()
		case <-tick:
			d.mu.Lock()
			d.nextDue = time.Now().Add(cfg.Interval)
			may := d.sched.mayStart(time.Now())
			d.mu.Unlock()
			if may {
				runSnap("interval")
			}
		case now := <-poll:
			if d.pollChanges(now) {
				runSnap("write-back")
			}
		case <-kick:
			runSnap("unpublished local changes")
		case <-wd:
			sdNotify(d.e.Getenv, "WATCHDOG=1")
		}
	}
	d.log.Info("stopping", "why", why, "stop_timeout", cfg.StopTimeout.String(),
		"second_signal", "stops at once, without the final snapshot (exit 5, local changes kept for the next start)")
	sdNotify(d.e.Getenv, "STOPPING=1\nSTATUS=stopping")
	// Status and umount are still answered while the daemon stops.
	ctl.refuse()
	res := d.stop(bg.Wait)
	d.result = res
	close(d.resultSet)
	ctl.close(5 * time.Second)
	if res.Code != exitOK {
		return withCode(res.Code, errors.New(res.Error))
	}
	return nil
}

// leaseLost records the loss of the writer lease: taken over by another
// holder (publishing stops for good), or lapsed because the store did not
// answer its renewals (taken again once it does: reacquireLease).
func (d *daemon) leaseLost() {
	d.mu.Lock()
	l := d.lease
	d.mu.Unlock()
	if l != nil && errors.Is(l.Err(), uploader.ErrLeaseLapsed) {
		d.mu.Lock()
		d.leaseState = "lapsed"
		d.mu.Unlock()
		err := fmt.Errorf("the writer lease lapsed because the store did not answer its renewals; the next snapshot takes it again once the store answers, unless another host took it meanwhile (local state kept, mount still served): %w", l.Err())
		d.log.Warn("lease lapsed", "err", err)
		d.setStoreErr(err)
		d.notify("store unreachable: the writer lease lapsed; publishing resumes when the store answers")
		return
	}
	d.mu.Lock()
	d.leaseState = "lost"
	d.mu.Unlock()
	err := fmt.Errorf("%w (local state kept, mount still served)", errLeaseLost)
	if l != nil && l.Err() != nil {
		err = fmt.Errorf("%w: %w (local state kept, mount still served)", errLeaseLost, l.Err())
	}
	d.log.Error("lease lost", "err", err)
	d.setErr(err)
	d.notify("lease lost: not publishing")
}

// reacquireLease takes the writer lease again when it was lost, which
// happens when the store stayed unreachable past the lease's life: without
// it, a host would never publish again after an outage of half a minute.
// If another host holds the lease now, it stays lost (errLeaseHeld). If
// another host published meanwhile (LATEST moved off what our next publish
// must replace), it is given back and never taken again: we could never
// publish, and holding it would lock that host out when it restarts.
// LATEST is read under the new lease, so no host can publish between the
// check and the take. snapMu must be held: no publish is using the old
// lease.
func (d *daemon) reacquireLease(ctx context.Context) error {
	d.mu.Lock()
	lost, gone, expect := d.leaseState == "lost" || d.leaseState == "lapsed", d.leaseGone, d.expect
	d.mu.Unlock()
	if !lost || gone || d.cfg.ReadOnly {
		return nil
	}
	l, err := d.cat.Lease(ctx, d.leaseHolder())
	if err != nil {
		if errors.Is(err, errLeaseHeld) {
			d.mu.Lock()
			d.leaseState = "lost" // another holder has it now
			d.mu.Unlock()
		}
		return err
	}
	latest, err := d.cat.Latest(ctx)
	if err != nil || latest.Pointer != expect {
		if rerr := l.Release(ctx); rerr != nil {
			d.log.Warn("could not give the writer lease back", "err", rerr)
		}
		if err != nil {
			return err
		}
		d.log.Warn("not keeping the writer lease: another host published since ours was lost", "latest", OrNone(latest.Pointer), "ours", OrNone(expect))
		d.mu.Lock()
		d.leaseGone = true
		d.mu.Unlock()
		return nil
	}
	d.mu.Lock()
	d.lease, d.leaseState = l, "held"
	d.mu.Unlock()
	select {
	case d.relet <- l.Lost():
	default:
	}
	d.log.Warn("took the writer lease again after it lapsed; publishing resumes")
	d.resolveStoreErr("the writer lease was taken again")
	d.notify("lease taken again: publishing")
	return nil
}

// leaseHolder names this daemon in the store's writer lease.
func (d *daemon) leaseHolder() string { return "hermesfs mount " + d.cfg.Mountpoint }

// changedSincePublished reports whether the tree changed after the freeze
// of the last published snapshot (or holds changes from before this mount
// that no snapshot has).
func (d *daemon) changedSincePublished() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.pending || d.ov.Generation() != d.publishedGen
}

// packedHere reports whether this state dir holds the segment snapshot s
// uploaded (the segment file it packed, in the pack dir or moved into the
// cache, of the size s's manifest records): this state dir published it.
func (d *daemon) packedHere(s snapshotInfo) bool {
	if s.NewBytes <= 0 {
		return false
	}
	for _, p := range []string{
		filepath.Join(d.sd.packDir(), "next.seg"),
		filepath.Join(d.sd.segmentsDir(), image.PlainName(uploader.SegmentKey(s.ID, false))),
	} {
		if fi, err := os.Stat(p); err == nil && fi.Size() == s.NewBytes {
			return true
		}
	}
	return false
}

// The answers of ProbeFUSE.
const (
	FUSELive = iota // it answered
	FUSEDead        // ENOTCONN or ECONNABORTED: its daemon is gone
	FUSEHung        // no answer within the wait
)

// hungMountWait is how long boot waits for the daemon of a mount left at
// the mountpoint to answer its control socket, and for the mount to answer
// statfs, before it calls it hung.
var hungMountWait = 5 * time.Second

// ProbeFUSE asks the mount at mp for statfs (never answered from the
// kernel's caches, unlike stat) and says whether it answered, failed as a
// FUSE mount whose daemon is gone, or did not answer within wait. A
// statfs that hangs stays blocked in its goroutine until the connection
// is aborted.
func ProbeFUSE(mp string, wait time.Duration) int {
	done := make(chan error, 1)
	go func() {
		var st syscall.Statfs_t
		done <- syscall.Statfs(mp, &st)
	}()
	select {
	case err := <-done:
		if errors.Is(err, syscall.ENOTCONN) || errors.Is(err, syscall.ECONNABORTED) {
			return FUSEDead
		}
		return FUSELive
	case <-time.After(wait):
		return FUSEHung
	}
}

// finish records the state for the next start. When the merged tree is
// a snapshot (the final one, or the base when nothing was ever published
// from it) and no mutation came after the final freeze, that snapshot
// becomes the base and the upper layer goes: the next start opens its
// image from the cache, with no old upper layer.
func (d *daemon) finish(synced bool, finalGen uint64) {
	d.mu.Lock()
	defer d.mu.Unlock()
	st := &d.st
	target := st.LastPublished
	if target == "" {
		target = st.Base
	}
	if synced && d.ov.Generation() == finalGen {
		// The upper layer goes before state.json names the new base: a
		// crash in between leaves an empty upper over the old base, and
		// the next start opens LATEST (the new base).
		if err := d.clearUpper("rebased"); err != nil {
			d.log.Warn("rebase: keeping base + upper", "err", err)
		} else {
			old := st.Base
			st.Base = target
			st.Unpublished, st.CleanShutdown = false, true
			if err := d.sd.save(*st); err != nil {
				d.log.Error("state", "err", err)
			}
			d.cleanCache(st.Base)
			if old != st.Base {
				d.log.Info("rebased: the final snapshot is the new base", "base", st.Base, "previous", OrNone(old))
			}
			return
		}
	}
	st.Unpublished = !synced || d.ov.Generation() != finalGen
	st.CleanShutdown = synced
	if err := d.sd.save(*st); err != nil {
		d.log.Error("state", "err", err)
	}
}

// clearUpper removes an upper layer whose every change is in the store:
// renamed aside first (one atomic step), then deleted.
func (d *daemon) clearUpper(why string) error {
	aside, err := setAside(d.sd.upper(), why)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(d.sd.upper(), 0o700); err != nil {
		return err
	}
	if err := uploader.SyncDir(d.sd.path); err != nil {
		return err
	}
	return os.RemoveAll(aside)
}

// lowerID is the snapshot the mount's lower layer is ("" for none).
func (d *daemon) lowerID() string {
	_, o := d.lowerArchive()
	if o == nil {
		return ""
	}
	return o.im.Manifest().ID
}

// bootError gives what failed opening a snapshot its exit code: an
// encrypted snapshot the identities do not open (6), damage (3).
func bootError(err error) error {
	switch {
	case isKeyError(err):
		return CryptError(err)
	case errors.Is(err, uploader.ErrCorrupt) || errors.Is(err, archive.ErrCorrupt):
		return withCode(exitCorrupt, err)
	}
	return CryptError(err)
}
