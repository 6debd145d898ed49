package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// snapshotNow takes one snapshot: freeze, pack the view, publish, prune.
// Nothing changed since the last published one: nothing is uploaded. A
// failure keeps all local state; the next tick tries again.
func (d *daemon) snapshotNow(ctx context.Context, reason string) (snapshotResult, error) {
	d.snapMu.Lock()
	defer d.snapMu.Unlock()
	return d.snapshotLocked(ctx, reason)
}

// snapshotLocked is snapshotNow with snapMu held by the caller.
func (d *daemon) snapshotLocked(ctx context.Context, reason string) (snapshotResult, error) {
	return d.snapshotOf(ctx, reason, nil)
}

// finalSnapshotLocked is the stop's snapshot, snapMu held: it seals the
// mount (from its freeze on, every change fails: fs.Mounted.Seal) and
// publishes that view, so the snapshot holds every write a writer was
// told succeeded and nothing can come after it. The mount stays sealed
// whatever it returns.
func (d *daemon) finalSnapshotLocked(ctx context.Context) (snapshotResult, error) {
	view, err := d.ov.Seal(ctx)
	if err != nil {
		err = fmt.Errorf("snapshot (final): seal the mount: %w", err)
		d.met.snapshotFailed(err)
		d.log.Error("final snapshot failed; local state kept", "err", err)
		d.setErr(err)
		return snapshotResult{}, err
	}
	return d.snapshotOf(ctx, "final", view)
}

// snapshotOf takes a snapshot of view (taken by the caller, closed here),
// or of a new freeze if view is nil.
func (d *daemon) snapshotOf(ctx context.Context, reason string, view frozenView) (snapshotResult, error) {
	if view != nil {
		defer func() {
			if view != nil {
				view.Close()
			}
		}()
	}
	if d.cfg.ReadOnly {
		return snapshotResult{}, errors.New("read-only mount: it never publishes")
	}
	d.resolveCompaction(ctx)
	gen := d.ov.Generation()
	if view != nil {
		gen = view.Generation()
	}
	d.mu.Lock()
	unchanged := gen == d.publishedGen && !d.pending
	last, expect := d.st.LastPublished, d.expect
	// The newest snapshot is the mount's base: a tree that is the base's
	// again (files created and removed, nothing else) needs none.
	onBase := !d.pending && (last == "" || last == d.st.Base)
	d.mu.Unlock()
	if unchanged {
		// Nothing to publish needs no lease: a host whose lease was
		// lost has nothing to resolve either.
		d.log.Debug("snapshot: nothing changed", "reason", reason, "last", OrNone(last))
		if last == "" {
			last = expect // LATEST: what the mount shows
		}
		return snapshotResult{ID: last, Unchanged: true}, nil
	}
	if err := d.reacquireLease(ctx); err != nil && !errors.Is(err, errLeaseHeld) {
		// The store is still unreachable: what fails is the upload, not
		// a conflict with another host (that is errLeaseHeld, below).
		err = fmt.Errorf("snapshot (%s): the writer lease lapsed while the store was unreachable and cannot be taken again yet: %w", reason, err)
		d.met.snapshotFailed(mark(err, errLeaseReacquire))
		d.log.Warn("not publishing", "err", err)
		d.setStoreErr(err)
		return snapshotResult{}, err
	}
	d.mu.Lock()
	lost, base := d.leaseState != "held", d.st.Base
	d.mu.Unlock()
	if lost {
		d.met.snapshotFailed(errLeaseLost)
		return snapshotResult{}, withCode(exitConflict, errLeaseLost)
	}
	d.mu.Lock()
	d.inProgress = true
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		d.inProgress = false
		d.mu.Unlock()
	}()

	parent := last
	if parent == "" {
		parent = base
	}
	var r snapshotDone
	given := view
	view = nil // snapshotOnce closes it
	err := contain(func() (err error) {
		r, err = d.snapshotOnce(ctx, parent, expect, onBase, given)
		return err
	})
	if err != nil {
		d.met.snapshotFailed(err)
		stack := panicStack(err)
		if stack != nil {
			err = fmt.Errorf("snapshot (%s): %w (a hermesfs bug: its stack is in the log)", reason, err)
			d.log.Error("snapshot failed on a panic; local state kept, the mount goes on", "err", err, "stack", string(stack))
		} else {
			err = fmt.Errorf("snapshot (%s): %w", reason, err)
			d.log.Error("snapshot failed; local state kept, retrying at the next tick", "err", err)
		}
		d.setStoreErr(err)
		if errors.Is(err, errConflict) || errors.Is(err, errLeaseLost) {
			return r.snapshotResult, withCode(exitConflict, err)
		}
		return r.snapshotResult, err
	}
	if r.Unchanged {
		d.log.Debug("snapshot: nothing changed but directory times (files created and removed again); nothing packed or uploaded", "reason", reason, "base", OrNone(base))
		if r.ID == "" {
			r.ID = expect // LATEST: what the mount shows
		}
		return r.snapshotResult, nil
	}
	d.log.Info("snapshot published", "reason", reason, "id", r.ID, "files", r.Files,
		"bytes_packed", r.BytesPacked, "size", r.Size, "bytes_reused", r.BytesReused, "bytes_matched", r.matched,
		"freeze_stall", r.FreezeStall.Round(time.Microsecond), "pack", r.PackTime.Round(time.Millisecond),
		"upload", r.UploadTime.Round(time.Millisecond), "bytes_uploaded", r.BytesUploaded,
		"segment_bytes", r.segment, "rewritten_bytes", r.rewritten, "extents", r.extents, "segments", r.segments,
		"packed_on", OrNone(r.packedOn))
	d.met.snapshotPublished(r)
	d.resolveStoreErr("snapshot " + r.ID + " published")
	d.notify("snapshot " + r.ID + " published")

	d.maybePrune(ctx, reason)
	d.maybeCompact(reason)
	return r.snapshotResult, nil
}

