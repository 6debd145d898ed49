package memguard

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"path"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"
)

// Kind says which limit applies to a guarded file.
type Kind string

const (
	// KindMemory is the agent's own notes: config key memory.memory_char_limit,
	// flag --memory-limit, default [DefaultMemoryLimit].
	KindMemory Kind = "memory"
	// KindUser is what the agent knows about its user: config key
	// memory.user_char_limit, flag --user-limit, default [DefaultUserLimit].
	KindUser Kind = "user"
)

// Default limits, in Unicode code points, as Hermes Agent ships them.
const (
	DefaultMemoryLimit = 2200
	DefaultUserLimit   = 1375
)

// DefaultFiles are the files guarded when Options.Files is nil.
func DefaultFiles() map[string]Kind {
	return map[string]Kind{
		"memories/MEMORY.md": KindMemory,
		"memories/USER.md":   KindUser,
	}
}

// Reasons recorded in the audit log and carried by [*RejectError]. A rejection
// by a threat pattern carries the pattern's id; one by a blocked character
// carries "char U+XXXX".
const (
	ReasonOK          = "ok"
	ReasonShrink      = "over-limit-shrink"
	ReasonLimit       = "limit"
	ReasonInvalidUTF8 = "invalid-utf8"
	// ReasonAuditLog goes with VerdictError (Options.OnVerdict only): the
	// decision could not be recorded, and the change was refused.
	ReasonAuditLog = "audit-log"
)

// Options configures a Guard. The zero value of every field but AuditLog is
// usable; [New] fills in the defaults.
type Options struct {
	// Files maps each guarded file, as a slash-separated path relative to the
	// mount root ("memories/MEMORY.md"), to the limit that applies to it. Nil
	// means [DefaultFiles]; an empty non-nil map guards nothing.
	Files map[string]Kind

	// MemoryLimit and UserLimit are the --memory-limit and --user-limit flags, in
	// code points. They apply when config.yaml does not set the limit; zero
	// means the default. Negative values are an error.
	MemoryLimit int
	UserLimit   int

	// ConfigYAML returns the current content of the home's config.yaml, or an
	// error satisfying errors.Is(err, iofs.ErrNotExist) when there is none. It
	// is called at every Check (memory writes are rare) so edits take effect
	// at once; it must not go through the mount's guarded write path. Nil
	// means there is no config file.
	ConfigYAML func() ([]byte, error)

	// AuditLog is the path of the JSON-lines audit log, normally in the state
	// dir, outside the mount. Required. Its directory is created (0700) if
	// missing, the file with mode 0600.
	AuditLog string

	// Patterns are the threat patterns of the content scan. Nil means
	// [DefaultPatterns]; to extend, append to DefaultPatterns().
	Patterns []Pattern

	// Logger receives a Warn line per rejection and per malformed
	// config.yaml, an Info line per accepted change. Nil discards.
	Logger *slog.Logger

	// Now is the clock of audit timestamps. Nil means time.Now.
	Now func() time.Time

	// OnVerdict, if set, is called with each decision Check records (the
	// verdict and reason of its audit event), and with VerdictError and
	// ReasonAuditLog for a change refused because it could not be
	// recorded. It is for monitoring: it must be quick and must not call
	// the Guard.
	OnVerdict func(verdict, reason string)
}

// Guard is the memory-file policy. It implements the overlay's Guard interface
// (Guarded, Check). Its methods may be called concurrently.
type Guard struct {
	files   map[string]Kind
	dirs    map[string]bool // every directory that holds a guarded file, at any depth
	flags   map[Kind]int    // flag value, or the default
	scanner *scanner
	config  *configCache
	audit   *auditLog
	log     *slog.Logger
	now     func() time.Time
	proc    string // where process ids are resolved: /proc
	verdict func(verdict, reason string)
}

