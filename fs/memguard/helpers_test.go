package memguard

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// logBuf collects slog records as JSON lines, safely from many goroutines.
type logBuf struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (l *logBuf) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.buf.Write(p)
}

// records returns the logged records at level whose message contains msg.
func (l *logBuf) records(t *testing.T, level slog.Level, msg string) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	for _, line := range bytes.Split(l.buf.Bytes(), []byte("\n")) {
		if len(line) == 0 {
			continue
		}
		var rec map[string]any
		if err := json.Unmarshal(line, &rec); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if rec["level"] == level.String() && strings.Contains(rec["msg"].(string), msg) {
			out = append(out, rec)
		}
	}
	return out
}

type testGuard struct {
	*Guard
	audit string
	logs  *logBuf
}

// newTestGuard builds a Guard with its audit log in a temp dir and its log
// captured. opts.AuditLog and opts.Logger are filled in.
func newTestGuard(t *testing.T, opts Options) *testGuard {
	t.Helper()
	lb := &logBuf{}
	if opts.AuditLog == "" {
		opts.AuditLog = filepath.Join(t.TempDir(), "state", "memory-audit.jsonl")
	}
	opts.Logger = slog.New(slog.NewJSONHandler(lb, &slog.HandlerOptions{Level: slog.LevelDebug}))
	g, err := New(opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	// Keep the made-up writer ids of these tests from meeting real processes.
	g.proc = t.TempDir()
	t.Cleanup(func() {
		if err := g.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return &testGuard{Guard: g, audit: opts.AuditLog, logs: lb}
}

const memFile = "memories/MEMORY.md"
const userFile = "memories/USER.md"

// accept fails the test unless Check accepts.
func (g *testGuard) accept(t *testing.T, rel string, old, new []byte) {
	t.Helper()
	if err := g.Check(t.Context(), rel, old, new, 4242); err != nil {
		t.Fatalf("Check(%s, %d bytes): want accepted, got %v", rel, len(new), err)
	}
}

// reject fails the test unless Check rejects with errno and reason, and
// returns the error.
func (g *testGuard) reject(t *testing.T, rel string, old, new []byte, errno syscall.Errno, reason string) *RejectError {
	t.Helper()
	err := g.Check(t.Context(), rel, old, new, 4242)
	if err == nil {
		t.Fatalf("Check(%s, %q): want rejected (%v, %s), got accepted", rel, shorten(new), errno, reason)
	}
	if !errors.Is(err, errno) {
		t.Fatalf("Check(%s, %q): want %v, got %v", rel, shorten(new), errno, err)
	}
	var rej *RejectError
	if !errors.As(err, &rej) {
		t.Fatalf("Check(%s): error %T is not a *RejectError: %v", rel, err, err)
	}
	if rej.Reason != reason {
		t.Fatalf("Check(%s, %q): want reason %q, got %q (%v)", rel, shorten(new), reason, rej.Reason, err)
	}
	return rej
}

func shorten(b []byte) string {
	if len(b) > 80 {
		return string(b[:80]) + "..."
	}
	return string(b)
}

// chars returns n code points: the pattern repeated, cut to length.
func chars(pattern string, n int) []byte {
	r := []rune(strings.Repeat(pattern, n/len([]rune(pattern))+1))
	return []byte(string(r[:n]))
}