// pruneEvery is the least time between two prunes after write-back
// snapshots: a prune lists the store twice and deletes, which snapshots
// seconds apart need not pay each time (retention counts hours and days).
const pruneEvery = 10 * time.Minute

// maybePrune applies the retention policy after a snapshot: after a
// write-back snapshot at most once per pruneEvery, never after the final
// snapshot of a stop (the stop's time is for getting the change into the
// store; the next snapshot prunes). The lower layer's segments are still
// read from the store: the writer lease names it, and prune keeps it (and
// LATEST).
func (d *daemon) maybePrune(ctx context.Context, reason string) {
	d.mu.Lock()
	due := reason != "final" && (reason != "write-back" || d.lastPrune.IsZero() || time.Since(d.lastPrune) >= pruneEvery)
	if due {
		d.lastPrune = time.Now()
	}
	d.mu.Unlock()
	if !due {
		return
	}
	t := time.Now()
	if err := contain(func() error { return d.cat.Prune(ctx, d.cfg.Retention) }); err != nil {
		d.log.Warn("prune", "err", err, "took", time.Since(t).Round(time.Millisecond))
		if stack := panicStack(err); stack != nil {
			d.log.Error("prune failed on a panic", "err", err, "stack", string(stack))
		}
	}
}

// snapshotDone is a published snapshot, with the figures only the log
// line shows.
type snapshotDone struct {
	snapshotResult
	// segment: the new segment's bytes (the image bytes new in it, with
	// those rewritten out of mostly dead segments); rewritten: those;
	// extents, segments: the image's layout in the store.
	segment, rewritten int64
	// matched: file bytes read and found unchanged by their block sums.
	matched           int64
	extents, segments int
	packedOn          string
}

