package archive

import (
	"bytes"
	"fmt"
	"io"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// rangeLog is an io.ReaderAt that records the ranges read from it.
type rangeLog struct {
	ra  io.ReaderAt
	mu  sync.Mutex
	got [][2]int64
	on  bool
}

func (l *rangeLog) ReadAt(p []byte, off int64) (int, error) {
	l.mu.Lock()
	if l.on {
		l.got = append(l.got, [2]int64{off, off + int64(len(p))})
	}
	l.mu.Unlock()
	return l.ra.ReadAt(p, off)
}

// image is an image packed with Segment: its segment and runs, readable
// as the whole image.
type image struct {
	seg  []byte
	runs []Run
	src  map[*Reader][]byte // the bytes of each source archive
	size int64
}

func (im *image) bytes(t *testing.T) []byte {
	t.Helper()
	var out []byte
	for _, r := range im.runs {
		if r.Source == nil {
			out = append(out, im.seg[r.Offset:r.Offset+r.Length]...)
			continue
		}
		b, ok := im.src[r.Source]
		if !ok {
			t.Fatalf("run %+v copies from an archive the pack was not given", r)
		}
		out = append(out, b[r.Offset:r.Offset+r.Length]...)
	}
	if int64(len(out)) != im.size {
		t.Fatalf("runs add up to %d bytes, the image has %d", len(out), im.size)
	}
	return out
}

// partialFS offers the files named in changed as PartialSource of inode
// paths of r: only the byte ranges listed in changed differ.
type partialFS struct {
	iofs.FS
	r       *Reader
	changed map[string][][2]int64
}

func (p partialFS) ReadDir(name string) ([]iofs.DirEntry, error) { return iofs.ReadDir(p.FS, name) }
func (p partialFS) Lstat(name string) (iofs.FileInfo, error)     { return iofs.Lstat(p.FS, name) }
func (p partialFS) ReadLink(name string) (string, error)         { return iofs.ReadLink(p.FS, name) }

func (p partialFS) Open(name string) (iofs.File, error) {
	f, err := p.FS.Open(name)
	if err != nil {
		return nil, err
	}
	ch, ok := p.changed[name]
	if !ok {
		return f, nil
	}
	a, err := p.r.resolve("open", name, false)
	if err != nil {
		return f, nil
	}
	return &partialFile{File: f, r: p.r, ino: a.Ino, ch: ch}, nil
}

type partialFile struct {
	iofs.File
	r   *Reader
	ino Inode
	ch  [][2]int64
}

func (f *partialFile) ReadAt(b []byte, off int64) (int, error) {
	return f.File.(io.ReaderAt).ReadAt(b, off)
}

func (f *partialFile) PartialArchiveSource() (*Reader, Inode, func(off, n int64) bool, bool) {
	a, _ := f.r.Stat(f.ino)
	return f.r, f.ino, func(off, n int64) bool {
		if off+n > a.Size {
			return true
		}
		for _, c := range f.ch {
			if off < c[1] && c[0] < off+n {
				return true
			}
		}
		return false
	}, true
}

// A chain of images packed with Segment on the previous one: each is the
// tree (checked by our reader, unsquashfs and the verifier) when its runs
// are laid end to end, the segment holds only new bytes, and the pack
// reads none of an unchanged or partly changed file's copied blocks.
func TestSegmentChain(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	rng := rand.New(rand.NewPCG(3, 4))
	src := filepath.Join(t.TempDir(), "tree")
	bs := 16 << 10
	db := noise(40*bs+123, 1)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	for i := range 30 {
		writeFile(t, filepath.Join(src, "sessions", fmt.Sprintf("s%02d.json", i)), append(text(500+rng.IntN(2*bs), i), noise(rng.IntN(3*bs), byte(i))...), 0o644)
	}
	writeFile(t, filepath.Join(src, "big.bin"), noise(20*bs, 9), 0o644)
	prevPath, _ := packToFile(t, src, PackOptions{BlockSize: bs})
	prevBytes, _ := os.ReadFile(prevPath)
	when := time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)
	for round := range 6 {
		var changed [][2]int64
		for range 1 + rng.IntN(3) {
			off := rng.IntN(len(db) - 4096)
			copy(db[off:], noise(4096, byte(rng.IntN(256))))
			changed = append(changed, [2]int64{int64(off), int64(off + 4096)})
		}
		if round%2 == 1 {
			changed = append(changed, [2]int64{int64(len(db)), 1 << 40})
			db = append(db, noise(bs+rng.IntN(bs), byte(round))...)
		}
		writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
		when = when.Add(time.Minute)
		os.Chtimes(filepath.Join(src, "state.db"), when, when)
		for range 3 {
			i := rng.IntN(35)
			p := filepath.Join(src, "sessions", fmt.Sprintf("s%02d.json", i))
			writeFile(t, p, append(text(500+rng.IntN(2*bs), i+100*round), noise(rng.IntN(3*bs), byte(i))...), 0o644)
			when = when.Add(time.Second)
			os.Chtimes(p, when, when)
		}

		f, err := os.Open(prevPath)
		if err != nil {
			t.Fatal(err)
		}
		log := &rangeLog{ra: f}
		prev, err := Open(log, int64(len(prevBytes)), ReaderOptions{Name: "prev"})
		if err != nil {
			t.Fatal(err)
		}
		// The unchanged big file and state.db's unchanged blocks: their
		// bytes in prev must not be read.
		big, _ := prev.resolve("open", "big.bin", false)
		bl, _ := prev.layout(big.Ino)
		dbIno, _ := prev.resolve("open", "state.db", false)
		dl, _ := prev.layout(dbIno.Ino)

		segPath := filepath.Join(t.TempDir(), "seg")
		sf, err := os.Create(segPath)
		if err != nil {
			t.Fatal(err)
		}
		fsys := WithBase(partialFS{FS: os.DirFS(src), r: prev, changed: map[string][][2]int64{"state.db": changed}}, prev)
		log.on = true
		res, err := Pack(t.Context(), sf, fsys, PackOptions{BlockSize: bs, Base: prev, Segment: true})
		log.on = false
		sf.Close()
		f.Close()
		if err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		seg, _ := os.ReadFile(segPath)
		if int64(len(seg)) != res.SegmentSize {
			t.Fatalf("segment has %d bytes, SegmentSize %d", len(seg), res.SegmentSize)
		}
		im := &image{seg: seg, runs: res.Runs, src: map[*Reader][]byte{prev: prevBytes}, size: res.Size}
		b := im.bytes(t)
		var copied int64
		for _, r := range res.Runs {
			if r.Source != nil {
				copied += r.Length
			}
		}
		t.Logf("round %d: image %d bytes, segment %d, copied %d, runs %d", round, res.Size, res.SegmentSize, copied, len(res.Runs))
		if res.SegmentSize >= res.Size/2 {
			t.Errorf("round %d: segment of %d bytes for a %d-byte image: most of it should be copies", round, res.SegmentSize, res.Size)
		}
		for _, rd := range log.got {
			for i, off := range bl.offs {
				if w := bl.words[i]; w != 0 && rd[0] < int64(off)+int64(w&^dataUncompBit) && int64(off) < rd[1] {
					t.Fatalf("round %d: the pack read bytes %v of the unchanged big.bin's block %d", round, rd, i)
				}
			}
			for i, off := range dl.offs {
				blk := [2]int64{int64(i * bs), int64((i + 1) * bs)}
				dirty := false
				for _, c := range changed {
					dirty = dirty || blk[0] < c[1] && c[0] < blk[1]
				}
				if w := dl.words[i]; !dirty && w != 0 && rd[0] < int64(off)+int64(w&^dataUncompBit) && int64(off) < rd[1] {
					t.Fatalf("round %d: the pack read bytes %v of state.db's unchanged block %d", round, rd, i)
				}
			}
		}
		p := filepath.Join(t.TempDir(), "image.sqfs")
		writeFile(t, p, b, 0o644)
		r := openFile(t, p)
		want := scanTree(t, src)
		compareTrees(t, want, scanArchive(t, r), compareOpts{nsec: true, owners: true, dirMtime: true})
		if err := r.Verify(t.Context()); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		if round%2 == 0 {
			dir := filepath.Join(t.TempDir(), "x")
			run(t, unsquashfs, "-no-progress", "-d", dir, p)
			compareTrees(t, want, scanTree(t, dir), compareOpts{})
		}
		if !bytes.Equal(b[:4], []byte("hsqs")) {
			t.Fatal("the image does not start with a squashfs superblock")
		}
		prevPath, prevBytes = p, b
	}
}
