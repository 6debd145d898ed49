package archive

import (
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"path"
	"runtime"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
)

// UnpackOptions configures Unpack.
type UnpackOptions struct {
	Logger *slog.Logger
	// NoOwners skips restoring owners even when running as root (as
	// non-root, owners are never restored).
	NoOwners bool
	// Progress, if set, is called after each regular file with the bytes
	// of file content written so far and the total to write. Calls are
	// serialized but may come from different goroutines.
	Progress func(done, total int64)
	// Workers is the number of goroutines decompressing and writing file
	// content. Default runtime.GOMAXPROCS(0).
	Workers int
	// Dir, if set, is the directory inode whose subtree is extracted
	// instead of the whole archive (dir then takes its attributes).
	// Progress still counts the whole archive's content as the total.
	Dir Inode
}

// Unpack extracts the whole archive into dir, which must not exist or be
// an empty directory. It restores file content (holes stay holes), modes
// including setuid/setgid/sticky, mtimes (to the nanosecond when the
// archive carries them), symlinks, hard links, fifos and sockets, and, when
// running as root, owners and device nodes (device nodes are skipped with a
// warning otherwise).
//
// One goroutine walks the tree and creates every entry; Workers goroutines
// fill in file content, a few blocks at a time, checking every block before
// it is written. Files with the same content (deduplicated in the archive)
// are decompressed once and copied in the kernel. Memory stays bounded (a
// block buffer per worker, the reader's cache, a bounded queue). Every entry
// is created relative to an open descriptor of its parent directory, with
// O_NOFOLLOW and O_EXCL, so nothing is written outside dir whatever the
// archive holds. On error the partial tree is left in place for inspection.
func Unpack(ctx context.Context, r *Reader, dir string, opts UnpackOptions) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	u := &unpacker{r: r, ctx: ctx, cancel: cancel, opts: opts, root: dir,
		links: map[Inode]string{}, same: map[layoutKey]*fileJob{}, open: map[*fileJob]bool{}}
	u.log = opts.Logger
	if u.log == nil {
		u.log = slog.New(slog.DiscardHandler)
	}
	u.isRoot = os.Geteuid() == 0
	u.owners = u.isRoot && !opts.NoOwners
	if err := u.run(); err != nil {
		return fmt.Errorf("archive: unpack %s into %s: %w", r.name, dir, err)
	}
	return nil
}

type unpacker struct {
	r      *Reader
	ctx    context.Context
	cancel context.CancelFunc
	opts   UnpackOptions
	log    *slog.Logger
	root   string
	rootFd int
	isRoot bool
	owners bool
	skips  int

	// Walker state.
	links map[Inode]string       // first path (relative to root) of multiply linked inodes
	same  map[layoutKey]*fileJob // first file of each content
	tasks chan task

	mu    sync.Mutex
	err   error
	open  map[*fileJob]bool
	done  int64
	total int64
}

// layoutKey identifies content by where it lives in the archive.
type layoutKey struct {
	size    int64
	first   uint64
	nblocks int
	frag    int
	fragOff uint32
}

// fileJob is a regular file being filled in.
type fileJob struct {
	f       *os.File
	l       *fileLayout
	a       Attr
	rel     string
	pending int        // chunks outstanding, plus one held by the walker (u.mu)
	src     *fileJob   // same content as src: copy it rather than decompress
	deps    []*fileJob // files waiting for this one's content (u.mu)
	done    bool       // content and metadata complete (u.mu)
}

// task is a range of blocks of a file to fill in, or a copy of a whole
// file from another.
type task struct {
	job         *fileJob
	first, last int  // block range [first, last)
	frag        bool // the fragment tail
	copy        bool
}

const unpackChunk = 16 // blocks per task

func (u *unpacker) fail(err error) {
	u.mu.Lock()
	if u.err == nil {
		u.err = err
	}
	u.mu.Unlock()
	u.cancel()
}