// snapshotOnce freezes the tree (unless given its view, which it closes),
// packs it and publishes it. onBase: the newest snapshot is the base the
// mount sits on, so a tree that is the lower layer's again is not packed
// (r.Unchanged, ID the base).
func (d *daemon) snapshotOnce(ctx context.Context, parent, expect string, onBase bool, view frozenView) (snapshotDone, error) {
	var r snapshotDone
	t0 := time.Now()
	given := view != nil
	if !given {
		d.resolveHot() // not part of the stall: nothing is frozen yet
		t0 = time.Now()
		var err error
		if view, err = d.ov.Freeze(ctx); err != nil {
			return r, fmt.Errorf("freeze: %w", err)
		}
	}
	// Closed below once packed, or on the way out of a panic.
	closeView := sync.OnceValue(view.Close)
	defer closeView()
	r.FreezeStall = time.Since(t0)
	if given {
		// The stop's sealed view: the hot set still ends before the
		// pack reads the lower layer.
		d.resolveHot()
	}
	viewGen := view.Generation()
	if onBase {
		// SQLite creates and removes a database's -wal and -shm even for
		// a query: the generation moved, the tree did not.
		same, err := view.SameAsLower()
		if err != nil {
			d.log.Debug("snapshot: cannot tell whether the tree is its base's; packing it", "err", err)
		} else if same {
			d.mu.Lock()
			d.publishedGen = viewGen
			r.ID = d.st.LastPublished
			d.mu.Unlock()
			r.Unchanged = true
			return r, nil
		}
	}
	d.met.snapshotFrozen()

	t1 := time.Now()
	out := filepath.Join(d.sd.packDir(), "next.seg")
	on := d.packBase(ctx)
	base, baseID := on.im, on.id
	ps, err := d.parts.packView(ctx, d, view, out, base, on.extend)
	if base != nil && ctx.Err() == nil && errors.Is(err, errBadBase) {
		// The image to build on cannot be read: it only ever saves work,
		// so pack without it.
		d.log.Warn("the previous snapshot cannot be packed on; packing without it", "id", baseID, "err", err)
		base, baseID, on = nil, "", packOn{}
		ps, err = d.parts.packView(ctx, d, view, out, nil, false)
	}
	if err == nil && on.extend && !ps.Extended {
		d.log.Info("snapshot laid out afresh: its base could not be extended", "base", baseID, "reason", ps.Fallback)
	}
	if cerr := closeView(); cerr != nil && err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(out)
		return r, fmt.Errorf("pack: %w", err)
	}
	r.PackTime = time.Since(t1)
	r.Files, r.BytesPacked, r.Size, r.BytesReused = ps.Files, ps.BytesPacked, ps.Size, ps.BytesReused
	r.segment, r.rewritten, r.matched, r.packedOn = ps.Segment, ps.Rewritten, ps.Matched, baseID

	t2 := time.Now()
	in := uploader.ImageInput{
		Segment: out, Extents: ps.Extents, Parent: parent, Expect: expect, Files: ps.Files,
		MetaOffset: ps.MetaOffset,
	}
	if base != nil {
		in.Sources = append(in.Sources, base.im.Manifest())
	}
	local := []*openImage{base}
	if _, lower := d.lowerArchive(); lower != nil && lower != base {
		in.Sources = append(in.Sources, lower.im.Manifest())
		local = append(local, lower)
	}
	// A format 1 base (no digests) was downloaded whole: its archive is
	// a segment of the new image through the digests of that copy.
	in.Local = func(key string) (string, bool) {
		for _, o := range local {
			if o != nil {
				if p, ok := o.im.SegmentPath(key); ok {
					return p, true
				}
			}
		}
		return "", false
	}
	if d.hot != nil || d.cfg.Standalone {
		// The new image, read from the new segment and the segments
		// open in the pool.
		comp, err := d.imgs.pool.Compose(ps.Extents, out)
		if err != nil {
			return r, fmt.Errorf("read the new image: %w", err)
		}
		defer comp.Close()
		if d.hot != nil {
			in.Hot = d.hotSet(comp, ps.Size, on.numbersOf(ps) != "")
		}
		in.Standalone, in.Image = d.cfg.Standalone, comp
	}
	pr, err := d.cat.PublishImage(ctx, in)
	if err != nil {
		// Kept: the publish may have moved LATEST before it failed
		// (its last read lost), and then this segment is what proves
		// at the next start that LATEST is ours (packedHere). The next
		// pack replaces it; a boot that saved its state removes it.
		return r, fmt.Errorf("publish: %w", err)
	}
	r.UploadTime = time.Since(t2)
	r.BytesUploaded, r.ID = pr.Sent, pr.ID
	r.extents, r.segments = pr.ExtentCount, len(pr.Segments)
	r.Duration = time.Since(t0)
	if err := d.adoptSegment(out, pr); err != nil {
		// Published all the same: the next pack reads the image from the
		// store.
		d.log.Warn("keeping the published segment in the cache", "err", err)
	}
	prev := parent

	d.mu.Lock()
	d.publishedGen, d.pending, d.expect = viewGen, false, pr.ID
	d.count++
	d.last = &snapshotRecord{ID: pr.ID, Time: time.Now().UTC(), snapshotFigures: r.snapshotFigures}
	switch {
	case ps.Generation == 0:
		// Laid out afresh: what later snapshots add is counted from here.
		d.st.CompactedExtents = pr.ExtentCount
	case baseID != d.st.LastPublished:
		d.st.CompactedExtents = 0 // extended another image: not known
	}
	d.st.LastPublished, d.st.PublishedAt = pr.ID, d.last.Time
	d.st.LastNumbersOf = on.numbersOf(ps)
	if err := d.sd.save(d.st); err != nil {
		// Published all the same; state.json stays conservative
		// (Unpublished is true while running).
		d.log.Warn("state", "err", err)
	}
	mounted := d.st.Base
	d.mu.Unlock()
	// The new image is what the next snapshot packs on; the one before
	// goes (unless it is the base).
	if _, err := d.image(ctx, pr.ID, &pr.Manifest); err != nil {
		d.log.Warn("open the published image", "id", pr.ID, "err", err)
	}
	if prev != "" && prev != pr.ID {
		d.closeImage(prev)
	}
	d.cleanCache(mounted, pr.ID)
	return r, nil
}