// New checks opts, fills in defaults, and opens (creating if needed) the audit
// log. Close the Guard when the mount is gone.
func New(opts Options) (*Guard, error) {
	if opts.AuditLog == "" {
		return nil, errors.New("memguard: no audit log path")
	}
	if opts.MemoryLimit < 0 || opts.UserLimit < 0 {
		return nil, fmt.Errorf("memguard: negative limit (memory %d, user %d)", opts.MemoryLimit, opts.UserLimit)
	}
	files := opts.Files
	if files == nil {
		files = DefaultFiles()
	}
	g := &Guard{
		files: make(map[string]Kind, len(files)),
		dirs:  make(map[string]bool),
		flags: map[Kind]int{
			KindMemory: orDefault(opts.MemoryLimit, DefaultMemoryLimit),
			KindUser:   orDefault(opts.UserLimit, DefaultUserLimit),
		},
		log:     opts.Logger,
		now:     opts.Now,
		proc:    "/proc",
		verdict: opts.OnVerdict,
	}
	if g.verdict == nil {
		g.verdict = func(string, string) {}
	}
	if g.log == nil {
		g.log = slog.New(slog.DiscardHandler)
	}
	if g.now == nil {
		g.now = time.Now
	}
	for rel, kind := range files {
		if err := validRel(rel); err != nil {
			return nil, fmt.Errorf("memguard: guarded file %q: %w", rel, err)
		}
		if _, ok := g.flags[kind]; !ok {
			return nil, fmt.Errorf("memguard: guarded file %q: unknown limit kind %q (want %q or %q)", rel, kind, KindMemory, KindUser)
		}
		g.files[rel] = kind
		for d := path.Dir(rel); d != "."; d = path.Dir(d) {
			g.dirs[d] = true
		}
	}
	patterns := opts.Patterns
	if patterns == nil {
		patterns = DefaultPatterns()
	}
	sc, err := newScanner(patterns)
	if err != nil {
		return nil, err
	}
	g.scanner = sc
	g.config = newConfigCache(opts.ConfigYAML, g.log)
	g.audit, err = openAudit(opts.AuditLog)
	if err != nil {
		return nil, err
	}
	return g, nil
}

func orDefault(v, def int) int {
	if v == 0 {
		return def
	}
	return v
}

// validRel accepts what the overlay hands to Guarded: a clean, relative,
// slash-separated path naming something below the root.
func validRel(rel string) error {
	switch {
	case rel == "" || rel == ".":
		return errors.New("empty path")
	case strings.HasPrefix(rel, "/"):
		return errors.New("must be relative to the mount root")
	case path.Clean(rel) != rel:
		return fmt.Errorf("not clean (want %q)", path.Clean(rel))
	case rel == ".." || strings.HasPrefix(rel, "../"):
		return errors.New("outside the mount")
	}
	return nil
}

// Close closes the audit log. Check must not be called after Close.
func (g *Guard) Close() error {
	return g.audit.close()
}

// Guarded reports whether rel (slash-separated, relative to the mount root) is a
// guarded file. It is called on hot paths for every file and does not allocate.
func (g *Guard) Guarded(rel string) bool {
	_, ok := g.files[rel]
	return ok
}

// GuardedBelow reports whether a guarded file may sit below directory rel, so
// that the overlay can skip walking a directory moved to rel when none can.
// The mount root ("" or ".") holds them all.
func (g *Guard) GuardedBelow(rel string) bool {
	return rel == "" || rel == "." || g.dirs[rel]
}

// Limits returns the limits Check would apply now, by kind, after consulting
// config.yaml; for `hermesfs status`.
func (g *Guard) Limits(ctx context.Context) map[Kind]int {
	lim := g.config.limits()
	out := make(map[Kind]int, len(g.flags))
	for k, v := range g.flags {
		if c, ok := lim[k]; ok {
			v = c
		}
		out[k] = v
	}
	return out
}

// ConfigProblems reads config.yaml again and says what in it needs fixing,
// each with its consequence: the file cannot be read or parsed, a value
// Hermes Agent's int() refuses (Hermes then uses its defaults for both
// limits, and the Guard the flag or default ones), or a value that works
// but is surely a mistake (a boolean, a limit of zero or less). Empty when
// config.yaml is absent or sets its limits plainly; for startup and
// `hermesfs status`.
func (g *Guard) ConfigProblems() []string {
	return g.config.trouble()
}

// RejectError is the error of a rejected change. It unwraps to its Errno
// (syscall.EFBIG for the limit, syscall.EPERM for blocked content), so
// errors.Is(err, syscall.EFBIG) works.
type RejectError struct {
	File   string        // guarded path, relative to the mount root
	Reason string        // as in the audit log: "limit", a pattern id, "invalid-utf8", "char U+XXXX"
	Detail string        // for humans: counts, the matched text
	Errno  syscall.Errno // EFBIG or EPERM
}

