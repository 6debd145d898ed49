package uploader_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// countingObserver records what an Observed store reports.
type countingObserver struct {
	mu       sync.Mutex
	requests map[string]int // "op outcome"
	retries  map[string]int
	read     int64
}

func (c *countingObserver) StoreRequest(op, outcome string, took time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.requests[op+" "+outcome]++
}

func (c *countingObserver) StoreRetry(op string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.retries[op]++
}

func (c *countingObserver) StoreRead(n int64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.read += n
}

func TestObservedCountsRequestsAndRetries(t *testing.T) {
	t.Parallel()
	local, err := uploader.NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	obs := &countingObserver{requests: map[string]int{}, retries: map[string]int{}}
	fl := newFlaky(local, errors.New("connection reset"), map[string]int{"put": 2})
	noSleep := func(context.Context, time.Duration) error { return nil }
	s := uploader.WithRetry(uploader.WithObserver(fl, obs), uploader.RetryPolicy{Sleep: noSleep}, nil)
	ctx := context.Background()

	if _, err := s.Put(ctx, "a/obj", bytes.NewReader([]byte("hello")), 5, uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Put(ctx, "a/obj", bytes.NewReader([]byte("again")), 5, uploader.PutOptions{IfNoneMatch: true}); !errors.Is(err, uploader.ErrPrecondition) {
		t.Fatalf("create-only put over an object: %v", err)
	}
	rc, _, err := s.Get(ctx, "a/obj", 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(rc); string(b) != "hello" {
		t.Fatalf("get: %q", b)
	}
	rc.Close()
	if _, err := s.Stat(ctx, "a/missing"); err == nil {
		t.Fatal("stat of a missing key succeeded")
	}
	stop := errors.New("enough")
	if err := s.List(ctx, "a/", func(uploader.ObjectInfo) error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("list: %v", err)
	}
	if err := s.Delete(ctx, "a/obj"); err != nil {
		t.Fatal(err)
	}

	want := map[string]int{
		"put error": 2, "put ok": 1, "put precondition": 1,
		"get ok": 1, "stat not_found": 1, "list ok": 1, "delete ok": 1,
	}
	obs.mu.Lock()
	defer obs.mu.Unlock()
	for k, n := range want {
		if obs.requests[k] != n {
			t.Errorf("requests %q = %d, want %d (all: %v)", k, obs.requests[k], n, obs.requests)
		}
	}
	if len(obs.requests) != len(want) {
		t.Errorf("requests: %v, want %v", obs.requests, want)
	}
	if obs.retries["put"] != 2 || len(obs.retries) != 1 {
		t.Errorf("retries: %v, want 2 of put", obs.retries)
	}
	if obs.read != 5 {
		t.Errorf("bytes read: %d, want 5", obs.read)
	}
}

func TestOutcome(t *testing.T) {
	t.Parallel()
	for err, want := range map[error]string{
		nil:                      uploader.OutcomeOK,
		uploader.ErrPrecondition: uploader.OutcomePrecondition,
		context.Canceled:         uploader.OutcomeCanceled,
		errors.New("boom"):       uploader.OutcomeError,
	} {
		if got := uploader.Outcome(err); got != want {
			t.Errorf("Outcome(%v) = %q, want %q", err, got, want)
		}
	}
}
