package main

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"
)

func generate(t *testing.T, size int64, seed uint64) (string, *gen) {
	t.Helper()
	if _, err := exec.LookPath("sqlite3"); err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") == "1" {
			t.Fatal("sqlite3 not installed")
		}
		t.Skip("sqlite3 not installed")
	}
	dir := filepath.Join(t.TempDir(), "home")
	g := &gen{root: dir, size: size, rng: rand.New(rand.NewPCG(seed, 0x4845524d4553))}
	if err := g.run(); err != nil {
		t.Fatal(err)
	}
	return dir, g
}

// digest summarises a tree: every path with its type, mode, size, mtime,
// content hash and symlink target.
func digest(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		b.WriteString(rel + " " + fi.Mode().String() + " " + fi.ModTime().UTC().String())
		switch {
		case fi.Mode().IsRegular():
			data, _ := os.ReadFile(p)
			fmt.Fprintf(&b, " %x", sha256.Sum256(data))
		case fi.Mode()&os.ModeSymlink != 0:
			tgt, _ := os.Readlink(p)
			b.WriteString(" -> " + tgt)
		}
		b.WriteByte('\n')
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestGenhome(t *testing.T) {
	const size = 12 << 20
	dir, g := generate(t, size, 7)

	if g.bytes < size*8/10 || g.bytes > size*13/10 {
		t.Errorf("generated %d bytes for -size %d", g.bytes, size)
	}
	// The same seed gives the same tree; another seed another one.
	dir2, _ := generate(t, size, 7)
	if digest(t, dir) != digest(t, dir2) {
		t.Error("two runs with the same seed differ")
	}
	dir3, _ := generate(t, size, 8)
	if digest(t, dir) == digest(t, dir3) {
		t.Error("two seeds gave the same tree")
	}

	cfg, _ := os.ReadFile(filepath.Join(dir, "config.yaml"))
	if !strings.Contains(string(cfg), "memory_char_limit: 2200") || !strings.Contains(string(cfg), "user_char_limit: 1375") {
		t.Errorf("config.yaml lacks the memory limits:\n%s", cfg)
	}
	for _, name := range []string{".env", "auth.json"} {
		if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: %v, %v", name, fi, err)
		}
	}
	for name, limit := range map[string]int{"memories/MEMORY.md": 2200, "memories/USER.md": 1375} {
		data, _ := os.ReadFile(filepath.Join(dir, name))
		if n := utf8.RuneCount(data); n == 0 || n > limit || !bytes.Contains(data, []byte("\n§\n")) {
			t.Errorf("%s: %d characters (limit %d), entries joined by §: %v", name, n, limit, bytes.Contains(data, []byte("\n§\n")))
		}
	}
	db := filepath.Join(dir, "state.db")
	out, err := exec.Command("sqlite3", db, "PRAGMA integrity_check; SELECT count(*) > 0 FROM sessions; SELECT count(*) > 10 FROM messages;").CombinedOutput()
	if err != nil || string(out) != "ok\n1\n1\n" {
		t.Errorf("state.db: %v: %q", err, out)
	}
	snaps, _ := filepath.Glob(filepath.Join(dir, "state-snapshots", "*.db"))
	if len(snaps) != 1 {
		t.Fatalf("state-snapshots: %v", snaps)
	}
	a, _ := os.ReadFile(db)
	b, _ := os.ReadFile(snaps[0])
	if !bytes.Equal(a, b) {
		t.Error("the state-snapshots copy differs from state.db")
	}
	links := 0
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if d.Type()&os.ModeSymlink != 0 {
			links++
		}
		return nil
	})
	if links < 3 {
		t.Errorf("%d symlinks", links)
	}
	for _, pattern := range []string{"sessions/session_*.json", "cron/output/*/*.md", "skills/*/*/SKILL.md", "logs/*.log.[1-5]"} {
		if m, _ := filepath.Glob(filepath.Join(dir, pattern)); len(m) == 0 {
			t.Errorf("nothing matches %s", pattern)
		}
	}
	// Text should compress like text: neither random nor zeros.
	sessions, _ := filepath.Glob(filepath.Join(dir, "sessions", "session_*.json"))
	var data []byte
	for _, s := range sessions {
		b, _ := os.ReadFile(s)
		data = append(data, b...)
	}
	if zstd, err := exec.LookPath("zstd"); err == nil {
		cmd := exec.Command(zstd, "-3", "-c")
		cmd.Stdin = bytes.NewReader(data)
		comp, err := cmd.Output()
		if err == nil {
			r := float64(len(data)) / float64(len(comp))
			if r < 2.5 || r > 12 {
				t.Errorf("session files compress %.1fx", r)
			}
		}
	}
}

func TestGenhomeRefusesNonEmptyDir(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "x"), nil, 0o644)
	g := &gen{root: dir, size: 1 << 20, rng: rand.New(rand.NewPCG(1, 2))}
	if err := g.run(); err == nil || !strings.Contains(err.Error(), "not empty") {
		t.Fatalf("run into a non-empty dir: %v", err)
	}
}

func TestParseSize(t *testing.T) {
	for in, want := range map[string]int64{"1G": 1 << 30, "50M": 50 << 20, "512K": 512 << 10, "1.5G": 3 << 29, "1GiB": 1 << 30, "100": 100} {
		if got, err := parseSize(in); err != nil || got != want {
			t.Errorf("parseSize(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "x", "-1G", "0"} {
		if _, err := parseSize(in); err == nil {
			t.Errorf("parseSize(%q) succeeded", in)
		}
	}
}
