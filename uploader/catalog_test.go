package uploader_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/s3"
	"github.com/hermesfs/hermesfs/uploader/s3test"
)

// eachStore runs fn against a fresh local store and a fresh prefix of a
// versitygw bucket on loopback.
func eachStore(t *testing.T, fn func(t *testing.T, s uploader.Store)) {
	t.Run("local", func(t *testing.T) { fn(t, newLocal(t)) })
	t.Run("s3", func(t *testing.T) {
		endpoint, bucket, access, secret := s3test.Start(t)
		st, err := s3.New(t.Context(), s3.Config{
			Bucket: bucket, Prefix: "hermes/agent", Endpoint: endpoint, Region: "us-east-1", PathStyle: true,
			AccessKeyID: access, SecretAccessKey: secret, PartSize: s3.MinPartSize,
		})
		if err != nil {
			t.Fatal(err)
		}
		fn(t, st)
	})
}

// clock is a settable clock for catalogs and leases.
type clock struct {
	mu     sync.Mutex
	t      time.Time
	origin time.Time
}

// newClock starts at the real time: stores stamp objects with their own
// (real) clock, and the catalog compares those stamps with its clock.
func newClock() *clock {
	t := time.Now().UTC().Truncate(time.Second)
	return &clock{t: t, origin: t}
}

// Mono is the clock as a monotonic one: it moves with Add.
func (c *clock) Mono() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t.Sub(c.origin)
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(time.Millisecond) // time moves on between calls
	return c.t
}

func (c *clock) Add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// archiveFile writes n random bytes to a file and returns its path and
// sha256.
func archiveFile(t *testing.T, n int) (string, string) {
	t.Helper()
	b := make([]byte, n)
	rand.Read(b)
	p := filepath.Join(t.TempDir(), "archive.sqfs")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	return p, hex.EncodeToString(sum[:])
}

func fileSum(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

func catalog(s uploader.Store, host string, clk *clock) *uploader.Catalog {
	return uploader.NewCatalog(s, uploader.CatalogOptions{Host: host, Version: "test", Now: clk.Now, Mono: clk.Mono})
}

// publish publishes a fresh random archive on top of what LATEST names.
func publish(t *testing.T, c *uploader.Catalog, n int) (uploader.Manifest, string) {
	t.Helper()
	latest, err := c.LatestID(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	p, sum := archiveFile(t, n)
	m, err := c.Publish(t.Context(), uploader.PublishInput{Path: p, Parent: latest, Expect: latest, Files: 42})
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	return m, sum
}

func TestCatalogPublishRestore(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		clk := newClock()
		c := catalog(s, "Agent Box.1", clk)
		if _, err := c.Latest(ctx); !errors.Is(err, uploader.ErrNoSnapshots) || !errors.Is(err, iofs.ErrNotExist) {
			t.Fatalf("Latest of an empty store: %v", err)
		}
		if _, err := c.Restore(ctx, filepath.Join(t.TempDir(), "x"), uploader.RestoreOptions{}); !errors.Is(err, uploader.ErrNoSnapshots) {
			t.Fatalf("Restore of an empty store: %v", err)
		}
		var ms []uploader.Manifest
		var sums []string
		for i := range 3 {
			m, sum := publish(t, c, 50_000+i)
			ms, sums = append(ms, m), append(sums, sum)
		}
		for i, m := range ms {
			if m.SHA256 != sums[i] || m.Size != int64(50_000+i) || m.Files != 42 || m.Host != "Agent Box.1" || m.Version != "test" || m.Compression != "zstd" {
				t.Errorf("manifest %d: %+v", i, m)
			}
			if !strings.Contains(m.ID, "-agent-box-1-") || uploader.ValidID(m.ID) != nil {
				t.Errorf("id %q does not carry the sanitised host", m.ID)
			}
			if i > 0 && (m.Parent != ms[i-1].ID || m.ID <= ms[i-1].ID) {
				t.Errorf("snapshot %d: parent %q id %q after %q", i, m.Parent, m.ID, ms[i-1].ID)
			}
		}
		latest, err := c.Latest(ctx)
		if err != nil || latest.ID != ms[2].ID {
			t.Fatalf("Latest = %q, %v; want %q", latest.ID, err, ms[2].ID)
		}
		dst := filepath.Join(t.TempDir(), "restored.sqfs")
		var progress atomic.Int64
		res, err := c.Restore(ctx, dst, uploader.RestoreOptions{Progress: func(done, total int64) { progress.Store(done) }})
		if err != nil || res.Manifest.ID != ms[2].ID || len(res.Skipped) != 0 || res.NoLatest {
			t.Fatalf("Restore: %+v, %v", res, err)
		}
		if fileSum(t, dst) != sums[2] || progress.Load() != ms[2].Size {
			t.Errorf("restored file differs from the newest archive (progress %d)", progress.Load())
		}
		if _, err := c.Restore(ctx, dst, uploader.RestoreOptions{ID: ms[0].ID}); err != nil || fileSum(t, dst) != sums[0] {
			t.Errorf("Restore of the first snapshot by id: %v", err)
		}
		if _, err := c.Restore(ctx, dst, uploader.RestoreOptions{ID: "../../etc/passwd"}); err == nil {
			t.Error("Restore accepted a path as a snapshot id")
		}
		list, err := c.Snapshots(ctx)
		if err != nil || len(list) != 3 {
			t.Fatalf("Snapshots: %d, %v", len(list), err)
		}
		for i, sn := range list {
			want := ms[2-i]
			if sn.ID != want.ID || sn.SHA256 != want.SHA256 || sn.Latest != (i == 0) || sn.Incomplete || sn.Err != nil {
				t.Errorf("Snapshots[%d] = %+v, want %s", i, sn, want.ID)
			}
		}
		ents, _ := os.ReadDir(filepath.Dir(dst))
		if len(ents) != 1 {
			t.Errorf("restore left %d files in the target directory, want 1", len(ents))
		}
	})
}

