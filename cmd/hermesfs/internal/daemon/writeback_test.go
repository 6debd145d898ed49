package daemon

import (
	"errors"
	"fmt"
	"testing"
	"time"
)

// sim runs the serve loop's write-back decisions on a simulated clock:
// writes at the given offsets bump the generation, the loop polls every
// pollEvery(D), a snapshot freezes when it starts (its view holds the
// writes made so far) and ends took later, failing while fail says so.
type sim struct {
	d, took time.Duration
	writes  []time.Duration // ascending
	fail    func(attempt int) bool
	pending bool // changes left from before the mount
	end     time.Duration

	starts  []time.Duration
	results []error
	// maxAge is the largest recovery point the polls saw.
	maxAge time.Duration
}

func (s *sim) run(t *testing.T) {
	t.Helper()
	t0 := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	var (
		c         changeLog
		sched     = newScheduler(s.d)
		published uint64
		running   bool
		endAt     time.Duration
		viewGen   uint64
	)
	c.reset(t0, 0)
	pending := s.pending
	gen := func(at time.Duration) uint64 {
		n := uint64(0)
		for _, w := range s.writes {
			if w <= at {
				n++
			}
		}
		return n
	}
	step := pollEvery(s.d)
	for now := step; now <= s.end; now += step {
		if running && now >= endAt {
			running = false
			var err error
			if s.fail != nil && s.fail(len(s.results)) {
				err = errors.New("publish: store down")
			} else {
				published, pending = viewGen, false
			}
			s.results = append(s.results, err)
			sched.finish(t0.Add(endAt), err, 0.5)
		}
		g := gen(now)
		oldest := c.unpublishedSince(t0.Add(now), g, published, pending, t0)
		if !oldest.IsZero() {
			s.maxAge = max(s.maxAge, t0.Add(now).Sub(oldest))
		}
		if due := sched.due(oldest); !due.IsZero() && !t0.Add(now).Before(due) {
			if !sched.start(t0.Add(now)) {
				t.Fatalf("%v: due while a snapshot runs", now)
			}
			running, endAt, viewGen = true, now+s.took, g
			s.starts = append(s.starts, now)
		}
	}
}

// spacing fails if two starts are closer than d.
func (s *sim) spacing(t *testing.T) {
	t.Helper()
	for i := 1; i < len(s.starts); i++ {
		if gap := s.starts[i] - s.starts[i-1]; gap < s.d {
			t.Errorf("snapshots started %s and %s: %s apart, less than D %s", s.starts[i-1], s.starts[i], gap, s.d)
		}
	}
}

func ms(n int) time.Duration { return time.Duration(n) * time.Millisecond }

func TestWriteBackBurst(t *testing.T) {
	s := &sim{d: 2 * time.Second, took: ms(300), end: 30 * time.Second}
	for i := range 11 {
		s.writes = append(s.writes, 10*time.Second+ms(50*i))
	}
	s.run(t)
	if len(s.starts) != 1 {
		t.Fatalf("a burst of writes within D: snapshots started at %v, want one", s.starts)
	}
	// D after the first write, give or take a poll.
	if at, want := s.starts[0], 12*time.Second; at < want-pollEvery(s.d) || at > want+pollEvery(s.d) {
		t.Errorf("snapshot started at %s, want about %s (D after the first write)", at, want)
	}
	if limit := s.d + pollEvery(s.d) + s.took; s.maxAge > limit {
		t.Errorf("recovery point reached %s, more than D + a poll + the snapshot (%s)", s.maxAge, limit)
	}
}

func TestWriteBackSteadyStream(t *testing.T) {
	for _, took := range []time.Duration{ms(300), 5 * time.Second} {
		t.Run(fmt.Sprint("snapshot takes ", took), func(t *testing.T) {
			s := &sim{d: 2 * time.Second, took: took, end: 40 * time.Second}
			for at := time.Second; at < 30*time.Second; at += ms(100) {
				s.writes = append(s.writes, at)
			}
			s.run(t)
			s.spacing(t)
			// Writes for 29s: one snapshot per D (or per snapshot, when a
			// snapshot takes longer), and a last one after the stream.
			per := max(s.d, took)
			if lo, hi := int(29*time.Second/per)-1, int(29*time.Second/per)+2; len(s.starts) < lo || len(s.starts) > hi {
				t.Errorf("%d snapshots for a 29s stream (started at %v), want %d to %d", len(s.starts), s.starts, lo, hi)
			}
			if last := s.starts[len(s.starts)-1]; last < 30*time.Second {
				t.Errorf("the last snapshot started at %s, before the stream's last write (30s)", last)
			}
			if limit := s.d + 2*took + pollEvery(s.d); s.maxAge > limit {
				t.Errorf("recovery point reached %s, want at most %s", s.maxAge, limit)
			}
		})
	}
}

