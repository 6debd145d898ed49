package fs

import (
	"os"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

func TestStatsCountsRequests(t *testing.T) {
	t.Parallel()
	if len(OpBuckets) != numBuckets {
		t.Fatalf("OpBuckets has %d bounds, numBuckets is %d", len(OpBuckets), numBuckets)
	}
	lower, _ := packLower(t, sampleTree)
	st := NewStats()
	// Without passthrough, so that writes reach the daemon, and without
	// filling the page cache at open, so that reads do.
	e := mountEnv(t, lower, Options{Stats: st, NoPassthrough: true, OpenFillMax: -1})

	if !st.FirstChange().IsZero() {
		t.Fatal("a change recorded before any")
	}
	before := time.Now()
	e.write("new.txt", "hello")
	// Opening a lower file for writing copies it up.
	f, err := os.OpenFile(e.path("a/b/two.txt"), os.O_WRONLY|os.O_APPEND, 0)
	must(t, err)
	_, err = f.WriteString(" more")
	must(t, err)
	must(t, f.Close())
	for range 3 * OpSampleEvery {
		e.read("top.txt")
	}
	// isatty(3) on a file: an ioctl the kernel sends to the daemon.
	tf, err := os.Open(e.path("top.txt"))
	must(t, err)
	if _, err := unix.IoctlGetTermios(int(tf.Fd()), unix.TCGETS); err != unix.ENOTTY {
		t.Errorf("TCGETS on a file: %v, want ENOTTY", err)
	}
	tf.Close()

	ops := map[string]OpStat{}
	for _, o := range st.Ops() {
		ops[o.Op] = o
	}
	for _, op := range []string{"lookup", "create", "write", "open", "read", "release", "ioctl"} {
		o, ok := ops[op]
		if !ok || o.Calls == 0 || o.Samples == 0 || o.Buckets[len(o.Buckets)-1] > o.Samples {
			t.Errorf("%s: %+v, want calls and samples", op, o)
		}
	}
	if o := ops["open"]; o.Calls < 3*OpSampleEvery || o.Samples < 3 || o.Samples > o.Calls/OpSampleEvery+1 {
		t.Errorf("open: %d calls, %d sampled; want one in %d sampled", o.Calls, o.Samples, OpSampleEvery)
	}
	if n, done := st.CopyUps(); n != 0 || done == 0 {
		t.Errorf("copy-ups: %d in progress, %d done; want 0 and some", n, done)
	}
	first := st.FirstChange()
	if first.Before(before.Add(-time.Second)) || first.After(time.Now()) {
		t.Errorf("first change at %v, the writes were after %v", first, before)
	}

	v, err := e.m.Freeze(t.Context())
	must(t, err)
	defer v.Close()
	if !st.FirstChange().IsZero() || !st.FrozenFirstChange().Equal(first) {
		t.Errorf("after a freeze: first change %v (want none), frozen %v (want %v)", st.FirstChange(), st.FrozenFirstChange(), first)
	}
	if got := st.TakeFrozenFirstChange(); !got.Equal(first) || !st.FrozenFirstChange().IsZero() {
		t.Errorf("take: %v, then %v; want %v, then none", got, st.FrozenFirstChange(), first)
	}
	e.write("later.txt", "x")
	if st.FirstChange().IsZero() {
		t.Error("a change after the freeze is not recorded")
	}
}

// BenchmarkStatsRequest is what Stats adds to each FUSE request: an atomic
// add, and for one request in OpSampleEvery two clock reads and three more
// atomic adds. Run in parallel, all on one operation (the worst case: one
// shared counter).
func BenchmarkStatsRequest(b *testing.B) {
	st := NewStats()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			st.end(st.begin(opRead))
		}
	})
}

// BenchmarkStatsWrapper is the cost timedFS adds to a request: a GETATTR
// through it to a file system that answers at once, against the same
// file system unwrapped.
func BenchmarkStatsWrapper(b *testing.B) {
	raw := fuse.NewDefaultRawFileSystem()
	for _, c := range []struct {
		name string
		fs   fuse.RawFileSystem
	}{{"plain", raw}, {"stats", &timedFS{RawFileSystem: raw, s: NewStats()}}} {
		b.Run(c.name, func(b *testing.B) {
			var in fuse.GetAttrIn
			var out fuse.AttrOut
			for b.Loop() {
				c.fs.GetAttr(nil, &in, &out)
			}
		})
	}
}

// BenchmarkMountOpenClose opens and closes a file of the mount, each a
// request served by the daemon (OPEN, FLUSH, RELEASE), with and without
// Stats.
func BenchmarkMountOpenClose(b *testing.B) {
	for _, withStats := range []bool{false, true} {
		name := "plain"
		var st *Stats
		if withStats {
			name, st = "stats", NewStats()
		}
		b.Run(name, func(b *testing.B) {
			e := mountEnv(b, nil, Options{Stats: st})
			e.write("f", "x")
			p := e.path("f")
			b.ResetTimer()
			for b.Loop() {
				f, err := os.Open(p)
				if err != nil {
					b.Fatal(err)
				}
				f.Close()
			}
		})
	}
}