// Ids are increasing even when this host's clock is behind the one that
// made LATEST.
func TestCatalogIDsFollowParent(t *testing.T) {
	s := newLocal(t)
	ahead, behind := newClock(), newClock()
	ahead.Add(time.Hour)
	m1, _ := publish(t, catalog(s, "a", ahead), 100)
	m2, _ := publish(t, catalog(s, "b", behind), 100)
	if m2.ID <= m1.ID {
		t.Errorf("id %s does not sort after its parent %s", m2.ID, m1.ID)
	}
}

func TestCatalogConflict(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		clk := newClock()
		a, b := catalog(s, "host-a", clk), catalog(s, "host-b", clk)
		winners := map[string]string{} // id -> sha256
		var losers []string
		for round := range 4 {
			latest, err := a.LatestID(ctx)
			if err != nil {
				t.Fatal(err)
			}
			type result struct {
				m   uploader.Manifest
				sum string
				err error
			}
			var res [2]result
			var wg sync.WaitGroup
			for i, c := range []*uploader.Catalog{a, b} {
				p, sum := archiveFile(t, 30_000+round)
				wg.Go(func() {
					m, err := c.Publish(ctx, uploader.PublishInput{Path: p, Parent: latest, Expect: latest})
					res[i] = result{m, sum, err}
				})
			}
			wg.Wait()
			var won int
			for _, r := range res {
				var ce *uploader.ConflictError
				switch {
				case r.err == nil:
					won++
					winners[r.m.ID] = r.sum
				case errors.As(r.err, &ce) && errors.Is(r.err, uploader.ErrConflict):
					if ce.Expected != latest || ce.Latest == "" || ce.Latest == latest {
						t.Errorf("round %d: conflict %+v does not name what won", round, ce)
					}
					if ce.ID != "" {
						losers = append(losers, ce.ID)
					}
				default:
					t.Fatalf("round %d: %v", round, r.err)
				}
			}
			if won != 1 {
				t.Fatalf("round %d: %d publishers won, want exactly 1", round, won)
			}
		}
		// Every winner is on LATEST's parent chain, and restores intact.
		m, err := a.Latest(ctx)
		if err != nil {
			t.Fatal(err)
		}
		chain := 0
		for id := m.ID; id != ""; chain++ {
			sum, ok := winners[id]
			if !ok {
				t.Fatalf("chain reaches %s, which did not win a round", id)
			}
			dst := filepath.Join(t.TempDir(), "x")
			got, err := a.Restore(ctx, dst, uploader.RestoreOptions{ID: id})
			if err != nil || fileSum(t, dst) != sum {
				t.Fatalf("restore %s: %v", id, err)
			}
			id = got.Manifest.Parent
		}
		if chain != len(winners) {
			t.Errorf("LATEST's chain has %d snapshots, %d won", chain, len(winners))
		}
		// Losers' uploads are kept, not deleted: nothing published is lost.
		for _, id := range losers {
			if _, err := a.Manifest(ctx, id); err != nil {
				t.Errorf("loser %s: %v", id, err)
			}
		}
		// A publisher that is behind finds out before uploading anything.
		p, _ := archiveFile(t, 10)
		_, err = b.Publish(ctx, uploader.PublishInput{Path: p, Expect: ""})
		var ce *uploader.ConflictError
		if !errors.As(err, &ce) || ce.ID != "" || ce.Latest != m.ID {
			t.Errorf("stale publish: %v", err)
		}
	})
}

