package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/fs"
)

// The stop (SIGTERM, SIGINT, `hermesfs umount`, the mount going away).
//
// Its length must not depend on the agent stopping first: a container
// runtime kills the daemon a few seconds after SIGTERM whatever it does.
// So the final snapshot seals the mount (fs.Mounted.Seal): from its freeze
// on, every change fails (EROFS; EIO for files written through
// passthrough), and the snapshot is exactly the last state any writer was
// told succeeded. Nothing written after it can be lost, because nothing
// can be written after it. Then the mount is detached lazily, the files
// still open on it get a short grace (unmountGrace, ending at most
// unmountGraceEnds after the signal) to be closed, and the connection is
// aborted: open files never hold the stop. Exit 0 when the
// final snapshot is published (or nothing changed), 5 when it is not (the
// upper layer is kept and the next start publishes it).
//
// While it stops the daemon answers `status` (what it waits for and until
// when), logs each step and, every stopProgressEvery, what it still waits
// for. A second SIGINT or SIGTERM while the final snapshot is under way
// abandons it: the upper layer, which holds everything, stays for the
// next start, and the daemon exits 5 at once. After the snapshot a second
// signal changes nothing (what is left takes a few seconds at most).

// unmountGrace is how long the stop waits, once the mount is detached, for
// the files still open on it to be closed before it aborts the connection.
var unmountGrace = time.Second

// unmountGraceEnds is how long after the signal the grace ends at the
// latest: the grace is a courtesy (the files can change nothing), and it
// must not make a stop whose snapshot was slow miss a container's grace.
// With a quick final snapshot the stop exits within about this long.
const unmountGraceEnds = 1500 * time.Millisecond

// stopProgressEvery is how often a stop says what it still waits for.
const stopProgressEvery = 5 * time.Second

// stopStep is how far a stop is.
type stopStep int

const (
	stepSnapshot stopStep = iota // the final snapshot, or waiting for one in progress
	stepUnmount
	stepRelease
)

// setStopPhase records what the stop does now, for status and the log.
func (d *daemon) setStopPhase(step stopStep, phase string) {
	d.mu.Lock()
	d.stopStep, d.stopPhase, d.stopSince = step, phase, time.Now()
	by := d.stopBy
	d.mu.Unlock()
	d.log.Info("stopping: "+phase, "gives_up_at", by.Format(time.TimeOnly))
	sdNotify(d.e.Getenv, "STATUS=stopping: "+phase)
}

// watchStop says, while the stop lasts, what it still waits for, and
// answers further signals: a second one during the final snapshot calls
// abandon. The returned func ends the watch.
func (d *daemon) watchStop(abandon func()) (end func()) {
	sigs := d.e.Signals
	stopNotify := func() {}
	if sigs == nil {
		ch := make(chan os.Signal, 2)
		signal.Notify(ch, os.Interrupt, syscall.SIGTERM)
		sigs, stopNotify = ch, func() { signal.Stop(ch) }
	}
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		tick := time.NewTicker(stopProgressEvery)
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case sig := <-sigs:
				d.mu.Lock()
				step, phase, by := d.stopStep, d.stopPhase, d.stopBy
				d.mu.Unlock()
				if step == stepSnapshot && !d.abandoned.Swap(true) {
					d.log.Warn("second signal: stopping now, without the final snapshot; the local changes stay in the state dir and the next start publishes them (exit 5)",
						"signal", sig.String(), "was", phase, "state_dir", d.sd.path)
					abandon()
					continue
				}
				d.log.Warn("already stopping; the rest takes seconds at most", "signal", sig.String(), "now", phase, "gives_up_at", by.Format(time.TimeOnly))
			case <-tick.C:
				d.mu.Lock()
				step, phase, since, by := d.stopStep, d.stopPhase, d.stopSince, d.stopBy
				d.mu.Unlock()
				args := []any{"for", time.Since(since).Round(time.Second).String(), "gives_up_at", by.Format(time.TimeOnly)}
				if step == stepSnapshot && !d.abandoned.Load() {
					args = append(args, "to_stop_now", "send SIGINT or SIGTERM again (Ctrl-C): exit 5, local changes kept for the next start")
				}
				d.log.Info("still stopping: "+phase, args...)
			}
		}
	}()
	return func() {
		close(done)
		<-finished
		stopNotify()
	}
}

