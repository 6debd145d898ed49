package daemon

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
)

// Waiting for the writer lease at boot (README "One writer per store
// prefix").
//
// A writable mount needs the store's writer lease before it decides what
// to mount and publishes anything. When another holder has it (a host
// that was killed: its lease lapses within the TTL; a host still
// stopping), or the store does not answer (a host booting before its
// network), the mount waits, up to Config.LeaseWait, instead of giving
// up:
//
//   - It shows what it safely can, with every change refused (EROFS; the
//     overlay's RefuseWrites, no kernel remount): with the store
//     answering, what a boot would decide now (the newest snapshot, or
//     the local changes over their base); without it, what the state dir
//     holds (its base and local changes). A decision that would publish
//     (a seed) waits for the lease, and nothing is shown.
//   - It says what it waits for: the log, `status` (Waiting) and the
//     systemd status line, which also extends the start timeout.
//   - Once the lease is its own, the base is decided again as a boot
//     does, against LATEST as it is now. If that is the tree shown, the
//     same mount becomes writable (AllowWrites); otherwise (LATEST moved
//     while it waited, local changes to set aside) the mount shown is
//     replaced before anything is written: never a write over a stale
//     base. Files written into the mountpoint directory before the mount
//     covered it are taken in over that decided base, not over the tree
//     shown (underneathWaits): a mount shown that must take some in is
//     replaced too.
//   - A holder this machine can prove gone (the lease was written during
//     this boot of this machine, and the holder's state dir lock is free
//     or its process is gone) is not waited for.
//
// READY=1 and the ready line come only once the mount is writable: the
// units ordered after hermesfs (the agent) need to write.

var (
	// errRemount: the decision needs the upper layer the mount shown
	// while waiting still serves (decideBase).
	errRemount = errors.New("the mount shown while waiting must be replaced")
	// errNothingToShow: nothing can be shown before the lease is ours.
	errNothingToShow = errors.New("nothing to show before the writer lease is ours")
)

// waitReport is what a mount waiting to become writable waits for, as
// status shows it.
type waitReport struct {
	// For is "lease" (another holder has the writer lease), "store" (the
	// store does not answer) or "boot" (the lease is ours now: the base
	// is being decided and mounted writable).
	For string `json:"for"`
	// Holder names the lease's holder and where it runs; Until is when
	// its lease lapses unless renewed (lease).
	Holder string    `json:"holder,omitempty"`
	Until  time.Time `json:"until,omitzero"`
	// Error is the store's last error (store).
	Error string `json:"error,omitempty"`
	// Since is when the wait began, GiveUp when it ends (--lease-wait).
	Since  time.Time `json:"since"`
	GiveUp time.Time `json:"give_up"`
	// Showing is what the mount shows meanwhile, read-only; "" when
	// nothing is mounted yet.
	Showing string `json:"showing,omitempty"`
}

// Describe says in one line what w waits for.
func (w *waitReport) Describe() string {
	var s string
	switch w.For {
	case "lease":
		s = "for the writer lease, held by " + w.Holder
		if !w.Until.IsZero() {
			s += fmt.Sprintf(" (valid until %s unless renewed)", w.Until.Local().Format(time.TimeOnly))
		}
	case "boot":
		return "for the mount to be writable: the writer lease is ours, the snapshot to write on is being decided"
	default:
		s = "for the store to answer (" + w.Error + ")"
	}
	if w.Showing != "" {
		s += "; showing " + w.Showing + " read-only meanwhile (writes fail with EROFS)"
	} else {
		s += "; nothing mounted yet"
	}
	return s + fmt.Sprintf("; giving up at %s", w.GiveUp.Local().Format(time.TimeOnly))
}

// leaseTry is how often a mount waiting for a held lease asks again (a
// holder that stops releases its lease at once); a lease that lapses
// sooner is asked for when it lapses. A store that does not answer is
// asked again after storeRetry, doubling up to 8 times that.
var (
	leaseTry   = 2 * time.Second
	storeRetry = 2 * time.Second
)

// takeLease takes the store's writer lease, waiting for it (waitForLease)
// when another holder has it or the store does not answer, if
// Config.LeaseWait allows.
func (d *daemon) takeLease(ctx context.Context) error {
	d.notify("taking the writer lease of " + d.st.Store)
	l, err := d.cat.Lease(ctx, d.leaseHolder())
	if err == nil {
		d.setLease(l)
		return nil
	}
	if !mayWait(ctx, err) || d.cfg.LeaseWait <= 0 {
		return leaseRefusal(err)
	}
	return d.waitForLease(ctx, err)
}

