package uploader

import (
	"bytes"
	"encoding/json"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func TestSplitHole(t *testing.T) {
	h := Hole{From: 100, To: 300}
	got := splitHole([]ComposeRange{{Offset: 10, SourceOffset: 10, Length: 340}, {Offset: 400, SourceOffset: 20, Length: 5}}, h)
	want := []ComposeRange{
		{Offset: 10, SourceOffset: 10, Length: 90},
		{Offset: 100, SourceOffset: 100, Length: 200, Unchecked: true},
		{Offset: 300, SourceOffset: 300, Length: 50},
		{Offset: 400, SourceOffset: 20, Length: 5},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("split %+v\nwant  %+v", got, want)
	}
	if got := splitHole([]ComposeRange{{Offset: 150, SourceOffset: 150, Length: 50}}, h); !got[0].Unchecked || len(got) != 1 {
		t.Fatalf("a range inside the hole: %+v", got)
	}
}

func TestHoleReader(t *testing.T) {
	local := bytes.Repeat([]byte{'l'}, 1000)
	fill := bytes.Repeat([]byte{'f'}, 1000)
	r := holeReader{f: bytes.NewReader(local), fill: bytes.NewReader(fill), hole: Hole{From: 100, To: 300}}
	buf := make([]byte, 400)
	if n, err := r.ReadAt(buf, 50); n != 400 || err != nil {
		t.Fatalf("read %d, %v", n, err)
	}
	want := append(append(bytes.Repeat([]byte{'l'}, 50), bytes.Repeat([]byte{'f'}, 200)...), bytes.Repeat([]byte{'l'}, 150)...)
	if !bytes.Equal(buf, want) {
		t.Fatalf("got %q", buf)
	}
}

// Only a format 3 manifest with chunk digests may lack the sha256.
func TestManifestWithoutSHA256(t *testing.T) {
	ctx := t.Context()
	s, err := NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	c := NewCatalog(s, CatalogOptions{Host: "h"})
	const id = "20261122T134501.123Z-h-1a2b3c4d"
	put := func(format int, chunks []string) error {
		m := Manifest{Format: format, ID: id, Size: 10, ChunkSize: 64 << 10, Chunks: chunks}
		j, _ := json.Marshal(m)
		if _, err := s.Put(ctx, ManifestKey(id), bytes.NewReader(j), int64(len(j)), PutOptions{}); err != nil {
			t.Fatal(err)
		}
		_, err := c.Manifest(ctx, id)
		return err
	}
	digest := strings.Repeat("ab", 32)
	if err := put(3, []string{digest}); err != nil {
		t.Fatalf("format 3 with chunk digests: %v", err)
	}
	if err := put(2, []string{digest}); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("format 2 without sha256: %v", err)
	}
	if err := put(3, nil); !errors.Is(err, ErrCorrupt) {
		t.Fatalf("format 3 without chunk digests: %v", err)
	}
}