func TestWriteBackIdle(t *testing.T) {
	s := &sim{d: 2 * time.Second, took: ms(300), end: time.Minute}
	s.run(t)
	if len(s.starts) != 0 || s.maxAge != 0 {
		t.Errorf("nothing written: snapshots at %v, recovery point %s", s.starts, s.maxAge)
	}
	// Changes a crash left go out D after the start, and count from it.
	s = &sim{d: 2 * time.Second, took: ms(300), end: time.Minute, pending: true}
	s.run(t)
	if len(s.starts) != 1 || s.starts[0] > s.d+pollEvery(s.d) {
		t.Errorf("changes from before the mount: snapshots at %v, want one at about D", s.starts)
	}
}

// A change made while a snapshot runs (after its freeze) is not in it:
// the next snapshot comes D after that change.
func TestWriteBackChangeDuringSnapshot(t *testing.T) {
	s := &sim{d: 2 * time.Second, took: 3 * time.Second, end: 30 * time.Second,
		writes: []time.Duration{5 * time.Second, 8 * time.Second}}
	s.run(t)
	if len(s.starts) != 2 {
		t.Fatalf("snapshots at %v, want two", s.starts)
	}
	// The first starts at ~7s and ends at ~10s; the write at 8s is
	// published D after it, at ~10s (the first has ended by then).
	if at := s.starts[1]; at < 10*time.Second-pollEvery(s.d) || at > 10*time.Second+pollEvery(s.d) {
		t.Errorf("second snapshot at %s, want about 10s", at)
	}
}

// Failed snapshots are retried with the store's backoff: D, then doubling
// up to the cap, never every D; the first success ends it.
func TestWriteBackBackoff(t *testing.T) {
	s := &sim{d: 2 * time.Second, took: ms(100), end: 5 * time.Minute,
		fail: func(n int) bool { return n < 7 }}
	for at := time.Second; at < 5*time.Minute; at += time.Second {
		s.writes = append(s.writes, at)
	}
	s.run(t)
	s.spacing(t)
	// Gaps between attempts after each failure: about 2, 4, 8, 16, 30, 30, 30s
	// (the policy's delay from D, doubling, capped; no jitter at rand 0.5).
	want := []time.Duration{2, 4, 8, 16, 30, 30, 30}
	for i, w := range want {
		if i+1 >= len(s.starts) {
			t.Fatalf("only %d attempts: %v", len(s.starts), s.starts)
		}
		gap := s.starts[i+1] - s.starts[i]
		w *= time.Second
		if gap < w || gap > w+s.took+2*pollEvery(s.d) {
			t.Errorf("attempt %d came %s after attempt %d, want about %s (starts %v)", i+2, gap, i+1, w, s.starts)
		}
	}
	// Then one per D again.
	n := len(s.starts)
	if n < 8+60 {
		t.Errorf("after the failures, %d attempts in all; want one per D again (starts %v)", n, s.starts[7:])
	}
	for i := 8; i+1 < n; i++ {
		if gap := s.starts[i+1] - s.starts[i]; gap > s.d+s.took+2*pollEvery(s.d) {
			t.Errorf("after the store came back, attempts %s apart", gap)
			break
		}
	}
}