// putCorrupted flips one bit in the middle of key.
func putCorrupted(t *testing.T, s uploader.Store, key string) {
	t.Helper()
	rc, info, err := s.Get(t.Context(), key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	buf.ReadFrom(rc)
	rc.Close()
	b := buf.Bytes()
	b[len(b)/2] ^= 0x10
	if _, err := s.Put(t.Context(), key, bytes.NewReader(b), info.Size, uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestCatalogCorruptFallback(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		c := catalog(s, "h", newClock())
		var ms []uploader.Manifest
		var sums []string
		for range 4 {
			m, sum := publish(t, c, 70_000)
			ms, sums = append(ms, m), append(sums, sum)
		}
		dst := filepath.Join(t.TempDir(), "a.sqfs")

		putCorrupted(t, s, uploader.ArchiveKey(ms[3].ID))
		res, err := c.Restore(ctx, dst, uploader.RestoreOptions{})
		if err != nil || res.Manifest.ID != ms[2].ID || fileSum(t, dst) != sums[2] {
			t.Fatalf("restore with a bit-flipped newest archive: %+v, %v", res, err)
		}
		if ids := res.SkippedIDs(); !slices.Equal(ids, []string{ms[3].ID}) || !errors.Is(res.Skipped[0], uploader.ErrCorrupt) || !strings.Contains(res.Skipped[0].Error(), "sha256") {
			t.Errorf("skipped %v (%v), want the corrupt %s", ids, res.Skipped, ms[3].ID)
		}
		// Asked for by id, a corrupt snapshot is an error, not a fallback.
		_, err = c.Restore(ctx, dst, uploader.RestoreOptions{ID: ms[3].ID})
		var ce *uploader.CorruptError
		if !errors.As(err, &ce) || ce.ID != ms[3].ID {
			t.Errorf("restore of the corrupt snapshot by id: %v", err)
		}
		if fileSum(t, dst) != sums[2] {
			t.Error("a failed restore replaced the target file")
		}

		// A missing manifest, and a failing extra check, also fall back.
		if err := s.Delete(ctx, uploader.ManifestKey(ms[2].ID)); err != nil {
			t.Fatal(err)
		}
		verify := func(ctx context.Context, f *os.File, m uploader.Manifest) error {
			if m.ID == ms[1].ID {
				return errors.New("block 7: checksum mismatch")
			}
			return nil
		}
		res, err = c.Restore(ctx, dst, uploader.RestoreOptions{Verify: verify})
		if err != nil || res.Manifest.ID != ms[0].ID || fileSum(t, dst) != sums[0] {
			t.Fatalf("restore past three bad snapshots: %+v, %v", res, err)
		}
		// (An archive without a manifest is an unfinished publish, not a
		// snapshot: it is not a candidate at all.)
		if ids := res.SkippedIDs(); !slices.Equal(ids, []string{ms[3].ID, ms[1].ID}) {
			t.Errorf("skipped %v", ids)
		}
		putCorrupted(t, s, uploader.ArchiveKey(ms[0].ID))
		if _, err := c.Restore(ctx, dst, uploader.RestoreOptions{Verify: verify}); !errors.Is(err, uploader.ErrCorrupt) {
			t.Errorf("all corrupt: %v, want ErrCorrupt", err)
		}
	})
}

func TestCatalogNoLatest(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		c := catalog(s, "h", newClock())
		publish(t, c, 1000)
		m2, sum2 := publish(t, c, 1000)
		m3, _ := publish(t, c, 1000)
		// LATEST names a snapshot whose manifest is gone: corrupt, skipped.
		if err := s.Delete(ctx, uploader.ManifestKey(m3.ID)); err != nil {
			t.Fatal(err)
		}
		dst := filepath.Join(t.TempDir(), "a")
		res, err := c.Restore(ctx, dst, uploader.RestoreOptions{})
		if err != nil || res.Manifest.ID != m2.ID || !slices.Equal(res.SkippedIDs(), []string{m3.ID}) || !strings.Contains(res.Skipped[0].Error(), "manifest missing") {
			t.Fatalf("restore with LATEST's manifest missing: %+v, %v", res, err)
		}
		if err := s.Delete(ctx, uploader.LatestKey); err != nil {
			t.Fatal(err)
		}
		res, err = c.Restore(ctx, dst, uploader.RestoreOptions{})
		if err != nil || !res.NoLatest || res.Manifest.ID != m2.ID || fileSum(t, dst) != sum2 {
			t.Fatalf("restore without LATEST: %+v, %v", res, err)
		}
		// A garbage LATEST is an error, not a silent fallback.
		if _, err := s.Put(ctx, uploader.LatestKey, strings.NewReader("../x\n"), 5, uploader.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Restore(ctx, dst, uploader.RestoreOptions{}); err == nil || !strings.Contains(err.Error(), "not a snapshot id") {
			t.Errorf("garbage LATEST: %v", err)
		}
	})
}

