package fs

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Names in the upper layer that start with reservedPrefix belong to the
// overlay; users cannot create them and they never appear in the merged view.
const (
	reservedPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"  // in a directory: it merges no lower directory
	redirectMarker = ".wh..wh..dir"  // in a directory: it merges the lower directory named in its content
	hashedPrefix   = ".wh..wh..h"    // whiteout of a name too long for ".wh."+name; content is the name
	tmpPrefix      = ".wh..wh..tmp." // a temporary in the work directory
	workDirName    = ".wh..wh..work" // in the upper root: temporaries, staging, view sidecars
	inoMapName     = ".wh..wh..ino"  // in the upper root: the inode map (inomap.go)

	nameMax = 255
)

func isReserved(name string) bool { return strings.HasPrefix(name, reservedPrefix) }

// whiteoutName is the marker that hides lower entry name. Names too long for
// the prefix get a hashed marker holding the name.
func whiteoutName(name string) (marker string, hashed bool) {
	if len(reservedPrefix)+len(name) <= nameMax {
		return reservedPrefix + name, false
	}
	sum := sha256.Sum256([]byte(name))
	return hashedPrefix + hex.EncodeToString(sum[:]), true
}

// upper is the upper layer directory. Every access goes through directory
// file descriptors and *at() calls resolved beneath the root without
// following symlinks, so a path of any length works and no name in the
// upper layer can lead outside it.
type upper struct {
	root       int // O_PATH descriptor of the upper root
	work       int // O_PATH descriptor of the work directory
	path       string
	realRoot   string // the upper root's absolute path as /proc shows it
	umask      uint32 // the process umask, undone for modes the kernel already masked
	privileged bool   // euid 0: new files are given to the calling user
	// dinoStat is set where getdents' inode numbers differ from stat's
	// (some stacked file systems): views stat entries to know them.
	dinoStat bool
	seq      atomic.Uint64
}

// maxRel bounds the relative path handed to one openat2 call; longer paths
// are resolved in steps.
const maxRel = 3000

// dir opens the upper directory at rel ("" is the root) as an O_PATH
// descriptor; release it with put.
func (u *upper) dir(rel string) (int, error) {
	return u.openDir(rel, unix.O_PATH)
}

// dirRead opens the upper directory at rel for reading (getdents, fsync);
// release it with put.
func (u *upper) dirRead(rel string) (int, error) {
	return u.openDir(rel, unix.O_RDONLY)
}

func (u *upper) openDir(rel string, mode int) (int, error) {
	if rel == "" {
		if mode == unix.O_PATH {
			return u.root, nil
		}
		rel = "."
	}
	at := u.root
	for len(rel) > maxRel {
		cut := strings.LastIndexByte(rel[:maxRel], '/')
		if cut <= 0 {
			return -1, syscall.ENAMETOOLONG
		}
		fd, err := openBeneath(at, rel[:cut], unix.O_PATH)
		u.put(at)
		if err != nil {
			return -1, err
		}
		at, rel = fd, rel[cut+1:]
	}
	fd, err := openBeneath(at, rel, mode)
	u.put(at)
	return fd, err
}

func openBeneath(at int, rel string, mode int) (int, error) {
	how := unix.OpenHow{
		Flags:   uint64(mode | unix.O_DIRECTORY | unix.O_CLOEXEC),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	}
	for {
		fd, err := unix.Openat2(at, rel, &how)
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		return fd, err
	}
}

// relOf returns the path, relative to the upper root, of the directory
// open at fd, as the kernel knows it now (which a concurrent rename of an
// ancestor cannot make stale, unlike a path kept from before).
func (u *upper) relOf(fd int) (string, bool) {
	if fd == u.root {
		return "", true
	}
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil || u.realRoot == "" {
		return "", false
	}
	if p == u.realRoot {
		return "", true
	}
	rel, ok := strings.CutPrefix(p, u.realRoot+"/")
	if !ok || strings.HasSuffix(rel, " (deleted)") {
		return "", false
	}
	return rel, true
}

// checkDino compares getdents' inode number of an entry of the upper root
// with stat's and sets dinoStat if they differ.
func (u *upper) checkDino() error {
	fd, err := u.dirRead("")
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ents, err := readDirents(fd)
	if err != nil || len(ents) == 0 {
		return err
	}
	st, err := statxAt(fd, ents[0].name)
	if err != nil {
		return err
	}
	u.dinoStat = st.ino != ents[0].ino
	return nil
}

// put releases a descriptor from dir or dirRead.
func (u *upper) put(fd int) {
	if fd >= 0 && fd != u.root {
		unix.Close(fd)
	}
}

