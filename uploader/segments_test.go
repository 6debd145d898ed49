package uploader_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// publishImage publishes an image of n new bytes followed by the ranges
// take of the snapshot on top of LATEST (its manifest is the source).
func publishImage(t *testing.T, c *uploader.Catalog, n int, take ...uploader.Extent) uploader.Manifest {
	t.Helper()
	ctx := t.Context()
	latest, err := c.LatestID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var sources []uploader.Manifest
	if latest != "" {
		m, err := c.Manifest(ctx, latest)
		if err != nil {
			t.Fatal(err)
		}
		sources = append(sources, m)
	}
	b := make([]byte, n)
	rand.Read(b)
	p := filepath.Join(t.TempDir(), "seg")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	ext := append([]uploader.Extent{{Length: int64(n)}}, take...)
	res, err := c.PublishImage(ctx, uploader.ImageInput{Segment: p, Extents: ext, Sources: sources, Parent: latest, Expect: latest})
	if err != nil {
		t.Fatalf("publish: %v", err)
	}
	return res.Manifest
}

// ownSegment is the segment snapshot m uploaded.
func ownSegment(m uploader.Manifest) string { return uploader.SegmentKey(m.ID, m.Encryption != nil) }

// everyManifestComplete fails if a manifest in the store names an object
// the store does not hold.
func everyManifestComplete(t *testing.T, c *uploader.Catalog) {
	t.Helper()
	ctx := t.Context()
	keys := keysOf(t, c.Store())
	snaps, err := c.Snapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range snaps {
		if s.Err != nil || !s.Segmented() {
			continue
		}
		for _, r := range s.Segments {
			if !slices.Contains(keys, r.Key) || !slices.Contains(keys, uploader.SumsKey(r.Key)) {
				t.Errorf("snapshot %s names segment %s, which the store lacks (or its digests)", s.ID, r.Key)
			}
		}
		if !slices.Contains(keys, s.Extents) {
			t.Errorf("snapshot %s: extents list missing", s.ID)
		}
	}
}

func TestPruneCollectsSegments(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		clk := newClock()
		c := catalog(s, "h", clk)
		a := publishImage(t, c, 300_000)
		// b takes half of a's segment; c takes a third of b's own and
		// nothing of a's.
		b := publishImage(t, c, 200_000, uploader.Extent{Key: ownSegment(a), Offset: 1000, Length: 150_000})
		cc := publishImage(t, c, 100_000, uploader.Extent{Key: ownSegment(b), Offset: 0, Length: 70_000})

		res, err := c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 2}, DryRun: true})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.Deleted, []string{a.ID}) || len(res.SegmentsDeleted) != 0 {
			t.Fatalf("dry run keeping 2: deletes %v and segments %v; want %s and no segment (b uses a's)", res.Deleted, res.SegmentsDeleted, a.ID)
		}
		res, err = c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 2}})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.Deleted, []string{a.ID}) || len(res.SegmentsDeleted) != 0 {
			t.Fatalf("keeping 2: deleted %v and segments %v", res.Deleted, res.SegmentsDeleted)
		}
		everyManifestComplete(t, c)
		if res.Segments != 3 {
			t.Errorf("%d segments stay, want 3 (a's, used by b)", res.Segments)
		}

		// Keeping only c: b's segment stays (c uses it), a's goes (once
		// it is too old to be a publish in progress's).
		clk.Add(2 * time.Hour)
		dry, err := c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}, DryRun: true})
		if err != nil {
			t.Fatal(err)
		}
		res, err = c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.SegmentsDeleted, []string{ownSegment(a)}) || !slices.Equal(dry.SegmentsDeleted, res.SegmentsDeleted) {
			t.Fatalf("keeping 1: deleted segments %v (dry run %v), want only a's", res.SegmentsDeleted, dry.SegmentsDeleted)
		}
		keys := keysOf(t, s)
		for _, k := range []string{ownSegment(a), uploader.SumsKey(ownSegment(a)), uploader.ExtentsKey(a.ID), uploader.ExtentsKey(b.ID), uploader.ManifestKey(b.ID)} {
			if slices.Contains(keys, k) {
				t.Errorf("%s is still in the store", k)
			}
		}
		for _, k := range []string{ownSegment(b), ownSegment(cc), uploader.ManifestKey(cc.ID)} {
			if !slices.Contains(keys, k) {
				t.Errorf("%s was deleted", k)
			}
		}
		everyManifestComplete(t, c)
	})
}

// racingStore runs hook once, the first time the store is listed under
// prefix, before listing: another host's step landing in the middle of a
// prune.
type racingStore struct {
	uploader.Store
	prefix string
	hook   func()
	n      int
}