func (d *daemon) setLease(l lease) {
	d.mu.Lock()
	d.lease, d.leaseState = l, "held"
	if d.waiting != nil {
		// Until ready: the lease is ours, the base being decided.
		w := *d.waiting
		w.For, w.Holder, w.Until, w.Error = "boot", "", time.Time{}, ""
		d.waiting = &w
	}
	d.mu.Unlock()
}

// mayWait reports whether a failure to take the lease may pass by itself:
// another holder's lease (it lapses or is released), or a store that did
// not answer. A store that refuses (credentials, a missing bucket, a
// permission) does not get better by waiting.
func mayWait(ctx context.Context, err error) bool {
	switch {
	case ctx.Err() != nil:
		return false
	case errors.Is(err, errLeaseHeld):
		return true
	case uploader.IsPermanent(err), errors.Is(err, iofs.ErrPermission):
		return false
	}
	return true
}

// leaseRefusal is the error of a boot that could not take the lease.
func leaseRefusal(err error) error {
	if errors.Is(err, errLeaseHeld) {
		hint := "use --read-only to mount the newest snapshot read-only"
		if held, ok := errors.AsType[*uploader.LeaseHeldError](err); ok && held.SameMachine {
			if mp, ok := strings.CutPrefix(held.Holder, "hermesfs mount "); ok {
				hint = fmt.Sprintf("stop that mount first ('hermesfs umount %s'), or %s", mp, hint)
			}
		}
		return withCode(exitConflict, fmt.Errorf("%w (%s)", err, hint))
	}
	return fmt.Errorf("lease: %w", err)
}

// errStoppedWaiting ends a boot stopped (a signal, `hermesfs umount`)
// while it waited for the lease; runDaemon exits with its code.
type errStoppedWaiting struct {
	code int
	why  string
}

func (e *errStoppedWaiting) Error() string { return e.why }

// waitForLease waits for the writer lease, first failure err, showing
// meanwhile what it safely can (see the top of this file). It returns once
// the lease is d.lease, with d.ov the mount shown (writes refused) or nil.
func (d *daemon) waitForLease(ctx context.Context, err error) error {
	cfg := d.cfg
	now := time.Now()
	w := &waitReport{Since: now, GiveUp: now.Add(cfg.LeaseWait)}
	d.noteWait(w, err)
	if lerr := d.listen(); lerr != nil {
		return lerr
	}
	if perr := d.showPreview(ctx, w.For == "lease"); perr != nil {
		return perr
	}
	d.mu.Lock()
	w.Showing = d.showing
	d.mu.Unlock()
	d.reportWait(w, true)

	backoff := storeRetry
	for {
		wait := leaseTry
		if w.For == "store" {
			wait, backoff = backoff, min(2*backoff, 8*storeRetry)
		} else if left := time.Until(w.Until); left > 0 && left < wait {
			wait = left
		}
		wait = min(wait, max(time.Until(w.GiveUp), 0))
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return d.stoppedWaiting("a signal")
		case <-d.stopCh:
			t.Stop()
			return d.stoppedWaiting("hermesfs umount")
		case <-t.C:
		}
		l, err := d.cat.Lease(ctx, d.leaseHolder())
		if err == nil {
			d.setLease(l)
			d.log.Info("took the writer lease", "waited", time.Since(w.Since).Round(time.Millisecond))
			d.notify("writer lease taken: deciding the base")
			return nil
		}
		if ctx.Err() != nil {
			return d.stoppedWaiting("a signal")
		}
		if !mayWait(ctx, err) {
			return leaseRefusal(err)
		}
		before := *w
		d.noteWait(w, err)
		if !time.Now().Before(w.GiveUp) {
			return d.giveUp(w, err)
		}
		if w.For == "lease" {
			if before.For == "store" {
				backoff = storeRetry
			}
			if perr := d.refreshPreview(ctx); perr != nil {
				return perr
			}
		}
		d.mu.Lock()
		w.Showing = d.showing
		d.mu.Unlock()
		d.reportWait(w, before.For != w.For || before.Holder != w.Holder)
	}
}

// noteWait records in w what the failure err says the mount waits for.
func (d *daemon) noteWait(w *waitReport, err error) {
	if held, ok := errors.AsType[*uploader.LeaseHeldError](err); ok {
		w.For, w.Error = "lease", ""
		w.Holder = strings.TrimSuffix(describeHeld(held), ")")
		w.Until = held.Expires
	} else {
		w.For, w.Holder, w.Until = "store", "", time.Time{}
		w.Error = err.Error()
		if plain := uploader.Explain(err); plain != "" {
			w.Error = plain + ": " + w.Error
		}
	}
	d.mu.Lock()
	cp := *w
	d.waiting, d.leaseState = &cp, "waiting"
	d.mu.Unlock()
}

