package uploader_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

func TestRetryDelay(t *testing.T) {
	p := uploader.RetryPolicy{}
	ms := time.Millisecond
	for _, c := range []struct {
		n    int
		r    float64
		want time.Duration
	}{
		{0, 0.5, 200 * ms},
		{1, 0.5, 400 * ms},
		{2, 0.5, 800 * ms},
		{0, 0, 150 * ms}, // -25%
		{0, 0.999999, 250 * ms},
		{7, 0.5, 25600 * ms},
		{8, 0.5, 30 * time.Second}, // capped
		{8, 0, 22500 * ms},         // jitter applies below the cap
		{8, 0.999999, 30 * time.Second},
		{60, 0.5, 30 * time.Second}, // no overflow
	} {
		got := p.Delay(c.n, c.r)
		if d := got - c.want; d > ms || d < -ms {
			t.Errorf("Delay(%d, %v) = %v, want %v", c.n, c.r, got, c.want)
		}
	}
}

// flaky fails the first failures[op] calls of each operation with err.
type flaky struct {
	uploader.Store
	mu       sync.Mutex
	err      error
	failures map[string]int
	calls    map[string]int
}

func newFlaky(s uploader.Store, err error, failures map[string]int) *flaky {
	return &flaky{Store: s, err: err, failures: failures, calls: map[string]int{}}
}

func (f *flaky) fail(op string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls[op]++
	if f.failures[op] > 0 {
		f.failures[op]--
		return fmt.Errorf("%s: %w", op, f.err)
	}
	return nil
}

func (f *flaky) Put(ctx context.Context, key string, r io.Reader, size int64, o uploader.PutOptions) (uploader.ObjectInfo, error) {
	if err := f.fail("put"); err != nil {
		io.CopyN(io.Discard, r, 3) // consume some of the body, as a broken upload does
		return uploader.ObjectInfo{}, err
	}
	return f.Store.Put(ctx, key, r, size, o)
}

func (f *flaky) Stat(ctx context.Context, key string) (uploader.ObjectInfo, error) {
	if err := f.fail("stat"); err != nil {
		return uploader.ObjectInfo{}, err
	}
	return f.Store.Stat(ctx, key)
}

func (f *flaky) Delete(ctx context.Context, key string) error {
	if err := f.fail("delete"); err != nil {
		return err
	}
	return f.Store.Delete(ctx, key)
}

func (f *flaky) List(ctx context.Context, prefix string, fn func(uploader.ObjectInfo) error) error {
	n := 0
	return f.Store.List(ctx, prefix, func(o uploader.ObjectInfo) error {
		if n++; n == 2 {
			if err := f.fail("list"); err != nil {
				return err
			}
		}
		return fn(o)
	})
}

func (f *flaky) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	if err := f.fail("get"); err != nil {
		return nil, uploader.ObjectInfo{}, err
	}
	rc, info, err := f.Store.Get(ctx, key, off, length)
	if err != nil {
		return nil, info, err
	}
	// Every body breaks after 1000 bytes while "readbreaks" lasts.
	f.mu.Lock()
	brk := f.failures["readbreaks"] > 0
	if brk {
		f.failures["readbreaks"]--
	}
	f.mu.Unlock()
	if brk {
		return &breakingBody{rc: rc, left: 1000, err: f.err}, info, nil
	}
	return rc, info, nil
}

type breakingBody struct {
	rc   io.ReadCloser
	left int
	err  error
}

func (b *breakingBody) Read(p []byte) (int, error) {
	if b.left == 0 {
		return 0, b.err
	}
	p = p[:min(len(p), b.left)]
	n, err := b.rc.Read(p)
	b.left -= n
	return n, err
}
func (b *breakingBody) Close() error { return b.rc.Close() }

// sleeps records the delays a policy asked for instead of waiting.
type sleeps struct {
	mu sync.Mutex
	d  []time.Duration
}

func (s *sleeps) sleep(ctx context.Context, d time.Duration) error {
	s.mu.Lock()
	s.d = append(s.d, d)
	s.mu.Unlock()
	return ctx.Err()
}

func testPolicy(s *sleeps, max int) uploader.RetryPolicy {
	return uploader.RetryPolicy{MaxRetries: max, Sleep: s.sleep, Rand: func() float64 { return 0.5 }}
}

var errTransient = errors.New("503 SlowDown")

