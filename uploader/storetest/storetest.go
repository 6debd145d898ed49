// Package storetest is the conformance suite every uploader.Store must pass.
// Each store's tests call Run with a constructor for a fresh, empty store;
// the same cases then run against the local directory store and against the
// S3 store talking to a real S3 server on loopback.
package storetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"slices"
	"sync"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// Options tunes the suite to a store.
type Options struct {
	// LargeSize is the size of the object used to exercise a store's path
	// for big objects (S3 multipart: make it a few parts long). Default 3 MiB.
	LargeSize int64
}

// Run runs every conformance case against stores made by newStore, which
// must return a fresh, empty store for each call.
func Run(t *testing.T, newStore func(t *testing.T) uploader.Store, opts Options) {
	if opts.LargeSize <= 0 {
		opts.LargeSize = 3 << 20
	}
	cases := []struct {
		name string
		fn   func(t *testing.T, s uploader.Store)
	}{
		{"RoundTrip", testRoundTrip},
		{"Missing", testMissing},
		{"Ranges", testRanges},
		{"Overwrite", testOverwrite},
		{"SizeMismatch", testSizeMismatch},
		{"FailingReader", testFailingReader},
		{"IfNoneMatch", testIfNoneMatch},
		{"IfMatch", testIfMatch},
		{"ConcurrentCreate", testConcurrentCreate},
		{"ConcurrentSwap", testConcurrentSwap},
		{"List", testList},
		{"Delete", testDelete},
		{"InvalidKeys", testInvalidKeys},
		{"Large", func(t *testing.T, s uploader.Store) { testLarge(t, s, opts.LargeSize) }},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) { c.fn(t, newStore(t)) })
	}
}

