package archive

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// useAll uses every part of an archive (every inode, listing, link and
// file, then Verify) and returns the first error.
func useAll(t *testing.T, r *Reader) error {
	seen := map[Inode]bool{}
	queue := []Inode{r.Root()}
	buf := make([]byte, 1<<20)
	for len(queue) > 0 {
		ino := queue[0]
		queue = queue[1:]
		a, err := r.Stat(ino)
		if err != nil {
			return err
		}
		switch {
		case a.Mode.IsDir():
			ents, err := r.ReadDir(ino)
			if err != nil {
				return err
			}
			for _, e := range ents {
				if _, err := r.Lookup(ino, e.Name); err != nil {
					return err
				}
				if !seen[e.Ino] {
					seen[e.Ino] = true
					queue = append(queue, e.Ino)
				}
			}
		case a.Mode.Type() == iofs.ModeSymlink:
			if _, err := r.Readlink(ino); err != nil {
				return err
			}
		case a.Mode.IsRegular():
			for off := int64(0); off < a.Size; off += int64(len(buf)) {
				if _, err := r.ReadAt(ino, buf, off); err != nil && err != io.EOF {
					return err
				}
			}
		}
	}
	return r.Verify(t.Context())
}

func flipAt(t *testing.T, p string, off int64) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, 1)
	f.ReadAt(b, off)
	b[0] ^= 0x10
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func copyFile(t *testing.T, p string) string {
	t.Helper()
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	q := filepath.Join(t.TempDir(), "copy.sqfs")
	if err := os.WriteFile(q, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return q
}

func wantCorrupt(t *testing.T, err error, off uint64, what string) {
	t.Helper()
	var ce *CorruptError
	if !errors.Is(err, ErrCorrupt) || !errors.As(err, &ce) {
		t.Fatalf("got %v, want a corruption error", err)
	}
	if uint64(ce.Offset) != off || ce.What != what {
		t.Fatalf("corruption reported at %d (%s), want %d (%s): %v", ce.Offset, ce.What, off, what, err)
	}
	if !strings.Contains(err.Error(), ce.Name) || ce.Name == "" {
		t.Fatalf("error does not name the archive: %v", err)
	}
}

// fileBlock returns the offset and size word of block i of the named file.
func fileBlock(t *testing.T, r *Reader, name string, i int) (Inode, uint64, uint32) {
	t.Helper()
	a, err := r.resolve("test", name, false)
	if err != nil {
		t.Fatal(err)
	}
	l, err := r.layout(a.Ino)
	if err != nil {
		t.Fatal(err)
	}
	return a.Ino, l.offs[i], l.words[i]
}

// A flipped byte in any data or fragment block, compressed or stored, is
// found by Verify and refused by ReadAt; bytes before the bad block still
// read, and no wrong byte is ever returned.
func TestCorruptDataBlocks(t *testing.T) {
	src := makeTree(t)
	for _, tc := range []struct {
		name, file string
		block      int
		fragment   bool
		compressed bool
	}{
		{"compressed data block", "sessions/big.json", 1, false, true},
		{"stored data block", "random.bin", 1, false, false},
		{"fragment block", "sessions/small.json", 0, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			orig, _ := packToFile(t, src, PackOptions{})
			p := copyFile(t, orig)
			r0 := openFile(t, orig)
			var off uint64
			var what string
			ino, boff, word := Inode(0), uint64(0), uint32(0)
			if tc.fragment {
				a, _ := r0.resolve("test", tc.file, false)
				l, _ := r0.layout(a.Ino)
				f, err := r0.fragAt(uint32(l.frag))
				if err != nil {
					t.Fatal(err)
				}
				ino, off, word, what = a.Ino, f.start, f.word, "fragment block"
			} else {
				ino, boff, word = fileBlock(t, r0, tc.file, tc.block)
				off, what = boff, "data block"
			}
			if compressed := word&dataUncompBit == 0; compressed != tc.compressed {
				t.Fatalf("block compressed=%v, test wants %v", compressed, tc.compressed)
			}
			want, _ := os.ReadFile(filepath.Join(src, tc.file))
			flipAt(t, p, int64(off)+int64(word&^dataUncompBit)/2)

			r := openFile(t, p)
			wantCorrupt(t, r.Verify(t.Context()), off, what)
			got := make([]byte, len(want))
			n, err := r.ReadAt(ino, got, 0)
			wantCorrupt(t, err, off, what)
			if want := tc.block * r.bs; n != want {
				t.Errorf("read %d good bytes before the bad block, want %d", n, want)
			}
			if !bytes.Equal(got[:n], want[:n]) {
				t.Error("bytes before the bad block differ")
			}
			// Through io/fs as well.
			f, err := r.Open(tc.file)
			if err != nil {
				t.Fatal(err)
			}
			_, err = io.ReadAll(f)
			if !errors.Is(err, ErrCorrupt) {
				t.Errorf("io/fs read: %v", err)
			}
		})
	}
}

