package archive

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// needTool returns the path of an external tool, skipping the test when it
// is missing (failing it under HERMESFS_TEST_STRICT=1).
func needTool(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") == "1" {
			t.Fatalf("%s not installed (run scripts/deps.sh)", name)
		}
		t.Skipf("%s not installed", name)
	}
	return p
}

func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, out)
	}
	return string(out)
}

func writeFile(t testing.TB, p string, data []byte, mode os.FileMode) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, data, mode); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(p, mode); err != nil {
		t.Fatal(err)
	}
}

// text returns n bytes of compressible, deterministic text.
func text(n int, seed int) []byte {
	var b bytes.Buffer
	words := []string{"session", "memory", "agent", "tool_call", "result", "{\"role\":", "\"assistant\"", "user", "hermes", "snapshot", "\n"}
	for i := 0; b.Len() < n; i++ {
		b.WriteString(words[(i*7+seed+i/13)%len(words)])
		fmt.Fprintf(&b, " %d ", (i*seed)%997)
	}
	return b.Bytes()[:n]
}

// noise returns n deterministic bytes that do not compress.
func noise(n int, seed byte) []byte {
	b := make([]byte, n)
	h := sha256.Sum256([]byte{seed})
	for i := 0; i < n; i += 32 {
		copy(b[i:], h[:])
		h = sha256.Sum256(h[:])
	}
	return b
}

