package lazy

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"
)

// A manifest without a whole-object sha256 (published with a hole): the
// fill completes after checking every chunk once more, a damaged complete
// candidate is not put in place, and the present log tells the object by
// its chunk digests.
func TestCompleteWithoutSHA256(t *testing.T) {
	t.Parallel()
	o := putObject(t, localStore(t), 1<<20+777)
	o.sha = ""
	dir := t.TempDir()
	r := open(t, o.options(dir))
	checkReads(t, r, o.data[:300<<10])
	r.Close()
	// Resumed with the log of the same object.
	r = open(t, o.options(dir))
	if st := r.Stats(); st.PresentBytes == 0 {
		t.Fatalf("the present log of the same object was discarded: %+v", st)
	}
	r.Fill()
	waitComplete(t, r)
	got, err := os.ReadFile(filepath.Join(dir, "x.sqfs"))
	if err != nil || !bytes.Equal(got, o.data) {
		t.Fatalf("complete cache differs from the object (err %v)", err)
	}
	r.Close()

	// Another object with the same size: its log is not taken.
	p := putObject(t, localStore(t), 1<<20+777)
	p.sha = ""
	dir2 := t.TempDir()
	r = open(t, o.options(dir2))
	checkReads(t, r, o.data[:200<<10])
	r.Close()
	r = open(t, p.options(dir2))
	if st := r.Stats(); st.PresentBytes != 0 {
		t.Fatalf("another object's chunks taken as present: %+v", st)
	}
	checkReads(t, r, p.data)
}
