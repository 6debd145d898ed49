package uploader

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Local is a Store in a local directory: key "a/b" is the file ROOT/a/b.
// It is the default store, so hermesfs works without a cloud account, and
// the directory stays readable with ordinary tools.
//
// Every put writes a temporary file next to its target, fsyncs it, renames
// it over the target and fsyncs the directory, so a crash leaves the old
// object or the new one. Conditional puts are serialised across processes
// by an flock on ROOT/.hermesfs-lock, held only for the check and the
// rename. A key cannot be both an object and a prefix of another key's
// directory ("a" and "a/b"), unlike in S3.
//
// ETags are the hex sha256 of the content, computed while writing and kept
// in the user.hermesfs.sha256 extended attribute. A file without it (copied
// in by hand, or on a file system without user xattrs) gets an ETag derived
// from its inode number, size and timestamps instead.
type Local struct {
	root string
}

var _ Store = (*Local)(nil)

const (
	etagXattr    = "user.hermesfs.sha256"
	lockName     = reservedPrefix + "lock"
	tempPattern  = reservedPrefix + "tmp-*"
	copyBufSize  = 1 << 20
	localDirPerm = 0o700
)

// NewLocal returns the store in directory root, creating it if needed.
func NewLocal(root string) (*Local, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("local store %s: %w", root, err)
	}
	if err := os.MkdirAll(abs, localDirPerm); err != nil {
		return nil, fmt.Errorf("local store: %w", err)
	}
	return &Local{root: abs}, nil
}

// Root is the store's directory.
func (l *Local) Root() string { return l.root }

func (l *Local) path(key string) string { return filepath.Join(l.root, filepath.FromSlash(key)) }

// Put implements Store.
func (l *Local) Put(ctx context.Context, key string, r io.Reader, size int64, opts PutOptions) (ObjectInfo, error) {
	if err := checkPutArgs(key, opts); err != nil {
		return ObjectInfo{}, fmt.Errorf("local: put %s: %w", key, err)
	}
	info, err := l.put(ctx, key, r, size, opts)
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("local: put %s: %w", key, err)
	}
	return info, nil
}

