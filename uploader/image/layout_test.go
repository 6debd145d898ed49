package image

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
)

// TestLayOut: copied runs become extents of the source image's segment
// while the new image uses at least MostlyDead of it; below that, or
// across encryption kinds, the bytes are appended to the new segment and
// laid out from there, and they are the source's bytes.
func TestLayOut(t *testing.T) {
	f := newFixture(t, false)
	want := noise(4<<20, 7)
	a := f.publish(want, []uploader.Extent{{Length: int64(len(want))}}, "")
	im := f.open(a, t.TempDir())
	seg := a.Segments[0].Key
	src := new(archive.Reader) // a key only: LayOut reads through the image
	sources := map[*archive.Reader]*Image{src: im}
	newBytes := []byte("new bytes of the segment")
	for _, tc := range []struct {
		name       string
		copyLen    int64
		encrypting bool
		rewritten  bool
	}{
		{"half used", 2 << 20, false, false},
		{"an eighth used", 512 << 10, false, true},
		{"half used, other kind", 2 << 20, true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(t.TempDir(), "seg")
			if err := os.WriteFile(out, newBytes, 0o600); err != nil {
				t.Fatal(err)
			}
			runs := []archive.Run{
				{Offset: 0, Length: int64(len(newBytes))},
				{Source: src, Offset: 1000, Length: tc.copyLen},
			}
			ext, copied, err := LayOut(t.Context(), runs, out, sources, tc.encrypting)
			if err != nil {
				t.Fatal(err)
			}
			if len(ext) != 2 || ext[0] != (uploader.Extent{Length: int64(len(newBytes))}) {
				t.Fatalf("extents %+v", ext)
			}
			got, _ := os.ReadFile(out)
			if !tc.rewritten {
				if copied != 0 || ext[1] != (uploader.Extent{Key: seg, Offset: 1000, Length: tc.copyLen}) || len(got) != len(newBytes) {
					t.Fatalf("kept: copied %d, extent %+v, segment %d bytes", copied, ext[1], len(got))
				}
				return
			}
			if copied != tc.copyLen || ext[1] != (uploader.Extent{Offset: int64(len(newBytes)), Length: tc.copyLen}) {
				t.Fatalf("rewritten: copied %d, extent %+v", copied, ext[1])
			}
			if !bytes.Equal(got, append(append([]byte{}, newBytes...), want[1000:1000+tc.copyLen]...)) {
				t.Fatal("the new segment does not hold the source's bytes after its own")
			}
		})
	}
	if _, _, err := LayOut(t.Context(), []archive.Run{{Source: new(archive.Reader), Length: 10}}, filepath.Join(t.TempDir(), "x"), sources, false); err == nil {
		t.Error("a run copied from an unknown archive was laid out")
	}
}
