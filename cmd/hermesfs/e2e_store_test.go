package main

// Helpers that look at a store's objects from outside, as its layout
// (format 4) describes them: a manifest, its extents list, the segments
// the extents name and each segment's digests.

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// storeExtents reads the extents list of snapshot m from the local store
// at storeDir, checked against m (a format 3 or older snapshot is its
// archive, whole).
func storeExtents(t *testing.T, storeDir string, m uploader.Manifest) *uploader.Extents {
	t.Helper()
	if !m.Segmented() {
		return uploader.LegacyExtents(m)
	}
	e, err := uploader.ParseManifestExtents([]byte(mustRead(t, filepath.Join(storeDir, filepath.FromSlash(m.Extents)))), m)
	if err != nil {
		t.Fatalf("extents of %s: %v", m.ID, err)
	}
	return e
}

// storeSums reads the digests of segment ref from the local store at
// storeDir, checked against ref.
func storeSums(t *testing.T, storeDir string, ref uploader.SegmentRef) *uploader.Sums {
	t.Helper()
	s, err := uploader.ParseSums([]byte(mustRead(t, filepath.Join(storeDir, filepath.FromSlash(uploader.SumsKey(ref.Key))))), ref)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// segmentRef returns the entry of m's segments for key.
func segmentRef(t *testing.T, m uploader.Manifest, key string) uploader.SegmentRef {
	t.Helper()
	for _, r := range m.Segments {
		if r.Key == key {
			return r
		}
	}
	t.Fatalf("snapshot %s does not use segment %s: %+v", m.ID, key, m.Segments)
	return uploader.SegmentRef{}
}

// ownSegment returns the segment snapshot m uploaded (the bytes new in it).
func ownSegment(t *testing.T, m uploader.Manifest) uploader.SegmentRef {
	t.Helper()
	return segmentRef(t, m, uploader.SegmentKey(m.ID, m.Encryption != nil))
}

// wholeSegment checks that m's image is all of one segment, its own (a
// first snapshot), so that segment offsets are image offsets.
func wholeSegment(t *testing.T, storeDir string, m uploader.Manifest) uploader.SegmentRef {
	t.Helper()
	ref := ownSegment(t, m)
	e := storeExtents(t, storeDir, m).List()
	if len(e) != 1 || e[0].Key != ref.Key || e[0].Offset != 0 || e[0].Length != m.Size {
		t.Fatalf("the image of %s is not its own segment whole: %+v", m.ID, e)
	}
	return ref
}

// flipStored flips the bits mask of byte off of the object key in the
// local store at storeDir, in place (as bit rot, or a hand, would).
func flipStored(t *testing.T, storeDir, key string, off int64, mask byte) {
	t.Helper()
	p := filepath.Join(storeDir, filepath.FromSlash(key))
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if off < 0 || off >= int64(len(b)) {
		t.Fatalf("flip byte %d of the %d-byte %s", off, len(b), key)
	}
	b[off] ^= mask
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// storeKeys lists every key of the store.
func storeKeys(ctx context.Context, s uploader.Store) (map[string]uploader.ObjectInfo, error) {
	keys := map[string]uploader.ObjectInfo{}
	err := s.List(ctx, "", func(o uploader.ObjectInfo) error {
		keys[o.Key] = o
		return nil
	})
	return keys, err
}

// checkStoreRefs checks what a crash anywhere in a publish (and a prune)
// must leave: LATEST names a snapshot whose manifest is there, and every
// manifest in the store names only objects that are there (its extents
// list, every segment the extents use and each one's digests), which
// match what it says of them (sizes, the extents' segments).
func checkStoreRefs(t *testing.T, cat *uploader.Catalog) {
	t.Helper()
	ctx := t.Context()
	keys, err := storeKeys(ctx, cat.Store())
	if err != nil {
		t.Fatalf("list the store: %v", err)
	}
	latest, err := cat.LatestID(ctx)
	if err != nil {
		t.Fatalf("LATEST: %v", err)
	}
	if _, ok := keys[uploader.ManifestKey(latest)]; latest != "" && !ok {
		t.Errorf("LATEST names %s, whose manifest is not in the store", latest)
	}
	var problems []string
	for k := range keys {
		id, ok := strings.CutPrefix(k, uploader.SnapshotsPrefix)
		if !ok || !strings.HasSuffix(id, uploader.ManifestExt) {
			continue
		}
		id = strings.TrimSuffix(id, uploader.ManifestExt)
		m, err := cat.Manifest(ctx, id)
		if err != nil {
			problems = append(problems, fmt.Sprintf("manifest of %s: %v", id, err))
			continue
		}
		if !m.Segmented() {
			if o, ok := keys[m.Archive]; !ok || o.Size != m.Size {
				problems = append(problems, fmt.Sprintf("%s names archive %s of %d bytes; the store has %+v", id, m.Archive, m.Size, o))
			}
			continue
		}
		if _, ok := keys[m.Extents]; !ok {
			problems = append(problems, fmt.Sprintf("%s names extents list %s, which is not in the store", id, m.Extents))
		} else if e, err := uploader.ReadExtents(ctx, cat.Store(), m); err != nil {
			problems = append(problems, fmt.Sprintf("extents of %s: %v", id, err))
		} else if e.Size() != m.Size {
			problems = append(problems, fmt.Sprintf("extents of %s give %d bytes, the manifest %d", id, e.Size(), m.Size))
		}
		for _, r := range m.Segments {
			if o, ok := keys[r.Key]; !ok || o.Size != r.Size {
				problems = append(problems, fmt.Sprintf("%s names segment %s of %d bytes; the store has %+v", id, r.Key, r.Size, o))
			}
			if _, err := uploader.ReadSums(ctx, cat.Store(), r); err != nil {
				problems = append(problems, fmt.Sprintf("%s names segment %s: %v", id, r.Key, err))
			}
		}
	}
	if len(problems) > 0 {
		t.Errorf("the store holds snapshots that name what it does not hold:\n%s", strings.Join(problems, "\n"))
	}
}