// describeHeld names a lease's holder as the refusal does, without the
// refusal's own words around it.
func describeHeld(h *uploader.LeaseHeldError) string {
	s := h.Error()
	s = strings.TrimPrefix(s, "the store is in use by ")
	if i := strings.LastIndex(s, "; lease valid until"); i >= 0 {
		s = s[:i]
	}
	return s
}

// reportWait says what the mount waits for: in the log when loud (the
// first time, and when what it waits for changed), always in the systemd
// status line, whose start timeout it extends past the wait's end.
func (d *daemon) reportWait(w *waitReport, loud bool) {
	if loud {
		attrs := []any{"give_up_at", w.GiveUp.Local().Format(time.DateTime), "lease_wait", d.cfg.LeaseWait.String()}
		if w.Showing != "" {
			attrs = append(attrs, "showing", w.Showing+" (read-only until the lease is ours: writes fail with EROFS)")
		} else {
			attrs = append(attrs, "showing", "nothing yet")
		}
		if w.For == "lease" {
			d.log.Warn("waiting for the writer lease held by "+w.Holder, append(attrs, "until", w.Until.Local().Format(time.DateTime))...)
		} else {
			d.log.Warn("waiting for the store to answer", append(attrs, "err", w.Error)...)
		}
	}
	left := max(time.Until(w.GiveUp), 0) + 2*time.Minute
	sdNotify(d.e.Getenv, fmt.Sprintf("STATUS=waiting %s\nEXTEND_TIMEOUT_USEC=%d", w.Describe(), left.Microseconds()))
}

// giveUp ends a wait that reached --lease-wait.
func (d *daemon) giveUp(w *waitReport, err error) error {
	if w.For == "lease" {
		return withCode(exitConflict, fmt.Errorf("gave up after waiting %s (--lease-wait) for the writer lease: %w", d.cfg.LeaseWait, leaseRefusal(err)))
	}
	return fmt.Errorf("gave up after waiting %s (--lease-wait) for the store %s to answer: %w", d.cfg.LeaseWait, d.st.Store, err)
}

// stoppedWaiting ends a boot stopped while it waited: nothing was
// published or changed, so exit 0, unless the state dir holds local
// changes the store does not have (exit 5: they are kept for the next
// mount).
func (d *daemon) stoppedWaiting(by string) error {
	d.log.Info("stopped while waiting for the writer lease", "by", by)
	changed, _ := fs.UpperHasChanges(d.sd.upper())
	if changed && (d.st.Unpublished || !d.st.CleanShutdown) {
		return &errStoppedWaiting{code: exitUnsynced, why: fmt.Sprintf("stopped (%s) while waiting for the writer lease; the local changes in %s are not in the store yet: the next mount publishes them", by, d.sd.path)}
	}
	return &errStoppedWaiting{code: exitOK, why: "stopped (" + by + ") while waiting for the writer lease; nothing changed"}
}

// showPreview mounts, with every change refused, what may be shown before
// the lease is ours: with the store answering (online), the base a boot
// would decide now; without it, the state dir's base and local changes.
// Nothing to show is no error. An error that carries an exit code (a
// conflict, a key that does not open the snapshot, damage) ends the boot;
// any other is logged, and the wait goes on with nothing shown.
func (d *daemon) showPreview(ctx context.Context, online bool) error {
	d.previewing = true
	defer func() { d.previewing = false }()
	var (
		lower string
		err   error
	)
	if online {
		lower, err = d.decideBase(ctx)
	} else {
		lower, err = d.offlineBase(ctx)
	}
	if err == nil {
		d.refuseWrites = true
		var ov overlay
		ov, err = d.parts.mount(ctx, d, lower)
		d.refuseWrites = false
		if err == nil {
			what := "snapshot " + OrNone(d.st.Base)
			if d.pending || !online {
				if changed, _ := fs.UpperHasChanges(d.sd.upper()); changed {
					// Local changes over the base: they hold what was
					// published from them, and more.
					what = "snapshot " + OrNone(cmp.Or(d.st.LastPublished, d.st.Base)) + " with the local changes over it"
				}
			}
			d.mu.Lock()
			d.ov, d.shown, d.showing, d.offline = ov, lower, what, !online
			d.mu.Unlock()
			d.log.Info("showing the home read-only while waiting for the writer lease", "showing", what)
			return nil
		}
		err = fmt.Errorf("mount %s: %w", d.cfg.Mountpoint, err)
	}
	switch {
	case errors.Is(err, errNothingToShow):
		d.log.Info("nothing to show before the writer lease is ours: the mountpoint directory stays as it is", "why", "the store holds no snapshot yet")
		return nil
	case ExitCode(err) != exitFailure:
		return err
	}
	if msg := err.Error(); msg != d.previewErr {
		d.previewErr = msg // said once, not at every try
		d.log.Warn("cannot show the home while waiting for the writer lease", "err", err)
	}
	return nil
}