func (u *unpacker) run() error {
	if err := os.Mkdir(u.root, 0o700); err != nil {
		if !errors.Is(err, iofs.ErrExist) {
			return err
		}
		ents, err := os.ReadDir(u.root)
		if err != nil {
			return err
		}
		if len(ents) > 0 {
			return fmt.Errorf("%s is not empty", u.root)
		}
	}
	fd, err := unix.Open(u.root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return &os.PathError{Op: "open", Path: u.root, Err: err}
	}
	defer unix.Close(fd)
	u.rootFd = fd
	if u.opts.Progress != nil {
		u.total = u.r.contentBytes()
	}
	workers := u.opts.Workers
	if workers <= 0 {
		workers = runtime.GOMAXPROCS(0)
	}
	u.tasks = make(chan task, 4*workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Go(u.worker)
	}

	start := u.r.Root()
	if u.opts.Dir != 0 {
		start = u.opts.Dir
	}
	root, err := u.r.Stat(start)
	if err == nil && !root.Mode.IsDir() {
		err = fmt.Errorf("inode %d is not a directory", start)
	}
	if err == nil {
		err = u.dir(fd, root, ".")
	}
	if err == nil {
		// The root's own metadata, like every directory's, goes last.
		err = u.setMetaAt(unix.AT_FDCWD, u.root, root, false)
	}
	if err != nil {
		u.fail(err)
	}
	close(u.tasks)
	wg.Wait()
	u.mu.Lock()
	defer u.mu.Unlock()
	for j := range u.open {
		j.f.Close()
	}
	if u.err != nil {
		return u.err
	}
	if err := u.ctx.Err(); err != nil {
		// Workers skip what is left once cancelled: the tree is not whole.
		return err
	}
	if u.skips > 0 {
		u.log.Warn("device nodes skipped: not running as root", "count", u.skips)
	}
	return nil
}

// contentBytes sums the sizes of the archive's regular files (each inode
// once). It walks the whole tree; damage counts as nothing more.
func (r *Reader) contentBytes() int64 {
	var total int64
	inos, _ := r.fileInodes()
	for _, ino := range inos {
		if a, err := r.Stat(ino); err == nil {
			total += a.Size
		}
	}
	return total
}

// dir creates the entries of directory a inside the open directory fd.
func (u *unpacker) dir(fd int, a Attr, rel string) error {
	ents, err := u.r.dirEntries(a.Ino)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := u.ctx.Err(); err != nil {
			return err
		}
		crel := path.Join(rel, e.Name)
		ca, err := u.r.Stat(e.Ino)
		if err != nil {
			return err
		}
		if err := u.entry(fd, e.Name, crel, ca); err != nil {
			return fmt.Errorf("%s: %w", crel, err)
		}
	}
	return nil
}

func (u *unpacker) entry(fd int, name, rel string, a Attr) error {
	if !a.Mode.IsDir() && a.Nlink > 1 {
		if first, ok := u.links[a.Ino]; ok {
			return unix.Linkat(u.rootFd, first, fd, name, 0)
		}
		u.links[a.Ino] = rel
	}
	perm := uint32(a.Mode.Perm())
	switch a.Mode.Type() {
	case iofs.ModeDir:
		if err := unix.Mkdirat(fd, name, 0o700); err != nil {
			return err
		}
		cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		err = u.dir(cfd, a, rel)
		unix.Close(cfd)
		if err != nil {
			return err
		}
	case 0:
		return u.file(fd, name, rel, a)
	case iofs.ModeSymlink:
		t, err := u.r.Readlink(a.Ino)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(t, fd, name); err != nil {
			return err
		}
		return u.setMetaAt(fd, name, a, true)
	case iofs.ModeNamedPipe:
		if err := unix.Mknodat(fd, name, unix.S_IFIFO|perm, 0); err != nil {
			return err
		}
	case iofs.ModeSocket:
		if err := unix.Mknodat(fd, name, unix.S_IFSOCK|perm, 0); err != nil {
			return err
		}
	case iofs.ModeDevice, iofs.ModeDevice | iofs.ModeCharDevice:
		if !u.isRoot {
			u.skips++
			delete(u.links, a.Ino)
			return nil
		}
		typ := uint32(unix.S_IFBLK)
		if a.Mode&iofs.ModeCharDevice != 0 {
			typ = unix.S_IFCHR
		}
		if err := unix.Mknodat(fd, name, typ|perm, int(a.Rdev)); err != nil {
			return err
		}
	default:
		return fmt.Errorf("unsupported type %v", a.Mode.Type())
	}
	return u.setMetaAt(fd, name, a, false)
}

