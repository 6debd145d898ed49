package archive

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// FuzzOpen feeds arbitrary bytes to Open and, when they open, walks and
// reads everything through both APIs and verifies. Nothing may panic, hang
// or allocate without bound; errors are fine. The seed corpus in
// testdata/fuzz/FuzzOpen (small archives of every compression, with and
// without the trailer, with trailers of both versions) runs in every plain
// `go test`. An input with a version 2 trailer is tried a second time
// with the checksums of the trailer's structure made to match what it
// holds (resealTrailer2), so that changes to the pages, index pages and
// root reach their decoders instead of stopping at a checksum.
func FuzzOpen(f *testing.F) {
	f.Fuzz(func(t *testing.T, data []byte) {
		if r, err := Open(bytes.NewReader(data), int64(len(data)), ReaderOptions{Name: "fuzz", CacheBytes: 1 << 20}); err == nil {
			exercise(r)
		}
		sealed := bytes.Clone(data)
		if !resealTrailer2(sealed) || bytes.Equal(sealed, data) {
			return
		}
		if r, err := Open(bytes.NewReader(sealed), int64(len(sealed)), ReaderOptions{Name: "fuzz", CacheBytes: 1 << 20}); err == nil {
			exercise(r)
		}
	})
}

// exercise touches every part of an opened archive, bounding the bytes it
// reads per file (hostile sizes can be huge and sparse).
func exercise(r *Reader) {
	buf := make([]byte, 64<<10)
	seen := map[Inode]bool{}
	var walk func(ino Inode, depth int)
	walk = func(ino Inode, depth int) {
		if seen[ino] || depth > 100 {
			return
		}
		seen[ino] = true
		a, err := r.Stat(ino)
		if err != nil {
			return
		}
		switch {
		case a.Mode.IsDir():
			ents, err := r.ReadDir(ino)
			if err != nil {
				return
			}
			for _, e := range ents {
				r.Lookup(ino, e.Name)
				walk(e.Ino, depth+1)
			}
		case a.Mode.Type() == iofs.ModeSymlink:
			r.Readlink(ino)
		case a.Mode.IsRegular():
			r.ReadAt(ino, buf, 0)
			if a.Size > int64(len(buf)) {
				r.ReadAt(ino, buf, a.Size-int64(len(buf)))
				r.ReadAt(ino, buf[:100], a.Size/2)
			}
		}
	}
	walk(r.Root(), 0)
	iofs.WalkDir(r.FS(), ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if d.Type().IsRegular() {
			if f, err := r.Open(p); err == nil {
				io.CopyN(io.Discard, f, 1<<20)
				f.Close()
			}
		}
		r.Lstat(p)
		r.ReadLink(p)
		return nil
	})
	r.Verify(context.Background())
}

// seedTree is a small tree with a bit of everything (fragments, a
// two-block file, a stored block, a hole, links), in 4 KiB blocks so the
// seeds stay small: the fuzzer minimizes every interesting input, and that
// costs time in proportion to its size.
func seedTree(t testing.TB) string {
	src := filepath.Join(t.TempDir(), "seed")
	writeFile(t, filepath.Join(src, "a.txt"), []byte("hello"), 0o644)
	writeFile(t, filepath.Join(src, "d", "big.json"), text(4200, 1), 0o600)
	writeFile(t, filepath.Join(src, "d", "noise"), append(make([]byte, 4096), noise(300, 2)...), 0o644)
	writeFile(t, filepath.Join(src, "e", "x"), nil, 0o4755)
	os.Symlink("../a.txt", filepath.Join(src, "d", "link"))
	os.Link(filepath.Join(src, "a.txt"), filepath.Join(src, "e", "hard"))
	os.Mkdir(filepath.Join(src, "empty"), 0o700)
	return src
}