// refreshPreview shows, while the lease is still held by another, the
// snapshot LATEST names, if that is not the one shown: nothing could be
// shown yet, or what was shown is the state dir's base from before the
// store answered, or the holder published again. Local changes stay shown
// over their base (what a boot shows, unless another host published over
// them, which is decided once the lease is ours).
func (d *daemon) refreshPreview(ctx context.Context) error {
	if d.ov != nil {
		if d.pending {
			return nil
		}
		if changed, _ := fs.UpperHasChanges(d.sd.upper()); changed {
			return nil
		}
	}
	latest, err := d.cat.Latest(ctx)
	if err != nil || latest.ID == "" || d.ov != nil && latest.ID == d.st.Base {
		return nil
	}
	if d.ov != nil {
		d.log.Info("the holder of the writer lease published a newer snapshot: showing it", "snapshot", latest.ID, "was", OrNone(d.st.Base))
	}
	d.dropPreview()
	return d.showPreview(ctx, true)
}

// offlineBase is the lower layer the state dir holds (its base, opened
// from the cache), to show while the store does not answer.
func (d *daemon) offlineBase(ctx context.Context) (string, error) {
	if err := d.openCache(); err != nil {
		return "", err
	}
	changed, err := fs.UpperHasChanges(d.sd.upper())
	if err != nil {
		return "", fmt.Errorf("state dir: %w", err)
	}
	switch {
	case d.st.Base != "":
		return d.baseFile(ctx, d.st.Base)
	case changed:
		return "", nil // local changes over an empty lower layer
	}
	return "", errNothingToShow
}

// dropPreview unmounts the mount shown while waiting.
func (d *daemon) dropPreview() {
	if d.underneath != nil {
		d.underneath.Close()
		d.underneath = nil
	}
	if d.ov == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.ov.Unmount(ctx); err != nil {
		d.log.Warn("unmount the tree shown while waiting", "err", err)
	}
	d.mu.Lock()
	d.ov, d.shown, d.showing, d.offline = nil, "", "", false
	d.mu.Unlock()
	d.lowMu.Lock()
	d.lowerImage, d.lowerReader = nil, nil
	d.lowMu.Unlock()
	d.hot = nil
}

// holderGone proves the holder of lease r gone, r having been written
// during this boot of this machine (uploader.Machine.SameBoot): the lock
// file of its state dir (the same file: device and inode as recorded) is
// not locked, or its process (in this pid namespace) is gone.
func holderGone(r uploader.LeaseRecord) (string, bool) {
	p := r.Process
	if p == nil {
		return "", false
	}
	if r.StateDir != "" && p.Lock != "" {
		lock := filepath.Join(r.StateDir, "lock")
		if free, ok := lockFree(lock, p.Lock); ok && free {
			return "its state dir's lock " + lock + " is free", true
		}
	}
	if p.PID > 0 && p.PIDNamespace != "" && p.PIDNamespace == pidNamespace() && !ProcessAlive(p.PID) {
		return fmt.Sprintf("its process (pid %d) is gone", p.PID), true
	}
	return "", false
}

// lockFree tests the lock file at path, if it is the file id names
// ("DEV:INODE"): free is true when no process holds a lock on it. ok is
// false when it cannot tell.
func lockFree(path, id string) (free, ok bool) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0)
	if err != nil {
		return false, false
	}
	defer f.Close()
	if fileID(f) != id {
		return false, false
	}
	err = syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB)
	switch {
	case err == nil:
		syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		return true, true
	case errors.Is(err, syscall.EWOULDBLOCK):
		return false, true
	}
	return false, false
}

// fileID names f's file as "DEV:INODE" ("" if it cannot be told).
func fileID(f *os.File) string {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return ""
	}
	return fmt.Sprintf("%d:%d", st.Dev, st.Ino)
}

// pidNamespace names this process's pid namespace.
func pidNamespace() string {
	ns, _ := os.Readlink("/proc/self/ns/pid")
	return ns
}

// leaseProcess is what the lease records of this daemon, for holderGone.
func (d *daemon) leaseProcess() *uploader.LeaseProcess {
	p := &uploader.LeaseProcess{PID: os.Getpid(), PIDNamespace: pidNamespace()}
	if d.sd != nil && d.sd.lock != nil {
		p.Lock = fileID(d.sd.lock)
	}
	return p
}
