package archive

import (
	"encoding/binary"
	"errors"
	"os"
	"runtime"
	"testing"
)

// resealTrailer2 recomputes, in data (an archive with a version 2
// trailer, changed by a test or the fuzzer), every checksum of the
// trailer's structure from the bytes it covers: each page's in its index
// page, each index page's in the root, the root's and the footer's own in
// the footer. What cannot be followed is left as it is. It reports
// whether data has a version 2 footer at all.
func resealTrailer2(data []byte) bool {
	le := binary.LittleEndian
	n := uint64(len(data))
	if n < footerSize {
		return false
	}
	fb := data[n-footerSize:]
	if string(fb[:8]) != footerMagic || le.Uint32(fb[8:]) != formatVersion2 {
		return false
	}
	rootOff, rootLen := le.Uint64(fb[16:]), le.Uint64(fb[24:])
	if rootOff <= n && rootLen <= n-rootOff && rootLen >= rootHeaderSize {
		root := data[rootOff : rootOff+rootLen]
		for g := 0; rootHeaderSize+groupEntrySize*(g+1) <= len(root); g++ {
			e := root[rootHeaderSize+groupEntrySize*g:]
			idxOff, idxLen := le.Uint64(e), uint64(le.Uint32(e[20:]))
			if idxOff > n || idxLen > n-idxOff {
				continue
			}
			idx := data[idxOff : idxOff+idxLen]
			var total uint64
			for p := 0; pageEntrySize*(p+1) <= len(idx); p++ {
				total += uint64(le.Uint32(idx[pageEntrySize*p:]) &^ pageCompressed)
			}
			if total <= idxOff {
				at := idxOff - total
				for p := 0; pageEntrySize*(p+1) <= len(idx); p++ {
					sl := uint64(le.Uint32(idx[pageEntrySize*p:]) &^ pageCompressed)
					le.PutUint32(idx[pageEntrySize*p+8:], crc32c(data[at:at+sl]))
					at += sl
				}
			}
			le.PutUint32(e[24:], crc32c(idx))
		}
		le.PutUint32(fb[40:], crc32c(root))
	}
	le.PutUint32(fb[44:], crc32c(fb[:44]))
	return true
}

// A version 2 trailer whose structure lies, with every checksum in it
// made to match (as a hostile image would): Open or the first use of
// what lies reports damage, and nothing allocates in proportion to the
// lie.
func TestHostileTrailer2(t *testing.T) {
	src := makeTree(t)
	orig, _ := packToFile(t, src, PackOptions{})
	r0 := openFile(t, orig)
	t2 := r0.tr2
	le := binary.LittleEndian
	rootOff := t2.tailOff + uint64(len(t2.tail))
	groupEntry := func(g int) uint64 { return rootOff + rootHeaderSize + groupEntrySize*uint64(g) }
	// The data region's group: the first with more than one block.
	dataGroup := -1
	for g := range t2.groups {
		if x, err := r0.trIndexOf(g); err == nil && x.blocks[0] > 1 {
			dataGroup = g
			break
		}
	}
	if dataGroup < 0 {
		t.Fatal("no group of several blocks")
	}
	for name, tc := range map[string]struct {
		patch func(data []byte)
		open  bool // Open itself finds it
	}{
		"page claims more records than its bytes hold": {patch: func(data []byte) {
			le.PutUint32(data[t2.groups[dataGroup].idxOff+12:], 1<<26)
		}},
		"page claims no records": {patch: func(data []byte) {
			le.PutUint32(data[t2.groups[dataGroup].idxOff+12:], 0)
		}},
		"page raw length past the bound": {patch: func(data []byte) {
			le.PutUint32(data[t2.groups[dataGroup].idxOff+4:], maxPageRaw+1)
		}},
		"page covers fewer image bytes than its records": {patch: func(data []byte) {
			at := t2.groups[dataGroup].idxOff + 16
			le.PutUint64(data[at:], le.Uint64(data[at:])-1)
		}},
		"group covers bytes the next one does": {open: true, patch: func(data []byte) {
			at := groupEntry(dataGroup) + 8
			le.PutUint64(data[at:], le.Uint64(data[at:])+1)
		}},
		"group index page before the trailer": {open: true, patch: func(data []byte) {
			le.PutUint64(data[groupEntry(dataGroup):], 0)
		}},
		"group index page length not its pages'": {open: true, patch: func(data []byte) {
			at := groupEntry(dataGroup) + 20
			le.PutUint32(data[at:], le.Uint32(data[at:])+pageEntrySize)
		}},
		"root group count": {open: true, patch: func(data []byte) {
			le.PutUint32(data[rootOff+72:], 1<<30)
		}},
		"image size": {open: true, patch: func(data []byte) {
			le.PutUint64(data[rootOff+16:], 1<<62)
		}},
	} {
		t.Run(name, func(t *testing.T) {
			data, err := os.ReadFile(orig)
			if err != nil {
				t.Fatal(err)
			}
			tc.patch(data)
			if !resealTrailer2(data) {
				t.Fatal("not a version 2 archive")
			}
			p := copyFile(t, orig)
			if err := os.WriteFile(p, data, 0o644); err != nil {
				t.Fatal(err)
			}
			var m0, m1 runtime.MemStats
			runtime.ReadMemStats(&m0)
			f, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			r, err := Open(f, int64(len(data)), ReaderOptions{Name: "hostile"})
			if tc.open && err == nil {
				t.Error("Open did not find the damage")
			}
			if err == nil {
				err = useAll(t, r)
			}
			runtime.ReadMemStats(&m1)
			if !errors.Is(err, ErrCorrupt) {
				t.Fatalf("got %v, want a corruption error", err)
			}
			t.Log(err)
			if a := m1.TotalAlloc - m0.TotalAlloc; a > 64<<20 {
				t.Errorf("reading it allocated %d MiB", a>>20)
			}
		})
	}
}