// TestWriteFuzzSeeds regenerates testdata/fuzz/FuzzOpen when
// HERMESFS_UPDATE_FUZZ_SEEDS=1; otherwise it checks that seeds exist.
func TestWriteFuzzSeeds(t *testing.T) {
	dir := filepath.Join("testdata", "fuzz", "FuzzOpen")
	if os.Getenv("HERMESFS_UPDATE_FUZZ_SEEDS") != "1" {
		ents, err := os.ReadDir(dir)
		if err != nil || len(ents) < 6 {
			t.Fatalf("fuzz seed corpus missing (%v); regenerate with HERMESFS_UPDATE_FUZZ_SEEDS=1", err)
		}
		// The generated seeds must be valid archives, or the fuzzer
		// starts from nothing useful.
		for _, e := range ents {
			if !strings.HasPrefix(e.Name(), "pack-") && !strings.HasPrefix(e.Name(), "bare-") && !strings.HasPrefix(e.Name(), "v2-") {
				continue
			}
			raw, _ := os.ReadFile(filepath.Join(dir, e.Name()))
			_, lit, _ := strings.Cut(strings.TrimSpace(string(raw)), "\n")
			data, err := strconv.Unquote(strings.TrimSuffix(strings.TrimPrefix(lit, "[]byte("), ")"))
			if err != nil {
				t.Fatalf("%s: %v", e.Name(), err)
			}
			r, err := Open(strings.NewReader(data), int64(len(data)), ReaderOptions{Name: e.Name()})
			if err == nil {
				err = r.Verify(t.Context())
			}
			if err != nil {
				t.Errorf("seed %s: %v", e.Name(), err)
			} else if r.Checksummed() == strings.HasPrefix(e.Name(), "bare-") {
				t.Errorf("seed %s: checksummed %v", e.Name(), r.Checksummed())
			} else if (r.tr2 != nil) != strings.HasPrefix(e.Name(), "v2-") {
				t.Errorf("seed %s: trailer version 2 %v", e.Name(), r.tr2 != nil)
			}
		}
		return
	}
	src := seedTree(t)
	os.MkdirAll(dir, 0o755)
	for _, c := range []Compression{Zstd, Gzip, LZ4, None} {
		// Version 2 trailers as Pack writes them; version 1 trailers (and
		// none) as earlier packs and other tools did.
		p, _ := packToFile(t, src, PackOptions{Compression: c, BlockSize: 4 << 10})
		data, _ := os.ReadFile(p)
		writeSeed(t, dir, "v2-"+string(c), data)
		p, _ = packToFile(t, src, PackOptions{Compression: c, BlockSize: 4 << 10, trailerV1: true})
		data, _ = os.ReadFile(p)
		r := openFile(t, p)
		// Without the 4 KiB padding (the trailer may follow the image
		// directly), and without any trailer, as other tools write.
		img := data[:r.sb.BytesUsed]
		ex := make([]extent, len(r.tr.ext.len))
		for i := range ex {
			ex[i] = extent{length: r.tr.ext.len[i], kind: r.tr.ext.kind[i], crc: r.tr.ext.crc[i]}
		}
		tr := marshalTrailer(ex, r.tr.mtimeNs, nil, uint64(len(img)), uint64(len(img)))
		writeSeed(t, dir, "pack-"+string(c), append(append([]byte(nil), img...), tr...))
		if c == None || c == Zstd {
			writeSeed(t, dir, "bare-"+string(c), img)
		}
	}
}

func writeSeed(t *testing.T, dir, name string, data []byte) {
	body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", data)
	h := sha256.Sum256(data)
	if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("%s-%x", name, h[:4])), []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

// The seeds themselves must open and read back correctly (not just not
// crash), or the fuzzer starts from nothing useful.
func TestFuzzSeedsOpen(t *testing.T) {
	src := seedTree(t)
	for _, c := range []Compression{Zstd, Gzip, LZ4, None} {
		p, _ := packToFile(t, src, PackOptions{Compression: c, BlockSize: 4 << 10})
		r := openFile(t, p)
		compareTrees(t, scanTree(t, src), scanArchive(t, r), compareOpts{nsec: true})
		exercise(r)
	}
}
