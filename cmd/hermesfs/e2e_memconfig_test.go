package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestMemoryConfigAsHermesReadsIt: a quoted limit is the limit Hermes uses;
// one hermesfs cannot read is said at startup and in status.
func TestMemoryConfigAsHermesReadsIt(t *testing.T) {
	need(t, "/dev/fuse")
	mp := e2eDir(t, "home")
	writeFile(t, filepath.Join(mp, "config.yaml"), "memory:\n  memory_char_limit: '3000'\n  user_char_limit: lots\n", 0o644)
	h := newHost(t, e2eDir(t, "store"))
	d := h.mount(mp, "--interval", "0")
	if err := os.MkdirAll(filepath.Join(mp, "memories"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mp, "memories", "MEMORY.md"), []byte(strings.Repeat("x", 2900)), 0o644); err != nil {
		t.Fatalf("2,900 characters under a quoted limit of 3000: %v", err)
	}
	if !strings.Contains(d.stderr.String(), "config.yaml sets a memory limit hermesfs cannot read") {
		t.Errorf("no startup error about user_char_limit:\n%s", d.stderr)
	}
	r, _ := h.statusJSON(mp)
	if r.MemoryLimits["memory"] != 3000 || r.MemoryLimits["user"] != 1375 {
		t.Errorf("status limits %v", r.MemoryLimits)
	}
	if len(r.MemoryConfigProblems) != 1 || !strings.Contains(r.MemoryConfigProblems[0], "user_char_limit") {
		t.Errorf("status problems %q", r.MemoryConfigProblems)
	}
	_, text, _ := h.run("status", mp)
	if !strings.Contains(text, "memory config:") || !strings.Contains(text, "WARNING") {
		t.Errorf("status text does not warn:\n%s", text)
	}
	d.stopOK(t)
}
