package memguard

import (
	"path/filepath"
	"sync"
	"syscall"
	"testing"
)

func TestOnVerdict(t *testing.T) {
	var mu sync.Mutex
	got := map[string]int{}
	audit := filepath.Join(t.TempDir(), "audit.jsonl")
	g := newTestGuard(t, Options{AuditLog: audit, OnVerdict: func(verdict, reason string) {
		mu.Lock()
		got[verdict+" "+reason]++
		mu.Unlock()
	}})
	g.accept(t, memFile, nil, chars("note ", 10))
	g.accept(t, memFile, chars("note ", 10), chars("note ", 10)) // no change: no verdict
	g.reject(t, memFile, nil, chars("note ", 3000), syscall.EFBIG, ReasonLimit)
	g.reject(t, memFile, nil, []byte{0xff, 0xfe}, syscall.EPERM, ReasonInvalidUTF8)
	// A decision that cannot be recorded is refused, and reported as such.
	g.Guard.audit.close()
	if err := g.Check(t.Context(), memFile, nil, chars("note ", 5), 0); err == nil {
		t.Error("a decision that cannot be recorded was accepted")
	}
	mu.Lock()
	defer mu.Unlock()
	want := map[string]int{"accepted ok": 1, "rejected limit": 1, "rejected invalid-utf8": 1, "error audit-log": 1}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("verdict %q: %d, want %d (all: %v)", k, got[k], n, got)
		}
	}
	if len(got) != len(want) {
		t.Errorf("verdicts %v, want %v", got, want)
	}
}