// tmpName is a fresh name for a temporary in the work directory.
func (u *upper) tmpName() string {
	return tmpPrefix + strconv.FormatUint(u.seq.Add(1), 36) + "." + strconv.FormatInt(time.Now().UnixNano()%1e9, 36)
}

// fsyncDir makes the entries of the directory dirfd (O_PATH or not) durable.
func fsyncDir(dirfd int) error {
	fd, err := unix.Openat(dirfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Fsync(fd)
}

// exists reports whether name exists in dirfd (without following it).
func exists(dirfd int, name string) (bool, error) {
	var st unix.Stat_t
	err := unix.Fstatat(dirfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case err == nil:
		return true, nil
	case err == unix.ENOENT || err == unix.ENOTDIR:
		return false, nil
	default:
		return false, err
	}
}

// whitedOut reports whether dirfd holds a whiteout for name.
func whitedOut(dirfd int, name string) (bool, error) {
	marker, hashed := whiteoutName(name)
	ok, err := exists(dirfd, marker)
	if !ok || err != nil || !hashed {
		return ok, err
	}
	got, err := readSmall(dirfd, marker)
	if err != nil {
		return false, err
	}
	return got == name, nil
}

// addWhiteout makes name's whiteout exist in dirfd, durably.
func (u *upper) addWhiteout(dirfd int, name string) error {
	marker, hashed := whiteoutName(name)
	if ok, err := exists(dirfd, marker); err != nil {
		return err
	} else if ok {
		return nil
	}
	if hashed {
		return u.writeMarker(dirfd, marker, []byte(name))
	}
	fd, err := unix.Openat(dirfd, marker, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil && err != unix.EEXIST {
		return err
	}
	if err == nil {
		unix.Close(fd)
	}
	return fsyncDir(dirfd)
}

// writeMarker atomically creates (or replaces) marker in dirfd with content,
// durably: written in the work directory, synced, renamed into place.
func (u *upper) writeMarker(dirfd int, marker string, content []byte) error {
	tmp := u.tmpName()
	fd, err := unix.Openat(u.work, tmp, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return err
	}
	_, err = unix.Write(fd, content)
	if err == nil {
		err = unix.Fsync(fd)
	}
	unix.Close(fd)
	if err == nil {
		err = unix.Renameat(u.work, tmp, dirfd, marker)
	}
	if err != nil {
		unix.Unlinkat(u.work, tmp, 0)
		return err
	}
	return fsyncDir(dirfd)
}

// readSmall reads a marker's content.
func readSmall(dirfd int, name string) (string, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	buf := make([]byte, 8192)
	n, err := unix.Pread(fd, buf, 0)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// dirMarkers are the overlay's markers inside one upper directory.
type dirMarkers struct {
	opaque   bool
	redirect string // lower path ("" root) merged instead of the same path, when hasRedirect
	hasRedir bool
}

func readDirMarkers(dirfd int) (dirMarkers, error) {
	var m dirMarkers
	var err error
	if m.opaque, err = exists(dirfd, opaqueMarker); err != nil {
		return m, err
	}
	ok, err := exists(dirfd, redirectMarker)
	if err != nil || !ok {
		return m, err
	}
	m.redirect, err = readSmall(dirfd, redirectMarker)
	m.hasRedir = err == nil
	return m, err
}

// ustat is what the overlay needs of an upper inode's status.
type ustat struct {
	mode    uint32
	nlink   uint32
	uid     uint32
	gid     uint32
	ino     uint64
	size    int64
	blocks  int64
	blksize uint32
	rdev    uint64
	btime   uint64 // ns since the epoch; 0 if the file system has none
	atime   unix.Timespec
	mtime   unix.Timespec
	ctime   unix.Timespec
}

func statxAt(dirfd int, name string) (ustat, error) {
	var x unix.Statx_t
	flags := unix.AT_SYMLINK_NOFOLLOW | unix.AT_STATX_SYNC_AS_STAT
	if name == "" {
		flags |= unix.AT_EMPTY_PATH
	}
	for {
		err := unix.Statx(dirfd, name, flags, unix.STATX_BASIC_STATS|unix.STATX_BTIME, &x)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return ustat{}, err
		}
		break
	}
	st := ustat{
		mode:    uint32(x.Mode),
		nlink:   x.Nlink,
		uid:     x.Uid,
		gid:     x.Gid,
		ino:     x.Ino,
		size:    int64(x.Size),
		blocks:  int64(x.Blocks),
		blksize: x.Blksize,
		rdev:    unix.Mkdev(x.Rdev_major, x.Rdev_minor),
		atime:   unix.Timespec{Sec: x.Atime.Sec, Nsec: int64(x.Atime.Nsec)},
		mtime:   unix.Timespec{Sec: x.Mtime.Sec, Nsec: int64(x.Mtime.Nsec)},
		ctime:   unix.Timespec{Sec: x.Ctime.Sec, Nsec: int64(x.Ctime.Nsec)},
	}
	if x.Mask&unix.STATX_BTIME != 0 {
		st.btime = uint64(x.Btime.Sec)*1e9 + uint64(x.Btime.Nsec)
	}
	return st, nil
}

// statFd is statxAt for an open descriptor.
func statFd(fd int) (ustat, error) { return statxAt(fd, "") }

// fixMode gives a just-created entry exactly mode: the kernel already applied
// the caller's umask, and the daemon's own umask must not apply twice.
func (u *upper) fixMode(dirfd int, name string, mode uint32, fd int) error {
	if mode&u.umask == 0 {
		return nil
	}
	if fd >= 0 {
		return unix.Fchmod(fd, mode&07777)
	}
	return unix.Fchmodat(dirfd, name, mode&07777, 0)
}

// processUmask reads the umask without changing it (Linux >= 4.7).
func processUmask() uint32 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0o022
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Umask:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32)
			if err == nil {
				return uint32(m)
			}
		}
	}
	return 0o022
}