func (l *Local) put(ctx context.Context, key string, r io.Reader, size int64, opts PutOptions) (_ ObjectInfo, err error) {
	target := l.path(key)
	dir := filepath.Dir(target)
	if err := os.MkdirAll(dir, localDirPerm); err != nil {
		return ObjectInfo{}, err
	}
	tmp, err := os.CreateTemp(dir, tempPattern)
	if err != nil {
		return ObjectInfo{}, err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	h := sha256.New()
	n, err := io.CopyBuffer(io.MultiWriter(tmp, h), &ctxReader{ctx: ctx, r: r}, make([]byte, copyBufSize))
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("write: %w", err)
	}
	if size >= 0 && n != size {
		return ObjectInfo{}, Permanent(fmt.Errorf("read %d bytes, want %d", n, size))
	}
	etag := hex.EncodeToString(h.Sum(nil))
	if err := unix.Fsetxattr(int(tmp.Fd()), etagXattr, []byte(etag), 0); err != nil && !errors.Is(err, unix.ENOTSUP) {
		return ObjectInfo{}, fmt.Errorf("set etag: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		return ObjectInfo{}, err
	}
	st, err := tmp.Stat()
	if err != nil {
		return ObjectInfo{}, err
	}
	etag = fileETag(tmp.Name(), st) // the fallback if the xattr did not stick
	if err := tmp.Close(); err != nil {
		return ObjectInfo{}, err
	}
	if opts.IfNoneMatch || opts.IfMatch != "" {
		err = l.renameIf(tmp.Name(), target, opts)
	} else {
		err = os.Rename(tmp.Name(), target)
	}
	if err != nil {
		return ObjectInfo{}, err
	}
	if err := SyncDir(dir); err != nil {
		return ObjectInfo{}, err
	}
	return ObjectInfo{Key: key, Size: n, ETag: etag, ModTime: st.ModTime()}, nil
}

// renameIf renames tmp over target if the condition holds, under the
// store's lock so no other conditional put can slip in between.
func (l *Local) renameIf(tmp, target string, opts PutOptions) error {
	lock, err := os.OpenFile(filepath.Join(l.root, lockName), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return err
	}
	defer lock.Close() // releases the flock
	if err := flock(lock); err != nil {
		return fmt.Errorf("lock: %w", err)
	}
	st, err := os.Stat(target)
	exists := err == nil && st.Mode().IsRegular()
	if err != nil && !errors.Is(err, iofs.ErrNotExist) {
		return err
	}
	switch {
	case opts.IfNoneMatch && exists:
		return fmt.Errorf("%w: object exists", ErrPrecondition)
	case opts.IfMatch != "" && !exists:
		return fmt.Errorf("%w: no object to match ETag %s", ErrPrecondition, opts.IfMatch)
	case opts.IfMatch != "":
		if cur := fileETag(target, st); cur != opts.IfMatch {
			return fmt.Errorf("%w: ETag is %s, not %s", ErrPrecondition, cur, opts.IfMatch)
		}
	}
	return os.Rename(tmp, target)
}

func flock(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}

// fileETag is the ETag of the file at path, whose stat is st.
func fileETag(path string, st iofs.FileInfo) string {
	buf := make([]byte, 64)
	if n, err := unix.Getxattr(path, etagXattr, buf); err == nil && n == 64 {
		return string(buf[:n])
	}
	return metaETag(st)
}

func fdETag(f *os.File, st iofs.FileInfo) string {
	buf := make([]byte, 64)
	if n, err := unix.Fgetxattr(int(f.Fd()), etagXattr, buf); err == nil && n == 64 {
		return string(buf[:n])
	}
	return metaETag(st)
}

// metaETag stands in for a content hash when none was stored: a file
// replaced by rename almost always has a new inode number or mtime. (The
// ctime is left out because the rename itself changes it.)
func metaETag(st iofs.FileInfo) string {
	var ino uint64
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		ino = s.Ino
	}
	sum := sha256.Sum256(fmt.Appendf(nil, "%d/%d/%d", ino, st.Size(), st.ModTime().UnixNano()))
	return "m-" + hex.EncodeToString(sum[:16])
}

// Get implements Store.
func (l *Local) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, ObjectInfo, error) {
	if err := CheckGetArgs(key, off, length); err != nil {
		return nil, ObjectInfo{}, fmt.Errorf("local: get %s: %w", key, err)
	}
	f, err := os.Open(l.path(key))
	if err != nil {
		return nil, ObjectInfo{}, fmt.Errorf("local: get %s: %w", key, notExist(err))
	}
	st, err := f.Stat()
	if err == nil && !st.Mode().IsRegular() {
		err = iofs.ErrNotExist
	}
	if err == nil && off > st.Size() {
		err = Permanent(fmt.Errorf("offset %d past size %d: %w", off, st.Size(), ErrInvalidRange))
	}
	if err == nil {
		_, err = f.Seek(off, io.SeekStart)
	}
	if err != nil {
		f.Close()
		return nil, ObjectInfo{}, fmt.Errorf("local: get %s: %w", key, err)
	}
	info := ObjectInfo{Key: key, Size: st.Size(), ETag: fdETag(f, st), ModTime: st.ModTime(), StoreTime: l.storeTime()}
	n := st.Size() - off
	if length >= 0 && length < n {
		n = length
	}
	return &fileBody{Reader: io.LimitReader(f, n), f: f}, info, nil
}

// storeTime reads the clock that stamps the store's files: it sets the
// lock file's times to "now" as the file system sees it (on NFS, the
// server's clock, like the modification times of what it stores) and
// reads them back. Zero if the store has no lock file yet (nothing was
// ever written conditionally) or cannot be written.
func (l *Local) storeTime() time.Time {
	p := filepath.Join(l.root, lockName)
	now := []unix.Timespec{{Nsec: unix.UTIME_NOW}, {Nsec: unix.UTIME_NOW}}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, now, 0); err != nil {
		return time.Time{}
	}
	st, err := os.Stat(p)
	if err != nil {
		return time.Time{}
	}
	return st.ModTime()
}

