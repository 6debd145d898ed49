// Package browse mounts every snapshot of a store as one read-only tree:
//
//	MOUNTPOINT/<snapshot-id>/...      the snapshot's files
//	MOUNTPOINT/latest                 -> the snapshot LATEST names
//	MOUNTPOINT/2026-11-24T1015        -> the snapshot taken in that minute (UTC)
//
// The root is listed from the catalog alone (Source.Snapshots): names and
// times come from snapshot ids, so listing a thousand snapshots opens none
// of them. A snapshot's archive is opened (Source.Open) the first time
// something inside it is looked up or listed, and kept open for the life
// of the mount; its files are then read block by block as they are asked
// for. The aliases are symlinks, so `ls -l` shows what they name and they
// follow the catalog as it changes; `cp -a MOUNTPOINT/latest/ DIR` copies
// the snapshot, `cp -a MOUNTPOINT/latest DIR` the link.
//
// Several snapshots taken in the same minute get the date alias in id
// order: the first the plain name, the next ones "-2", "-3"...
//
// The root is listed again from the catalog when it is read after
// Options.RefreshAfter, or when a name that is not there is looked up
// after it, so new snapshots appear and pruned ones go.
//
// Everything is read-only: the mount is "ro", so the kernel answers every
// write, create, rename or chmod with EROFS; the nodes refuse them too.
// Permissions are not checked (no default_permissions): only the mounting
// user can reach the mount, and whoever can read the store can read every
// archive in it anyway.
package browse

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"sync"
	"syscall"
	"time"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/fs"
)

// Snapshot is one snapshot as the root lists it.
type Snapshot struct {
	ID      string
	Created time.Time
	// Latest marks the snapshot LATEST names; "latest" links to it (to the
	// newest if none is marked).
	Latest bool
}

// Source is where the tree's snapshots come from. Its methods may be
// called concurrently.
type Source interface {
	// Snapshots lists the snapshots, in any order. It must not open them.
	Snapshots(ctx context.Context) ([]Snapshot, error)
	// Open opens snapshot id's archive for reading. The tree calls it the
	// first time it needs the snapshot's content, once at a time per id,
	// and keeps what it returns; a failed open is tried again the next
	// time.
	Open(ctx context.Context, id string) (fs.Lower, error)
}

// Options configures Mount.
type Options struct {
	Source Source
	// RefreshAfter is how old the root's listing may get before a readdir
	// of the root, or a lookup of a name missing from it, lists the
	// catalog again (default 30s).
	RefreshAfter time.Duration
	Logger       *slog.Logger
	Debug        bool // log every FUSE request
}

// FsName is the source name the mount shows in /proc/mounts.
const FsName = "hermesfs-browse"

// Timeouts of the kernel's caches: the content of a snapshot never changes;
// the root and the snapshot directories' attributes follow the catalog.
const (
	immutableTimeout = time.Hour
	rootTimeout      = time.Second
)

// Mounted is a mounted browse tree.
type Mounted struct {
	server     *fuse.Server
	mountpoint string
	privileged bool
	done       chan struct{}
	log        *slog.Logger
}