// splitRel splits a relative path into its directory and last name.
func splitRel(rel string) (dir, name string) {
	i := strings.LastIndexByte(rel, '/')
	if i < 0 {
		return "", rel
	}
	return rel[:i], rel[i+1:]
}

func joinRel(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// removeAllAt removes name (a tree) from dirfd. It is used on overlay
// temporaries only.
func removeAllAt(dirfd int, name string) error {
	err := unix.Unlinkat(dirfd, name, 0)
	if err == nil || err == unix.ENOENT {
		return nil
	}
	if err != unix.EISDIR && err != unix.EPERM {
		return err
	}
	sub, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	names, err := readNames(sub)
	if err == nil {
		for _, n := range names {
			if err = removeAllAt(sub, n); err != nil {
				break
			}
		}
	}
	unix.Close(sub)
	if err != nil {
		return err
	}
	return unix.Unlinkat(dirfd, name, unix.AT_REMOVEDIR)
}

// dirent is a raw directory entry.
type dirent struct {
	name string
	ino  uint64
	typ  uint8 // DT_*
}

// readDirents lists the directory open for reading at fd from the start,
// without "." and "..". Names share one string per getdents call (one
// allocation per call, not per entry): a name kept keeps at most its
// directory's own dirent bytes alive, as a listing kept whole does anyway.
func readDirents(fd int) ([]dirent, error) {
	if _, err := unix.Seek(fd, 0, 0); err != nil {
		return nil, err
	}
	var out []dirent
	buf := make([]byte, 32<<10)
	for {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return out, nil
		}
		chunk := string(buf[:n])
		if out == nil {
			out = make([]dirent, 0, n/24)
		}
		for b := 0; b < n; {
			reclen := int(chunk[b+16]) | int(chunk[b+17])<<8
			if reclen < 19 || b+reclen > n {
				return nil, fmt.Errorf("fs: bad dirent length %d", reclen)
			}
			var ino uint64
			for i := 7; i >= 0; i-- {
				ino = ino<<8 | uint64(chunk[b+i])
			}
			typ := chunk[b+18]
			name := chunk[b+19 : b+reclen]
			if i := strings.IndexByte(name, 0); i >= 0 {
				name = name[:i]
			}
			if name != "." && name != ".." {
				out = append(out, dirent{name: name, ino: ino, typ: typ})
			}
			b += reclen
		}
	}
}

func readNames(fd int) ([]string, error) {
	ents, err := readDirents(fd)
	names := make([]string, len(ents))
	for i, e := range ents {
		names[i] = e.name
	}
	return names, err
}

// errnoOf converts an error from a syscall or the lower layer into the errno
// a FUSE reply carries.
func errnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		return e
	}
	if errors.Is(err, os.ErrNotExist) {
		return syscall.ENOENT
	}
	if errors.Is(err, os.ErrPermission) {
		return syscall.EACCES
	}
	if errors.Is(err, os.ErrExist) {
		return syscall.EEXIST
	}
	return syscall.EIO
}

// cleanRel validates a View path and makes it relative ("" for the root).
func cleanRel(name string) (string, bool) {
	if name == "." {
		return "", true
	}
	if !validPath(name) {
		return "", false
	}
	return name, true
}

func validPath(name string) bool {
	if name == "" || strings.HasPrefix(name, "/") || path.Clean(name) != name {
		return false
	}
	for _, el := range strings.Split(name, "/") {
		if el == ".." || el == "." || el == "" {
			return false
		}
	}
	return true
}

// futimens sets the times of an open file (utimensat with a NULL path).
func futimens(fd int, ts []unix.Timespec) error {
	_, _, e := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}
