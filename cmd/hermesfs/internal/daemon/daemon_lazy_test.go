package daemon

import (
	"os"
	"path/filepath"
	"testing"
)

func TestKeepInCache(t *testing.T) {
	dir := t.TempDir()
	const id = "20261122T134501.123Z-h-1a2b3c4d"
	cases := []struct {
		name string
		want bool
	}{
		{id + ".sqfs", true},
		{id + ".sqfs.partial", true},
		{id + ".sqfs.present", true},
		{"20261122T134500.000Z-h-00000000.sqfs", false},
		{"20261122T134500.000Z-h-00000000.sqfs.partial", false},
	}
	for _, c := range cases {
		if got := keepInCache(dir, c.name, id); got != c.want {
			t.Errorf("partial cache: keepInCache(%s) = %v, want %v", c.name, got, c.want)
		}
	}
	// Once the archive is complete, its partial files are leftovers.
	if err := os.WriteFile(filepath.Join(dir, id+".sqfs"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if keepInCache(dir, id+".sqfs.partial", id) || !keepInCache(dir, id+".sqfs", id) {
		t.Error("complete cache: the partial file is kept or the archive is not")
	}
}
