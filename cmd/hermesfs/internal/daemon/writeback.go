package daemon

import (
	"errors"
	"math/rand/v2"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// Write-back and the recovery point: when a change goes out, and how old
// the oldest change the store lacks is (README "Write-back").
//
// The serve loop polls the overlay's generation every pollEvery: an atomic
// read, plus an fstat of each file open for passthrough writes (the kernel
// writes those without the daemon; Generation notices them). The change
// log turns what the polls saw into the time of the oldest change not in
// the store: the recovery point status and the metrics show, and the time
// the write-back delay runs from. So a burst of writes gives one snapshot
// D after its first write, a steady stream one per D, and nothing changed
// gives none. Every snapshot the loop starts (write-back, interval, the
// changes a crash left) goes through the scheduler, which lets one run at
// a time, at most one start per D, and after a failure waits the store's
// retry backoff (uploader.RetryPolicy, from D up to writeBackRetryCap).
// Everything here is guarded by daemon.mu.

// changeLog remembers when the generations the polls saw were reached, so
// that for any published generation it can tell when the oldest change
// after it was made.
type changeLog struct {
	gen   uint64    // the newest generation observed
	at    time.Time // when it was last observed
	marks []genMark // ascending gen
}

// genMark says that the changes numbered up to gen and above the previous
// mark's gen were all made after after: it is the time of the observation
// before the one that saw them, so a change's time is never later than
// its mark's, and at most one poll earlier.
type genMark struct {
	gen   uint64
	after time.Time
}

// maxMarks bounds the log while nothing is published (a store outage):
// past it, neighbouring marks merge, keeping the earlier time.
const maxMarks = 256

// reset starts the log at generation gen, observed at now.
func (c *changeLog) reset(now time.Time, gen uint64) {
	*c = changeLog{gen: gen, at: now}
}

// observe records that the generation was gen at now.
func (c *changeLog) observe(now time.Time, gen uint64) {
	if gen > c.gen {
		if len(c.marks) >= maxMarks {
			c.compact()
		}
		c.marks = append(c.marks, genMark{gen: gen, after: c.at})
		c.gen = gen
	}
	if now.After(c.at) {
		c.at = now
	}
}

// compact halves the marks: each pair becomes one mark with the pair's
// newer generation and older time (an earlier time: never a later one).
func (c *changeLog) compact() {
	out := c.marks[:0]
	for i := 0; i < len(c.marks); i += 2 {
		m := c.marks[i]
		if i+1 < len(c.marks) {
			m.gen = c.marks[i+1].gen
		}
		out = append(out, m)
	}
	c.marks = out
}

// oldest returns when the oldest change after generation published was
// made (zero when none is known), and forgets the marks published covers.
func (c *changeLog) oldest(published uint64) time.Time {
	i := 0
	for i < len(c.marks) && c.marks[i].gen <= published {
		i++
	}
	c.marks = c.marks[i:]
	if len(c.marks) == 0 {
		return time.Time{}
	}
	return c.marks[0].after
}

// writeBackRetryCap is the longest wait between write-back attempts while
// snapshots fail: the store's request backoff cap, or D if longer.
const writeBackRetryCap = uploader.DefaultRetryCap

// defaultRecoveryGrace is how far the recovery point may fall behind the
// snapshot schedule before status and the log warn: several failed
// attempts in a row at the backoff's cap, or a publish that has been
// running for minutes, not one retry or one large upload.
const defaultRecoveryGrace = 5 * time.Minute

// scheduler is the state of the snapshots the serve loop starts.
type scheduler struct {
	delay  time.Duration // --write-back; 0: off
	policy uploader.RetryPolicy

	running   bool
	lastStart time.Time // of the last snapshot started (zero: none yet)
	prevStart time.Time // lastStart before the current one, restored if it did not run
	failures  int       // in a row
	retryAt   time.Time // no write-back attempt before, after a failure
	warned    bool      // the recovery point is past its bound and the log said so
}

func newScheduler(delay time.Duration) scheduler {
	return scheduler{delay: delay, policy: uploader.RetryPolicy{Base: delay, Cap: max(delay, writeBackRetryCap)}}
}

// due is when the next write-back snapshot should start, given the time
// of the oldest change not in the store; zero when none is due (off,
// nothing to publish, or one running).
func (s *scheduler) due(oldest time.Time) time.Time {
	if s.delay <= 0 || oldest.IsZero() || s.running {
		return time.Time{}
	}
	t := oldest.Add(s.delay)
	if !s.lastStart.IsZero() {
		t = latest(t, s.lastStart.Add(s.delay))
	}
	if s.failures > 0 {
		t = latest(t, s.retryAt)
	}
	return t
}

// mayStart reports whether an interval tick may start a snapshot now: with
// write-back on, not within D of the last start (write-back publishes the
// change by then anyway).
func (s *scheduler) mayStart(now time.Time) bool {
	if s.running {
		return false
	}
	return s.delay <= 0 || s.lastStart.IsZero() || !now.Before(s.lastStart.Add(s.delay))
}

// start records a snapshot started at now; false if one is running.
func (s *scheduler) start(now time.Time) bool {
	if s.running {
		return false
	}
	s.running, s.prevStart, s.lastStart = true, s.lastStart, now
	return true
}

// skipped: the started snapshot did not run (another one held snapMu).
func (s *scheduler) skipped() {
	s.running, s.lastStart = false, s.prevStart
}

// finish records the end of a started snapshot at now, and returns the
// wait before the next write-back attempt after a failure (0 on success).
func (s *scheduler) finish(now time.Time, err error, rnd float64) time.Duration {
	s.running = false
	if err == nil {
		s.failures, s.retryAt = 0, time.Time{}
		return 0
	}
	wait := s.policy.Delay(s.failures, rnd)
	s.failures++
	s.retryAt = now.Add(wait)
	return wait
}

func latest(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// initSchedule starts the change log at the mount's generation, before
// anything (a status request, a snapshot) can read it.
func (d *daemon) initSchedule() {
	d.mu.Lock()
	d.sched = newScheduler(d.cfg.WriteBack)
	d.changes.reset(time.Now(), d.publishedGen)
	d.mu.Unlock()
}

// pollEvery is how often the serve loop looks for changes: a tenth of the
// write-back delay, at most a second (the recovery point's resolution).
func pollEvery(writeBack time.Duration) time.Duration {
	if writeBack <= 0 {
		return time.Second
	}
	return min(time.Second, max(50*time.Millisecond, writeBack/10))
}

// recoveryBound is the age of the oldest change not in the store above
// which status and the log warn: the schedule's own delay (write-back's,
// else the interval: with write-back on, no snapshot starts within D of
// another, so D is what a change may wait) plus defaultRecoveryGrace
// (Config.recoveryGrace in tests). 0: no bound (read-only, or no
// automatic snapshots).
func (d *daemon) recoveryBound() time.Duration {
	if d.cfg.ReadOnly {
		return 0
	}
	sched := d.cfg.Interval
	if d.cfg.WriteBack > 0 {
		sched = d.cfg.WriteBack
	}
	if sched <= 0 {
		return 0
	}
	grace := d.cfg.recoveryGrace
	if grace <= 0 {
		grace = defaultRecoveryGrace
	}
	return sched + grace
}

// oldestUnpublishedLocked is when the oldest change not in the store was
// made, as far as the polls tell (at most one poll early); changes a
// crash left count from this daemon's start. Zero: the store has it all.
// d.mu is held.
func (d *daemon) oldestUnpublishedLocked(now time.Time, gen uint64) time.Time {
	if d.cfg.ReadOnly {
		return time.Time{}
	}
	return d.changes.unpublishedSince(now, gen, d.publishedGen, d.pending, d.started)
}

// unpublishedSince records that the generation is gen at now and returns
// when the oldest change after generation published was made; pending
// (changes from before this mount) counts from started.
func (c *changeLog) unpublishedSince(now time.Time, gen, published uint64, pending bool, started time.Time) time.Time {
	c.observe(now, gen)
	t := c.oldest(published)
	if gen <= published {
		t = time.Time{}
	}
	if pending && (t.IsZero() || started.Before(t)) {
		t = started
	}
	return t
}

// recoveryPoint is oldestUnpublishedLocked for callers without d.mu.
func (d *daemon) recoveryPoint(now time.Time) time.Time {
	gen := d.ov.Generation() // outside mu: it may stat files
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.oldestUnpublishedLocked(now, gen)
}

// pollChanges is the serve loop's poll: it records the generation, warns
// when the recovery point passes its bound (and says when it is back),
// and reports whether a write-back snapshot is due now, in which case
// the caller starts it.
func (d *daemon) pollChanges(now time.Time) bool {
	oldest := d.recoveryPoint(now)
	d.mu.Lock()
	defer d.mu.Unlock()
	if bound := d.recoveryBound(); bound > 0 {
		age := time.Duration(0)
		if !oldest.IsZero() {
			age = now.Sub(oldest)
		}
		switch {
		case age > bound && !d.sched.warned:
			d.sched.warned = true
			d.log.Warn("recovery point: changes older than the bound are not in the store; a host lost now loses them (the store is down, or snapshots fail or take long)",
				"oldest_change", oldest.Format(time.RFC3339), "age", age.Round(time.Second), "bound", bound, "last_error", d.lastErr)
		case age <= bound && d.sched.warned:
			d.sched.warned = false
			d.log.Info("recovery point back within its bound", "age", age.Round(time.Second), "bound", bound)
		}
	}
	due := d.sched.due(oldest)
	return !due.IsZero() && !now.Before(due)
}

// recoveryStatusLocked fills in the write-back and recovery point part of
// status; d.mu is held and r.Generation read.
func (d *daemon) recoveryStatusLocked(r *statusReport, now time.Time) {
	if d.cfg.ReadOnly {
		return
	}
	r.WriteBack = d.cfg.WriteBack
	oldest := d.oldestUnpublishedLocked(now, r.Generation)
	if oldest.IsZero() {
		return
	}
	r.UnpublishedSince = oldest
	r.UnpublishedAge = max(0, now.Sub(oldest))
	if bound := d.recoveryBound(); bound > 0 {
		r.RecoveryPointBound = bound
		if r.UnpublishedAge > bound {
			r.RecoveryPointWarning = recoveryWarning(r.UnpublishedAge, bound)
		}
	}
	if due := d.sched.due(oldest); !due.IsZero() && (r.NextDue.IsZero() || due.Before(r.NextDue)) {
		r.NextDue = latest(due, now)
	}
}

// recoveryWarning is status' warning for a recovery point past its bound.
func recoveryWarning(age, bound time.Duration) string {
	return "changes made " + age.Round(time.Second).String() + " ago are not in the store (bound " + bound.String() +
		"): a host lost now loses them; the store is down, or snapshots fail or take long (see last error)"
}

// startScheduled records the start of a snapshot by the serve loop, for
// reason; false while one it started runs.
func (d *daemon) startScheduled(reason string) bool {
	now := time.Now()
	d.mu.Lock()
	ok := d.sched.start(now)
	prev := d.sched.prevStart
	d.mu.Unlock()
	if ok {
		since := time.Duration(0)
		if !prev.IsZero() {
			since = now.Sub(prev)
		}
		d.log.Debug("snapshot starting", "reason", reason, "since_last_start", since)
	}
	return ok
}

// scheduledSkipped: the snapshot startScheduled recorded did not run
// (another one held snapMu); the next poll or tick tries again.
func (d *daemon) scheduledSkipped() {
	d.mu.Lock()
	d.sched.skipped()
	d.mu.Unlock()
}

// snapshotEnded records the end of a snapshot the serve loop started.
// After a failure, write-back waits the backoff before it tries again
// (the interval tick, if any, still comes on time).
func (d *daemon) snapshotEnded(err error) {
	d.mu.Lock()
	wait := d.sched.finish(time.Now(), err, rand.Float64())
	failures := d.sched.failures
	d.mu.Unlock()
	if err != nil && d.cfg.WriteBack > 0 && d.bgCtx.Err() == nil && !errors.Is(err, errLeaseLost) {
		d.log.Info("write-back: trying again after the backoff", "in", wait.Round(time.Millisecond), "failures_in_a_row", failures)
	}
}