func TestRetryRecovers(t *testing.T) {
	var sl sleeps
	f := newFlaky(newLocal(t), errTransient, map[string]int{"put": 2, "stat": 3, "delete": 1, "get": 1, "list": 1, "readbreaks": 3})
	s := uploader.WithRetry(f, testPolicy(&sl, 0), nil)
	ctx := t.Context()
	data := bytes.Repeat([]byte("0123456789"), 500)
	// The body is re-read from where it was at the start of the put.
	body := bytes.NewReader(append([]byte("HEADER"), data...))
	body.Seek(6, io.SeekStart)
	if _, err := s.Put(ctx, "k", body, int64(len(data)), uploader.PutOptions{}); err != nil {
		t.Fatalf("put: %v", err)
	}
	if _, err := s.Stat(ctx, "k"); err != nil {
		t.Fatalf("stat: %v", err)
	}
	rc, _, err := s.Get(ctx, "k", 0, -1)
	if err != nil {
		t.Fatalf("get: %v", err)
	}
	got, err := io.ReadAll(rc)
	rc.Close()
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("get through three broken bodies: %d bytes, %v", len(got), err)
	}
	s.Put(ctx, "k2", strings.NewReader("x"), 1, uploader.PutOptions{})
	var keys []string
	if err := s.List(ctx, "", func(o uploader.ObjectInfo) error { keys = append(keys, o.Key); return nil }); err != nil {
		t.Fatalf("list: %v", err)
	}
	if strings.Join(keys, ",") != "k,k2" {
		t.Errorf("list after a retry delivered %q, want each key once", keys)
	}
	if err := s.Delete(ctx, "k"); err != nil {
		t.Fatalf("delete: %v", err)
	}
	// put 2 + stat 3 + get 1 + 3 resumes + list 1 + delete 1, each first
	// retry waiting Base·2⁰ (jitter centred by Rand 0.5).
	ms := time.Millisecond
	want := []time.Duration{200 * ms, 400 * ms, 200 * ms, 400 * ms, 800 * ms, 200 * ms, 200 * ms, 200 * ms, 200 * ms, 200 * ms, 200 * ms}
	if fmt.Sprint(sl.d) != fmt.Sprint(want) {
		t.Errorf("delays %v, want %v", sl.d, want)
	}
}

func TestRetryGivesUp(t *testing.T) {
	for _, c := range []struct{ max, attempts int }{{0, 4}, {-1, 1}, {2, 3}, {99, 6}} {
		var sl sleeps
		f := newFlaky(newLocal(t), errTransient, map[string]int{"stat": 100})
		s := uploader.WithRetry(f, testPolicy(&sl, c.max), nil)
		_, err := s.Stat(t.Context(), "k")
		if !errors.Is(err, errTransient) || !strings.Contains(err.Error(), "gave up") && c.attempts > 1 {
			t.Errorf("MaxRetries %d: %v", c.max, err)
		}
		if f.calls["stat"] != c.attempts {
			t.Errorf("MaxRetries %d: %d attempts, want %d", c.max, f.calls["stat"], c.attempts)
		}
	}
}

func TestRetryPermanent(t *testing.T) {
	for _, perm := range []error{
		uploader.Permanent(errors.New("403 AccessDenied")),
		uploader.ErrPrecondition,
		iofs.ErrNotExist,
		context.Canceled,
		uploader.ErrInvalidKey,
	} {
		var sl sleeps
		f := newFlaky(newLocal(t), perm, map[string]int{"put": 10})
		s := uploader.WithRetry(f, testPolicy(&sl, 5), nil)
		_, err := s.Put(t.Context(), "k", strings.NewReader("x"), 1, uploader.PutOptions{})
		if !errors.Is(err, perm) || f.calls["put"] != 1 || len(sl.d) != 0 {
			t.Errorf("%v: err %v after %d attempts, want no retry", perm, err, f.calls["put"])
		}
	}
}

// A put whose body cannot be rewound is tried once.
func TestRetryUnseekableBody(t *testing.T) {
	var sl sleeps
	f := newFlaky(newLocal(t), errTransient, map[string]int{"put": 1})
	s := uploader.WithRetry(f, testPolicy(&sl, 3), nil)
	_, err := s.Put(t.Context(), "k", io.MultiReader(strings.NewReader("abc")), 3, uploader.PutOptions{})
	if !errors.Is(err, errTransient) || f.calls["put"] != 1 {
		t.Errorf("unseekable put: %v after %d attempts, want one failed attempt", err, f.calls["put"])
	}
}

// A read resumed after the object was replaced fails instead of splicing
// two versions together.
func TestRetryGetObjectChanged(t *testing.T) {
	var sl sleeps
	local := newLocal(t)
	f := newFlaky(local, errTransient, map[string]int{"readbreaks": 1})
	s := uploader.WithRetry(f, testPolicy(&sl, 3), nil)
	ctx := t.Context()
	v1 := bytes.Repeat([]byte("a"), 5000)
	if _, err := local.Put(ctx, "k", bytes.NewReader(v1), 5000, uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	rc, _, err := s.Get(ctx, "k", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	buf := make([]byte, 1000)
	if _, err := io.ReadFull(rc, buf); err != nil {
		t.Fatal(err)
	}
	if _, err := local.Put(ctx, "k", bytes.NewReader(bytes.Repeat([]byte("b"), 5000)), 5000, uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadAll(rc); err == nil || !strings.Contains(err.Error(), "changed") {
		t.Errorf("resumed read of a replaced object: %v, want an error", err)
	}
}
