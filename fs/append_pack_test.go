package fs

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/hermesfs/hermesfs/archive"
)

// TestAppendedFilePack appends to a lower file small enough to be copied
// up whole (a session log), freezes and packs the view with the lower
// archive as Base: the log is read, but its unchanged leading blocks are
// copied from Base, not compressed (PackResult.MatchedBytes), and the
// image holds the appended content (unsquashfs).
func TestAppendedFilePack(t *testing.T) {
	t.Parallel()
	unsq := needTool(t, "unsquashfs")
	const bs = 128 << 10
	src := tempDir(t)
	log := randBytes(8*bs, 41) // 8 whole blocks
	must(t, os.MkdirAll(filepath.Join(src, "sessions"), 0o755))
	must(t, os.WriteFile(filepath.Join(src, "sessions", "s1.jsonl"), log, 0o644))
	img := filepath.Join(tempDir(t), "lower.sqfs")
	f, err := os.Create(img)
	must(t, err)
	_, err = archive.PackDir(t.Context(), f, src, archive.PackOptions{BlockSize: bs})
	f.Close()
	must(t, err)
	lower := openLower(t, img)
	e := mountEnv(t, lower, Options{}) // copy-up whole
	tail := randBytes(bs/2+77, 42)
	a, err := os.OpenFile(e.path("sessions/s1.jsonl"), os.O_WRONLY|os.O_APPEND, 0)
	must(t, err)
	_, err = a.Write(tail)
	must(t, err)
	must(t, a.Close())
	want := append(append([]byte(nil), log...), tail...)

	v, err := e.m.Freeze(t.Context())
	must(t, err)
	defer v.Close()
	out := filepath.Join(tempDir(t), "snap.sqfs")
	of, err := os.Create(out)
	must(t, err)
	res, err := archive.Pack(t.Context(), of, v, archive.PackOptions{BlockSize: bs, Base: lower})
	of.Close()
	must(t, err)
	if res.MatchedBytes != 8*bs {
		t.Errorf("%d bytes matched in Base, want the 8 unchanged blocks (%d)", res.MatchedBytes, 8*bs)
	}
	dest := filepath.Join(tempDir(t), "x")
	if b, err := exec.Command(unsq, "-no-xattrs", "-d", dest, out).CombinedOutput(); err != nil {
		t.Fatalf("unsquashfs: %v\n%s", err, b)
	}
	checkFile(t, filepath.Join(dest, "sessions", "s1.jsonl"), want, "packed appended log")
}