// file creates a regular file and queues the work that fills it in.
func (u *unpacker) file(dirfd int, name, rel string, a Attr) error {
	l, err := u.r.layout(a.Ino)
	if err != nil {
		return err
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	j := &fileJob{f: os.NewFile(uintptr(fd), rel), l: l, a: a, rel: rel, pending: 1}
	u.mu.Lock()
	u.open[j] = true
	u.mu.Unlock()

	key := layoutKey{size: l.size, nblocks: len(l.offs), frag: l.frag, fragOff: l.fragOff}
	if len(l.offs) > 0 {
		key.first = l.offs[0]
	}
	if prior := u.same[key]; prior != nil && l.size > 0 {
		j.src = prior
		u.mu.Lock()
		if !prior.done {
			prior.deps = append(prior.deps, j)
			u.mu.Unlock()
			return nil
		}
		u.mu.Unlock()
		return u.queue(task{job: j, copy: true})
	}
	u.same[key] = j

	for first := 0; first < len(l.words); first += unpackChunk {
		last := min(first+unpackChunk, len(l.words))
		if err := u.queue(task{job: j, first: first, last: last}); err != nil {
			return err
		}
	}
	if l.frag >= 0 {
		if err := u.queue(task{job: j, frag: true}); err != nil {
			return err
		}
	}
	return u.release(j)
}

func (u *unpacker) queue(t task) error {
	if !t.copy {
		u.mu.Lock()
		t.job.pending++
		u.mu.Unlock()
	}
	select {
	case u.tasks <- t:
		return nil
	case <-u.ctx.Done():
		return u.ctx.Err()
	}
}

// release drops one hold on j; the last one finishes the file.
func (u *unpacker) release(j *fileJob) error {
	u.mu.Lock()
	j.pending--
	last := j.pending == 0
	u.mu.Unlock()
	if !last {
		return nil
	}
	return u.finish(j)
}

// finish completes a file whose content is in place: size (trailing
// holes), owner, mode, mtime; then files waiting to copy it.
func (u *unpacker) finish(j *fileJob) error {
	err := j.f.Truncate(j.l.size)
	if err == nil {
		err = u.setMetaFd(int(j.f.Fd()), j.a)
	}
	if cerr := j.f.Close(); err == nil {
		err = cerr
	}
	u.mu.Lock()
	delete(u.open, j)
	j.done = true
	deps := j.deps
	j.deps = nil
	u.done += j.l.size
	if u.opts.Progress != nil {
		u.opts.Progress(u.done, u.total)
	}
	u.mu.Unlock()
	if err != nil {
		return fmt.Errorf("%s: %w", j.rel, err)
	}
	for _, d := range deps {
		if err := u.copyFile(d); err != nil {
			return err
		}
	}
	return nil
}

func (u *unpacker) worker() {
	var raw, buf []byte
	for t := range u.tasks {
		if u.ctx.Err() != nil {
			continue
		}
		var err error
		switch {
		case t.copy:
			err = u.copyFile(t.job)
		default:
			raw, buf, err = u.fill(t, raw, buf)
			if err == nil {
				err = u.release(t.job)
			}
		}
		if err != nil {
			u.fail(err)
		}
	}
}

// fill decompresses and writes the blocks of t, skipping holes.
func (u *unpacker) fill(t task, raw, buf []byte) ([]byte, []byte, error) {
	j, l, r := t.job, t.job.l, u.r
	bs := int64(r.bs)
	if t.frag {
		off := int64(len(l.words)) * bs
		n := l.size - off
		b, err := r.fragment(l.frag, int(l.fragOff)+int(n))
		if err != nil {
			return raw, buf, err
		}
		_, err = j.f.WriteAt(b[l.fragOff:int64(l.fragOff)+n], off)
		return raw, buf, err
	}
	for i := t.first; i < t.last; i++ {
		w := l.words[i]
		if w == 0 {
			continue
		}
		off := int64(i) * bs
		want := int(min(bs, l.size-off))
		var b []byte
		var err error
		raw, b, err = r.loadBlockInto(raw, buf, l.offs[i], w, kindData)
		if err != nil {
			return raw, buf, err
		}
		if w&dataUncompBit == 0 {
			buf = b
		}
		if len(b) != want {
			return raw, buf, r.corruptf(l.offs[i], kindData.String(), "decompressed to %d bytes, want %d", len(b), want)
		}
		if _, err := j.f.WriteAt(b, off); err != nil {
			return raw, buf, fmt.Errorf("%s: %w", j.rel, err)
		}
	}
	return raw, buf, nil
}

// copyFile fills j with the content of the file it duplicates, copying
// only the ranges that are not holes; it falls back to decompressing when
// the first copy cannot be read back.
func (u *unpacker) copyFile(j *fileJob) error {
	src, err := unix.Openat(u.rootFd, j.src.rel, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return u.decompressAll(j)
	}
	defer unix.Close(src)
	l, bs := j.l, int64(u.r.bs)
	dst := int(j.f.Fd())
	copyRange := func(from, to int64) error {
		for from < to {
			roff, woff := from, from
			n, err := unix.CopyFileRange(src, &roff, dst, &woff, int(to-from), 0)
			if err != nil {
				return fmt.Errorf("%s: copy from %s: %w", j.rel, j.src.rel, err)
			}
			if n == 0 {
				return fmt.Errorf("%s: copy from %s: source ended early", j.rel, j.src.rel)
			}
			from += int64(n)
		}
		return nil
	}
	var start int64 = -1
	for i, w := range l.words {
		off := int64(i) * bs
		if w == 0 {
			if start >= 0 {
				if err := copyRange(start, off); err != nil {
					return err
				}
				start = -1
			}
		} else if start < 0 {
			start = off
		}
	}
	if start < 0 && l.frag >= 0 {
		start = int64(len(l.words)) * bs
	}
	if start >= 0 {
		if err := copyRange(start, l.size); err != nil {
			return err
		}
	}
	return u.finish(j)
}

// decompressAll fills j from the archive in the calling goroutine.
func (u *unpacker) decompressAll(j *fileJob) error {
	var raw, buf []byte
	var err error
	raw, buf, err = u.fill(task{job: j, first: 0, last: len(j.l.words)}, raw, buf)
	if err == nil && j.l.frag >= 0 {
		_, _, err = u.fill(task{job: j, frag: true}, raw, buf)
	}
	if err != nil {
		return err
	}
	return u.finish(j)
}

// loadBlockInto is loadBlock without the cache: raw and dst are reused
// buffers. It returns the (possibly grown) raw buffer and the block's
// bytes, which alias raw for blocks stored uncompressed.
func (r *Reader) loadBlockInto(raw, dst []byte, off uint64, w uint32, kind extentKind) ([]byte, []byte, error) {
	n := uint64(w &^ dataUncompBit)
	if n == 0 || n > uint64(r.bs) {
		return raw, nil, r.corruptf(off, kind.String(), "size word %#x", w)
	}
	if off > r.sb.BytesUsed || n > r.sb.BytesUsed-off {
		return raw, nil, r.corruptf(off, kind.String(), "%d bytes beyond the image", n)
	}
	if cap(raw) < int(n) {
		raw = make([]byte, r.bs)
	}
	raw = raw[:n]
	if m, err := r.ra.ReadAt(raw, int64(off)); m != len(raw) {
		if err == nil || errors.Is(err, io.EOF) {
			return raw, nil, r.corruptf(off, kind.String(), "short read: %d of %d bytes", m, n)
		}
		return raw, nil, fmt.Errorf("archive %s: read %s at offset %d: %w", r.name, kind, off, err)
	}
	if err := r.check(off, raw, kind.String()); err != nil {
		return raw, nil, err
	}
	if w&dataUncompBit == 0 && cap(dst) < r.bs {
		dst = make([]byte, 0, r.bs)
	}
	out, err := r.blockContent(dst[:0], raw, w)
	if err != nil {
		return raw, nil, r.corruptf(off, kind.String(), "decompress: %v", err)
	}
	return raw, out, nil
}

func timespecs(a Attr) *[2]unix.Timespec {
	ts := unix.NsecToTimespec(a.Mtime.UnixNano())
	return &[2]unix.Timespec{ts, ts}
}

// setMetaFd restores owner, mode and mtime of an open file: chown first
// (it clears setuid/setgid), the mtime last.
func (u *unpacker) setMetaFd(fd int, a Attr) error {
	if u.owners {
		if err := unix.Fchown(fd, int(a.Uid), int(a.Gid)); err != nil {
			return err
		}
	}
	if err := unix.Fchmod(fd, uint32(squashMode(a.Mode))); err != nil {
		return err
	}
	// utimensat(fd, NULL, ...) is futimens: no path, nanoseconds.
	_, _, e := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(timespecs(a))), 0, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

// setMetaAt restores owner, mode and mtime of name in directory fd, after
// its content: chown first (it clears setuid/setgid), the mtime last.
func (u *unpacker) setMetaAt(fd int, name string, a Attr, symlink bool) error {
	if u.owners {
		if err := unix.Fchownat(fd, name, int(a.Uid), int(a.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return err
		}
	}
	if !symlink {
		if err := unix.Fchmodat(fd, name, uint32(squashMode(a.Mode)), 0); err != nil {
			return err
		}
	}
	return unix.UtimesNanoAt(fd, name, timespecs(a)[:], unix.AT_SYMLINK_NOFOLLOW)
}