func randBytes(t *testing.T, n int64) []byte {
	t.Helper()
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// put stores data under key with a seekable reader and fails the test on error.
func put(t *testing.T, s uploader.Store, key string, data []byte) uploader.ObjectInfo {
	t.Helper()
	info, err := s.Put(t.Context(), key, bytes.NewReader(data), int64(len(data)), uploader.PutOptions{})
	if err != nil {
		t.Fatalf("put %s: %v", key, err)
	}
	if info.Key != key || info.Size != int64(len(data)) || info.ETag == "" {
		t.Fatalf("put %s: info %+v, want key %s size %d and an ETag", key, info, key, len(data))
	}
	return info
}

func get(t *testing.T, s uploader.Store, key string, off, length int64) ([]byte, uploader.ObjectInfo) {
	t.Helper()
	rc, info, err := s.Get(t.Context(), key, off, length)
	if err != nil {
		t.Fatalf("get %s [%d,+%d): %v", key, off, length, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("get %s [%d,+%d): read: %v", key, off, length, err)
	}
	return b, info
}

func testRoundTrip(t *testing.T, s uploader.Store) {
	for _, n := range []int64{0, 1, 4096, 1<<20 + 3} {
		key := fmt.Sprintf("dir/sub/obj-%d", n)
		data := randBytes(t, n)
		pinfo := put(t, s, key, data)
		got, ginfo := get(t, s, key, 0, -1)
		if !bytes.Equal(got, data) {
			t.Fatalf("%s: got %d bytes back, not the %d put", key, len(got), n)
		}
		sinfo, err := s.Stat(t.Context(), key)
		if err != nil {
			t.Fatal(err)
		}
		for _, i := range []uploader.ObjectInfo{ginfo, sinfo} {
			if i.Key != key || i.Size != n || i.ETag != pinfo.ETag || i.ModTime.IsZero() {
				t.Errorf("%s: info %+v, want size %d ETag %s and a mod time", key, i, n, pinfo.ETag)
			}
		}
	}
	// An unknown size and a reader that is neither a Seeker nor a ReaderAt.
	data := randBytes(t, 100_000)
	info, err := s.Put(t.Context(), "unknown-size", io.MultiReader(bytes.NewReader(data)), -1, uploader.PutOptions{})
	if err != nil || info.Size != int64(len(data)) {
		t.Fatalf("put unknown size: %+v, %v", info, err)
	}
	if got, _ := get(t, s, "unknown-size", 0, -1); !bytes.Equal(got, data) {
		t.Fatal("unknown-size object differs")
	}
}

func testMissing(t *testing.T, s uploader.Store) {
	ctx := t.Context()
	if _, _, err := s.Get(ctx, "nope", 0, -1); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("get missing: %v, want ErrNotExist", err)
	}
	if _, err := s.Stat(ctx, "no/such/key"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("stat missing: %v, want ErrNotExist", err)
	}
	put(t, s, "dir/obj", []byte("x"))
	// A "directory" is not an object, and an object is not a directory.
	if _, err := s.Stat(ctx, "dir"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("stat of a key prefix: %v, want ErrNotExist", err)
	}
	if _, err := s.Stat(ctx, "dir/obj/below"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("stat below an object: %v, want ErrNotExist", err)
	}
	if !uploader.IsPermanent(fmt.Errorf("wrapped: %w", iofs.ErrNotExist)) {
		t.Error("a missing key must not be retried")
	}
}

func testRanges(t *testing.T, s uploader.Store) {
	data := randBytes(t, 10_000)
	put(t, s, "r", data)
	for _, c := range []struct{ off, length, wantLen int64 }{
		{0, -1, 10_000},
		{0, 10, 10},
		{9_990, -1, 10},
		{9_990, 100, 10}, // past the end: cut
		{5_000, 1, 1},
		{123, 0, 0},
		{10_000, -1, 0}, // at the end: empty
		{10_000, 5, 0},
	} {
		got, info := get(t, s, "r", c.off, c.length)
		if int64(len(got)) != c.wantLen || !bytes.Equal(got, data[c.off:c.off+c.wantLen]) {
			t.Errorf("range %d+%d: got %d bytes, want %d of the object", c.off, c.length, len(got), c.wantLen)
		}
		if info.Size != 10_000 {
			t.Errorf("range %d+%d: info size %d, want the whole object's 10000", c.off, c.length, info.Size)
		}
	}
	if _, _, err := s.Get(t.Context(), "r", 10_001, -1); !errors.Is(err, uploader.ErrInvalidRange) {
		t.Errorf("offset past the end: %v, want ErrInvalidRange", err)
	}
	if _, _, err := s.Get(t.Context(), "r", -1, -1); err == nil {
		t.Error("negative offset accepted")
	}
	put(t, s, "empty", nil)
	if got, info := get(t, s, "empty", 0, -1); len(got) != 0 || info.Size != 0 {
		t.Errorf("empty object: %d bytes, size %d", len(got), info.Size)
	}
}

func testOverwrite(t *testing.T, s uploader.Store) {
	a := put(t, s, "k", []byte("first version"))
	b := put(t, s, "k", []byte("second, longer version"))
	if a.ETag == b.ETag {
		t.Errorf("different contents share ETag %s", a.ETag)
	}
	if got, info := get(t, s, "k", 0, -1); string(got) != "second, longer version" || info.ETag != b.ETag {
		t.Errorf("after overwrite: %q ETag %s", got, info.ETag)
	}
}

func testSizeMismatch(t *testing.T, s uploader.Store) {
	put(t, s, "k", []byte("keep me"))
	for _, size := range []int64{3, 100} {
		_, err := s.Put(t.Context(), "k", bytes.NewReader([]byte("0123456789")), size, uploader.PutOptions{})
		if err == nil {
			t.Errorf("put of 10 bytes declared as %d succeeded", size)
		}
	}
	if got, _ := get(t, s, "k", 0, -1); string(got) != "keep me" {
		t.Errorf("failed put changed the object to %q", got)
	}
	assertKeys(t, s, "", "k")
}

// failingReader yields n bytes and then an error.
type failingReader struct {
	n   int
	err error
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n == 0 {
		return 0, f.err
	}
	k := min(len(p), f.n)
	clear(p[:k])
	f.n -= k
	return k, nil
}

func testFailingReader(t *testing.T, s uploader.Store) {
	put(t, s, "k", []byte("keep me"))
	boom := errors.New("disk on fire")
	_, err := s.Put(t.Context(), "k", &failingReader{n: 70_000, err: boom}, -1, uploader.PutOptions{})
	if !errors.Is(err, boom) {
		t.Errorf("put from a failing reader: %v, want the reader's error", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if _, err := s.Put(ctx, "k", bytes.NewReader(make([]byte, 70_000)), 70_000, uploader.PutOptions{}); err == nil {
		t.Error("put with a canceled context succeeded")
	}
	if got, _ := get(t, s, "k", 0, -1); string(got) != "keep me" {
		t.Errorf("failed put changed the object to %q", got)
	}
	assertKeys(t, s, "", "k")
}

func testIfNoneMatch(t *testing.T, s uploader.Store) {
	ctx := t.Context()
	create := uploader.PutOptions{IfNoneMatch: true}
	if _, err := s.Put(ctx, "lease", bytes.NewReader([]byte("one")), 3, create); err != nil {
		t.Fatalf("create-only put of a new key: %v", err)
	}
	_, err := s.Put(ctx, "lease", bytes.NewReader([]byte("two")), 3, create)
	if !errors.Is(err, uploader.ErrPrecondition) || !uploader.IsPermanent(err) {
		t.Errorf("create-only put of an existing key: %v, want a permanent ErrPrecondition", err)
	}
	if got, _ := get(t, s, "lease", 0, -1); string(got) != "one" {
		t.Errorf("object is %q after a refused put", got)
	}
}

func testIfMatch(t *testing.T, s uploader.Store) {
	ctx := t.Context()
	if _, err := s.Put(ctx, "L", bytes.NewReader([]byte("x")), 1, uploader.PutOptions{IfMatch: "0123"}); !errors.Is(err, uploader.ErrPrecondition) {
		t.Errorf("IfMatch on a missing key: %v, want ErrPrecondition", err)
	}
	v1 := put(t, s, "L", []byte("v1"))
	v2, err := s.Put(ctx, "L", bytes.NewReader([]byte("v2")), 2, uploader.PutOptions{IfMatch: v1.ETag})
	if err != nil {
		t.Fatalf("IfMatch with the current ETag: %v", err)
	}
	if _, err := s.Put(ctx, "L", bytes.NewReader([]byte("v3")), 2, uploader.PutOptions{IfMatch: v1.ETag}); !errors.Is(err, uploader.ErrPrecondition) {
		t.Errorf("IfMatch with a stale ETag: %v, want ErrPrecondition", err)
	}
	if got, info := get(t, s, "L", 0, -1); string(got) != "v2" || info.ETag != v2.ETag {
		t.Errorf("object is %q (ETag %s), want v2 (%s)", got, info.ETag, v2.ETag)
	}
}

// race runs n puts of distinct contents at once and returns how many won.
func race(t *testing.T, n int, putOne func(i int) error) int {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		wins int
	)
	for i := range n {
		wg.Go(func() {
			err := putOne(i)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil:
				wins++
			case !errors.Is(err, uploader.ErrPrecondition):
				t.Errorf("racer %d: %v, want success or ErrPrecondition", i, err)
			}
		})
	}
	wg.Wait()
	return wins
}

func testConcurrentCreate(t *testing.T, s uploader.Store) {
	wins := race(t, 8, func(i int) error {
		b := fmt.Appendf(nil, "racer %d", i)
		_, err := s.Put(t.Context(), "LATEST", bytes.NewReader(b), int64(len(b)), uploader.PutOptions{IfNoneMatch: true})
		return err
	})
	if wins != 1 {
		t.Errorf("%d create-only puts won, want exactly 1", wins)
	}
}

func testConcurrentSwap(t *testing.T, s uploader.Store) {
	base := put(t, s, "LATEST", []byte("base"))
	wins := race(t, 8, func(i int) error {
		b := fmt.Appendf(nil, "racer %d", i)
		_, err := s.Put(t.Context(), "LATEST", bytes.NewReader(b), int64(len(b)), uploader.PutOptions{IfMatch: base.ETag})
		return err
	})
	if wins != 1 {
		t.Errorf("%d compare-and-swap puts won, want exactly 1", wins)
	}
}

func listKeys(t *testing.T, s uploader.Store, prefix string) []string {
	t.Helper()
	var keys []string
	err := s.List(t.Context(), prefix, func(o uploader.ObjectInfo) error {
		keys = append(keys, o.Key)
		if o.Size < 0 || o.ETag == "" || o.ModTime.IsZero() {
			t.Errorf("list %q: incomplete info %+v", prefix, o)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("list %q: %v", prefix, err)
	}
	return keys
}

func assertKeys(t *testing.T, s uploader.Store, prefix string, want ...string) {
	t.Helper()
	if got := listKeys(t, s, prefix); !slices.Equal(got, want) {
		t.Errorf("list %q = %q, want %q", prefix, got, want)
	}
}

func testList(t *testing.T, s uploader.Store) {
	assertKeys(t, s, "")
	keys := []string{"LATEST", "a-b", "a/b", "a/c/d", "lease", "snapshots/1.json", "snapshots/1.sqfs", "snapshots/2.json", "snapshotsX"}
	for _, k := range slices.Backward(keys) {
		put(t, s, k, []byte(k))
	}
	assertKeys(t, s, "", keys...)
	assertKeys(t, s, "snapshots/", "snapshots/1.json", "snapshots/1.sqfs", "snapshots/2.json")
	assertKeys(t, s, "snap", "snapshots/1.json", "snapshots/1.sqfs", "snapshots/2.json", "snapshotsX")
	assertKeys(t, s, "snapshots/1", "snapshots/1.json", "snapshots/1.sqfs")
	assertKeys(t, s, "a", "a-b", "a/b", "a/c/d")
	assertKeys(t, s, "zzz")
	assertKeys(t, s, "nodir/")

	stop := errors.New("stop")
	calls := 0
	err := s.List(t.Context(), "", func(uploader.ObjectInfo) error {
		calls++
		if calls == 2 {
			return stop
		}
		return nil
	})
	if err != stop || calls != 2 {
		t.Errorf("list with a failing callback: %v after %d calls, want the callback's error after 2", err, calls)
	}
}

func testDelete(t *testing.T, s uploader.Store) {
	put(t, s, "snapshots/x.sqfs", []byte("x"))
	put(t, s, "snapshots/y.sqfs", []byte("y"))
	if err := s.Delete(t.Context(), "snapshots/x.sqfs"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Stat(t.Context(), "snapshots/x.sqfs"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("stat after delete: %v", err)
	}
	if err := s.Delete(t.Context(), "snapshots/x.sqfs"); err != nil {
		t.Errorf("delete of a missing key: %v", err)
	}
	assertKeys(t, s, "", "snapshots/y.sqfs")
}

func testInvalidKeys(t *testing.T, s uploader.Store) {
	for _, k := range []string{"", "/abs", "a//b", "a/../b", "./a", "a/", ".hermesfs-lock", "x/.hermesfs-tmp-1"} {
		_, err := s.Put(t.Context(), k, bytes.NewReader(nil), 0, uploader.PutOptions{})
		if !errors.Is(err, uploader.ErrInvalidKey) || !uploader.IsPermanent(err) {
			t.Errorf("put %q: %v, want a permanent ErrInvalidKey", k, err)
		}
	}
	assertKeys(t, s, "")
}

func testLarge(t *testing.T, s uploader.Store, size int64) {
	data := randBytes(t, size)
	// A ReaderAt with a known size, and a plain stream of unknown size.
	a := put(t, s, "big/known", data)
	b, err := s.Put(t.Context(), "big/stream", io.MultiReader(bytes.NewReader(data)), -1, uploader.PutOptions{IfNoneMatch: true})
	if err != nil || b.Size != size {
		t.Fatalf("put stream: %+v, %v", b, err)
	}
	for _, key := range []string{"big/known", "big/stream"} {
		if got, info := get(t, s, key, 0, -1); !bytes.Equal(got, data) || info.Size != size {
			t.Errorf("%s: read back %d bytes (size %d), not the %d put", key, len(got), info.Size, size)
		}
		off := size/2 + 7
		if got, _ := get(t, s, key, off, 1<<20); !bytes.Equal(got, data[off:min(size, off+1<<20)]) {
			t.Errorf("%s: middle range differs", key)
		}
	}
	// Conditions hold on the big-object path too.
	if _, err := s.Put(t.Context(), "big/known", bytes.NewReader(data), size, uploader.PutOptions{IfNoneMatch: true}); !errors.Is(err, uploader.ErrPrecondition) {
		t.Errorf("create-only put over a big object: %v", err)
	}
	if _, err := s.Put(t.Context(), "big/known", bytes.NewReader(data), size, uploader.PutOptions{IfMatch: a.ETag}); err != nil {
		t.Errorf("IfMatch put of a big object: %v", err)
	}
	// A big put that fails part way leaves the old object.
	_, err = s.Put(t.Context(), "big/stream", &failingReader{n: int(size - 1), err: io.ErrClosedPipe}, -1, uploader.PutOptions{})
	if err == nil {
		t.Error("failing big put succeeded")
	}
	if got, _ := get(t, s, "big/stream", 0, -1); !bytes.Equal(got, data) {
		t.Error("failed big put changed the object")
	}
}