// A flipped byte in a metadata block (compressed with zstd, or stored with
// "none") makes Open fail, or the first use of what the block holds
// (Open reads only the superblock, the trailer's root and the table
// indexes), naming the block.
func TestCorruptMetadata(t *testing.T) {
	src := makeTree(t)
	for _, c := range []Compression{Zstd, None} {
		for _, kind := range []extentKind{kindInodeTable, kindDirTable, kindFragTable, kindIDTable, kindExportTable, kindIndex, kindSuperblock, kindCompOpts} {
			if c == None && kind == kindCompOpts {
				continue
			}
			t.Run(string(c)+"/"+kind.String(), func(t *testing.T) {
				orig, _ := packToFile(t, src, PackOptions{Compression: c})
				r0 := openFile(t, orig)
				ex := allBlocks(t, r0)
				i := -1
				for k := range ex.len {
					if ex.kind[k] == kind {
						i = k
						break
					}
				}
				if i < 0 {
					t.Fatalf("no %s in the archive", kind)
				}
				p := copyFile(t, orig)
				flipAt(t, p, int64(ex.off[i]+uint64(ex.len[i])/2))
				f, _ := os.Open(p)
				defer f.Close()
				st, _ := f.Stat()
				r, err := Open(f, st.Size(), ReaderOptions{Name: "copy.sqfs"})
				if err == nil {
					err = useAll(t, r)
				}
				wantCorrupt(t, err, ex.off[i], kind.String())
			})
		}
	}
}

// Damage to the trailer, the footer or the padding is reported too (by
// Open, or when the damaged part is first used), and a truncated archive
// is refused.
func TestCorruptTrailer(t *testing.T) {
	src := makeTree(t)
	orig, res := packToFile(t, src, PackOptions{})
	r0 := openFile(t, orig)
	openErr := func(p string) error {
		f, _ := os.Open(p)
		defer f.Close()
		st, _ := f.Stat()
		r, err := Open(f, st.Size(), ReaderOptions{Name: "x"})
		if err == nil {
			err = useAll(t, r)
		}
		return err
	}
	for name, off := range map[string]int64{
		"footer":  res.Size - 10,
		"trailer": int64(r0.trailerStart()) + 20,
		"magic":   res.Size - footerSize,
	} {
		t.Run(name, func(t *testing.T) {
			p := copyFile(t, orig)
			flipAt(t, p, off)
			if err := openErr(p); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Open: %v", err)
			}
		})
	}
	t.Run("padding", func(t *testing.T) {
		if r0.trailerStart() == r0.sb.BytesUsed {
			t.Skip("image needs no padding")
		}
		p := copyFile(t, orig)
		flipAt(t, p, int64(r0.sb.BytesUsed))
		r := openFile(t, p)
		wantCorrupt(t, r.Verify(t.Context()), r0.sb.BytesUsed, "padding")
	})
	for _, n := range []int64{res.Size - 1, res.Size / 2, 100, 10, 0} {
		p := copyFile(t, orig)
		os.Truncate(p, n)
		if err := openErr(p); !errors.Is(err, ErrCorrupt) {
			t.Errorf("truncated to %d: Open: %v", n, err)
		}
	}
}

// stripped packs dir with uncompressed metadata and no trailer, so a test
// can edit structures in place and see what the reader makes of them.
func stripped(t *testing.T, dir string) (string, *Reader) {
	t.Helper()
	p, _ := packToFile(t, dir, PackOptions{Compression: None})
	r := openFile(t, p)
	data, _ := os.ReadFile(p)
	data = data[:r.trailerStart()]
	q := filepath.Join(t.TempDir(), "stripped.sqfs")
	os.WriteFile(q, data, 0o644)
	r2 := openFile(t, q)
	if r2.Checksummed() {
		t.Fatal("stripped archive still checksummed")
	}
	return q, r2
}

// tableOffset maps a position in the decompressed table (stored
// uncompressed) to its offset in the file.
func tableOffset(start, u uint64) int64 {
	return int64(start + u/metaBlockSize*(metaBlockSize+2) + 2 + u%metaBlockSize)
}

