package uploader_test

import (
	"bytes"
	"context"
	"io"
	"sync"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

func TestCatalogCompleteReadsNoManifest(t *testing.T) {
	s := &countingGets{Store: newLocal(t)}
	c := catalog(s, "box", newClock())
	var ms []uploader.Manifest
	for range 3 {
		m, _ := publish(t, c, 1000)
		ms = append(ms, m)
	}
	// An archive without a manifest (a publish in progress) is left out.
	orphan := "20990101T000000.000Z-box-00000000"
	if _, err := s.Put(t.Context(), uploader.ArchiveKey(orphan), bytes.NewReader([]byte("x")), 1, uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	s.keys = nil
	refs, err := c.Complete(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if len(refs) != 3 {
		t.Fatalf("Complete: %+v", refs)
	}
	for i, r := range refs {
		want := ms[2-i]
		tm, _ := uploader.IDTime(want.ID)
		if r.ID != want.ID || !r.Created.Equal(tm) || r.Size != want.Size || r.Latest != (i == 0) {
			t.Errorf("Complete[%d] = %+v, want %s", i, r, want.ID)
		}
	}
	if len(s.keys) != 1 || s.keys[0] != uploader.LatestKey {
		t.Errorf("Complete read %v; want only %s", s.keys, uploader.LatestKey)
	}
}

// countingGets records the keys of Gets.
type countingGets struct {
	uploader.Store
	mu   sync.Mutex
	keys []string
}

func (s *countingGets) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	s.mu.Lock()
	s.keys = append(s.keys, key)
	s.mu.Unlock()
	return s.Store.Get(ctx, key, off, length)
}