// keysOf lists the snapshots' and segments' keys.
func keysOf(t *testing.T, s uploader.Store) []string {
	var keys []string
	for _, p := range []string{uploader.SegmentsPrefix, uploader.SnapshotsPrefix} {
		if err := s.List(t.Context(), p, func(o uploader.ObjectInfo) error {
			keys = append(keys, o.Key)
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

// noManifestWithoutArchive fails if a manifest's archive is missing.
func noManifestWithoutArchive(t *testing.T, s uploader.Store) {
	t.Helper()
	keys := keysOf(t, s)
	for _, k := range keys {
		if id, ok := strings.CutSuffix(strings.TrimPrefix(k, uploader.SnapshotsPrefix), uploader.ManifestExt); ok {
			if !slices.Contains(keys, uploader.ArchiveKey(id)) {
				t.Errorf("manifest of %s without its archive", id)
			}
		}
	}
}

func TestCatalogPrune(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		clk := newClock()
		c := catalog(s, "h", clk)
		var ids []string
		for range 5 {
			m, _ := publish(t, c, 500)
			ids = append(ids, m.ID)
		}
		// An orphan archive older than LATEST (a crashed publish) and a
		// complete snapshot newer than LATEST (a publish about to move it).
		orphan := strings.Replace(ids[1], "-h-", "-crashed-", 1)
		if _, err := s.Put(ctx, uploader.ArchiveKey(orphan), strings.NewReader("partial"), 7, uploader.PutOptions{}); err != nil {
			t.Fatal(err)
		}
		newer := uploader.ArchiveKey(ids[4] + "0")
		for _, k := range []string{newer, strings.TrimSuffix(newer, uploader.ArchiveExt) + uploader.ManifestExt} {
			s.Put(ctx, k, strings.NewReader("{}"), 2, uploader.PutOptions{})
		}

		if _, err := c.Prune(ctx, 0); err == nil {
			t.Error("keep 0 accepted")
		}
		res, err := c.Prune(ctx, 2)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.Deleted, []string{ids[2], ids[1], ids[0]}) {
			t.Errorf("deleted %v, want the three oldest", res.Deleted)
		}
		noManifestWithoutArchive(t, s)
		keys := keysOf(t, s)
		for _, k := range []string{uploader.ArchiveKey(ids[4]), uploader.ArchiveKey(ids[3]), uploader.ArchiveKey(orphan), newer} {
			if !slices.Contains(keys, k) {
				t.Errorf("prune removed %s", k)
			}
		}
		// Once the orphan is old enough, it goes too.
		clk.Add(2 * time.Hour)
		res, err = c.Prune(ctx, 2)
		if err != nil || !slices.Equal(res.Deleted, []string{orphan}) {
			t.Errorf("second prune deleted %v, %v; want the orphan", res.Deleted, err)
		}
		// keep 1 keeps LATEST even when newer snapshots exist.
		if _, err := c.Prune(ctx, 1); err != nil {
			t.Fatal(err)
		}
		if m, err := c.Latest(ctx); err != nil || m.ID != ids[4] {
			t.Errorf("after prune, LATEST = %v, %v", m.ID, err)
		}
		if _, err := c.Restore(ctx, filepath.Join(t.TempDir(), "r"), uploader.RestoreOptions{}); err != nil {
			t.Errorf("restore after prune: %v", err)
		}
	})
}

// Prune running while snapshots are published never breaks LATEST.
func TestCatalogPruneDuringPublish(t *testing.T) {
	s := newLocal(t)
	c := catalog(s, "h", newClock())
	ctx, cancel := context.WithCancel(t.Context())
	var wg sync.WaitGroup
	var pruneErr error
	wg.Go(func() {
		for ctx.Err() == nil {
			if _, err := c.Prune(ctx, 1); err != nil && ctx.Err() == nil {
				pruneErr = err
				return
			}
		}
	})
	for range 15 {
		m, sum := publish(t, c, 20_000)
		dst := filepath.Join(t.TempDir(), "r")
		res, err := c.Restore(t.Context(), dst, uploader.RestoreOptions{})
		if err != nil || res.Manifest.ID != m.ID || fileSum(t, dst) != sum {
			t.Fatalf("restore right after publish: %+v, %v", res, err)
		}
	}
	cancel()
	wg.Wait()
	if pruneErr != nil {
		t.Fatal(pruneErr)
	}
	noManifestWithoutArchive(t, s)
}

func TestLease(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		clk := newClock()
		ca, cb := catalog(s, "host-a", clk), catalog(s, "host-b", clk)
		manual := uploader.LeaseOptions{Holder: "mount /a", Heartbeat: -1}
		a, err := ca.AcquireLease(ctx, manual)
		if err != nil {
			t.Fatal(err)
		}
		_, err = cb.AcquireLease(ctx, uploader.LeaseOptions{Holder: "mount /b", Heartbeat: -1})
		var held *uploader.LeaseHeldError
		if !errors.As(err, &held) || !errors.Is(err, uploader.ErrLeaseHeld) || held.Host != "host-a" || held.Holder != "mount /a" {
			t.Fatalf("second acquirer: %v, want refused naming host-a", err)
		}
		// Heartbeats keep it; a missed TTL makes it stale.
		clk.Add(20 * time.Second)
		if err := a.Renew(ctx); err != nil {
			t.Fatal(err)
		}
		clk.Add(20 * time.Second)
		if err := a.Err(); err != nil {
			t.Fatalf("renewed lease: %v", err)
		}
		if _, err := cb.AcquireLease(ctx, uploader.LeaseOptions{Holder: "mount /b", Heartbeat: -1}); !errors.Is(err, uploader.ErrLeaseHeld) {
			t.Fatalf("lease renewed 20s ago taken: %v", err)
		}
		// The store's clock did not move, but host b has now seen the
		// lease unchanged for a whole TTL: stale.
		clk.Add(uploader.DefaultLeaseTTL)
		b, err := cb.AcquireLease(ctx, uploader.LeaseOptions{Holder: "mount /b", Heartbeat: -1})
		if err != nil {
			t.Fatalf("takeover of a stale lease: %v", err)
		}
		if b.Record().Generation != a.Record().Generation+1 {
			t.Errorf("generation %d after %d", b.Record().Generation, a.Record().Generation)
		}
		// The old holder finds out on its next heartbeat, and its publish
		// is refused before LATEST moves.
		if err := a.Renew(ctx); !errors.Is(err, uploader.ErrLeaseLost) || !strings.Contains(err.Error(), "host-b") {
			t.Errorf("renew after takeover: %v", err)
		}
		select {
		case <-a.Lost():
		default:
			t.Error("Lost not closed after takeover")
		}
		p, _ := archiveFile(t, 100)
		if _, err := ca.Publish(ctx, uploader.PublishInput{Path: p, Lease: a}); !errors.Is(err, uploader.ErrLeaseLost) {
			t.Errorf("publish with a lost lease: %v", err)
		}
		if id, _ := ca.LatestID(ctx); id != "" {
			t.Errorf("LATEST moved to %s under a lost lease", id)
		}
		if _, err := cb.Publish(ctx, uploader.PublishInput{Path: p, Lease: b}); err != nil {
			t.Errorf("publish with the lease: %v", err)
		}
		if err := a.Release(ctx); err != nil {
			t.Errorf("release of a lost lease: %v", err)
		}
		if err := b.Err(); err != nil {
			t.Errorf("old holder's release disturbed the new holder: %v", err)
		}
		// Release frees it at once.
		if err := b.Release(ctx); err != nil {
			t.Fatal(err)
		}
		c, err := ca.AcquireLease(ctx, manual)
		if err != nil {
			t.Fatalf("acquire after release: %v", err)
		}
		// The same writer restarting after a crash takes its own lease over.
		if _, err := ca.AcquireLease(ctx, manual); err != nil {
			t.Errorf("same holder re-acquiring: %v", err)
		}
		if err := c.Renew(ctx); !errors.Is(err, uploader.ErrLeaseLost) {
			t.Errorf("renew of the crashed run's lease: %v", err)
		}
	})
}