// makeTree builds a tree with every kind of entry a Hermes home (or any
// home) may hold and returns its path.
func makeTree(t testing.TB) string {
	t.Helper()
	root := filepath.Join(t.TempDir(), "tree")
	bs := 128 << 10
	writeFile(t, filepath.Join(root, "config.yaml"), []byte("memory:\n  memory_char_limit: 2200\n"), 0o644)
	writeFile(t, filepath.Join(root, ".env"), []byte("OPENAI_API_KEY=sk-test\n"), 0o600)
	writeFile(t, filepath.Join(root, "empty"), nil, 0o644)
	writeFile(t, filepath.Join(root, "sessions", "small.json"), text(1000, 1), 0o644)
	writeFile(t, filepath.Join(root, "sessions", "exact-block.json"), text(bs, 2), 0o644)
	writeFile(t, filepath.Join(root, "sessions", "big.json"), text(3*bs+777, 3), 0o644)
	writeFile(t, filepath.Join(root, "sessions", "dup-of-big.json"), text(3*bs+777, 3), 0o644)
	writeFile(t, filepath.Join(root, "sessions", "dup-of-small.json"), text(1000, 1), 0o644)
	writeFile(t, filepath.Join(root, "sessions", "same-size-other.json"), text(1000, 9), 0o644)
	writeFile(t, filepath.Join(root, "random.bin"), noise(2*bs+5, 1), 0o644)
	writeFile(t, filepath.Join(root, "bin", "setuid"), []byte("#!/bin/sh\n"), 0o4755)
	writeFile(t, filepath.Join(root, "bin", "setgid"), []byte("#!/bin/sh\necho\n"), 0o2711)
	writeFile(t, filepath.Join(root, "ünïcødé ✓ 名前.md"), []byte("non-ASCII name\n"), 0o644)
	writeFile(t, filepath.Join(root, strings.Repeat("L", 255)), []byte("long name\n"), 0o644)
	if err := os.MkdirAll(filepath.Join(root, "sticky"), 0o1777); err != nil {
		t.Fatal(err)
	}
	os.Chmod(filepath.Join(root, "sticky"), 0o1777)
	if err := os.MkdirAll(filepath.Join(root, "empty-dir"), 0o750); err != nil {
		t.Fatal(err)
	}
	os.Chmod(filepath.Join(root, "empty-dir"), 0o750)
	os.MkdirAll(filepath.Join(root, "state-snapshots"), 0o755)
	// Sparse: a hole at the start, data, a hole at the end.
	f, err := os.Create(filepath.Join(root, "sparse.db"))
	if err != nil {
		t.Fatal(err)
	}
	f.WriteAt(text(5000, 4), int64(3*bs))
	f.Truncate(int64(8*bs + 100))
	f.Close()
	// Its twin: stored once, extracted by copying around the holes.
	f, _ = os.Create(filepath.Join(root, "state-snapshots", "sparse-copy.db"))
	f.WriteAt(text(5000, 4), int64(3*bs))
	f.Truncate(int64(8*bs + 100))
	f.Close()
	// Hard links, across directories.
	writeFile(t, filepath.Join(root, "memories", "MEMORY.md"), []byte("entry one\n§\nentry two\n"), 0o644)
	os.MkdirAll(filepath.Join(root, "state-snapshots"), 0o755)
	if err := os.Link(filepath.Join(root, "memories", "MEMORY.md"), filepath.Join(root, "state-snapshots", "MEMORY.link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(root, "big-hardlink"), filepath.Join(root, "nope")); err == nil {
		t.Fatal("unexpected")
	}
	writeFile(t, filepath.Join(root, "logs", "agent.log"), text(200000, 5), 0o644)
	os.Link(filepath.Join(root, "logs", "agent.log"), filepath.Join(root, "logs", "agent.log.hardlink"))
	// Symlinks: relative, into a directory, dangling, absolute.
	os.Symlink("config.yaml", filepath.Join(root, "config.link"))
	os.Symlink("../sessions", filepath.Join(root, "bin", "sessions-link"))
	os.Symlink("does/not/exist", filepath.Join(root, "dangling"))
	os.Symlink("/etc/hostname", filepath.Join(root, "absolute"))
	// Special files.
	if err := syscall.Mkfifo(filepath.Join(root, "fifo"), 0o640); err != nil {
		t.Fatal(err)
	}
	if os.Geteuid() == 0 {
		if err := syscall.Mknod(filepath.Join(root, "null"), syscall.S_IFCHR|0o666, int(mkdev(1, 3))); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Mknod(filepath.Join(root, "loopdev"), syscall.S_IFBLK|0o660, int(mkdev(7, 300))); err != nil {
			t.Fatal(err)
		}
		if err := syscall.Mknod(filepath.Join(root, "bigdev"), syscall.S_IFCHR|0o600, int(mkdev(300, 70000))); err != nil {
			t.Fatal(err)
		}
		os.Lchown(filepath.Join(root, "config.yaml"), 1000, 1000)
		os.Lchown(filepath.Join(root, "absolute"), 1001, 1002)
		os.Lchown(filepath.Join(root, "sessions"), 65534, 100)
	}
	sock, err := syscall.Socket(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err == nil {
		if err := syscall.Bind(sock, &syscall.SockaddrUnix{Name: filepath.Join(root, "agent.sock")}); err != nil {
			t.Logf("no socket entry: %v", err)
		}
		syscall.Close(sock)
	}
	// Distinct, sub-second mtimes, set last (and on directories after
	// their contents).
	when := time.Date(2026, 3, 4, 5, 6, 7, 123456789, time.UTC)
	var paths []string
	filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
		paths = append(paths, p)
		return err
	})
	sort.Sort(sort.Reverse(sort.StringSlice(paths)))
	for i, p := range paths {
		ts := []syscall.Timespec{syscall.NsecToTimespec(when.Add(time.Duration(i) * 1001 * time.Millisecond).UnixNano())}
		ts = append(ts, ts[0])
		if err := utimesNoFollow(p, ts); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func mkdev(major, minor uint64) uint64 {
	return (major&0xfff)<<8 | (major&^0xfff)<<32 | minor&0xff | (minor&^0xff)<<12
}

// packToFile packs dir into a file in a temporary directory.
func packToFile(t testing.TB, dir string, opts PackOptions) (string, PackResult) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "a.sqfs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	res, err := PackDir(t.Context(), f, dir, opts)
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := f.Stat(); st.Size() != res.Size {
		t.Fatalf("PackResult.Size %d, file has %d bytes", res.Size, st.Size())
	}
	data, _ := os.ReadFile(p)
	if sha256.Sum256(data) != res.SHA256 {
		t.Fatal("PackResult.SHA256 does not match the file")
	}
	return p, res
}

func openFile(t testing.TB, p string) *Reader {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	st, _ := f.Stat()
	r, err := Open(f, st.Size(), ReaderOptions{Name: filepath.Base(p)})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// entryInfo is what the comparisons check of one entry.
type entryInfo struct {
	mode   iofs.FileMode
	uid    uint32
	gid    uint32
	mtime  time.Time
	size   int64
	sum    [32]byte // regular files
	target string   // symlinks
	rdev   uint64
	link   string // first path of the same inode, for hard links
}

type compareOpts struct {
	nsec     bool // compare mtimes to the nanosecond (else seconds)
	owners   bool
	dirMtime bool
	devices  bool
}

// scanTree lists a tree on disk: path -> entry.
func scanTree(t testing.TB, root string) map[string]entryInfo {
	t.Helper()
	out := map[string]entryInfo{}
	inodes := map[uint64]string{}
	err := filepath.WalkDir(root, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		e := entryInfo{mode: fi.Mode(), uid: st.Uid, gid: st.Gid, mtime: fi.ModTime(), rdev: uint64(st.Rdev)}
		switch fi.Mode().Type() {
		case 0:
			data, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			e.size = int64(len(data))
			e.sum = sha256.Sum256(data)
		case iofs.ModeSymlink:
			e.target, _ = os.Readlink(p)
		}
		if !fi.IsDir() && st.Nlink > 1 {
			if first, ok := inodes[st.Ino]; ok {
				e.link = first
			} else {
				inodes[st.Ino] = rel
			}
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// scanArchive lists an archive through the inode API, the same way.
func scanArchive(t testing.TB, r *Reader) map[string]entryInfo {
	t.Helper()
	out := map[string]entryInfo{}
	inodes := map[Inode]string{}
	var walk func(ino Inode, rel string)
	walk = func(ino Inode, rel string) {
		a, err := r.Stat(ino)
		if err != nil {
			t.Fatal(err)
		}
		e := entryInfo{mode: a.Mode, uid: a.Uid, gid: a.Gid, mtime: a.Mtime, rdev: a.Rdev}
		switch a.Mode.Type() {
		case 0:
			data := make([]byte, a.Size)
			n, err := r.ReadAt(ino, data, 0)
			if n != len(data) || (err != nil && err != io.EOF) {
				t.Fatalf("%s: ReadAt: %d, %v", rel, n, err)
			}
			e.size = a.Size
			e.sum = sha256.Sum256(data)
		case iofs.ModeSymlink:
			e.target, err = r.Readlink(ino)
			if err != nil {
				t.Fatal(err)
			}
		}
		if !a.Mode.IsDir() && a.Nlink > 1 {
			if first, ok := inodes[ino]; ok {
				e.link = first
			} else {
				inodes[ino] = rel
			}
		}
		out[rel] = e
		if a.Mode.IsDir() {
			ents, err := r.ReadDir(ino)
			if err != nil {
				t.Fatal(err)
			}
			for _, c := range ents {
				walk(c.Ino, filepath.Join(rel, c.Name))
			}
		}
	}
	walk(r.Root(), ".")
	return out
}

func compareTrees(t testing.TB, want, got map[string]entryInfo, o compareOpts) {
	t.Helper()
	bad := 0
	report := func(format string, a ...any) {
		t.Helper()
		if bad++; bad <= 20 {
			t.Errorf(format, a...)
		}
	}
	for p, w := range want {
		g, ok := got[p]
		if !ok {
			report("%s: missing", p)
			continue
		}
		if w.mode != g.mode {
			report("%s: mode %v, want %v", p, g.mode, w.mode)
		}
		if w.size != g.size || w.sum != g.sum {
			report("%s: content differs (size %d, want %d)", p, g.size, w.size)
		}
		if w.target != g.target {
			report("%s: symlink target %q, want %q", p, g.target, w.target)
		}
		if w.link != g.link {
			report("%s: hard link to %q, want %q", p, g.link, w.link)
		}
		if o.owners && (w.uid != g.uid || w.gid != g.gid) {
			report("%s: owner %d:%d, want %d:%d", p, g.uid, g.gid, w.uid, w.gid)
		}
		if o.devices && w.mode&iofs.ModeDevice != 0 && w.rdev != g.rdev {
			report("%s: rdev %#x, want %#x", p, g.rdev, w.rdev)
		}
		if w.mode.IsDir() && !o.dirMtime {
			continue
		}
		wm, gm := w.mtime, g.mtime
		if !o.nsec {
			wm, gm = wm.Truncate(time.Second), gm.Truncate(time.Second)
		}
		if !wm.Equal(gm) {
			report("%s: mtime %v, want %v", p, g.mtime, w.mtime)
		}
	}
	for p := range got {
		if _, ok := want[p]; !ok {
			report("%s: unexpected", p)
		}
	}
}

func utimesNoFollow(p string, ts []syscall.Timespec) error {
	u := []unix.Timespec{{Sec: ts[0].Sec, Nsec: ts[0].Nsec}, {Sec: ts[1].Sec, Nsec: ts[1].Nsec}}
	return unix.UtimesNanoAt(unix.AT_FDCWD, p, u, unix.AT_SYMLINK_NOFOLLOW)
}

// allEntries lists every directory entry of the archive, walking it.
func allEntries(t testing.TB, r *Reader) []DirEntry {
	t.Helper()
	var out []DirEntry
	if err := r.walk(true, func(_ Inode, ents []DirEntry, _ []uint64) error {
		out = append(out, ents...)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

// blockList is every block the archive's trailer records, in image order.
type blockList struct {
	off  []uint64
	len  []uint32
	kind []extentKind
	crc  []uint32
}

func allBlocks(t testing.TB, r *Reader) *blockList {
	t.Helper()
	var l blockList
	if err := r.eachRecord(0, r.sb.BytesUsed, func(off uint64, bi blockInfo, _ *trPage, _ int) error {
		l.off = append(l.off, off)
		l.len = append(l.len, bi.length)
		l.kind = append(l.kind, bi.kind)
		l.crc = append(l.crc, bi.crc)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return &l
}

// tableBlocks returns the content length of each metadata block of the
// table [start, end) of kind, in order.
func tableBlocks(t testing.TB, r *Reader, kind extentKind, start, end uint64) []int {
	t.Helper()
	var out []int
	for off := start; off < end; {
		m, err := r.metaBlock(off, kind, end)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, len(m.b))
		off += m.n
	}
	return out
}