// The control socket's handler.
var _ controlHandler = (*daemon)(nil)

func (d *daemon) status() statusReport {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.booting {
		// The boot owns the state until the mount is ready; what it
		// waits for is all there is to say.
		r := statusReport{
			Mountpoint: d.cfg.Mountpoint, Running: true, PID: os.Getpid(), StateDir: d.sd.path, Host: d.host,
			Store: d.parts.storeURL(d), Lease: d.leaseState, Started: d.started,
		}
		if d.waiting != nil {
			w := *d.waiting
			r.Waiting = &w
		}
		return r
	}
	r := statusReport{
		Mountpoint: d.cfg.Mountpoint, Running: true, PID: os.Getpid(),
		Store: d.st.Store, StateDir: d.sd.path, Host: d.host, ReadOnly: d.cfg.ReadOnly,
		Base: d.st.Base, LastPublished: d.st.LastPublished,
		Snapshots: d.count, Last: d.last, NextDue: d.nextDue, InProgress: d.inProgress,
		LastError: d.lastErr, LastErrorAt: d.lastErrAt, LastErrorOver: d.lastErrOver, LastErrorOverBy: d.lastErrOverBy,
		Lease: d.leaseState, Started: d.started,
		Generation: d.ov.Generation(), Encryption: d.encryption,
		Stopping: d.stopPhase, StopDeadline: d.stopBy,
	}
	if r.Last == nil && d.st.LastPublished != "" {
		r.Last = &snapshotRecord{ID: d.st.LastPublished, Time: d.st.PublishedAt}
	}
	if d.cfg.ReadOnly {
		r.Base, r.LastPublished, r.Last = d.roBase, "", nil
	} else {
		r.DirtyFiles, r.DirtyBytes = d.ov.Dirty(d.publishedGen)
		r.Unpublished = d.pending || r.Generation != d.publishedGen
		d.recoveryStatusLocked(&r, time.Now())
		c := &d.compact
		r.Compaction = &compactionStatus{Running: c.running, Policy: c.policy.String(), Done: c.done, Failed: c.failed, Last: c.last}
	}
	r.Rejections = d.parts.rejections(d.sd.auditLog(), 5)
	r.Lazy = d.lazyStats()
	d.memoryStatus(&r)
	r.PartialCopyUps = partialCopyUps(d.ov)
	r.Adopted = d.adopted
	return r
}

func (d *daemon) snapshot(ctx context.Context) (snapshotResult, error) {
	d.mu.Lock()
	booting := d.booting
	d.mu.Unlock()
	if booting {
		return snapshotResult{}, withCode(exitConflict, errors.New("the mount is not writable yet (waiting for the writer lease): nothing to snapshot"))
	}
	// Bounded like the periodic snapshots, so the final one never waits
	// on a request past the stop timeout.
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(d.bgCtx, cancel)
	defer stop()
	return d.snapshotNow(ctx, "requested")
}

func (d *daemon) shutdown() <-chan shutdownResult {
	d.stopOnce.Do(func() { close(d.stopCh) })
	ch := make(chan shutdownResult, 1)
	go func() {
		<-d.resultSet
		ch <- d.result
	}()
	return ch
}
