// Package memguard is the policy behind the memory write hook: it decides whether
// a complete new version of a memory file (memories/MEMORY.md, memories/USER.md, or
// any file added to Options.Files) may replace the old one, and records every
// decision in an audit log.
//
// # Where it sits
//
// The overlay (package fs) owns the mechanics: for a guarded path it stages the
// writer's bytes privately and, at close or at a rename over the guarded name,
// hands the whole new content to [Guard.Check]. Check is pure policy plus one
// fsynced append; it never touches the mounted tree. memguard does not import fs:
// *Guard satisfies fs.Guard structurally (the tests pin that with a compile-time
// check).
//
// # Verdicts, in order
//
//  1. Invalid UTF-8: rejected with EPERM, reason "invalid-utf8". Counting characters
//     of bytes that are not text would be a guess.
//  2. A blocked invisible or bidi-control code point (zero-width characters, word
//     joiners, the BOM, bidi embeddings, overrides and isolates): EPERM, reason
//     "char U+XXXX". These hide text from a human reading the file.
//  3. A threat pattern (see [DefaultPatterns]), matched case-insensitively on the
//     NFKC-normalised text so that fullwidth or mathematical letters and
//     compatibility spaces cannot dodge it: EPERM, reason the pattern's id.
//  4. Over the character limit: EFBIG, reason "limit".
//
// The content scan wins over the limit: content that is blocked stays blocked
// however short it is made, so a writer told "too big" would only trim, retry and
// then learn the real reason. EPERM for content that is both is the more useful
// answer, and the audit log records what was found.
//
// Writes are refused early ([Guard.CheckWrite], the overlay's optional
// fs.GuardWriteChecker) when the content they make is certain to be refused at
// close, so that a shell redirection (which ignores close's error) still fails:
// the write(2) that takes the staged content past the limit fails with EFBIG, as a
// write past RLIMIT_FSIZE does; an append (a handle opened with O_APPEND, which
// can only add) that puts in what no further append can take out fails with
// EPERM: invalid UTF-8 before a trailing incomplete character, a blocked
// character, a threat pattern whose match ends before the last character of the
// NFKC-settled text (up to the last normalisation boundary, so what follows
// cannot recompose it). A match that reaches the end may still be undone ("you
// are now" + "here"); a prefix of the old content may still become it again (no
// change); a writer that can overwrite (no O_APPEND) may still replace any
// byte: those wait for Check at close. The overlay then commits nothing from
// that handle (unless a truncation cuts the refused append away) and has Check
// judge and record the refused content at close, once.
//
// Closing a guarded file without changing its bytes is not a change: it is
// accepted and not recorded, whatever the content, so a file that predates the
// guard can still be opened and closed; it is judged when it is changed.
//
// One exception softens the limit: when the file already holds more than its
// limit (the limit was lowered after it was written, or the file came from an
// older snapshot) a change that makes it strictly shorter is accepted, with reason
// "over-limit-shrink". Without it, removing one entry at a time (which is how
// Hermes' memory tool edits) would be refused until a single write got under the
// new limit in one go.
//
// # Limits
//
// A limit counts Unicode code points of the whole file, entry delimiters
// ("\n§\n") included: not bytes, not tokens, not entries. Each guarded file has a
// [Kind]; the limit of a kind is resolved at every Check, first match wins:
// the home's config.yaml (memory.memory_char_limit, memory.user_char_limit), read
// exactly as Hermes Agent reads it (config.go: YAML 1.1 types as PyYAML makes
// them, Python's int() of each value, and one value int() refuses sends both
// limits to their defaults); else the flag value in Options; else the default
// (2,200 and 1,375). config.yaml is read through a callback so
// that editing it takes effect without a remount; the parsed result is cached by
// the content's hash, and a malformed file is reported once per distinct content
// (a Warn log line) and otherwise ignored, never blocking a write.
//
// # Audit log
//
// Every decision, accepted or rejected, is one JSON object per line appended to
// Options.AuditLog (mode 0600) and fsynced before Check returns: the log is the
// transaction log of memory mutations, so a change that cannot be recorded is not
// made (Check fails with EIO). It records decisions: a change accepted here can
// still fail afterwards in the overlay (a full disk), and its writer then gets
// that error. Appends are serialised by a mutex; Check may be called from many
// goroutines. The id a FUSE request carries is the writing
// thread's; the log resolves it through /proc to the process and its name, so a
// line says "sed" or "python3". [ReadAudit] reads the newest events from the
// end of the file without reading all of it.
//
// # Cost
//
// Guarded and GuardedBelow are map lookups that do not allocate: the overlay
// asks them on every open, create and rename of any file, so files that are
// not guarded pay nothing measurable (scripts/bench-hook.sh). Check reads
// config.yaml, scans a few kilobytes and makes one fsynced append; memory
// files change a few times a session.
package memguard