func (r *racingStore) List(ctx context.Context, prefix string, fn func(uploader.ObjectInfo) error) error {
	if prefix == r.prefix && r.hook != nil {
		if r.n++; r.n == 2 { // the prune's second listing: after its decisions
			h := r.hook
			r.hook = nil
			h()
		}
	}
	return r.Store.List(ctx, prefix, fn)
}

func TestPruneRacingPublish(t *testing.T) {
	// A publish lands while a prune runs (between its decisions and its
	// collection, or while it lists segments): the new snapshot keeps
	// every segment it uses, and stays readable.
	for _, at := range []string{uploader.SnapshotsPrefix, uploader.SegmentsPrefix} {
		t.Run(strings.TrimSuffix(at, "/"), func(t *testing.T) {
			s := newLocal(t)
			clk := newClock()
			c := catalog(s, "h", clk)
			a := publishImage(t, c, 300_000)
			b := publishImage(t, c, 100_000, uploader.Extent{Key: ownSegment(a), Length: 200_000})
			var late uploader.Manifest
			rs := &racingStore{Store: s, prefix: at}
			rs.hook = func() {
				late = publishImage(t, c, 50_000, uploader.Extent{Key: ownSegment(b), Length: 100_000}, uploader.Extent{Key: ownSegment(a), Length: 10_000})
			}
			if at == uploader.SegmentsPrefix {
				rs.n = 1 // the only listing of segments
			}
			pc := catalog(rs, "pruner", clk)
			if _, err := pc.PruneWith(t.Context(), uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}}); err != nil {
				t.Fatal(err)
			}
			if late.ID == "" {
				t.Fatal("the racing publish did not run")
			}
			everyManifestComplete(t, c)
			keys := keysOf(t, s)
			for _, k := range []string{ownSegment(a), ownSegment(b), ownSegment(late)} {
				if !slices.Contains(keys, k) {
					t.Errorf("segment %s, used by the snapshot published during the prune, was deleted", k)
				}
			}
		})
	}
}

func TestPruneCrashLeftovers(t *testing.T) {
	// A publish that crashed after its segment (or its extents list) and
	// before its manifest leaves objects no manifest names: kept while
	// they may be a publish in progress, collected after the grace.
	s := newLocal(t)
	clk := newClock()
	c := catalog(s, "h", clk)
	a := publishImage(t, c, 100_000)
	ctx := t.Context()
	ghost := strings.Replace(a.ID, "-h-", "-ghost-", 1)
	for _, k := range []string{uploader.SegmentKey(ghost, false), uploader.SumsKey(uploader.SegmentKey(ghost, false)), uploader.ExtentsKey(ghost)} {
		if _, err := s.Put(ctx, k, strings.NewReader("x"), 1, uploader.PutOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	res, err := c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.SegmentsDeleted) != 0 || !slices.Contains(keysOf(t, s), uploader.SegmentKey(ghost, false)) {
		t.Fatalf("a fresh segment without a manifest was deleted: %v", res.SegmentsDeleted)
	}
	clk.Add(2 * time.Hour)
	if _, err := c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}}); err != nil {
		t.Fatal(err)
	}
	keys := keysOf(t, s)
	for _, k := range []string{uploader.SegmentKey(ghost, false), uploader.SumsKey(uploader.SegmentKey(ghost, false)), uploader.ExtentsKey(ghost)} {
		if slices.Contains(keys, k) {
			t.Errorf("leftover %s survived the grace", k)
		}
	}
	if !slices.Contains(keys, ownSegment(a)) {
		t.Error("LATEST's segment was deleted")
	}
}

func TestLegacyArchiveKeptWhileUsedAsSegment(t *testing.T) {
	s := newLocal(t)
	clk := newClock()
	c := catalog(s, "h", clk)
	old, _ := publish(t, c, 400_000) // format 2: one archive object
	m := publishImage(t, c, 10_000, uploader.Extent{Key: old.Archive, Offset: 0, Length: 300_000})
	res, err := c.PruneWith(t.Context(), uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Deleted, []string{old.ID}) {
		t.Fatalf("deleted %v, want the format 2 snapshot", res.Deleted)
	}
	keys := keysOf(t, s)
	if slices.Contains(keys, uploader.ManifestKey(old.ID)) || !slices.Contains(keys, old.Archive) {
		t.Fatal("the pruned format 2 snapshot's archive, used as a segment, must stay (and only it)")
	}
	everyManifestComplete(t, c)
	// Once no snapshot uses it, it goes.
	publishImage(t, c, 10_000)
	clk.Add(2 * time.Hour)
	if _, err := c.PruneWith(t.Context(), uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}}); err != nil {
		t.Fatal(err)
	}
	keys = keysOf(t, s)
	if slices.Contains(keys, old.Archive) || slices.Contains(keys, ownSegment(m)) {
		t.Fatal("segments no snapshot uses survived")
	}
}

