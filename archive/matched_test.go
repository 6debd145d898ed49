package archive

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
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
