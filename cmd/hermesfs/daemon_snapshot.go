package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"
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
	if d.cfg.ReadOnly {
		return snapshotResult{}, errors.New("read-only mount: it never publishes")
	}
	d.mu.Lock()
	gen, lost := d.ov.Generation(), d.leaseState == "lost"
	unchanged := gen == d.publishedGen && !d.pending
	last, expect, base := d.st.LastPublished, d.expect, d.st.Base
	d.mu.Unlock()
	if lost {
		return snapshotResult{}, withCode(exitConflict, errLeaseLost)
	}
	if unchanged {
		d.log.Debug("snapshot: nothing changed", "reason", reason, "last", orNone(last))
		if last == "" {
			last = expect // LATEST: what the mount shows
		}
		return snapshotResult{ID: last, Unchanged: true}, nil
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
	r, err := d.snapshotOnce(ctx, parent, expect)
	if err != nil {
		err = fmt.Errorf("snapshot (%s): %w", reason, err)
		d.log.Error("snapshot failed; local state kept, retrying at the next tick", "err", err)
		d.setErr(err)
		if errors.Is(err, errConflict) || errors.Is(err, errLeaseLost) {
			return r, withCode(exitConflict, err)
		}
		return r, err
	}
	d.log.Info("snapshot published", "reason", reason, "id", r.ID, "files", r.Files,
		"bytes_packed", r.BytesPacked, "size", r.Size, "bytes_reused", r.BytesReused,
		"freeze_stall", r.FreezeStall.Round(time.Microsecond), "pack", r.PackTime.Round(time.Millisecond),
		"upload", r.UploadTime.Round(time.Millisecond), "bytes_uploaded", r.BytesUploaded)
	sdNotify(d.e.getenv, "STATUS=snapshot "+r.ID+" published")

	t := time.Now()
	if err := d.cat.Prune(ctx, d.cfg.Keep); err != nil {
		d.log.Warn("prune", "err", err, "took", time.Since(t).Round(time.Millisecond))
	}
	return r, nil
}

func (d *daemon) snapshotOnce(ctx context.Context, parent, expect string) (snapshotResult, error) {
	var r snapshotResult
	t0 := time.Now()
	view, err := d.ov.Freeze(ctx)
	if err != nil {
		return r, fmt.Errorf("freeze: %w", err)
	}
	r.FreezeStall = time.Since(t0)
	viewGen := view.Generation()

	t1 := time.Now()
	out := filepath.Join(d.sd.packDir(), "next.sqfs")
	ps, err := d.parts.packView(ctx, view, out)
	if cerr := view.Close(); cerr != nil && err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(out)
		return r, fmt.Errorf("pack: %w", err)
	}
	r.PackTime = time.Since(t1)
	r.Files, r.BytesPacked, r.Size, r.BytesReused = ps.Files, ps.BytesPacked, ps.Size, ps.BytesReused

	t2 := time.Now()
	pr, err := d.cat.Publish(ctx, out, publishMeta{Parent: parent, Files: ps.Files, Host: d.host}, expect)
	if err != nil {
		os.Remove(out)
		return r, fmt.Errorf("publish: %w", err)
	}
	r.UploadTime = time.Since(t2)
	r.BytesUploaded = pr.BytesUploaded
	r.ID = pr.ID
	r.Duration = time.Since(t0)

	// Keep the newest published archive: a clean shutdown makes it the
	// base without downloading it again.
	keep := filepath.Join(d.sd.packDir(), pr.ID+".sqfs")
	if err := os.Rename(out, keep); err != nil {
		d.log.Warn("keeping the published archive", "err", err)
	}
	olds, _ := filepath.Glob(filepath.Join(d.sd.packDir(), "*.sqfs"))
	for _, o := range olds {
		if o != keep {
			os.Remove(o)
		}
	}

	d.mu.Lock()
	defer d.mu.Unlock()
	d.publishedGen, d.pending, d.expect = viewGen, false, pr.ID
	d.publishedSHA = ps.SHA256
	d.count++
	d.last = &snapshotRecord{ID: pr.ID, Time: time.Now().UTC(), snapshotFigures: r.snapshotFigures}
	d.st.LastPublished, d.st.PublishedAt = pr.ID, d.last.Time
	if err := d.sd.save(d.st); err != nil {
		// Published all the same; state.json stays conservative
		// (Unpublished is true while running).
		d.log.Warn("state", "err", err)
	}
	return r, nil
}

// The control socket's handler.
var _ controlHandler = (*daemon)(nil)

func (d *daemon) status() statusReport {
	d.mu.Lock()
	defer d.mu.Unlock()
	r := statusReport{
		Mountpoint: d.cfg.Mountpoint, Running: true, PID: os.Getpid(),
		Store: d.st.Store, StateDir: d.sd.path, Host: d.host, ReadOnly: d.cfg.ReadOnly,
		Base: d.st.Base, LastPublished: d.st.LastPublished,
		Snapshots: d.count, Last: d.last, NextDue: d.nextDue, InProgress: d.inProgress,
		LastError: d.lastErr, LastErrorAt: d.lastErrAt, Lease: d.leaseState, Started: d.started,
		Generation: d.ov.Generation(),
	}
	if r.Last == nil && d.st.LastPublished != "" {
		r.Last = &snapshotRecord{ID: d.st.LastPublished, Time: d.st.PublishedAt}
	}
	if d.cfg.ReadOnly {
		r.Base, r.LastPublished, r.Last = d.roBase, "", nil
	} else {
		r.DirtyFiles, r.DirtyBytes = d.ov.Dirty(d.publishedGen)
		r.Unpublished = d.pending || r.Generation != d.publishedGen
	}
	r.Rejections = d.parts.rejections(d.sd.auditLog(), 5)
	return r
}

func (d *daemon) snapshot(ctx context.Context) (snapshotResult, error) {
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
