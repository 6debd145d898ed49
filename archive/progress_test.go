package archive

import "testing"

// TestPackProgress: Pack reports its way through the files' content, from
// nothing to every file and byte, never backwards, on its own goroutine
// (no locking needed in the callback).
func TestPackProgress(t *testing.T) {
	dir := makeTree(t)
	var got []PackProgress
	_, res := packToFile(t, dir, PackOptions{Progress: func(p PackProgress) { got = append(got, p) }})
	if len(got) < 2 {
		t.Fatalf("%d progress reports for %d files", len(got), res.Files)
	}
	first, last := got[0], got[len(got)-1]
	if first.Files != 0 || first.Bytes != 0 || first.TotalFiles != res.Files || first.TotalBytes != res.DataBytes {
		t.Errorf("first report %+v, want nothing done of %d files, %d bytes", first, res.Files, res.DataBytes)
	}
	if last.Files != res.Files || last.Bytes != res.DataBytes || last.TotalFiles != res.Files || last.TotalBytes != res.DataBytes {
		t.Errorf("last report %+v, want all %d files, %d bytes", last, res.Files, res.DataBytes)
	}
	for i := 1; i < len(got); i++ {
		if got[i].Files < got[i-1].Files || got[i].Bytes < got[i-1].Bytes {
			t.Fatalf("progress went backwards: %+v after %+v", got[i], got[i-1])
		}
	}
}
