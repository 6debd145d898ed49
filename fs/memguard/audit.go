package memguard

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"
)

// Verdicts of an [Event].
const (
	VerdictAccepted = "accepted"
	VerdictRejected = "rejected"
	// VerdictError is never in the audit log: Options.OnVerdict gets it
	// for a change refused because its decision could not be recorded.
	VerdictError = "error"
)

// Event is one line of the audit log: one decision about one change.
type Event struct {
	Time    time.Time `json:"time"` // UTC, RFC 3339 with nanoseconds
	File    string    `json:"file"` // guarded path relative to the mount root
	Verdict string    `json:"verdict"`
	// Reason is "ok" or "over-limit-shrink" for accepted changes; "limit",
	// "invalid-utf8", "char U+XXXX" or a threat pattern's id for rejected ones.
	Reason string `json:"reason"`
	// Detail is for humans: the counts, or the blocked text (bounded).
	Detail       string `json:"detail,omitempty"`
	Limit        int    `json:"limit"` // the limit in force, in code points
	CharsBefore  int    `json:"chars_before"`
	CharsAfter   int    `json:"chars_after"`
	SHA256Before string `json:"sha256_before"` // "" when the file did not exist
	SHA256After  string `json:"sha256_after"`
	PID          uint32 `json:"pid"`               // the writing process
	Process      string `json:"process,omitempty"` // its name (comm), when it could be found
}

// auditLog appends events, each fsynced before append returns.
type auditLog struct {
	path string

	mu   sync.Mutex
	f    *os.File
	torn bool // a failed write may have left a partial line: start the next on a fresh one

	sync func(*os.File) error // (*os.File).Sync; tests observe it
}

func openAudit(path string) (*auditLog, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("memguard: create audit log dir %s: %w", dir, err)
	}
	_, statErr := os.Lstat(path)
	created := errors.Is(statErr, iofs.ErrNotExist)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("memguard: open audit log: %w", err)
	}
	a := &auditLog{path: path, f: f, sync: (*os.File).Sync}
	if err := a.prepare(created); err != nil {
		f.Close()
		return nil, fmt.Errorf("memguard: open audit log %s: %w", path, err)
	}
	return a, nil
}

// prepare makes a new log's directory entry durable, keeps an old log private,
// and ends a line a crash cut short so the next event does not join it.
func (a *auditLog) prepare(created bool) error {
	if created {
		return syncDir(filepath.Dir(a.path))
	}
	fi, err := a.f.Stat()
	if err != nil {
		return err
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("not a regular file (%s)", fi.Mode().Type())
	}
	if fi.Mode().Perm()&0o077 != 0 {
		if err := a.f.Chmod(0o600); err != nil {
			return err
		}
	}
	if fi.Size() == 0 {
		return nil
	}
	last := make([]byte, 1)
	if _, err := a.f.ReadAt(last, fi.Size()-1); err != nil {
		return err
	}
	if last[0] != '\n' {
		a.torn = true
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

func (a *auditLog) append(ev *Event) error {
	line, err := json.Marshal(ev)
	if err != nil {
		return fmt.Errorf("audit log: encode: %w", err)
	}
	line = append(line, '\n')
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.f == nil {
		return fmt.Errorf("audit log %s: closed", a.path)
	}
	if a.torn {
		line = append([]byte{'\n'}, line...)
	}
	if _, err := a.f.Write(line); err != nil {
		a.torn = true
		return fmt.Errorf("audit log %s: append: %w", a.path, err)
	}
	a.torn = false
	if err := a.sync(a.f); err != nil {
		return fmt.Errorf("audit log %s: fsync: %w", a.path, err)
	}
	return nil
}

func (a *auditLog) close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.f == nil {
		return nil
	}
	err := a.f.Close()
	a.f = nil
	if err != nil {
		return fmt.Errorf("memguard: close audit log %s: %w", a.path, err)
	}
	return nil
}

// ReadAudit returns the newest n events of the audit log at path (all of them
// when n <= 0), only rejections when onlyRejected is set, oldest first. It
// reads the file backwards from its end, so the cost follows n, not the log's
// size. A line a crash cut short and lines that are not events are skipped.
// A missing log satisfies errors.Is(err, iofs.ErrNotExist): no change has been
// decided yet.
func ReadAudit(path string, n int, onlyRejected bool) ([]Event, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("memguard: read audit log: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("memguard: read audit log %s: %w", path, err)
	}
	r := &tailReader{f: f, pos: fi.Size()}
	var out []Event
	// The segment after the last newline is empty in a healthy log and a torn
	// line otherwise; either way it is not an event.
	skip := true
	for n <= 0 || len(out) < n {
		line, ok, err := r.prevLine()
		if err != nil {
			return nil, fmt.Errorf("memguard: read audit log %s: %w", path, err)
		}
		if !ok {
			break
		}
		if skip {
			skip = false
			continue
		}
		line = bytes.TrimSpace(line)
		if len(line) == 0 {
			continue
		}
		var ev Event
		if json.Unmarshal(line, &ev) != nil || ev.Verdict == "" {
			continue
		}
		if onlyRejected && ev.Verdict != VerdictRejected {
			continue
		}
		out = append(out, ev)
	}
	slices.Reverse(out)
	return out, nil
}

// tailReader yields a file's newline-separated segments from last to first.
type tailReader struct {
	f    *os.File
	pos  int64  // bytes before pos are not read yet
	buf  []byte // read, not yet yielded; starts at file offset pos
	done bool
}

const tailChunk = 64 << 10

func (t *tailReader) prevLine() ([]byte, bool, error) {
	for {
		if i := bytes.LastIndexByte(t.buf, '\n'); i >= 0 {
			line := t.buf[i+1:]
			t.buf = t.buf[:i]
			return line, true, nil
		}
		if t.pos == 0 {
			if t.done {
				return nil, false, nil
			}
			t.done = true
			line := t.buf
			t.buf = nil
			return line, true, nil
		}
		start := max(0, t.pos-tailChunk)
		chunk := make([]byte, t.pos-start, int(t.pos-start)+len(t.buf))
		if _, err := t.f.ReadAt(chunk, start); err != nil && !errors.Is(err, io.EOF) {
			return nil, false, err
		}
		t.buf = append(chunk, t.buf...)
		t.pos = start
	}
}
