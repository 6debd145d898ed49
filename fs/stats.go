package fs

import (
	"sync/atomic"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// Stats are the overlay's figures for monitoring: FUSE requests by
// operation with sampled latencies, copy-ups in progress, and when the
// oldest change not yet in a frozen view was made. A mount keeps them when
// Options.Stats is set (NewStats); the daemon exports them. Every method
// may be called concurrently; the request path only adds to atomic
// counters, and reads the clock for one request in OpSampleEvery of each
// operation.
type Stats struct {
	ops [numOps]opStat

	// filled counts the lower files handed to the page cache at open
	// (lowerfill.go), filledBytes their bytes.
	filled, filledBytes atomic.Uint64

	copyUps     atomic.Int64  // in progress
	copyUpsDone atomic.Uint64 // finished, successfully or not

	// firstChange is when the first change after the last freeze was made
	// (UnixNano; 0: none since); frozenFirst is what the last freeze
	// took of it.
	firstChange atomic.Int64
	frozenFirst atomic.Int64
}

// NewStats returns empty Stats.
func NewStats() *Stats { return &Stats{} }

// OpSampleEvery is the sampling period of request latencies: the first
// request of each operation and every OpSampleEvery-th after it is timed.
const OpSampleEvery = 64

// OpBuckets are the upper bounds of the latency histogram buckets.
var OpBuckets = []time.Duration{
	10 * time.Microsecond, 25 * time.Microsecond, 50 * time.Microsecond,
	100 * time.Microsecond, 250 * time.Microsecond, 500 * time.Microsecond,
	time.Millisecond, 2500 * time.Microsecond, 5 * time.Millisecond,
	10 * time.Millisecond, 25 * time.Millisecond, 50 * time.Millisecond,
	100 * time.Millisecond, 250 * time.Millisecond, 500 * time.Millisecond,
	time.Second, 2500 * time.Millisecond, 5 * time.Second, 10 * time.Second,
}

const numBuckets = 19 // len(OpBuckets)

type opStat struct {
	calls   atomic.Uint64
	samples atomic.Uint64
	sum     atomic.Int64                  // nanoseconds of the samples
	buckets [numBuckets + 1]atomic.Uint64 // per bucket, not cumulative; the last is +Inf
	_       [64]byte                      // keeps operations off each other's cache lines
}

// The timed operations.
const (
	opLookup = iota
	opGetAttr
	opSetAttr
	opAccess
	opOpen
	opCreate
	opRead
	opWrite
	opFlush
	opFsync
	opRelease
	opFallocate
	opLseek
	opCopyFileRange
	opMkdir
	opMknod
	opUnlink
	opRmdir
	opRename
	opLink
	opSymlink
	opReadlink
	opOpenDir
	opReadDir
	opReadDirPlus
	opReleaseDir
	opFsyncDir
	opStatFs
	opStatx
	opIoctl
	numOps
)

var opNames = [numOps]string{
	opLookup: "lookup", opGetAttr: "getattr", opSetAttr: "setattr", opAccess: "access",
	opOpen: "open", opCreate: "create", opRead: "read", opWrite: "write",
	opFlush: "flush", opFsync: "fsync", opRelease: "release", opFallocate: "fallocate",
	opLseek: "lseek", opCopyFileRange: "copy_file_range", opMkdir: "mkdir", opMknod: "mknod",
	opUnlink: "unlink", opRmdir: "rmdir", opRename: "rename", opLink: "link",
	opSymlink: "symlink", opReadlink: "readlink", opOpenDir: "opendir", opReadDir: "readdir",
	opReadDirPlus: "readdirplus", opReleaseDir: "releasedir", opFsyncDir: "fsyncdir",
	opStatFs: "statfs", opStatx: "statx", opIoctl: "ioctl",
}

// epoch anchors the monotonic timestamps of samples.
var epoch = time.Now()

// begin counts a request of op and says whether to time it, from when:
// end(begin(op)) around the request (one deferred line in each of
// timedFS's methods).
func (s *Stats) begin(op int) (int, time.Duration, bool) {
	if s.ops[op].calls.Add(1)%OpSampleEvery != 1 {
		return op, 0, false
	}
	return op, time.Since(epoch), true
}

// end records a timed request.
func (s *Stats) end(op int, t0 time.Duration, timed bool) {
	if !timed {
		return
	}
	d := time.Since(epoch) - t0
	o := &s.ops[op]
	i := 0
	for i < numBuckets && d > OpBuckets[i] {
		i++
	}
	o.buckets[i].Add(1)
	o.sum.Add(int64(d))
	o.samples.Add(1)
}

// OpStat is one operation's figures: Calls counts every request, the rest
// only the timed ones. Buckets[i] counts samples that took at most
// OpBuckets[i] (cumulative, as Prometheus histograms count);
// Samples - Buckets[len-1] took longer than the last bound.
type OpStat struct {
	Op      string
	Calls   uint64
	Samples uint64
	Sum     time.Duration
	Buckets []uint64
}

// Ops returns the figures of every operation requested at least once. The
// counters are read one by one while requests go on, so a bucket may
// include a sample that Samples does not yet: Samples is raised to the
// total of the buckets.
func (s *Stats) Ops() []OpStat {
	var out []OpStat
	for op := range numOps {
		o := &s.ops[op]
		calls := o.calls.Load()
		if calls == 0 {
			continue
		}
		st := OpStat{Op: opNames[op], Calls: calls, Sum: time.Duration(o.sum.Load()), Buckets: make([]uint64, numBuckets)}
		var cum uint64
		for i := range numBuckets {
			cum += o.buckets[i].Load()
			st.Buckets[i] = cum
		}
		cum += o.buckets[numBuckets].Load()
		st.Samples = max(o.samples.Load(), cum)
		out = append(out, st)
	}
	return out
}

// Filled returns the lower files whose content was handed to the kernel's
// page cache at their first open, and their bytes.
func (s *Stats) Filled() (files, bytes uint64) {
	return s.filled.Load(), s.filledBytes.Load()
}

// CopyUps returns the copy-ups of lower files (not directories) into the
// upper layer in progress, and how many have finished.
func (s *Stats) CopyUps() (inProgress int64, done uint64) {
	return s.copyUps.Load(), s.copyUpsDone.Load()
}

// copyUpStarted counts a copy-up until the function it returns is called.
func (s *Stats) copyUpStarted() func() {
	if s == nil {
		return func() {}
	}
	s.copyUps.Add(1)
	return func() {
		s.copyUps.Add(-1)
		s.copyUpsDone.Add(1)
	}
}

// noteChange records the time of the first change after a freeze.
func (s *Stats) noteChange() {
	if s == nil || s.firstChange.Load() != 0 {
		return
	}
	s.firstChange.CompareAndSwap(0, time.Now().UnixNano())
}

// noteFreeze is called by a freeze while no change can be made: the
// changes so far are the view's.
func (s *Stats) noteFreeze() {
	if s == nil {
		return
	}
	s.frozenFirst.Store(s.firstChange.Swap(0))
}

// FirstChange is when the oldest change made after the last freeze was
// made; zero if none was.
func (s *Stats) FirstChange() time.Time { return unixNano(s.firstChange.Load()) }

// FrozenFirstChange is when the oldest change in the last frozen view
// that was not in the view before it was made; zero if the view holds no
// change.
func (s *Stats) FrozenFirstChange() time.Time { return unixNano(s.frozenFirst.Load()) }

// TakeFrozenFirstChange is FrozenFirstChange, which it resets to zero:
// the caller (the one that froze the view) now accounts for those changes.
func (s *Stats) TakeFrozenFirstChange() time.Time { return unixNano(s.frozenFirst.Swap(0)) }

func unixNano(n int64) time.Time {
	if n == 0 {
		return time.Time{}
	}
	return time.Unix(0, n)
}

// timedFS counts and samples the requests of the file system it wraps:
// each method is the wrapped one with `defer t.s.end(t.s.begin(op))`, an
// open-coded defer that costs the request nothing more than the two calls
// (BenchmarkMountOpenClose).
type timedFS struct {
	fuse.RawFileSystem
	s *Stats
}

func (t *timedFS) Lookup(c <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	defer t.s.end(t.s.begin(opLookup))
	return t.RawFileSystem.Lookup(c, h, name, out)
}

func (t *timedFS) GetAttr(c <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	defer t.s.end(t.s.begin(opGetAttr))
	return t.RawFileSystem.GetAttr(c, in, out)
}

func (t *timedFS) SetAttr(c <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	defer t.s.end(t.s.begin(opSetAttr))
	return t.RawFileSystem.SetAttr(c, in, out)
}

func (t *timedFS) Access(c <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	defer t.s.end(t.s.begin(opAccess))
	return t.RawFileSystem.Access(c, in)
}

func (t *timedFS) Open(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	defer t.s.end(t.s.begin(opOpen))
	return t.RawFileSystem.Open(c, in, out)
}

func (t *timedFS) Create(c <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	defer t.s.end(t.s.begin(opCreate))
	return t.RawFileSystem.Create(c, in, name, out)
}

func (t *timedFS) Read(c <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	defer t.s.end(t.s.begin(opRead))
	return t.RawFileSystem.Read(c, in, buf)
}

func (t *timedFS) Write(c <-chan struct{}, in *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	defer t.s.end(t.s.begin(opWrite))
	return t.RawFileSystem.Write(c, in, data)
}

func (t *timedFS) Writev(c <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	defer t.s.end(t.s.begin(opWrite))
	return t.RawFileSystem.Writev(c, in, data)
}

func (t *timedFS) Flush(c <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	defer t.s.end(t.s.begin(opFlush))
	return t.RawFileSystem.Flush(c, in)
}

func (t *timedFS) Fsync(c <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	defer t.s.end(t.s.begin(opFsync))
	return t.RawFileSystem.Fsync(c, in)
}

func (t *timedFS) Release(c <-chan struct{}, in *fuse.ReleaseIn) {
	defer t.s.end(t.s.begin(opRelease))
	t.RawFileSystem.Release(c, in)
}

func (t *timedFS) Fallocate(c <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	defer t.s.end(t.s.begin(opFallocate))
	return t.RawFileSystem.Fallocate(c, in)
}

func (t *timedFS) Lseek(c <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	defer t.s.end(t.s.begin(opLseek))
	return t.RawFileSystem.Lseek(c, in, out)
}

func (t *timedFS) CopyFileRange(c <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	defer t.s.end(t.s.begin(opCopyFileRange))
	return t.RawFileSystem.CopyFileRange(c, in)
}

func (t *timedFS) Mkdir(c <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	defer t.s.end(t.s.begin(opMkdir))
	return t.RawFileSystem.Mkdir(c, in, name, out)
}

func (t *timedFS) Mknod(c <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	defer t.s.end(t.s.begin(opMknod))
	return t.RawFileSystem.Mknod(c, in, name, out)
}

func (t *timedFS) Unlink(c <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	defer t.s.end(t.s.begin(opUnlink))
	return t.RawFileSystem.Unlink(c, h, name)
}

func (t *timedFS) Rmdir(c <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	defer t.s.end(t.s.begin(opRmdir))
	return t.RawFileSystem.Rmdir(c, h, name)
}

func (t *timedFS) Rename(c <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	defer t.s.end(t.s.begin(opRename))
	return t.RawFileSystem.Rename(c, in, oldName, newName)
}

func (t *timedFS) Link(c <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	defer t.s.end(t.s.begin(opLink))
	return t.RawFileSystem.Link(c, in, name, out)
}

func (t *timedFS) Symlink(c <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	defer t.s.end(t.s.begin(opSymlink))
	return t.RawFileSystem.Symlink(c, h, target, name, out)
}

func (t *timedFS) Readlink(c <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	defer t.s.end(t.s.begin(opReadlink))
	return t.RawFileSystem.Readlink(c, h)
}

func (t *timedFS) OpenDir(c <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	defer t.s.end(t.s.begin(opOpenDir))
	return t.RawFileSystem.OpenDir(c, in, out)
}

func (t *timedFS) ReadDir(c <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	defer t.s.end(t.s.begin(opReadDir))
	return t.RawFileSystem.ReadDir(c, in, out)
}

func (t *timedFS) ReadDirPlus(c <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	defer t.s.end(t.s.begin(opReadDirPlus))
	return t.RawFileSystem.ReadDirPlus(c, in, out)
}

func (t *timedFS) ReleaseDir(in *fuse.ReleaseIn) {
	defer t.s.end(t.s.begin(opReleaseDir))
	t.RawFileSystem.ReleaseDir(in)
}

func (t *timedFS) FsyncDir(c <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	defer t.s.end(t.s.begin(opFsyncDir))
	return t.RawFileSystem.FsyncDir(c, in)
}

func (t *timedFS) StatFs(c <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	defer t.s.end(t.s.begin(opStatFs))
	return t.RawFileSystem.StatFs(c, h, out)
}

func (t *timedFS) Statx(c <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	defer t.s.end(t.s.begin(opStatx))
	return t.RawFileSystem.Statx(c, in, out)
}

func (t *timedFS) Ioctl(c <-chan struct{}, in *fuse.IoctlIn, inbuf []byte, out *fuse.IoctlOut, outbuf []byte) fuse.Status {
	defer t.s.end(t.s.begin(opIoctl))
	return t.RawFileSystem.Ioctl(c, in, inbuf, out, outbuf)
}
