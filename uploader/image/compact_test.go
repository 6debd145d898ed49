package image

import (
	"strings"
	"testing"
)

func TestParseCompactPolicy(t *testing.T) {
	def := DefaultCompactPolicy()
	for _, c := range []struct {
		in   string
		want CompactPolicy
		err  string
	}{
		{"off", CompactPolicy{}, ""},
		{"default", def, ""},
		{"garbage=10%", CompactPolicy{GarbageShare: 0.1, Extents: def.Extents, Generation: def.Generation}, ""},
		{"extents=50, snapshots=0", CompactPolicy{GarbageShare: def.GarbageShare, Extents: 50}, ""},
		{"garbage=150%", def, "0% to 100%"},
		{"extents", def, "NAME=VALUE"},
		{"size=3", def, "unknown bound"},
	} {
		got, err := ParseCompactPolicy(c.in)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%q: %v, want an error saying %q", c.in, err, c.err)
			}
			continue
		}
		if err != nil || got != c.want {
			t.Errorf("%q: %+v, %v; want %+v", c.in, got, err, c.want)
		}
	}
	if why := (CompactPolicy{}).Due(100, 90, 1000, 0, 5000); why != "" {
		t.Errorf("off compacts: %s", why)
	}
	if why := def.Due(100, 90, 1000, 0, 0); why != "" {
		t.Errorf("a fresh image (generation 0) is due: %s", why)
	}
	if why := def.Due(1000, 10, def.Extents+500, 500, 3); why != "" {
		t.Errorf("an image with %d extents, all but %d from its compaction, is due: %s", def.Extents+500, def.Extents, why)
	}
	if why := def.Due(1000, 10, def.Extents+501, 500, 3); why == "" {
		t.Error("an image over the extents bound is not due")
	}
}
