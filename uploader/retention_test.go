package uploader_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	iofs "io/fs"
	"math/rand/v2"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// memStore is the smallest Store the catalog accepts: objects in a map.
// It makes a catalog of thousands of snapshots cost nothing to build.
type memStore struct {
	mu   sync.Mutex
	objs map[string][]byte
	gen  int
	mod  map[string]time.Time
}

func newMemStore() *memStore {
	return &memStore{objs: map[string][]byte{}, mod: map[string]time.Time{}}
}

func (m *memStore) Put(ctx context.Context, key string, r io.Reader, size int64, o uploader.PutOptions) (uploader.ObjectInfo, error) {
	b, err := io.ReadAll(r)
	if err != nil {
		return uploader.ObjectInfo{}, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	_, exists := m.objs[key]
	if o.IfNoneMatch && exists || o.IfMatch != "" && (!exists || m.etag(key) != o.IfMatch) {
		return uploader.ObjectInfo{}, fmt.Errorf("mem: put %s: %w", key, uploader.ErrPrecondition)
	}
	m.gen++
	m.objs[key] = append(b, fmt.Sprintf("\x00%d", m.gen)...) // the suffix versions the ETag
	m.mod[key] = time.Now()
	return m.info(key), nil
}

func (m *memStore) etag(key string) string { return fmt.Sprintf("%x", m.objs[key]) }

func (m *memStore) body(key string) []byte {
	b := m.objs[key]
	return b[:bytes.LastIndexByte(b, 0)]
}

func (m *memStore) info(key string) uploader.ObjectInfo {
	return uploader.ObjectInfo{Key: key, Size: int64(len(m.body(key))), ETag: m.etag(key), ModTime: m.mod[key]}
}

func (m *memStore) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.objs[key]; !ok {
		return nil, uploader.ObjectInfo{}, fmt.Errorf("mem: get %s: %w", key, iofs.ErrNotExist)
	}
	b := m.body(key)
	off = min(off, int64(len(b)))
	end := int64(len(b))
	if length >= 0 {
		end = min(end, off+length)
	}
	return io.NopCloser(bytes.NewReader(b[off:end])), m.info(key), nil
}

func (m *memStore) Stat(ctx context.Context, key string) (uploader.ObjectInfo, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.objs[key]; !ok {
		return uploader.ObjectInfo{}, fmt.Errorf("mem: stat %s: %w", key, iofs.ErrNotExist)
	}
	return m.info(key), nil
}

func (m *memStore) List(ctx context.Context, prefix string, fn func(uploader.ObjectInfo) error) error {
	m.mu.Lock()
	var infos []uploader.ObjectInfo
	for k := range m.objs {
		if strings.HasPrefix(k, prefix) {
			infos = append(infos, m.info(k))
		}
	}
	m.mu.Unlock()
	sort.Slice(infos, func(i, j int) bool { return infos[i].Key < infos[j].Key })
	for _, o := range infos {
		if err := fn(o); err != nil {
			return err
		}
	}
	return nil
}

func (m *memStore) Delete(ctx context.Context, key string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.objs, key)
	return nil
}

func (m *memStore) put(key, body string) {
	m.Put(context.Background(), key, strings.NewReader(body), int64(len(body)), uploader.PutOptions{})
}

// refKeep is an independent statement of the retention rules: for each
// rule, group the snapshots by the rule's calendar bucket (a formatted
// time), order the buckets by their newest snapshot, and keep the newest
// snapshot of the first n buckets. Within keeps what is younger than the
// newest snapshot by less than the duration.
func refKeep(p uploader.RetentionPolicy, times []time.Time) map[int]bool {
	keep := map[int]bool{}
	rule := func(n int, bucket func(time.Time) string) {
		newest := map[string]int{} // bucket -> index of its newest snapshot
		var order []string
		for i, t := range times {
			b := bucket(t.UTC())
			if j, ok := newest[b]; !ok || t.After(times[j]) {
				if !ok {
					order = append(order, b)
				}
				newest[b] = i
			}
		}
		sort.Slice(order, func(a, b int) bool { return times[newest[order[a]]].After(times[newest[order[b]]]) })
		if n >= 0 && len(order) > n {
			order = order[:n]
		}
		for _, b := range order {
			keep[newest[b]] = true
		}
	}
	uniq := 0
	rule(p.Last, func(time.Time) string { uniq++; return fmt.Sprint(uniq) })
	rule(p.Hourly, func(t time.Time) string { return t.Format("2006-01-02T15") })
	rule(p.Daily, func(t time.Time) string { return t.Format("2006-01-02") })
	rule(p.Weekly, func(t time.Time) string { y, w := t.ISOWeek(); return fmt.Sprintf("%d-W%d", y, w) })
	rule(p.Monthly, func(t time.Time) string { return t.Format("2006-01") })
	rule(p.Yearly, func(t time.Time) string { return t.Format("2006") })
	if p.Within > 0 {
		var newest time.Time
		for _, t := range times {
			if t.After(newest) {
				newest = t
			}
		}
		for i, t := range times {
			if newest.Sub(t) < p.Within {
				keep[i] = true
			}
		}
	}
	return keep
}