func TestPublishStandalone(t *testing.T) {
	// The whole image also as one object: composed by the store from the
	// segments (S3 copies the 6 MiB extent as a part), byte for byte the
	// image, kept by prune while its snapshot is.
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		clk := newClock()
		c := catalog(s, "h", clk)
		a := publishImage(t, c, 6<<20)
		segA := readObject(t, s, ownSegment(a))
		fresh := make([]byte, 100_000)
		rand.Read(fresh)
		p := filepath.Join(t.TempDir(), "seg")
		os.WriteFile(p, fresh, 0o600)
		want := append(append([]byte{}, segA...), fresh...)
		img := bytesReaderAt(want)
		res, err := c.PublishImage(ctx, uploader.ImageInput{Segment: p, Sources: []uploader.Manifest{a}, Parent: a.ID, Expect: a.ID,
			Extents:    []uploader.Extent{{Key: ownSegment(a), Offset: 0, Length: int64(len(segA))}, {Length: int64(len(fresh))}},
			Standalone: true, Image: img})
		if err != nil {
			t.Fatal(err)
		}
		m, err := c.Manifest(ctx, res.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !m.Standalone || m.Archive != uploader.ArchiveKey(res.ID) {
			t.Fatalf("manifest: standalone %v archive %q", m.Standalone, m.Archive)
		}
		if got := readObject(t, s, m.Archive); !bytes.Equal(got, want) {
			t.Fatalf("the standalone object (%d bytes) is not the image (%d bytes)", len(got), len(want))
		}
		if res.Sent > int64(len(fresh))+(6<<20)/2 && strings.Contains(fmt.Sprintf("%T", s), "s3") {
			t.Errorf("S3 sent %d bytes: the 6 MiB extent should have been copied by the store", res.Sent)
		}
		clk.Add(2 * time.Hour)
		if _, err := c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}}); err != nil {
			t.Fatal(err)
		}
		keys := keysOf(t, s)
		if !slices.Contains(keys, m.Archive) || !slices.Contains(keys, ownSegment(a)) {
			t.Fatal("prune deleted the standalone image or a segment it uses")
		}
		everyManifestComplete(t, c)
	})
}

func readObject(t *testing.T, s uploader.Store, key string) []byte {
	t.Helper()
	rc, _, err := s.Get(t.Context(), key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

type bytesReaderAt []byte

func (b bytesReaderAt) ReadAt(p []byte, off int64) (int, error) {
	if off >= int64(len(b)) {
		return 0, io.EOF
	}
	n := copy(p, b[off:])
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// A compaction takes the place of the snapshot it compacts: the policy
// sees one snapshot where there are two with the same tree, and the
// compacted one goes, with the old layout's segments only it used.
func TestPruneCompactionTakesItsParentsPlace(t *testing.T) {
	eachStore(t, func(t *testing.T, s uploader.Store) {
		ctx := t.Context()
		clk := newClock()
		c := catalog(s, "h", clk)
		a := publishImage(t, c, 100_000)
		clk.Add(time.Minute)
		b := publishImage(t, c, 50_000, uploader.Extent{Key: ownSegment(a), Offset: 0, Length: 100_000})
		clk.Add(time.Minute)
		// b's tree laid out anew in one segment of its own.
		seg := filepath.Join(t.TempDir(), "seg")
		if err := os.WriteFile(seg, bytes.Repeat([]byte{7}, 150_000), 0o600); err != nil {
			t.Fatal(err)
		}
		pr, err := c.PublishImage(ctx, uploader.ImageInput{Segment: seg, Extents: []uploader.Extent{{Length: 150_000}},
			Sources: []uploader.Manifest{b}, Parent: b.ID, Expect: b.ID, Compacts: b.ID})
		if err != nil {
			t.Fatal(err)
		}
		comp := pr.Manifest

		clk.Add(2 * time.Hour) // past the grace of a publish in progress
		res, err := c.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 2}})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(res.Kept, []string{comp.ID, a.ID}) || !slices.Equal(res.Deleted, []string{b.ID}) {
			t.Fatalf("keeping 2: kept %v, deleted %v; want the compaction and a kept, b (compacted) deleted", res.Kept, res.Deleted)
		}
		for _, d := range res.Decisions {
			if d.ID == b.ID && (len(d.Reasons) != 1 || !strings.Contains(d.Reasons[0], comp.ID)) {
				t.Errorf("b's decision: %v; want it replaced by its compaction", d.Reasons)
			}
		}
		if !slices.Equal(res.SegmentsDeleted, []string{ownSegment(b)}) {
			t.Errorf("segments deleted %v, want b's own only (a is kept)", res.SegmentsDeleted)
		}
		everyManifestComplete(t, c)
	})
}