func (e *RejectError) Error() string {
	return fmt.Sprintf("memguard: %s rejected: %s: %s", e.File, e.Reason, e.Detail)
}

func (e *RejectError) Unwrap() error { return e.Errno }

// Check decides whether new may replace old as the content of the guarded file
// rel; old is nil when the file does not exist yet (an existing empty file is a
// non-nil empty slice). Identical old and new content is not a change: it is
// accepted without being judged or recorded. pid is the id the FUSE request
// carries (the writing thread's); the audit log records the process it belongs
// to. Check returns nil to accept, a *RejectError (wrapping EFBIG or EPERM) to
// reject, or an error wrapping syscall.EIO when the decision could not be
// recorded in the audit log, in which case the change must not be made
// either. Check never modifies old or new and does not keep them.
func (g *Guard) Check(ctx context.Context, rel string, old, new []byte, pid uint32) error {
	kind, ok := g.files[rel]
	if !ok {
		return fmt.Errorf("memguard: check %s: not a guarded file: %w", rel, syscall.EINVAL)
	}
	if old != nil && bytes.Equal(old, new) {
		// A close without writes, or a rewrite of the same bytes: nothing
		// changes, so there is nothing to decide or record. Content that
		// predates the guard is judged when it is changed, not when touched.
		return nil
	}
	limit := g.limit(kind)
	ev := Event{
		File:         rel,
		Limit:        limit,
		CharsBefore:  utf8.RuneCount(old),
		CharsAfter:   utf8.RuneCount(new),
		SHA256Before: digest(old),
		SHA256After:  digest(new),
	}
	ev.PID, ev.Process = process(g.proc, pid)
	rej := g.decide(rel, old, new, &ev)
	if rej != nil {
		ev.Verdict, ev.Reason, ev.Detail = VerdictRejected, rej.Reason, rej.Detail
	} else {
		ev.Verdict = VerdictAccepted
	}
	ev.Time = g.now().UTC()
	if err := g.audit.append(&ev); err != nil {
		g.log.Error("memory change not recorded, refusing it", "file", rel, "pid", pid, "err", err)
		g.verdict(VerdictError, ReasonAuditLog)
		return fmt.Errorf("memguard: check %s: %w: %w", rel, err, syscall.EIO)
	}
	g.verdict(ev.Verdict, ev.Reason)
	attrs := []any{"file", rel, "reason", ev.Reason, "chars_before", ev.CharsBefore,
		"chars_after", ev.CharsAfter, "limit", limit, "pid", ev.PID, "process", ev.Process}
	if rej != nil {
		g.log.Warn("memory change rejected", append(attrs, "detail", rej.Detail, "errno", rej.Errno.Error())...)
		return rej
	}
	g.log.Info("memory change accepted", attrs...)
	return nil
}

// CheckWrite refuses a write that makes the staged content of a guarded
// file certain to be rejected at close, the way RLIMIT_FSIZE refuses a
// write past a size, so that a writer that ignores close(2)'s error
// (`echo ... >> MEMORY.md`) sees the write itself fail. It records
// nothing; the overlay then has Check judge and record the refused content
// at close. old is the committed content (nil for a file the handle
// created).
//
// The limit is judged on every write, with the same shrink rule as Check.
// The content scan is judged only when appendOnly says that nothing but
// appends can follow (a handle opened with O_APPEND): a writer that may
// still overwrite what it wrote (pwrite, an editor filling in a
// placeholder) can still make any content acceptable. Even then only
// what no append can undo is refused (settledReject): a trailing
// incomplete character may still be completed, the last characters may
// still compose with what comes, a pattern that matches up to the end may
// stop matching ("you are now" + "here"), and a prefix of old may still
// become old itself, which is not a change. A truncation can undo
// anything; the overlay lifts such a refusal when the handle cuts the
// file back to where the refused write began.
func (g *Guard) CheckWrite(rel string, old, content []byte, appendOnly bool) error {
	kind, ok := g.files[rel]
	if !ok {
		return nil
	}
	if appendOnly && !(old != nil && bytes.HasPrefix(old, content)) {
		if rej := g.settledReject(rel, content); rej != nil {
			return rej
		}
	}
	limit := g.limit(kind)
	n := partialRuneCount(content)
	if n <= limit {
		return nil
	}
	if before := utf8.RuneCount(old); old != nil && before > limit && n < before {
		return nil
	}
	return &RejectError{File: rel, Reason: ReasonLimit, Errno: syscall.EFBIG,
		Detail: fmt.Sprintf("%d characters exceeds the limit of %d", n, limit)}
}

