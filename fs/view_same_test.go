package fs

import (
	"os"
	"testing"
)

// SameAsLower holds while nothing that survives differs from the lower
// layer (files created and removed again leave directories whose times
// alone moved), and fails at any surviving difference.
func TestViewSameAsLower(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	same := func(step string, want bool) {
		t.Helper()
		v, err := e.m.Freeze(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer v.Close()
		got, err := v.SameAsLower()
		if err != nil || got != want {
			t.Errorf("%s: SameAsLower %v, %v; want %v", step, got, err, want)
		}
	}
	same("fresh mount", true)
	for _, s := range []struct {
		step string
		do   func() error
		want bool
	}{
		{"file created deep down", func() error { return os.WriteFile(e.path("a/b/x.tmp"), []byte("x"), 0o644) }, false},
		{"and removed", func() error { return os.Remove(e.path("a/b/x.tmp")) }, true},
		{"a lower file read", func() error { _, err := os.ReadFile(e.path("skills/web/SKILL.md")); return err }, true},
		{"directory chmod", func() error { return os.Chmod(e.path("a"), 0o700) }, false},
		{"chmod back", func() error { return os.Chmod(e.path("a"), 0o755) }, true},
		{"directory chown", func() error { return os.Chown(e.path("t"), 1234, 0) }, false},
		{"chown back", func() error { return os.Chown(e.path("t"), 0, 0) }, true},
		{"new directory", func() error { return os.Mkdir(e.path("skills/new"), 0o755) }, false},
		{"removed again", func() error { return os.Remove(e.path("skills/new")) }, true},
		{"lower file changed", func() error { return os.WriteFile(e.path("top.txt"), []byte("top"), 0o644) }, false},
	} {
		if err := s.do(); err != nil {
			t.Fatalf("%s: %v", s.step, err)
		}
		same(s.step, s.want)
	}

	e = mountEnv(t, lower, Options{})
	must(t, os.Remove(e.path("a/one.txt")))
	same("lower file removed (whiteout)", false)
	e = mountEnv(t, lower, Options{})
	must(t, os.Rename(e.path("skills/web"), e.path("skills/web2")))
	must(t, os.Rename(e.path("skills/web2"), e.path("skills/web")))
	same("lower directory renamed away and back", false) // a redirect, conservatively a change
	e = mountEnv(t, lower, Options{})
	must(t, os.Chmod(e.mnt, 0o700))
	same("root chmod", false)

	e = mountEnv(t, nil, Options{})
	same("no lower, nothing", true)
	must(t, os.Mkdir(e.path("d"), 0o755))
	same("no lower, a directory", false)
	must(t, os.Remove(e.path("d")))
	same("no lower, the directory removed", true)
}
