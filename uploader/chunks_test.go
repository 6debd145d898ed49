package uploader_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

func TestPublishRecordsChunkDigests(t *testing.T) {
	s := newLocal(t)
	c := catalog(s, "a", newClock())
	p, sum := archiveFile(t, 3*uploader.DefaultChunkSize+1000)
	m, err := c.Publish(t.Context(), uploader.PublishInput{Path: p, Hot: []int64{2, 0, 2, 99, -1}})
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Manifest(t.Context(), m.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Format != 2 || got.SHA256 != sum || got.ChunkSize != uploader.DefaultChunkSize || len(got.Chunks) != 4 || !got.Lazy() {
		t.Fatalf("manifest %+v", got)
	}
	b, _ := os.ReadFile(p)
	for i, d := range got.Chunks {
		end := min(len(b), (i+1)*uploader.DefaultChunkSize)
		s := sha256.Sum256(b[i*uploader.DefaultChunkSize : end])
		if d != hex.EncodeToString(s[:]) {
			t.Fatalf("chunk %d digest %s, want %x", i, d, s)
		}
	}
	if want := []int64{2, 0}; len(got.Hot) != 2 || got.Hot[0] != want[0] || got.Hot[1] != want[1] {
		t.Fatalf("hot %v, want %v (deduplicated, in range)", got.Hot, want)
	}
	if got.MetaOffset != 0 {
		t.Fatalf("meta_offset %d for a file that is not squashfs", got.MetaOffset)
	}
}

// The hot set a manifest records is bounded by bytes: an eighth of the
// archive, at least 4 MiB, at most MaxHotBytes; the first chunks given
// are the ones kept.
func TestHotLimit(t *testing.T) {
	const cs = uploader.DefaultChunkSize
	for _, c := range []struct {
		size int64
		want int
	}{
		{1000, 1},                         // smaller than a chunk
		{3 << 20, 12},                     // smaller than 4 MiB: all of it
		{10 << 20, 16},                    // 4 MiB
		{277 << 20, (277 << 20) / 8 / cs}, // an eighth
		{2 << 30, uploader.MaxHotBytes / cs},
		{1 << 40, uploader.MaxHotBytes / cs},
	} {
		if got := uploader.HotLimit(c.size, cs); got != c.want {
			t.Errorf("HotLimit(%d) = %d, want %d", c.size, got, c.want)
		}
	}
	if got := uploader.HotLimit(1<<30, 64<<20); got != 1 {
		t.Errorf("HotLimit with 64 MiB chunks = %d, want 1", got)
	}

	s := newLocal(t)
	c := catalog(s, "a", newClock())
	p, _ := archiveFile(t, 40*cs)
	var hot []int64
	for i := int64(39); i >= 0; i-- {
		hot = append(hot, i)
	}
	m, err := c.Publish(t.Context(), uploader.PublishInput{Path: p, Hot: hot})
	if err != nil {
		t.Fatal(err)
	}
	got, err := c.Manifest(t.Context(), m.ID)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Hot) != 16 || got.Hot[0] != 39 || got.Hot[15] != 24 {
		t.Fatalf("hot %v; want the first 16 given (4 MiB), 39 down to 24", got.Hot)
	}
}

func TestFormat1ManifestStillLoads(t *testing.T) {
	s := newLocal(t)
	c := catalog(s, "a", newClock())
	p, _ := archiveFile(t, 1000)
	m, err := c.Publish(t.Context(), uploader.PublishInput{Path: p})
	if err != nil {
		t.Fatal(err)
	}
	// Rewrite it as an older hermesfs wrote it.
	m.Format, m.ChunkSize, m.Chunks, m.MetaOffset = 1, 0, nil, 0
	j, _ := json.Marshal(m)
	if strings.Contains(string(j), "chunk") {
		t.Fatalf("format 1 JSON mentions chunks: %s", j)
	}
	if _, err := s.Put(t.Context(), uploader.ManifestKey(m.ID), bytes.NewReader(j), int64(len(j)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := c.Manifest(t.Context(), m.ID)
	if err != nil {
		t.Fatal(err)
	}
	if got.Lazy() || got.Format != 1 {
		t.Fatalf("format 1 manifest read as %+v", got)
	}
	// A format 2 manifest whose digests do not cover the archive is corrupt.
	m.Format, m.ChunkSize, m.Chunks = 2, uploader.DefaultChunkSize, []string{"00", "11"}
	j, _ = json.Marshal(m)
	s.Put(t.Context(), uploader.ManifestKey(m.ID), bytes.NewReader(j), int64(len(j)), uploader.PutOptions{})
	if _, err := c.Manifest(t.Context(), m.ID); err == nil || !strings.Contains(err.Error(), "chunk digests") {
		t.Fatalf("bad digests accepted: %v", err)
	}
}