func TestChangeLog(t *testing.T) {
	t0 := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }
	var c changeLog
	c.reset(at(0), 5)
	if got := c.unpublishedSince(at(1), 5, 5, false, t0); !got.IsZero() {
		t.Errorf("nothing changed: %v", got)
	}
	// Changes 6 and 7 seen at 3s: made after the poll at 2s.
	c.observe(at(2), 5)
	if got := c.unpublishedSince(at(3), 7, 5, false, t0); !got.Equal(at(2)) {
		t.Errorf("changes seen at 3s: since %v, want 2s", got)
	}
	// A snapshot froze at 6: change 7 is still out, from the same mark.
	if got := c.unpublishedSince(at(4), 7, 6, false, t0); !got.Equal(at(2)) {
		t.Errorf("6 published: since %v, want 2s", got)
	}
	// Change 8 seen at 6s, after a poll at 5s; 7 published.
	c.observe(at(5), 7)
	if got := c.unpublishedSince(at(6), 8, 7, false, t0); !got.Equal(at(5)) {
		t.Errorf("7 published, 8 seen at 6s: since %v, want 5s", got)
	}
	// A freeze may see changes no poll saw: published past the log.
	if got := c.unpublishedSince(at(7), 9, 9, false, t0); !got.IsZero() {
		t.Errorf("all published: %v", got)
	}
	if got := c.unpublishedSince(at(8), 10, 9, false, t0); !got.Equal(at(7)) {
		t.Errorf("10 seen at 8s: since %v, want 7s", got)
	}
	// Changes a crash left count from the start.
	if got := c.unpublishedSince(at(9), 10, 10, true, t0); !got.Equal(t0) {
		t.Errorf("pending: %v, want the start", got)
	}

	// An outage: nothing is published for hours. The log stays bounded,
	// and never says a change is newer than it is.
	c.reset(at(0), 0)
	for i := 1; i <= 10000; i++ {
		c.observe(at(i), uint64(i))
		if len(c.marks) > maxMarks {
			t.Fatalf("%d marks", len(c.marks))
		}
	}
	if got := c.unpublishedSince(at(10001), 10000, 0, false, t0); !got.Equal(at(0)) {
		t.Errorf("oldest after compaction: %v, want 0s", got)
	}
	for _, pub := range []uint64{1000, 5000, 9999} {
		// Change pub+1 was seen at pub+1 s, made after pub s.
		if got := c.unpublishedSince(at(10001), 10000, pub, false, t0); got.After(at(int(pub))) {
			t.Errorf("%d published: oldest %v, later than the change (after %ds)", pub, got, pub)
		}
	}
}

func TestRecoveryBound(t *testing.T) {
	for _, c := range []struct {
		cfg  Config
		want time.Duration
	}{
		{Config{Interval: 15 * time.Minute}, 20 * time.Minute},
		{Config{Interval: 15 * time.Minute, WriteBack: 2 * time.Second}, 5*time.Minute + 2*time.Second},
		{Config{Interval: time.Minute, WriteBack: 10 * time.Minute}, 15 * time.Minute},
		{Config{WriteBack: 10 * time.Second}, 5*time.Minute + 10*time.Second},
		{Config{}, 0},
		{Config{Interval: time.Minute, WriteBack: time.Second, ReadOnly: true}, 0},
	} {
		d := &daemon{cfg: &c.cfg}
		if got := d.recoveryBound(); got != c.want {
			t.Errorf("interval %s write-back %s read-only %v: bound %s, want %s", c.cfg.Interval, c.cfg.WriteBack, c.cfg.ReadOnly, got, c.want)
		}
	}
}

// The interval tick starts no snapshot within D of another, and none while
// one runs; without write-back it only waits for the running one.
func TestWriteBackIntervalTick(t *testing.T) {
	t0 := time.Date(2026, 11, 28, 12, 0, 0, 0, time.UTC)
	s := newScheduler(2 * time.Second)
	if !s.mayStart(t0) {
		t.Error("first tick refused")
	}
	s.start(t0)
	if s.mayStart(t0.Add(3 * time.Second)) {
		t.Error("tick allowed while a snapshot runs")
	}
	s.finish(t0.Add(500*time.Millisecond), nil, 0.5)
	if s.mayStart(t0.Add(1900 * time.Millisecond)) {
		t.Error("tick allowed within D of the last start")
	}
	if !s.mayStart(t0.Add(2 * time.Second)) {
		t.Error("tick refused D after the last start")
	}
	// A start that did not run (snapMu held by a requested snapshot)
	// does not count.
	s.start(t0.Add(3 * time.Second))
	s.skipped()
	if !s.mayStart(t0.Add(3 * time.Second)) {
		t.Error("a skipped start holds the next tick back")
	}
	// A change noticed by a poll before a tick's snapshot started (its
	// time is that poll's) is not due within D of that start either.
	s.start(t0.Add(10 * time.Second))
	s.finish(t0.Add(10*time.Second+100*time.Millisecond), nil, 0.5)
	if due := s.due(t0.Add(9900 * time.Millisecond)); due.Before(t0.Add(12 * time.Second)) {
		t.Errorf("write-back due at %s, within D of the last start (10s)", due.Sub(t0))
	}
	off := newScheduler(0)
	off.start(t0)
	off.finish(t0, nil, 0.5)
	if !off.mayStart(t0.Add(time.Millisecond)) {
		t.Error("without write-back, a tick right after a snapshot is refused")
	}
	if !off.due(t0).IsZero() {
		t.Error("write-back off, yet a snapshot is due")
	}
}
