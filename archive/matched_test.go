package archive

import (
	"bytes"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
)

// An appended file (a session log) is read, but its leading blocks, which
// Base stores already, are copied from Base instead of compressed
// (PackResult.MatchedBytes); the new tail, and a block rewritten in the
// middle, are compressed. The image holds the new content (unsquashfs).
func TestPackMatchesAppendedBlocks(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	bs := 16 << 10
	src := filepath.Join(t.TempDir(), "tree")
	lg := append(text(6*bs, 1), noise(4*bs, 2)...) // 10 whole blocks
	writeFile(t, filepath.Join(src, "logs", "session.jsonl"), lg, 0o644)
	writeFile(t, filepath.Join(src, "other.txt"), text(3*bs+7, 3), 0o644)
	prevPath, _ := packToFile(t, src, PackOptions{BlockSize: bs})
	prev := openFile(t, prevPath)
	prevBytes, err := os.ReadFile(prevPath)
	if err != nil {
		t.Fatal(err)
	}

	lg = append(lg, noise(bs+bs/2, 4)...) // appended: 1.5 blocks
	copy(lg[3*bs+100:], "rewritten in the middle")
	writeFile(t, filepath.Join(src, "logs", "session.jsonl"), lg, 0o644)
	for _, segment := range []bool{false, true} {
		t.Run(fmt.Sprintf("segment=%v", segment), func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "new.sqfs")
			f, err := os.Create(out)
			if err != nil {
				t.Fatal(err)
			}
			// Without WithBase: the log is read like any changed file.
			res, err := Pack(t.Context(), f, os.DirFS(src), PackOptions{BlockSize: bs, Base: prev, Segment: segment})
			f.Close()
			if err != nil {
				t.Fatal(err)
			}
			// 9 of the log's 10 old blocks (other.txt is found whole
			// by its file sum: ReusedBytes).
			if want := int64(9 * bs); res.MatchedBytes != want {
				t.Errorf("matched %d bytes, want %d", res.MatchedBytes, want)
			}
			img := out
			if segment {
				// The image is the runs laid end to end.
				seg, err := os.ReadFile(out)
				if err != nil {
					t.Fatal(err)
				}
				im := &image{seg: seg, runs: res.Runs, src: map[*Reader][]byte{prev: prevBytes}, size: res.Size}
				img = filepath.Join(t.TempDir(), "image.sqfs")
				writeFile(t, img, im.bytes(t), 0o644)
				if limit := int64(3*bs + 8<<10); res.SegmentSize > limit {
					t.Errorf("segment of %d bytes: more than the ~2.5 new blocks and metadata", res.SegmentSize)
				}
			}
			dest := filepath.Join(t.TempDir(), "x")
			run(t, unsquashfs, "-no-xattrs", "-d", dest, img)
			for name, want := range map[string][]byte{"logs/session.jsonl": lg, "other.txt": text(3*bs+7, 3)} {
				got, err := os.ReadFile(filepath.Join(dest, name))
				if err != nil || !bytes.Equal(got, want) {
					t.Errorf("%s: unpacked content differs (%v)", name, err)
				}
			}
		})
	}
}

// countingFS counts the bytes read from its files.
type countingFS struct {
	partialFS
	n *atomic.Int64
}

func (c countingFS) Open(name string) (iofs.File, error) {
	f, err := c.partialFS.Open(name)
	if pf, ok := f.(*partialFile); ok {
		return &countingPartial{partialFile: pf, n: c.n}, err
	}
	return f, err
}

type countingPartial struct {
	*partialFile
	n *atomic.Int64
}

func (f *countingPartial) Read(b []byte) (int, error) {
	k, err := f.partialFile.Read(b)
	f.n.Add(int64(k))
	return k, err
}

func (f *countingPartial) ReadAt(b []byte, off int64) (int, error) {
	k, err := f.partialFile.ReadAt(b, off)
	f.n.Add(int64(k))
	return k, err
}

// A file that is an earlier archive's inode with some bytes changed
// (PartialSource), of a size Base has (a database changed in place), is
// read only where it changed, with or without Base: the plan does not
// read it whole for its sum.
func TestPackPartialSourceWithBase(t *testing.T) {
	bs := 16 << 10
	src := filepath.Join(t.TempDir(), "tree")
	db := noise(20*bs, 5)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	prevPath, _ := packToFile(t, src, PackOptions{BlockSize: bs})
	prev := openFile(t, prevPath)
	copy(db[5*bs+10:], "changed")
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	for _, base := range []*Reader{nil, prev} {
		var n atomic.Int64
		fsys := countingFS{partialFS{FS: os.DirFS(src), r: prev, changed: map[string][][2]int64{"state.db": {{int64(5*bs + 10), int64(5*bs + 17)}}}}, &n}
		res, err := Pack(t.Context(), io.Discard, fsys, PackOptions{BlockSize: bs, Base: base})
		if err != nil {
			t.Fatal(err)
		}
		if n.Load() != int64(bs) || res.ReusedBytes != int64(19*bs) {
			t.Errorf("base %v: read %d bytes of the file, %d reused; want the changed block only (%d) and the 19 others reused", base != nil, n.Load(), res.ReusedBytes, bs)
		}
	}
}