// stop takes the final snapshot, sealing the mount, then unmounts and
// rebases, all within the stop timeout.
func (d *daemon) stop(waitBg func()) shutdownResult {
	cfg := d.cfg
	t0 := time.Now()
	deadline := t0.Add(cfg.StopTimeout)
	d.mu.Lock()
	d.stopBy = deadline
	d.mu.Unlock()
	// Keep a part of the budget for the unmount.
	reserve := min(10*time.Second, cfg.StopTimeout/4)
	snapCtx, cancel := context.WithDeadline(context.Background(), deadline.Add(-reserve))
	defer cancel()

	// Snapshots still running are cancelled when the deadline nears.
	t := time.AfterFunc(time.Until(deadline.Add(-reserve)), d.bgCancel)
	defer t.Stop()
	endWatch := d.watchStop(func() {
		cancel()
		d.bgCancel()
	})
	defer endWatch()
	// A compaction in progress goes at once: it only ever saves later
	// snapshots' bytes, and the stop is for getting the change out.
	d.stopCompaction()

	d.stopLazyFill()
	res := shutdownResult{Code: exitOK}
	var finalGen uint64
	gone := false
	select {
	case <-d.ov.Done():
		gone = true
	default:
	}
	switch {
	case cfg.ReadOnly:
	case gone:
		// Nothing can be frozen any more; the upper layer is intact on
		// disk and the next start publishes it, if anything changed.
		d.snapMu.Lock()
		d.mu.Lock()
		finalGen, res.FinalID = d.publishedGen, d.st.LastPublished
		d.mu.Unlock()
		changed := d.changedSincePublished()
		d.snapMu.Unlock()
		if changed {
			res.Code, res.Error = exitUnsynced, fmt.Sprintf("the mount went away before a final snapshot; local changes are kept in %s and published by the next start", d.sd.path)
		} else {
			gone = false // nothing to lose: a clean stop
		}
	default:
		// A snapshot in progress finishes (or fails) first, within the
		// same deadline (bgCancel above): never a half-published snapshot.
		locked := make(chan struct{})
		go func() { d.snapMu.Lock(); close(locked) }()
		select {
		case <-locked:
		case <-time.After(10 * time.Millisecond):
			d.setStopPhase(stepSnapshot, "waiting for the snapshot in progress to end")
		}
		var r snapshotResult
		var err error
		select {
		case <-locked:
			d.setStopPhase(stepSnapshot, "final snapshot (the mount refuses every change from its freeze on)")
			r, err = d.finalSnapshotLocked(snapCtx)
			// After the seal only stores into a shared mapping of a
			// file written through passthrough can change the tree
			// (no system call carries them): take them once more.
			if err == nil && snapCtx.Err() == nil && d.changedSincePublished() {
				d.log.Warn("stores into shared mappings (mmap) of files open for writing went on after the final snapshot's freeze; taking them too")
				var again snapshotResult
				if again, err = d.snapshotLocked(snapCtx, "final, mapped stores"); err == nil {
					r = again
				}
			}
			d.snapMu.Unlock()
		case <-snapCtx.Done():
			err = fmt.Errorf("a snapshot in progress did not end within --stop-timeout %s", cfg.StopTimeout)
			go func() { <-locked; d.snapMu.Unlock() }()
		}
		switch {
		case err != nil && d.abandoned.Load():
			res.Code, res.Error = exitUnsynced, fmt.Sprintf("stopped without the final snapshot (a second signal); local changes are kept in %s and published by the next start", d.sd.path)
		case err != nil:
			res.Code, res.Error = exitUnsynced, fmt.Sprintf("final snapshot failed: %v; local changes are kept in %s and published by the next start", err, d.sd.path)
			if errors.Is(err, errLeaseLost) || errors.Is(err, errConflict) {
				res.Code = exitConflict
			}
		default:
			res.FinalID = r.ID
		}
		d.mu.Lock()
		finalGen = d.publishedGen
		d.mu.Unlock()
	}

	graceBy := t0.Add(unmountGraceEnds)
	if by := deadline.Add(reserve / 2); by.Before(graceBy) {
		graceBy = by
	}
	d.unmountForStop(&res, graceBy)
	// Snapshot goroutines see the cancelled mount and return.
	waitDone := make(chan struct{})
	go func() { waitBg(); close(waitDone) }()
	select {
	case <-waitDone:
	case <-time.After(time.Until(deadline) + reserve):
	}
	d.closeImages()

	if !cfg.ReadOnly && res.Code == exitOK && !gone {
		switch {
		case d.ov.Generation() != finalGen:
			// Only stores into a shared mapping can change a sealed
			// tree: kept, and exit 0 would tell whoever throws this
			// machine away that the store has everything.
			res.Code = exitUnsynced
			res.Error = fmt.Sprintf("stores into shared mappings (mmap) of files open for writing went on after the final snapshot %s; they are kept in %s and published by the next start (stop the writers before hermesfs)", OrNone(res.FinalID), d.sd.path)
		case d.ov.Unrevoked() > 0:
			// Their writes after the final snapshot would reach only
			// the upper layer (the log names them).
			res.Code = exitUnsynced
			res.Error = fmt.Sprintf("the writes of %d files open for writing through passthrough could not be refused after the final snapshot %s; whatever they write is kept in %s and published by the next start", d.ov.Unrevoked(), OrNone(res.FinalID), d.sd.path)
		}
	}
	if !cfg.ReadOnly {
		d.finish(res.Code == exitOK && !gone, finalGen)
	}
	if d.lease != nil {
		d.setStopPhase(stepRelease, "giving the writer lease back")
		wait := 5 * time.Second
		if d.abandoned.Load() {
			wait = 2 * time.Second
		}
		rctx, rcancel := context.WithTimeout(context.Background(), wait)
		if err := d.lease.Release(rctx); err != nil {
			d.log.Warn("lease release", "err", err)
		}
		rcancel()
	}
	d.cat.Close()
	d.sd.close()
	took := time.Since(t0).Round(time.Millisecond).String()
	if res.Code == exitOK {
		d.log.Info("stopped", "final_snapshot", OrNone(res.FinalID), "took", took)
	} else {
		d.log.Error("stopped with unpublished changes", "err", res.Error, "code", res.Code, "took", took)
	}
	return res
}