// synthTimes makes n snapshot times over about 90 days ending at end: the
// 15-minute rhythm of a running mount with random jitter, nights and
// whole days switched off, and bursts of on-demand snapshots.
func synthTimes(r *rand.Rand, n int, end time.Time) []time.Time {
	start := end.Add(-90 * 24 * time.Hour)
	set := map[int64]bool{}
	var out []time.Time
	for len(out) < n {
		t := start.Add(time.Duration(r.Int64N(int64(90 * 24 * time.Hour))))
		day := t.Sub(start) / (24 * time.Hour)
		if day%9 == 4 || day%13 == 7 || (t.Hour() >= 1 && t.Hour() < 6 && r.IntN(4) > 0) {
			continue // days off, quiet nights
		}
		t = t.Truncate(time.Millisecond)
		if set[t.UnixMilli()] {
			continue
		}
		set[t.UnixMilli()] = true
		out = append(out, t)
		if r.IntN(50) == 0 { // a burst of snapshots within a minute
			for k := 1; k <= 3 && len(out) < n; k++ {
				b := t.Add(time.Duration(k) * 7 * time.Second)
				if !set[b.UnixMilli()] {
					set[b.UnixMilli()] = true
					out = append(out, b)
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b time.Time) int { return b.Compare(a) })
	return out
}

func synthID(t time.Time, i int) string {
	return fmt.Sprintf("%s-synth-%08x", t.UTC().Format("20060102T150405.000Z"), i)
}

// TestRetentionMatchesReference prunes a catalog of 2,000 snapshots over
// 90 days with several policies and checks every decision against
// refKeep, the protections, and what is left in the store.
func TestRetentionMatchesReference(t *testing.T) {
	t.Parallel()
	end := time.Date(2026, 11, 24, 10, 15, 0, 0, time.UTC)
	times := synthTimes(rand.New(rand.NewPCG(16, 2026)), 2000, end)
	policies := []uploader.RetentionPolicy{
		uploader.DefaultRetention(),
		{Last: 10},
		{Hourly: 48, Daily: 30},
		{Daily: 7, Weekly: 4, Monthly: 6, Yearly: 2},
		{Within: 36 * time.Hour, Weekly: 5},
		{Last: 3, Hourly: 1000, Monthly: -1},
		{Weekly: -1},
		{Within: 200 * 24 * time.Hour},
	}
	for _, p := range policies {
		t.Run(strings.ReplaceAll(p.String(), " ", ""), func(t *testing.T) {
			t.Parallel()
			s := newMemStore()
			ids := make([]string, len(times))
			for i, tm := range times {
				ids[i] = synthID(tm, i)
				s.put(uploader.ArchiveKey(ids[i]), "a")
				s.put(uploader.ManifestKey(ids[i]), "{}")
			}
			// LATEST is the third newest: the two newer ones are a
			// publish in progress and must stay.
			latestIdx := 2
			s.put(uploader.LatestKey, ids[latestIdx]+"\n")
			// A writer's mount is based on an old snapshot the policy
			// would drop.
			baseIdx := 1500
			s.put(uploader.LeaseKey, fmt.Sprintf(`{"holder":"mount /h","host":"a","token":"t","base":%q}`, ids[baseIdx]))
			// A manifest whose archive is gone, an old archive whose
			// manifest is missing and a new one (an upload in progress).
			broken := synthID(times[1000].Add(time.Second), 9001)
			s.put(uploader.ManifestKey(broken), "{}")
			orphan := synthID(times[1200].Add(time.Second), 9002)
			s.put(uploader.ArchiveKey(orphan), "a")
			s.mod[uploader.ArchiveKey(orphan)] = time.Now().Add(-2 * time.Hour)
			uploading := synthID(times[latestIdx].Add(-time.Second), 9003)
			s.put(uploader.ArchiveKey(uploading), "a")

			c := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "pruner"})
			want := refKeep(p, times[latestIdx:])
			check := func(res uploader.PruneResult) {
				t.Helper()
				if len(res.Decisions) != len(ids)+3 {
					t.Fatalf("%d decisions for %d snapshots", len(res.Decisions), len(ids)+3)
				}
				for _, d := range res.Decisions {
					switch d.ID {
					case broken:
						if d.Keep {
							t.Errorf("kept the manifest without an archive: %+v", d)
						}
						continue
					case orphan:
						if d.Keep {
							t.Errorf("kept the old orphan archive: %+v", d)
						}
						continue
					case uploading:
						if !d.Keep {
							t.Errorf("removed an upload in progress: %+v", d)
						}
						continue
					}
					i := slices.Index(ids, d.ID)
					wantKeep := i < latestIdx || i == baseIdx || want[i-latestIdx]
					if d.Keep != wantKeep {
						t.Errorf("snapshot %d (%s): keep=%v, the reference says %v (reasons %q)", i, d.ID, d.Keep, wantKeep, d.Reasons)
					}
					if len(d.Reasons) == 0 {
						t.Errorf("snapshot %s: no reason given", d.ID)
					}
					if i == latestIdx && d.Reasons[0] != "LATEST" {
						t.Errorf("LATEST's reasons: %q", d.Reasons)
					}
					if i == baseIdx && !strings.Contains(strings.Join(d.Reasons, ","), "writer lease") {
						t.Errorf("lease base's reasons: %q", d.Reasons)
					}
				}
			}

			dry, err := c.PruneWith(t.Context(), uploader.PruneOptions{Policy: p, DryRun: true})
			if err != nil {
				t.Fatal(err)
			}
			check(dry)
			if n := len(s.objs); n != 2*len(ids)+5 {
				t.Fatalf("dry run changed the store: %d objects", n)
			}
			res, err := c.PruneWith(t.Context(), uploader.PruneOptions{Policy: p})
			if err != nil {
				t.Fatal(err)
			}
			check(res)
			if !slices.Equal(res.Deleted, dry.Deleted) {
				t.Errorf("the prune deleted other snapshots than its dry run named")
			}
			// The store holds exactly the kept snapshots.
			var left []string
			s.List(t.Context(), uploader.SnapshotsPrefix, func(o uploader.ObjectInfo) error {
				if id, ok := strings.CutSuffix(strings.TrimPrefix(o.Key, uploader.SnapshotsPrefix), uploader.ManifestExt); ok {
					left = append(left, id)
				}
				return nil
			})
			slices.Reverse(left)
			if !slices.Equal(left, res.Kept) {
				t.Errorf("the store holds %d manifests, the prune kept %d", len(left), len(res.Kept))
			}
			t.Logf("policy %s: kept %d of %d", p, len(res.Kept), len(ids))
			// Pruning again with the same policy changes nothing beyond
			// what LATEST's age shifts: the kept set is stable.
			again, err := c.PruneWith(t.Context(), uploader.PruneOptions{Policy: p, DryRun: true})
			if err != nil {
				t.Fatal(err)
			}
			if len(again.Deleted) != 0 {
				t.Errorf("a second prune would delete %d more: %q", len(again.Deleted), again.Deleted)
			}
		})
	}
}

