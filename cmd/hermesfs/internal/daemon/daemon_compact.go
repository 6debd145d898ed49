package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// Compaction in the background (README "Snapshots and the store").
//
// Snapshots extend the image before them (daemon_extend.go), so the last
// published image carries what the changes since its lineage's last
// compaction replaced, and more extents each time. When it passes a bound
// of image.CompactPolicy, the daemon rewrites it with archive.Compact (the
// same tree and inode numbers, laid out afresh, data copied by reference)
// and publishes the result as a snapshot of the same tree whose manifest
// says it compacts its parent, provided LATEST still names the image it
// compacted; retention then prunes what only older snapshots use.
//
// It never holds up a snapshot for long, and a stop never waits for it:
// the image is read and the new one written without snapMu (the last
// published image does not change: it is in the store), which is taken
// only to publish, and only while the image is still the last published
// one. A stop cancels a compaction at once (stopCompaction). A publish
// cancelled before it knows whether LATEST moved leaves compact.maybe
// set: the next snapshot, holding snapMu, reads LATEST first and takes the
// compaction as published if it is (resolveCompaction); a restart after a
// kill does the same through decideBase (a snapshot of ours on our last
// published one).

// compactionRecord is the last compaction, for status.
type compactionRecord struct {
	ID       string        `json:"id"`        // the compacted snapshot published
	Of       string        `json:"of"`        // the snapshot it compacts
	Reason   string        `json:"reason"`    // the bound it passed
	Time     time.Time     `json:"time"`      // when it was published
	Took     time.Duration `json:"took_ns"`   // from start to published
	Freed    int64         `json:"freed"`     // image bytes it left out (the image's size before less after)
	Garbage  int64         `json:"garbage"`   // the compacted image's garbage estimate
	Extents  [2]int        `json:"extents"`   // extents before and after
	Uploaded int64         `json:"uploaded"`  // bytes it sent to the store
	Rewrote  int64         `json:"rewritten"` // bytes copied out of mostly dead segments into its own
}

// compactState is the daemon's compaction, guarded by d.mu.
type compactState struct {
	policy  image.CompactPolicy
	ctx     context.Context // cancelled by a stop
	cancel  context.CancelFunc
	running bool
	// maybe is the snapshot whose compaction's publish failed without
	// knowing whether LATEST moved to it.
	maybe string
	last  *compactionRecord
	// Counters for the metrics.
	done, failed    int
	freed, uploaded int64
}

// startCompaction readies background compaction (serve, before the first
// snapshot can run).
func (d *daemon) startCompaction() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.compact.policy = d.cfg.compactPolicy()
	d.compact.ctx, d.compact.cancel = context.WithCancel(context.Background())
}

// stopCompaction cancels a compaction in progress and any later one; it
// does not wait.
func (d *daemon) stopCompaction() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.compact.cancel != nil {
		d.compact.cancel()
	}
}

// maybeCompact starts compacting the last published image in the
// background when it passes a bound of the policy. Not after a stop's
// snapshot, and one at a time.
func (d *daemon) maybeCompact(reason string) {
	d.mu.Lock()
	ctx, last, running := d.compact.ctx, d.st.LastPublished, d.compact.running
	d.mu.Unlock()
	if ctx == nil || ctx.Err() != nil || running || last == "" || d.cfg.ReadOnly || isFinal(reason) {
		return
	}
	o := d.openedImage(last)
	if o == nil {
		return
	}
	r, err := o.archive()
	if err != nil {
		return
	}
	m := o.im.Manifest()
	d.mu.Lock()
	baseExtents := d.st.CompactedExtents
	d.mu.Unlock()
	why := d.compact.policy.Due(m.Size, r.GarbageBytes(), m.ExtentCount, baseExtents, r.Generation())
	if why == "" {
		return
	}
	d.mu.Lock()
	if d.compact.running {
		d.mu.Unlock()
		return
	}
	d.compact.running = true
	d.mu.Unlock()
	go func() {
		defer func() {
			d.mu.Lock()
			d.compact.running = false
			d.mu.Unlock()
		}()
		t := time.Now()
		err := contain(func() error { return d.compactOnce(ctx, last, why) })
		switch {
		case err == nil:
		case errors.Is(err, errCompactionStale):
			d.log.Info("compaction dropped: a newer snapshot was published meanwhile; the next one compacts", "of", last, "took", time.Since(t).Round(time.Millisecond))
		case ctx.Err() != nil:
			d.log.Info("compaction cancelled", "of", last, "took", time.Since(t).Round(time.Millisecond))
		default:
			d.mu.Lock()
			d.compact.failed++
			d.mu.Unlock()
			if stack := panicStack(err); stack != nil {
				d.log.Error("compaction failed on a panic; the snapshots are untouched", "of", last, "err", err, "stack", string(stack))
			} else {
				d.log.Warn("compaction failed; the snapshots are untouched, the next snapshot tries again", "of", last, "err", err)
			}
		}
	}()
}

// isFinal reports a stop's snapshot.
func isFinal(reason string) bool { return len(reason) >= 5 && reason[:5] == "final" }

// testCompactHook, if set by a test, runs when a compaction has written
// its image, before it publishes.
var testCompactHook func(ctx context.Context)

// errCompactionStale: the image compacted is no longer the last published.
var errCompactionStale = errors.New("the compacted snapshot is no longer the last published")