// A lease whose holder cannot reach the store expires in the holder's own
// view too, so it stops publishing when others may take over.
func TestLeaseExpiresUnrenewed(t *testing.T) {
	clk := newClock()
	c := catalog(newLocal(t), "h", clk)
	l, err := c.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "x", Heartbeat: -1})
	if err != nil {
		t.Fatal(err)
	}
	clk.Add(uploader.DefaultLeaseTTL)
	if err := l.Err(); !errors.Is(err, uploader.ErrLeaseLost) || !errors.Is(err, uploader.ErrLeaseLapsed) {
		t.Errorf("lease past its TTL: %v, want it lost and lapsed", err)
	}
}

func TestLeaseHeartbeat(t *testing.T) {
	c := uploader.NewCatalog(newLocal(t), uploader.CatalogOptions{Host: "h"})
	l, err := c.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "x", Heartbeat: 5 * time.Millisecond, TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	first := l.Record().Renewed
	deadline := time.Now().Add(30 * time.Second)
	for l.Record().Renewed.Equal(first) {
		if time.Now().After(deadline) {
			t.Fatal("the background heartbeat never renewed the lease")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if err := l.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	rec, _, err := c.ReadLease(t.Context())
	if err != nil || !rec.Released {
		t.Errorf("after release the lease object is %+v, %v", rec, err)
	}
}

// lostReply is a store whose write of LATEST lands but reports an error,
// as a connection reset after the server acted does once retries are
// spent.
type lostReply struct{ uploader.Store }

func (s lostReply) Put(ctx context.Context, key string, r io.Reader, size int64, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	info, err := s.Store.Put(ctx, key, r, size, opts)
	if err == nil && key == uploader.LatestKey {
		return info, errors.New("connection reset by peer")
	}
	return info, err
}

// A LATEST write that landed is a published snapshot, whatever error came
// back with it.
func TestCatalogLatestLandedDespiteError(t *testing.T) {
	s := newLocal(t)
	c := catalog(lostReply{s}, "host-a", newClock())
	p, _ := archiveFile(t, 1000)
	m, err := c.Publish(t.Context(), uploader.PublishInput{Path: p})
	if err != nil {
		t.Fatalf("publish whose LATEST landed: %v", err)
	}
	if got, _ := catalog(s, "checker", newClock()).LatestID(t.Context()); got != m.ID {
		t.Fatalf("LATEST %q, published %q", got, m.ID)
	}
}

// blackout is a store whose next write of LATEST lands but reports an
// error, and whose next read of LATEST then fails: an outage that took
// both the answer to a publish and its check.
type blackout struct {
	uploader.Store
	armed, reading *atomic.Bool
}

func (s blackout) Put(ctx context.Context, key string, r io.Reader, size int64, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	info, err := s.Store.Put(ctx, key, r, size, opts)
	if err == nil && key == uploader.LatestKey && s.armed.CompareAndSwap(true, false) {
		s.reading.Store(true)
		return info, errors.New("502 Bad Gateway")
	}
	return info, err
}

func (s blackout) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	if key == uploader.LatestKey && s.reading.CompareAndSwap(true, false) {
		return nil, uploader.ObjectInfo{}, errors.New("connection refused")
	}
	return s.Store.Get(ctx, key, off, length)
}

// A publish whose LATEST write landed while neither its answer nor its
// check came back is taken for a failure; the next publish, which expects
// what that one did, finds LATEST naming it and goes over it: it is this
// host's own snapshot, not a conflict with another host.
func TestCatalogUnconfirmedPublishIsOwn(t *testing.T) {
	for _, images := range []bool{false, true} {
		t.Run(map[bool]string{false: "archive", true: "image"}[images], func(t *testing.T) {
			s := newLocal(t)
			armed, reading := new(atomic.Bool), new(atomic.Bool)
			c := catalog(blackout{s, armed, reading}, "host-a", newClock())
			publish := func(expect string) (string, error) {
				p, _ := archiveFile(t, 1000)
				if !images {
					m, err := c.Publish(t.Context(), uploader.PublishInput{Path: p, Parent: expect, Expect: expect})
					return m.ID, err
				}
				pr, err := c.PublishImage(t.Context(), uploader.ImageInput{
					Segment: p, Extents: []uploader.Extent{{Length: 1000}}, Parent: expect, Expect: expect,
				})
				return pr.ID, err
			}
			first, err := publish("")
			if err != nil {
				t.Fatal(err)
			}
			armed.Store(true)
			if _, err := publish(first); err == nil {
				t.Fatal("a publish whose LATEST write and check both failed reported success")
			}
			lost, err := catalog(s, "checker", newClock()).LatestID(t.Context())
			if err != nil || lost == first {
				t.Fatalf("the blacked-out LATEST write did not land (LATEST %q, %v): the test shows nothing", lost, err)
			}
			next, err := publish(first)
			if err != nil {
				t.Fatalf("the publish after an unconfirmed one of the same host: %v", err)
			}
			if got, _ := catalog(s, "checker", newClock()).LatestID(t.Context()); got != next || next == lost {
				t.Fatalf("LATEST %q; published %q over the unconfirmed %q", got, next, lost)
			}
			// What the host never published stays a conflict: a publish
			// expecting the first snapshot, now two behind.
			if _, err := publish(first); !errors.Is(err, uploader.ErrConflict) {
				t.Fatalf("a publish over a LATEST it did not expect: %v, want a conflict", err)
			}
		})
	}
}

// lostLeaseReply is a store whose next lease write lands but reports an
// error, as a renewal that timed out after the server acted does.
type lostLeaseReply struct {
	uploader.Store
	lose *atomic.Bool
}

func (s lostLeaseReply) Put(ctx context.Context, key string, r io.Reader, size int64, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	info, err := s.Store.Put(ctx, key, r, size, opts)
	if err == nil && key == uploader.LeaseKey && s.lose.CompareAndSwap(true, false) {
		return info, context.DeadlineExceeded
	}
	return info, err
}

// TestLeaseRenewalAnswerLost: a renewal that landed although its caller
// saw a timeout is the holder's own write: the next renewal goes on from
// it (the lease is not "taken over" by its own holder), and a release
// after such a renewal releases.
func TestLeaseRenewalAnswerLost(t *testing.T) {
	s := newLocal(t)
	var lose atomic.Bool
	c := uploader.NewCatalog(lostLeaseReply{s, &lose}, uploader.CatalogOptions{Host: "h"})
	l, err := c.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "x", Heartbeat: -1, TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	lose.Store(true)
	if err := l.Renew(t.Context()); err == nil {
		t.Fatal("a renewal that reported a timeout returned no error")
	}
	if err := l.Renew(t.Context()); err != nil {
		t.Fatalf("the renewal after one whose answer was lost: %v", err)
	}
	if err := l.Err(); err != nil {
		t.Fatalf("the lease after a lost answer: %v", err)
	}
	lose.Store(true)
	l.Renew(t.Context())
	if err := l.Release(t.Context()); err != nil {
		t.Fatal(err)
	}
	if rec, _, err := c.ReadLease(t.Context()); err != nil || !rec.Released {
		t.Errorf("after release the lease is %+v, %v", rec, err)
	}
	// Another holder's write is still a takeover.
	l2, err := c.AcquireLease(t.Context(), uploader.LeaseOptions{Holder: "y", Heartbeat: -1, TTL: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	lose.Store(true)
	l2.Renew(t.Context())
	other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "h2"})
	rec, tag, _ := other.ReadLease(t.Context())
	rec.Token, rec.Write = "someone-else", "w"
	b, _ := json.Marshal(rec)
	if _, err := s.Put(t.Context(), uploader.LeaseKey, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{IfMatch: tag}); err != nil {
		t.Fatal(err)
	}
	if err := l2.Renew(t.Context()); !errors.Is(err, uploader.ErrLeaseLost) {
		t.Fatalf("a renewal over another holder's lease: %v, want ErrLeaseLost", err)
	}
}