// unmountForStop detaches the mount and waits at most unmountGrace (none
// once a second signal came, never past graceBy) for the files still open on
// it, then aborts the connection. Files still open are no failure: the
// mount is sealed (or read-only, or gone) and they can change nothing.
func (d *daemon) unmountForStop(res *shutdownResult, graceBy time.Time) {
	d.setStopPhase(stepUnmount, "unmounting")
	grace := unmountGrace
	if d.abandoned.Load() {
		grace = 0
	}
	if until := time.Until(graceBy); grace > until {
		grace = max(until, 0)
	}
	if hs := d.ov.Holders(8); len(hs) > 0 {
		d.log.Info("files are still open on the mount; it is detached now, and they fail (ENOTCONN) once they are closed or the grace is over",
			"open", joinHolders(hs), "grace", grace.String())
	}
	uctx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := d.ov.Unmount(uctx)
	switch {
	case err == nil:
	case errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled):
		d.log.Warn("unmounted with files still open: they get ENOTCONN from now on (at the latest when the daemon exits)", "err", err)
	default:
		d.log.Error("unmount", "err", err)
		if res.Code == exitOK {
			res.Code, res.Error = exitFailure, fmt.Sprintf("unmount: %v", err)
		}
	}
}

// joinHolders names open files for a log line.
func joinHolders(hs []fs.Holder) string {
	s := make([]string, len(hs))
	for i, h := range hs {
		s[i] = h.String()
	}
	return strings.Join(s, ", ")
}