// compactOnce compacts snapshot id (the last published) and publishes the
// result if id is still the last published snapshot.
func (d *daemon) compactOnce(ctx context.Context, id, why string) error {
	t0 := time.Now()
	d.log.Info("compacting the last snapshot in the background", "of", id, "reason", why)
	o, err := d.image(ctx, id, nil)
	if err != nil {
		return err
	}
	r, err := o.archive()
	if err != nil {
		return err
	}
	before := o.im.Manifest()
	out := filepath.Join(d.sd.packDir(), "compact.seg")
	defer os.Remove(out) // moved into the cache once published
	// One worker: it runs beside the agent, and nothing waits for it.
	c, err := image.Compact(ctx, out, r, o.im, d.encryption != nil, 1)
	if err != nil {
		return err
	}
	res, ext, rewritten := c.PackResult, c.Extents, c.Rewritten
	ps := statsOf(res, ext, out)
	if testCompactHook != nil {
		testCompactHook(ctx)
	}
	if err := d.lockSnapshots(ctx); err != nil {
		return err
	}
	defer d.snapMu.Unlock()
	d.mu.Lock()
	current, expect, lost := d.st.LastPublished, d.expect, d.leaseState == "lost"
	numbered := keepsLowerNumbers(&d.st, id)
	d.mu.Unlock()
	if current != id {
		return errCompactionStale
	}
	if lost {
		return errLeaseLost
	}
	in := uploader.ImageInput{
		Segment: out, Extents: ext, Parent: id, Expect: expect, Files: ps.Files,
		MetaOffset: ps.MetaOffset, Sources: []uploader.Manifest{before}, Compacts: id,
	}
	if d.hot != nil || d.cfg.Standalone {
		comp, err := d.imgs.pool.Compose(ext, out)
		if err != nil {
			return fmt.Errorf("read the compacted image: %w", err)
		}
		defer comp.Close()
		if d.hot != nil {
			in.Hot = d.hotSet(comp, ps.Size, numbered)
		}
		in.Standalone, in.Image = d.cfg.Standalone, comp
	}
	pr, err := d.cat.PublishImage(ctx, in)
	if err != nil {
		if !errors.Is(err, errConflict) {
			// LATEST may have moved before the error reached us.
			d.mu.Lock()
			d.compact.maybe = id
			d.mu.Unlock()
		}
		return fmt.Errorf("publish the compacted image: %w", err)
	}
	if err := d.adoptSegment(out, pr); err != nil {
		d.log.Warn("keeping the compacted segment in the cache", "err", err)
	}
	rec := &compactionRecord{
		ID: pr.ID, Of: id, Reason: why, Time: time.Now().UTC(), Took: time.Since(t0),
		Freed: before.Size - pr.Manifest.Size, Garbage: res.GarbageBytes, Extents: [2]int{before.ExtentCount, pr.ExtentCount},
		Uploaded: pr.Sent, Rewrote: rewritten,
	}
	d.mu.Lock()
	d.adoptCompactionLocked(id, pr.ID, pr.Manifest.ID, pr.ExtentCount)
	d.compact.last = rec
	d.compact.done++
	d.compact.freed += max(rec.Freed, 0)
	d.compact.uploaded += rec.Uploaded
	mounted := d.st.Base
	d.mu.Unlock()
	if _, err := d.image(ctx, pr.ID, &pr.Manifest); err != nil {
		d.log.Warn("open the compacted image", "id", pr.ID, "err", err)
	}
	d.closeImage(id)
	d.cleanCache(mounted, pr.ID)
	d.log.Info("compacted snapshot published", "id", pr.ID, "of", id, "reason", why, "size", pr.Manifest.Size, "freed", rec.Freed,
		"extents_before", before.ExtentCount, "extents", pr.ExtentCount, "segments", len(pr.Segments),
		"bytes_uploaded", pr.Sent, "rewritten_bytes", rewritten, "took", rec.Took.Round(time.Millisecond))
	d.maybePrune(ctx, "compaction")
	return nil
}

// adoptCompactionLocked makes snapshot id, a compaction of the last
// published snapshot of, the last published one (d.mu held): the same
// tree, and the same inode numbers.
func (d *daemon) adoptCompactionLocked(of, id, pointer string, extents int) {
	st := &d.st
	keeps := keepsLowerNumbers(st, of)
	st.LastPublished, st.PublishedAt, st.CompactedExtents = id, time.Now().UTC(), extents
	st.LastNumbersOf = ""
	if keeps {
		st.LastNumbersOf = st.Base
	}
	d.expect = pointer
	d.compact.maybe = ""
	if err := d.sd.save(*st); err != nil {
		d.log.Warn("state", "err", err)
	}
}

// lockSnapshots takes snapMu, waiting for a snapshot in progress, unless
// ctx ends first.
func (d *daemon) lockSnapshots(ctx context.Context) error {
	for !d.snapMu.TryLock() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
	return nil
}

// resolveCompaction settles a compaction whose publish failed not knowing
// whether LATEST moved: if LATEST names it, it is the last published
// snapshot now. snapMu is held.
func (d *daemon) resolveCompaction(ctx context.Context) {
	d.mu.Lock()
	of := d.compact.maybe
	d.mu.Unlock()
	if of == "" {
		return
	}
	latest, err := d.cat.Latest(ctx)
	if err != nil {
		return // the publish fails the same way; asked again next time
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if latest.Compacts == of && latest.Host == d.host && latest.Parent == of && d.st.LastPublished == of {
		d.log.Info("the compaction whose publish seemed to fail was published", "id", latest.ID, "of", of)
		d.adoptCompactionLocked(of, latest.ID, latest.Pointer, 0)
		return
	}
	d.compact.maybe = ""
}
