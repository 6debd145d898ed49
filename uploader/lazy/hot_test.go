package lazy

import (
	"bytes"
	"slices"
	"sync"
	"testing"
	"time"
)

func TestHotRecorderStop(t *testing.T) {
	t.Parallel()
	data := bytes.Repeat([]byte{7}, 8*testChunk)
	h := NewHotRecorder(bytes.NewReader(data), testChunk, time.Hour)
	buf := make([]byte, 10)
	h.ReadAt(buf, 3*testChunk)
	h.Note(testChunk, 1)
	h.Stop()
	h.Stop()
	if n, err := h.ReadAt(buf, 5*testChunk); n != 10 || err != nil {
		t.Fatalf("read after Stop: %d, %v", n, err)
	}
	h.Note(6*testChunk, 1)
	if got := h.Hot(); !slices.Equal(got, []int64{3, 1}) {
		t.Fatalf("hot %v after Stop; want [3 1], what was recorded before", got)
	}
	// Concurrent with notes: nothing is recorded once Stop returned.
	h = NewHotRecorder(nil, testChunk, time.Hour)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 500 {
				h.Note(int64(g*500+i)*testChunk, 1)
			}
		})
	}
	wg.Go(h.Stop)
	h.Stop()
	at := h.Hot()
	wg.Wait()
	h.Note(1<<40, 1)
	if got := h.Hot(); !slices.Equal(got, at) {
		t.Fatalf("%d chunks recorded after Stop returned", len(got)-len(at))
	}
}
