package faultproxy

import (
	"context"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Options shape the link between the proxy's clients and its target, so
// that tests and benchmarks on loopback see a WAN: every response waits
// Latency before its first byte, and all bodies share a link of Rate bytes
// per second in each direction (parallel requests divide it, as they
// divide a real uplink). The zero Options is an unshaped link.
type Options struct {
	// Latency is added to every request before its answer starts.
	Latency time.Duration
	// Rate caps the bytes per second of all response bodies together
	// (downloads) and, separately, of all request bodies together
	// (uploads); 0 is no cap.
	Rate int64
}

// link is a token bucket kept as a virtual clock: next is when the link
// is free again. A writer reserves the time its bytes take on the link,
// then sleeps until its reservation ends; reservations are served in the
// order they were made, so concurrent bodies share the rate fairly at the
// granularity of one chunk.
type link struct {
	mu   sync.Mutex
	rate int64
	next time.Time
}

func (l *link) setRate(rate int64) {
	l.mu.Lock()
	l.rate = max(rate, 0)
	l.next = time.Time{}
	l.mu.Unlock()
}

// chunk is how many bytes a shaped copy moves per reservation: about 10 ms
// of the link, within [16 KiB, 256 KiB]. The link also lends one chunk of
// idle credit (a burst), no more.
func (l *link) chunk() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.rate == 0 {
		return 256 << 10
	}
	return int(min(max(l.rate/100, 16<<10), 256<<10))
}

// wait blocks until n bytes may pass.
func (l *link) wait(ctx context.Context, n int) error {
	l.mu.Lock()
	if l.rate == 0 {
		l.mu.Unlock()
		return nil
	}
	now := time.Now()
	burst := time.Duration(float64(min(max(l.rate/100, 16<<10), 256<<10)) / float64(l.rate) * float64(time.Second))
	if floor := now.Add(-burst); l.next.Before(floor) {
		l.next = floor
	}
	l.next = l.next.Add(time.Duration(float64(n) / float64(l.rate) * float64(time.Second)))
	d := l.next.Sub(now)
	l.mu.Unlock()
	return sleep(ctx, d)
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// SetLatency changes the latency added to each request from now on.
func (p *Proxy) SetLatency(d time.Duration) {
	p.latency.Store(int64(max(d, 0)))
}

// SetRate changes the link's rate in bytes per second (0: no cap), for
// bodies that start from now on and the rest of those in flight.
func (p *Proxy) SetRate(bytesPerSecond int64) {
	p.down.setRate(bytesPerSecond)
	p.up.setRate(bytesPerSecond)
}

// copyShaped copies src to w through the link, flushing each chunk so the
// client sees bytes at the link's pace. It returns the bytes written.
func copyShaped(ctx context.Context, l *link, w io.Writer, src io.Reader) (int64, error) {
	buf := make([]byte, l.chunk())
	flush := func() {}
	if rw, ok := w.(http.ResponseWriter); ok {
		rc := http.NewResponseController(rw)
		flush = func() { rc.Flush() }
	}
	var n int64
	for {
		k, rerr := src.Read(buf)
		if k > 0 {
			if err := l.wait(ctx, k); err != nil {
				return n, err
			}
			m, werr := w.Write(buf[:k])
			n += int64(m)
			if werr != nil {
				return n, werr
			}
			flush()
		}
		if rerr == io.EOF {
			return n, nil
		}
		if rerr != nil {
			return n, rerr
		}
	}
}

// shapedReader paces a request body through the upload link.
type shapedReader struct {
	ctx context.Context
	l   *link
	r   io.ReadCloser
	max int
	n   *atomic.Int64
}

func (s *shapedReader) Read(b []byte) (int, error) {
	if len(b) > s.max {
		b = b[:s.max]
	}
	k, err := s.r.Read(b)
	if k > 0 {
		s.n.Add(int64(k))
		if werr := s.l.wait(s.ctx, k); werr != nil {
			return k, werr
		}
	}
	return k, err
}

func (s *shapedReader) Close() error { return s.r.Close() }
