package main

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// TestMemoryConfigAsHermesReadsIt: the daemon enforces the limits Hermes
// Agent's load_on_disk_store makes of config.yaml. A quoted limit is a
// number to it, but one value its int() refuses (user_char_limit: lots)
// sends BOTH limits to their defaults: the quoted 3000 no longer counts, and
// 2,900 characters are refused as Hermes would refuse them. Said at startup
// and in status.
func TestMemoryConfigAsHermesReadsIt(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	mp := e2eDir(t, "home")
	writeFile(t, filepath.Join(mp, "config.yaml"), "memory:\n  memory_char_limit: '3000'\n  user_char_limit: lots\n", 0o644)
	h := newHost(t, e2eDir(t, "store"))
	d := h.mount(mp, "--interval", "0")
	if err := os.MkdirAll(filepath.Join(mp, "memories"), 0o755); err != nil {
		t.Fatal(err)
	}
	mem := filepath.Join(mp, "memories", "MEMORY.md")
	if err := os.WriteFile(mem, []byte(strings.Repeat("x", 2900)), 0o644); !errors.Is(err, syscall.EFBIG) {
		t.Fatalf("2,900 characters while Hermes' limit is its default 2,200: %v, want EFBIG", err)
	}
	if err := os.WriteFile(mem, []byte(strings.Repeat("x", 2200)), 0o644); err != nil {
		t.Fatalf("2,200 characters: %v", err)
	}
	if !strings.Contains(d.stderr.String(), "config.yaml's memory limits need fixing") {
		t.Errorf("no startup error about user_char_limit:\n%s", d.stderr)
	}
	r, _ := h.statusJSON(mp)
	if r.MemoryLimits["memory"] != 2200 || r.MemoryLimits["user"] != 1375 {
		t.Errorf("status limits %v, want the defaults for both", r.MemoryLimits)
	}
	if len(r.MemoryConfigProblems) != 1 || !strings.Contains(r.MemoryConfigProblems[0], "user_char_limit") || !strings.Contains(r.MemoryConfigProblems[0], "BOTH") {
		t.Errorf("status problems %q", r.MemoryConfigProblems)
	}
	_, text, _ := h.run("status", mp)
	if !strings.Contains(text, "memory config:") || !strings.Contains(text, "WARNING") {
		t.Errorf("status text does not warn:\n%s", text)
	}
	d.stopOK(t)
}