func TestRetentionBucketsInZone(t *testing.T) {
	// 23:30 and 00:30 UTC are one day in New York.
	ny, err := time.LoadLocation("America/New_York")
	if err != nil {
		t.Skip("no tzdata:", err)
	}
	times := []time.Time{
		time.Date(2026, 11, 25, 0, 30, 0, 0, time.UTC),
		time.Date(2026, 11, 24, 23, 30, 0, 0, time.UTC),
	}
	if got := (uploader.RetentionPolicy{Daily: 2}).Keep(times); got[1] == nil {
		t.Errorf("UTC days: the older snapshot is the newest of its day, got %q", got)
	}
	if got := (uploader.RetentionPolicy{Daily: 2, Location: ny}).Keep(times); got[1] != nil {
		t.Errorf("New York days: one day, one snapshot kept, got %q", got)
	}
}

func TestParseRetentionDuration(t *testing.T) {
	for in, want := range map[string]time.Duration{
		"36h": 36 * time.Hour, "1m": 30 * 24 * time.Hour, "7d": 7 * 24 * time.Hour, "2w": 14 * 24 * time.Hour,
		"1y2m3d4h": (365+60+3)*24*time.Hour + 4*time.Hour,
	} {
		if got, err := uploader.ParseRetentionDuration(in); err != nil || got != want {
			t.Errorf("%q: %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "7", "d", "3x", "-5h", "1.5d"} {
		if _, err := uploader.ParseRetentionDuration(in); err == nil {
			t.Errorf("%q parsed", in)
		}
	}
}
