package archive

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// reusedRanges lists the image ranges of an image packed with Segment that
// are copies of a source archive, as [start, end) pairs.
func reusedRanges(res PackResult) [][2]uint64 {
	var out [][2]uint64
	var pos uint64
	for _, run := range res.Runs {
		if run.Source != nil {
			out = append(out, [2]uint64{pos, pos + uint64(run.Length)})
		}
		pos += uint64(run.Length)
	}
	return out
}

func inRanges(rs [][2]uint64, off, n uint64) bool {
	for _, r := range rs {
		if off >= r[0] && off+n <= r[1] {
			return true
		}
	}
	return false
}

// tamperTree is a tree whose trailer has pages and a group of pages an
// extending pack reuses whole: a file of a few thousand blocks (at 4 KiB,
// compressible, each different) and a few hundred small files.
func tamperTree(t *testing.T) string {
	src := makeTree(t)
	var blob []byte
	for i := range 3600 {
		blob = append(blob, bytes.Repeat([]byte(fmt.Sprintf("block %d\n", i)), 4096)[:4096]...)
	}
	writeFile(t, filepath.Join(src, "blob.bin"), blob, 0o644)
	for i := range 400 {
		writeFile(t, filepath.Join(src, "many", fmt.Sprintf("file-%04d.js", i)), text(50+i, i), 0o644)
	}
	return src
}

// A flipped byte in what an extended image reuses of its base (a
// metadata block, a data block, a trailer page, an index page), in an
// index page it wrote, or in its root, is reported as damage by the
// reader: by Open, by the first use of what the byte belongs to, or by
// Verify; never served.
func TestExtendTamper(t *testing.T) {
	src := tamperTree(t)
	opts := PackOptions{BlockSize: 4 << 10}
	basePath, _ := packToFile(t, src, opts)
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	tr := newTracker(src, base)
	var img string
	var res PackResult
	for i, name := range []string{"sessions/small.json", "config.yaml"} {
		p := filepath.Join(src, name)
		data, _ := os.ReadFile(p)
		writeFile(t, p, append(data, "one more line\n"...), 0o644)
		when := time.Date(2026, 5, 1, 0, 0, i, 0, time.UTC)
		os.Chtimes(p, when, when)
		tr.touch(name)
		var b []byte
		img, b, res = extendImage(t, tr, base, baseBytes, opts)
		if res.Base != BaseExtended {
			t.Fatalf("not extended: %s", res.ExtendFallback)
		}
		base, baseBytes = checkImage(t, img, scanTree(t, src)), b
		tr.reset(base)
	}
	r := base
	reused := reusedRanges(res)

	type target struct {
		off  uint64
		what string
	}
	targets := map[string]target{}
	blocks := allBlocks(t, r)
	for i, off := range blocks.off {
		k := blocks.kind[i]
		name := "reused " + k.String()
		if _, ok := targets[name]; ok || !inRanges(reused, off, uint64(blocks.len[i])) {
			continue
		}
		switch k {
		case kindInodeTable, kindDirTable, kindData, kindFragment, kindExportTable, kindFragTable:
			targets[name] = target{off + uint64(blocks.len[i])/2, k.String()}
		}
	}
	t2 := r.tr2
	for g, grp := range t2.groups {
		x, err := r.trIndexOf(g)
		if err != nil {
			t.Fatal(err)
		}
		idx := "new integrity trailer index page"
		if inRanges(reused, grp.idxOff, uint64(grp.idxLen)) {
			idx = "reused integrity trailer index page"
		}
		if _, ok := targets[idx]; !ok {
			targets[idx] = target{grp.idxOff + uint64(grp.idxLen)/2, "integrity trailer index page"}
		}
		for p := range x.stored {
			sl := uint64(x.stored[p] &^ pageCompressed)
			if _, ok := targets["reused integrity trailer page"]; !ok && inRanges(reused, x.fileOff[p], sl) {
				targets["reused integrity trailer page"] = target{x.fileOff[p] + sl/2, "integrity trailer page"}
			}
		}
	}
	rootOff := t2.tailOff + uint64(len(t2.tail))
	targets["root"] = target{rootOff + 20, "integrity trailer root"}
	for _, want := range []string{"reused inode table block", "reused directory table block", "reused data block",
		"reused integrity trailer page", "reused integrity trailer index page", "new integrity trailer index page"} {
		if _, ok := targets[want]; !ok {
			t.Errorf("the extended image has no %s", want)
		}
	}
	for name, tg := range targets {
		t.Run(name, func(t *testing.T) {
			p := copyFile(t, img)
			flipAt(t, p, int64(tg.off))
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			st, _ := f.Stat()
			r, err := Open(f, st.Size(), ReaderOptions{Name: "tampered"})
			if err == nil {
				err = useAll(t, r)
			}
			var ce *CorruptError
			if !errors.As(err, &ce) || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("got %v, want a corruption error", err)
			}
			if ce.What != tg.what || uint64(ce.Offset) > tg.off || tg.off-uint64(ce.Offset) > metaBlockSize+2+maxPageRaw {
				t.Errorf("damage at %d reported as %v", tg.off, err)
			}
		})
	}
}
