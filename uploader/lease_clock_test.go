package uploader_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// noStoreTime hides the store's clock, so contenders fall back to watching
// the lease object.
type noStoreTime struct{ uploader.Store }

func (s noStoreTime) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	rc, info, err := s.Store.Get(ctx, key, off, length)
	info.StoreTime = time.Time{}
	return rc, info, err
}

// prefixed keeps a test's keys apart in a shared store.
type prefixed struct {
	uploader.Store
	p string
}

func withPrefix(s uploader.Store, p string) uploader.Store { return prefixed{s, p} }

func (s prefixed) Put(ctx context.Context, key string, r io.Reader, size int64, o uploader.PutOptions) (uploader.ObjectInfo, error) {
	return s.Store.Put(ctx, s.p+key, r, size, o)
}

func (s prefixed) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	return s.Store.Get(ctx, s.p+key, off, length)
}

// skewed is a host whose wall clock is off by d.
func skewed(s uploader.Store, host string, d time.Duration) *uploader.Catalog {
	return uploader.NewCatalog(s, uploader.CatalogOptions{Host: host, Now: func() time.Time { return time.Now().Add(d) }})
}

// Two hosts whose wall clocks differ by ten minutes either way behave as
// with synced clocks: a live holder is never taken over, and a dead one
// is taken over once its own view of the lease has lapsed, within the
// stale bound. Every scenario waits on time, so they run side by side.
func TestLeaseClockSkew(t *testing.T) {
	// S3 dates have one-second resolution; and a holder renewing every
	// TTL/10 must never miss a whole TTL, even on a loaded machine with
	// the 24 scenarios side by side (at 2s, it did; at 5s, with the
	// whole suite running at load 25, an S3 holder did too).
	const ttl = 10 * time.Second
	eachStore(t, func(t *testing.T, s uploader.Store) {
		t.Parallel()
		var wg sync.WaitGroup
		for _, store := range []struct {
			name string
			s    uploader.Store
		}{{"store-clock", s}, {"watched", noStoreTime{s}}} {
			for _, skew := range []struct{ holder, contender time.Duration }{
				{-10 * time.Minute, 10 * time.Minute}, {10 * time.Minute, -10 * time.Minute}, {0, 0},
			} {
				name := fmt.Sprintf("%s/holder%+v/contender%+v", store.name, skew.holder, skew.contender)
				for _, dead := range []bool{false, true} {
					prefix := withPrefix(store.s, fmt.Sprintf("%s-%v-%d-%d/", store.name, dead, skew.holder/time.Minute+10, skew.contender/time.Minute+10))
					holder := skewed(prefix, "host-a", skew.holder)
					contender := skewed(prefix, "host-b", skew.contender)
					wg.Go(func() {
						if dead {
							leaseDead(t, name+"/dead", holder, contender, ttl)
						} else {
							leaseLive(t, name+"/live", holder, contender, ttl)
						}
					})
				}
			}
		}
		wg.Wait()
	})
}

// leaseLive: the holder renews; the contender tries for two TTLs.
func leaseLive(t *testing.T, name string, holder, contender *uploader.Catalog, ttl time.Duration) {
	a, err := holder.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "mount /a", TTL: ttl, Heartbeat: ttl / 10})
	if err != nil {
		t.Errorf("%s: %v", name, err)
		return
	}
	defer a.Release(context.Background())
	for end := time.Now().Add(2 * ttl); time.Now().Before(end); time.Sleep(ttl / 20) {
		if _, err := contender.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "mount /b", TTL: ttl, Heartbeat: -1}); !errors.Is(err, uploader.ErrLeaseHeld) {
			t.Errorf("%s: a live lease was taken over: %v", name, err)
			return
		}
	}
	if err := a.Err(); err != nil {
		t.Errorf("%s: the live holder lost its lease: %v", name, err)
	}
}

// leaseDead: the holder stops renewing; the contender takes over, but only
// once the holder itself no longer believes in its lease.
func leaseDead(t *testing.T, name string, holder, contender *uploader.Catalog, ttl time.Duration) {
	begin := time.Now()
	a, err := holder.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "mount /a", TTL: ttl, Heartbeat: -1})
	if err != nil {
		t.Errorf("%s: %v", name, err)
		return
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, err := contender.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "mount /b", TTL: ttl, Heartbeat: -1})
		if err == nil {
			if aerr := a.Err(); !errors.Is(aerr, uploader.ErrLeaseLost) {
				t.Errorf("%s: taken over while the holder still counts its lease valid: %v", name, aerr)
			}
			// The stale bound: TTL, a second of date resolution, and
			// (when watched) the TTL of watching; plus a generous
			// allowance for a loaded machine.
			if took, bound := time.Since(begin), 2*ttl+time.Second+10*time.Second; took > bound {
				t.Errorf("%s: dead lease taken over after %s, bound %s", name, took, bound)
			}
			b.Release(context.Background())
			return
		}
		if !errors.Is(err, uploader.ErrLeaseHeld) {
			t.Errorf("%s: %v", name, err)
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%s: a dead lease was never taken over: %v", name, err)
			return
		}
		time.Sleep(ttl / 20)
	}
}