// Mount lists the catalog once and mounts the tree at mountpoint. The
// mount is ready when Mount returns.
func Mount(ctx context.Context, mountpoint string, o Options) (*Mounted, error) {
	if o.Source == nil {
		return nil, errors.New("browse: no source")
	}
	if o.RefreshAfter <= 0 {
		o.RefreshAfter = 30 * time.Second
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	t := &tree{src: o.Source, opts: o, log: o.Logger, snaps: map[string]*snapshot{}, aliasIno: map[string]uint64{}}
	if err := t.refresh(ctx); err != nil {
		return nil, fmt.Errorf("browse: list snapshots: %w", err)
	}
	privileged := os.Geteuid() == 0
	timeout := rootTimeout
	logger := slog.NewLogLogger(o.Logger.Handler(), slog.LevelDebug)
	fopts := &fusefs.Options{
		EntryTimeout:    &timeout,
		AttrTimeout:     &timeout,
		NullPermissions: true,
		RootStableAttr:  &fusefs.StableAttr{Ino: 1, Gen: 1},
		Logger:          logger,
		MountOptions: fuse.MountOptions{
			FsName:           FsName,
			Name:             FsName,
			Options:          []string{"ro"},
			DisableXAttrs:    true,
			MaxBackground:    64,
			Debug:            o.Debug,
			Logger:           logger,
			DirectMount:      privileged,
			DirectMountFlags: syscall.MS_NOSUID | syscall.MS_NODEV | syscall.MS_RDONLY,
		},
	}
	server, err := fuse.NewServer(fusefs.NewNodeFS(&rootNode{t: t}, fopts), mountpoint, &fopts.MountOptions)
	if err != nil {
		return nil, fmt.Errorf("browse: mount %s: %w", mountpoint, err)
	}
	go server.Serve()
	if err := server.WaitMount(); err != nil {
		detach(mountpoint, privileged)
		return nil, fmt.Errorf("browse: mount %s: %w", mountpoint, err)
	}
	m := &Mounted{server: server, mountpoint: mountpoint, privileged: privileged, done: make(chan struct{}), log: o.Logger}
	go func() {
		server.Wait()
		close(m.done)
	}()
	o.Logger.Info("mounted", "mountpoint", mountpoint, "snapshots", t.count())
	return m, nil
}

// Done is closed once the tree is unmounted, by Unmount or from outside
// (umount, fusermount3 -u).
func (m *Mounted) Done() <-chan struct{} { return m.done }

// Unmount detaches the mount (lazily: files open in it stay readable until
// closed) and waits until the kernel has let go of it, or ctx ends.
func (m *Mounted) Unmount(ctx context.Context) error {
	select {
	case <-m.done:
		return nil
	default:
	}
	if err := detach(m.mountpoint, m.privileged); err != nil {
		select {
		case <-m.done:
			return nil
		default:
		}
		return fmt.Errorf("browse: unmount %s: %w", m.mountpoint, err)
	}
	select {
	case <-m.done:
		m.log.Info("unmounted", "mountpoint", m.mountpoint)
		return nil
	case <-ctx.Done():
		return fmt.Errorf("browse: unmount %s: files still open: %w", m.mountpoint, ctx.Err())
	}
}

func detach(mountpoint string, privileged bool) error {
	if privileged {
		if err := unix.Unmount(mountpoint, unix.MNT_DETACH); err == nil {
			return nil
		}
	}
	out, err := exec.Command("fusermount3", "-uz", mountpoint).CombinedOutput()
	if err != nil {
		return fmt.Errorf("fusermount3 -uz: %v: %s", err, out)
	}
	return nil
}

// tree is the catalog as the root shows it.
type tree struct {
	src  Source
	opts Options
	log  *slog.Logger

	mu        sync.Mutex
	snaps     map[string]*snapshot // by id; kept once seen, so inode numbers stay
	listed    []string             // ids in the current listing, oldest first
	aliases   map[string]string    // alias name -> id
	aliasIno  map[string]uint64
	refreshed time.Time
	nextSnap  uint64
}

// snapshot is one snapshot of the tree and, once entered, its archive.
type snapshot struct {
	id      string
	created time.Time
	ino     uint64 // the snapshot directory's inode number; content is ino|archive inode

	mu    sync.Mutex
	lower fs.Lower
}

// aliasLayout names date aliases: minutes, in UTC, without colons (which
// some tools take for host names).
const aliasLayout = "2006-01-02T1504"

// refresh lists the catalog again.
func (t *tree) refresh(ctx context.Context) error {
	list, err := t.src.Snapshots(ctx)
	if err != nil {
		return err
	}
	slices.SortFunc(list, func(a, b Snapshot) int {
		switch {
		case a.ID < b.ID:
			return -1
		case a.ID > b.ID:
			return 1
		}
		return 0
	})
	t.mu.Lock()
	defer t.mu.Unlock()
	t.refreshed = time.Now()
	t.listed = t.listed[:0]
	t.aliases = map[string]string{}
	latest := ""
	for _, s := range list {
		if t.snaps[s.ID] == nil {
			t.nextSnap++
			t.snaps[s.ID] = &snapshot{id: s.ID, created: s.Created, ino: t.nextSnap << 32}
		}
		t.listed = append(t.listed, s.ID)
		if s.Latest {
			latest = s.ID
		}
		base := s.Created.UTC().Format(aliasLayout)
		name := base
		for i := 2; t.aliases[name] != ""; i++ {
			name = fmt.Sprintf("%s-%d", base, i)
		}
		t.aliases[name] = s.ID
	}
	if latest == "" && len(list) > 0 {
		latest = list[len(list)-1].ID
	}
	if latest != "" {
		t.aliases["latest"] = latest
	}
	for name := range t.aliases {
		if t.aliasIno[name] == 0 {
			t.aliasIno[name] = 1<<62 | uint64(len(t.aliasIno)+1)
		}
	}
	return nil
}

// refreshIfStale lists the catalog again if the listing is older than
// RefreshAfter; a failure keeps the old listing (and is logged).
func (t *tree) refreshIfStale(ctx context.Context) {
	t.mu.Lock()
	stale := time.Since(t.refreshed) >= t.opts.RefreshAfter
	t.mu.Unlock()
	if !stale {
		return
	}
	if err := t.refresh(ctx); err != nil {
		t.log.Warn("could not list snapshots; showing the previous listing", "err", err)
		t.mu.Lock()
		t.refreshed = time.Now() // do not hammer a failing store
		t.mu.Unlock()
	}
}

func (t *tree) count() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.listed)
}

// entry resolves a root name: a listed snapshot or an alias.
func (t *tree) entry(name string) (s *snapshot, target string, aliasIno uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if id, ok := t.aliases[name]; ok {
		return nil, id, t.aliasIno[name]
	}
	if _, ok := slices.BinarySearch(t.listed, name); ok {
		return t.snaps[name], "", 0
	}
	return nil, "", 0
}

// open returns the snapshot's archive, opening it on first use.
func (t *tree) open(ctx context.Context, s *snapshot) (fs.Lower, syscall.Errno) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lower != nil {
		return s.lower, 0
	}
	start := time.Now()
	l, err := t.src.Open(ctx, s.id)
	if err != nil {
		t.log.Error("cannot open snapshot", "id", s.id, "err", err)
		if errors.Is(err, context.Canceled) {
			return nil, syscall.EINTR
		}
		return nil, syscall.EIO
	}
	t.log.Info("opened snapshot", "id", s.id, "took", time.Since(start).Round(time.Millisecond))
	s.lower = l
	return l, 0
}