type fileBody struct {
	io.Reader
	f *os.File
}

func (b *fileBody) Close() error { return b.f.Close() }

// notExist turns "a path component is a file" into a missing key.
func notExist(err error) error {
	if errors.Is(err, syscall.ENOTDIR) {
		return fmt.Errorf("%w (%v)", iofs.ErrNotExist, err)
	}
	return err
}

// Stat implements Store.
func (l *Local) Stat(ctx context.Context, key string) (ObjectInfo, error) {
	if err := ValidKey(key); err != nil {
		return ObjectInfo{}, fmt.Errorf("local: stat %s: %w", key, Permanent(err))
	}
	p := l.path(key)
	st, err := os.Stat(p)
	if err == nil && !st.Mode().IsRegular() {
		err = iofs.ErrNotExist
	}
	if err != nil {
		return ObjectInfo{}, fmt.Errorf("local: stat %s: %w", key, notExist(err))
	}
	return ObjectInfo{Key: key, Size: st.Size(), ETag: fileETag(p, st), ModTime: st.ModTime()}, nil
}

// List implements Store. It reads the whole matching tree before the first
// callback, which is fine for a catalog of tens of keys.
func (l *Local) List(ctx context.Context, prefix string, fn func(ObjectInfo) error) error {
	start := l.root
	if i := strings.LastIndexByte(prefix, '/'); i >= 0 {
		start = l.path(prefix[:i])
	}
	var keys []string
	err := filepath.WalkDir(start, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			if p == start && errors.Is(err, iofs.ErrNotExist) {
				return iofs.SkipAll
			}
			return err
		}
		if strings.HasPrefix(d.Name(), reservedPrefix) {
			if d.IsDir() {
				return iofs.SkipDir
			}
			return nil
		}
		if !d.Type().IsRegular() {
			return nil
		}
		rel, err := filepath.Rel(l.root, p)
		if err != nil {
			return err
		}
		if key := filepath.ToSlash(rel); strings.HasPrefix(key, prefix) && ValidKey(key) == nil {
			keys = append(keys, key)
		}
		return ctx.Err()
	})
	if err != nil {
		return fmt.Errorf("local: list %q: %w", prefix, err)
	}
	slices.Sort(keys)
	for _, key := range keys {
		info, err := l.Stat(ctx, key)
		if errors.Is(err, iofs.ErrNotExist) {
			continue // deleted since the walk
		}
		if err != nil {
			return err
		}
		if err := fn(info); err != nil {
			return err
		}
	}
	return nil
}

// Delete implements Store.
func (l *Local) Delete(ctx context.Context, key string) error {
	if err := ValidKey(key); err != nil {
		return fmt.Errorf("local: delete %s: %w", key, Permanent(err))
	}
	p := l.path(key)
	if err := os.Remove(p); err != nil {
		if errors.Is(notExist(err), iofs.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("local: delete %s: %w", key, err)
	}
	if err := SyncDir(filepath.Dir(p)); err != nil {
		return fmt.Errorf("local: delete %s: %w", key, err)
	}
	return nil
}

// ContextReader returns r, failing with ctx's error once ctx ends: a long
// copy from it stops then.
func ContextReader(ctx context.Context, r io.Reader) io.Reader { return &ctxReader{ctx: ctx, r: r} }

// ctxReader stops a long copy when its context ends.
type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c *ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// DefaultLocalDir is where the default store lives: $XDG_DATA_HOME/hermesfs/store
// if XDG_DATA_HOME is set, /var/lib/hermesfs/store for root, else
// ~/.local/share/hermesfs/store.
func DefaultLocalDir(getenv func(string) string, uid int) (string, error) {
	if x := getenv("XDG_DATA_HOME"); x != "" && filepath.IsAbs(x) {
		return filepath.Join(x, "hermesfs", "store"), nil
	}
	if uid == 0 {
		return "/var/lib/hermesfs/store", nil
	}
	home := getenv("HOME")
	if home == "" {
		return "", errors.New("default store: neither XDG_DATA_HOME nor HOME is set; pass --store")
	}
	return filepath.Join(home, ".local", "share", "hermesfs", "store"), nil
}