// streamPos is the position in the decompressed table of a reference
// into a table stored uncompressed in full blocks.
func streamPos(ref uint64) uint64 {
	return refBlock(ref)/(metaBlockSize+2)*metaBlockSize + uint64(refOffset(ref))
}

func patch(t *testing.T, p string, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(p, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

func openErr(p string) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	st, _ := f.Stat()
	r, err := Open(f, st.Size(), ReaderOptions{Name: "hostile"})
	if err == nil {
		err = r.Verify(context.Background())
	}
	return err
}

// Hostile images: names that would escape or alias, duplicates, a
// directory cycle, absurd counts and sizes. Each gives a corruption error;
// nothing panics or allocates wildly.
func TestHostileImages(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	writeFile(t, filepath.Join(src, "AA"), []byte("a"), 0o644)
	writeFile(t, filepath.Join(src, "BB"), []byte("b"), 0o644)
	writeFile(t, filepath.Join(src, "CC"), text(300000, 1), 0o644)
	os.MkdirAll(filepath.Join(src, "loop", "x"), 0o755)
	p0, r0 := stripped(t, src)
	data0, _ := os.ReadFile(p0)
	sb := r0.sb

	rename := func(from, to string) func(t *testing.T, p string) {
		return func(t *testing.T, p string) {
			i := bytes.Index(data0[sb.DirTable:], []byte(from))
			if i < 0 {
				t.Fatalf("%q not found in the directory table", from)
			}
			patch(t, p, int64(sb.DirTable)+int64(i), []byte(to))
		}
	}
	cases := map[string]func(t *testing.T, p string){
		"dotdot name":    rename("BB", ".."),
		"slash name":     rename("BB", "a/"),
		"nul name":       rename("BB", "B\x00"),
		"duplicate name": rename("BB", "AA"),
		"unsorted":       rename("BB", "ZZ"),
		"cycle": func(t *testing.T, p string) {
			// Point the only entry of loop/ ("x") at the root directory.
			loop, _ := r0.Lookup(r0.Root(), "loop")
			in, _ := r0.lookupInode(loop.Ino)
			u := streamPos(inodeRef(uint64(in.dirBlk), in.dirOff))
			root, _ := r0.refOf(r0.Root())
			hdr := binary.LittleEndian.AppendUint32(nil, 0)
			hdr = binary.LittleEndian.AppendUint32(hdr, uint32(refBlock(root)))
			hdr = binary.LittleEndian.AppendUint32(hdr, uint32(r0.Root()))
			hdr = binary.LittleEndian.AppendUint16(hdr, refOffset(root))
			hdr = binary.LittleEndian.AppendUint16(hdr, 0)
			patch(t, p, tableOffset(sb.DirTable, u), hdr)
		},
		"inode count": func(t *testing.T, p string) {
			patch(t, p, 4, []byte{0xff, 0xff, 0xff, 0xff})
		},
		"fragment count": func(t *testing.T, p string) {
			patch(t, p, 16, []byte{0xff, 0xff, 0xff, 0x7f})
		},
		"block size": func(t *testing.T, p string) {
			patch(t, p, 12, []byte{0, 0, 0, 0x80})
		},
		"bytes used": func(t *testing.T, p string) {
			patch(t, p, 40, []byte{0, 0, 0, 0, 0, 1, 0, 0})
		},
		"table order": func(t *testing.T, p string) {
			patch(t, p, 64, binary.LittleEndian.AppendUint64(nil, sb.DirTable+1))
		},
		"huge file": func(t *testing.T, p string) {
			// CC's inode (basic file): file_size at +28.
			a, _ := r0.Lookup(r0.Root(), "CC")
			ref, _ := r0.refOf(a.Ino)
			u := streamPos(ref)
			patch(t, p, tableOffset(sb.InodeTable, u+28), []byte{0xff, 0xff, 0xff, 0xff})
		},
		"directory size": func(t *testing.T, p string) {
			in, _ := r0.lookupInode(r0.Root())
			ref, _ := r0.refOf(r0.Root())
			u := streamPos(ref)
			off := u + 16 + 8 // basic dir: file_size
			if in.typ == typeLDir {
				off = u + 16 + 4
			}
			patch(t, p, tableOffset(sb.InodeTable, off), []byte{0xff, 0xff})
		},
	}
	for name, fn := range cases {
		t.Run(name, func(t *testing.T) {
			p := copyFile(t, p0)
			fn(t, p)
			err := openErr(p)
			if err == nil {
				// Reads of every file must then fail or be sane.
				t.Fatalf("hostile image accepted")
			}
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("error does not match ErrCorrupt: %v", err)
			}
			t.Log(err)
		})
	}
}