// settledReject is the content scan's verdict on what no append to b can
// change: decide's first three checks, on the part of b whose verdict is
// settled. nil when nothing there is refused (which says nothing about
// the whole content).
func (g *Guard) settledReject(rel string, b []byte) *RejectError {
	reject := func(reason, detail string) *RejectError {
		return &RejectError{File: rel, Reason: reason, Detail: detail, Errno: syscall.EPERM}
	}
	b = b[:len(b)-incompleteTail(b)]
	if !utf8.Valid(b) {
		return reject(ReasonInvalidUTF8, fmt.Sprintf("not valid UTF-8 at byte %d", invalidUTF8Offset(b)))
	}
	if f := findBlockedChar(b); f != nil {
		return reject(f.reason(), f.detail())
	}
	if m := g.scanner.matchSettled(b); m != nil {
		return reject(m.id, m.detail())
	}
	return nil
}

// limit is the character limit of kind: config.yaml's, else the flags'.
func (g *Guard) limit(kind Kind) int {
	if c, ok := g.config.limits()[kind]; ok {
		return c
	}
	return g.flags[kind]
}

// partialRuneCount counts the characters of content that a writer may
// still be writing: an incomplete UTF-8 sequence at the end counts as the
// one character it will become, not as one per byte.
func partialRuneCount(b []byte) int {
	if k := incompleteTail(b); k > 0 {
		return utf8.RuneCount(b[:len(b)-k]) + 1
	}
	return utf8.RuneCount(b)
}

// incompleteTail is the length of the UTF-8 sequence b ends with that more
// bytes may still complete (0 when b ends with a whole character or with
// bytes no continuation can make valid).
func incompleteTail(b []byte) int {
	for i := len(b) - 1; i >= 0 && i >= len(b)-utf8.UTFMax; i-- {
		if utf8.RuneStart(b[i]) {
			if !utf8.FullRune(b[i:]) {
				return len(b) - i
			}
			return 0
		}
	}
	return 0
}

// decide runs the checks in the order doc.go gives. It fills ev.Reason and
// ev.Detail for accepted changes too.
func (g *Guard) decide(rel string, old, new []byte, ev *Event) *RejectError {
	reject := func(errno syscall.Errno, reason, detail string) *RejectError {
		return &RejectError{File: rel, Reason: reason, Detail: detail, Errno: errno}
	}
	if !utf8.Valid(new) {
		off := invalidUTF8Offset(new)
		return reject(syscall.EPERM, ReasonInvalidUTF8, fmt.Sprintf("not valid UTF-8 at byte %d", off))
	}
	if f := findBlockedChar(new); f != nil {
		return reject(syscall.EPERM, f.reason(), f.detail())
	}
	if m := g.scanner.match(new); m != nil {
		return reject(syscall.EPERM, m.id, m.detail())
	}
	switch {
	case ev.CharsAfter <= ev.Limit:
		ev.Reason = ReasonOK
	case old != nil && ev.CharsBefore > ev.Limit && ev.CharsAfter < ev.CharsBefore:
		ev.Reason = ReasonShrink
		ev.Detail = fmt.Sprintf("%d characters, over the limit of %d but down from %d", ev.CharsAfter, ev.Limit, ev.CharsBefore)
	default:
		return reject(syscall.EFBIG, ReasonLimit, fmt.Sprintf("%d characters exceeds the limit of %d", ev.CharsAfter, ev.Limit))
	}
	return nil
}

func invalidUTF8Offset(b []byte) int {
	for i := 0; i < len(b); {
		r, n := utf8.DecodeRune(b[i:])
		if r == utf8.RuneError && n <= 1 {
			return i
		}
		i += n
	}
	return len(b)
}

// digest is the audit log's hash of a version: "" for a file that did not exist.
func digest(b []byte) string {
	if b == nil {
		return ""
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}
