package lazy

import (
	"bytes"
	"slices"
	"testing"
	"time"
)

// chunksIn returns the chunks of [from, to) that are present or being
// fetched.
func chunksIn(r *Reader, from, to int) []int {
	r.mu.Lock()
	defer r.mu.Unlock()
	var got []int
	for i := from; i < to; i++ {
		if r.present[i] || r.inflight[i] != nil {
			got = append(got, i)
		}
	}
	return got
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(time.Millisecond)
	}
}

func readOK(t *testing.T, r *Reader, o *object, off, n int64) {
	t.Helper()
	buf := make([]byte, n)
	if _, err := r.ReadAt(buf, off); err != nil || !bytes.Equal(buf, o.data[off:off+n]) {
		t.Fatalf("read of %d bytes at %d: %v (right bytes: %v)", n, off, err, bytes.Equal(buf, o.data[off:off+n]))
	}
}

// TestReadAheadOnlyForReadsInOrder: a read starts read-ahead (and has the
// fill follow it) only when it starts where the previous read ended; two
// reads in one chunk, or a read further on, are not a sequential reader.
func TestReadAheadOnlyForReadsInOrder(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 16*testChunk)
	opts := o.options(t.TempDir())
	opts.ReadAhead = 4
	r := open(t, opts)
	readOK(t, r, o, 0, 100)
	readOK(t, r, o, 1000, 100)
	if got := chunksIn(r, 0, 16); !slices.Equal(got, []int{0}) {
		t.Fatalf("two reads in chunk 0, not in order, fetched chunks %v; want [0]", got)
	}
	readOK(t, r, o, 5*testChunk+10, 100)
	if got := chunksIn(r, 0, 16); !slices.Equal(got, []int{0, 5}) {
		t.Fatalf("a read further on fetched chunks %v; want [0 5]", got)
	}
	r.mu.Lock()
	follows := !r.seqAt.IsZero()
	r.mu.Unlock()
	if follows {
		t.Fatal("the fill would follow reads that were not in order")
	}
	// Where the previous read ended: chunks 5-6 read, 7-10 read ahead.
	readOK(t, r, o, 5*testChunk+110, testChunk)
	if got := chunksIn(r, 0, 16); !slices.Equal(got, []int{0, 5, 6, 7, 8, 9, 10}) {
		t.Fatalf("a read in order fetched chunks %v; want [0 5 6 7 8 9 10]", got)
	}
	if n := o.store.gets.Load(); n > 7 {
		t.Fatalf("%d gets for 7 chunks", n)
	}
}
