package archive

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
	"sync"
	"testing"
)

// readLog is a base archive that records the ranges read from it.
type readLog struct {
	ra   io.ReaderAt
	mu   sync.Mutex
	offs [][2]int64
}

func (l *readLog) ReadAt(p []byte, off int64) (int, error) {
	l.mu.Lock()
	l.offs = append(l.offs, [2]int64{off, off + int64(len(p))})
	l.mu.Unlock()
	return l.ra.ReadAt(p, off)
}

// Packed on a base with PrefixHole, the archive leaves the shared prefix's
// aligned slices unwritten and unread; filled with the base's bytes there,
// it is the very archive packed without the hole.
func TestPrefixHole(t *testing.T) {
	src := filepath.Join(t.TempDir(), "tree")
	bs := 128 << 10
	writeFile(t, filepath.Join(src, "state.db"), noise(12*bs, 3), 0o644)
	writeFile(t, filepath.Join(src, "a", "one.json"), text(3000, 1), 0o644)
	basePath, _ := packToFile(t, src, PackOptions{})
	writeFile(t, filepath.Join(src, "a", "two.json"), text(70000, 2), 0o644)

	bf, err := os.Open(basePath)
	if err != nil {
		t.Fatal(err)
	}
	defer bf.Close()
	st, _ := bf.Stat()
	log := &readLog{ra: bf}
	base, err := Open(log, st.Size(), ReaderOptions{Name: "base"})
	if err != nil {
		t.Fatal(err)
	}
	const align = 64 << 10
	log.offs = nil
	holey, hres := packBase(t, WithBase(os.DirFS(src), base), PackOptions{Base: base, PrefixHole: align})
	if hres.Base != BaseAppended {
		t.Fatalf("not appended: %+v", hres)
	}
	h := hres.Hole
	if h.From != align || h.To%align != 0 || h.To <= h.From || h.To > superblockSize+hres.SharedBytes {
		t.Fatalf("hole %+v for a shared prefix of %d bytes", h, hres.SharedBytes)
	}
	if hres.SHA256 != ([32]byte{}) {
		t.Error("a holey archive reports a sha256")
	}
	var inside int64
	for _, r := range log.offs {
		inside += max(0, min(r[1], h.To)-max(r[0], h.From))
	}
	if inside > int64(2*bs) {
		t.Fatalf("%d bytes of the base read inside the hole %+v (more than the blocks on its edges)", inside, h)
	}
	full, fres := packBase(t, WithBase(os.DirFS(src), base), PackOptions{Base: base})
	if fres.Size != hres.Size || fres.Hole.Len() != 0 {
		t.Fatalf("sizes %d and %d, hole %+v", fres.Size, hres.Size, fres.Hole)
	}
	got, _ := os.ReadFile(holey)
	b, _ := os.ReadFile(basePath)
	if mid := (h.From + h.To) / 2; !bytes.Equal(got[mid:mid+4096], make([]byte, 4096)) {
		t.Error("bytes written inside the hole")
	}
	copy(got[h.From:h.To], b[h.From:h.To])
	want, _ := os.ReadFile(full)
	if !bytes.Equal(got, want) {
		t.Fatal("the holey archive, filled from the base, differs from the archive packed without a hole")
	}
}
