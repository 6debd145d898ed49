package memguard

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// blockedChars are the invisible and bidi-control code points the scan rejects,
// with the names a reader of the log needs to recognise them.
var blockedChars = map[rune]string{
	0x200B: "ZERO WIDTH SPACE",
	0x200C: "ZERO WIDTH NON-JOINER",
	0x200D: "ZERO WIDTH JOINER",
	0x2060: "WORD JOINER",
	0x2062: "INVISIBLE TIMES",
	0x2063: "INVISIBLE SEPARATOR",
	0x2064: "INVISIBLE PLUS",
	0xFEFF: "ZERO WIDTH NO-BREAK SPACE (BOM)",
	0x202A: "LEFT-TO-RIGHT EMBEDDING",
	0x202B: "RIGHT-TO-LEFT EMBEDDING",
	0x202C: "POP DIRECTIONAL FORMATTING",
	0x202D: "LEFT-TO-RIGHT OVERRIDE",
	0x202E: "RIGHT-TO-LEFT OVERRIDE",
	0x2066: "LEFT-TO-RIGHT ISOLATE",
	0x2067: "RIGHT-TO-LEFT ISOLATE",
	0x2068: "FIRST STRONG ISOLATE",
	0x2069: "POP DIRECTIONAL ISOLATE",
}

// BlockedChars returns the code points the content scan rejects.
func BlockedChars() []rune {
	out := make([]rune, 0, len(blockedChars))
	for r := range blockedChars {
		out = append(out, r)
	}
	return out
}

type blockedChar struct {
	r    rune
	name string
	at   int // index in code points
}

func (b *blockedChar) reason() string { return fmt.Sprintf("char U+%04X", b.r) }
func (b *blockedChar) detail() string {
	if b.r < 0x20 {
		return fmt.Sprintf("blocked control character U+%04X %s at character %d", b.r, b.name, b.at)
	}
	return fmt.Sprintf("blocked invisible character U+%04X %s at character %d", b.r, b.name, b.at)
}

// controlName names a C0 control character a memory file may not hold:
// all of U+0000..U+001F but tab, newline and carriage return. Hermes
// reads the files as text and splits them into entries; a NUL (which a
// file grown with ftruncate is filled with) or an escape breaks that, and
// none of them has a place in a note. "" for any other rune.
func controlName(r rune) string {
	if r >= 0x20 || r == '\t' || r == '\n' || r == '\r' {
		return ""
	}
	if r == 0 {
		return "NUL"
	}
	if r == 0x1B {
		return "ESCAPE"
	}
	return "(control character)"
}

// findBlockedChar returns the first blocked code point of valid UTF-8 text
// b: a control character (controlName) or an invisible one (blockedChars).
func findBlockedChar(b []byte) *blockedChar {
	at := 0
	for i := 0; i < len(b); at++ {
		r, n := utf8.DecodeRune(b[i:])
		i += n
		if r < 0x20 {
			if name := controlName(r); name != "" {
				return &blockedChar{r: r, name: name, at: at}
			}
			continue
		}
		if r < 0x200B { // the other blocked code points are above; most text is below
			continue
		}
		if name, ok := blockedChars[r]; ok {
			return &blockedChar{r: r, name: name, at: at}
		}
	}
	return nil
}

// Pattern is one threat pattern of the content scan.
type Pattern struct {
	// ID is stable: it is the reason in the audit log and in errors, and
	// people grep for it. Lower case, words joined by hyphens.
	ID string
	// Description says what the pattern catches, for humans.
	Description string
	// Regexp (RE2 syntax) is matched case-insensitively against the content
	// after Unicode NFKC normalisation; write it in plain ASCII/lower case.
	Regexp string
	// Keywords, when given, are lower-case strings of which every match of
	// Regexp contains at least one: the regexp is tried only on text that
	// holds one of them. It is a filter for speed (most memory text holds
	// none) and must never hide a match; the tests check that it does not.
	Keywords []string
}

// DefaultPatterns returns the built-in threat patterns, a fresh slice each call
// so that callers may append their own.
//
// They aim at text that has no business in an agent's long-term memory and
// would act on the agent when the memory is loaded into its prompt: orders to
// drop its instructions, identity switches, smuggled system prompts, and shell
// commands that send secrets away or plant access. Each is written to leave
// ordinary notes alone: mentioning curl, ssh keys, a .env file or "the system
// prompt" as a topic passes; using them in those ways does not.
func DefaultPatterns() []Pattern {
	return []Pattern{
		{
			ID:          "ignore-instructions",
			Description: "an order to ignore, disregard or forget earlier instructions",
			Regexp:      `\b(?:ignore|disregard|forget)\s+(?:(?:all|any|every|of|the|these|those|your|my)\s+){0,3}(?:previous|prior|above|earlier|preceding|foregoing|all|any|your|system|developer|original)\s+(?:instructions?|prompts?|directives?|rules|guidelines|guardrails)\b`,
			Keywords:    []string{"ignore", "disregard", "forget"},
		},
		{
			ID:          "role-hijack",
			Description: "an identity switch aimed at the agent (\"you are now ...\")",
			Regexp:      `\byou\s+are\s+now\b|\bfrom\s+now\s+on,?\s+you\s+are\b|\bact\s+as\s+(?:if|though)\s+you\s+(?:have|had)\s+no\s+(?:restrictions|limits|rules|guidelines)\b`,
			Keywords:    []string{"you"},
		},
		{
			ID:          "system-prompt-override",
			Description: "a replacement or override of the system prompt",
			Regexp:      `\b(?:override|overwrite|replace|ignore|disregard|bypass)\s+(?:the\s+|your\s+|my\s+|any\s+|all\s+)?system\s+prompts?\b|\bsystem\s+prompt\s+(?:override|overwrite|replacement)\b|\bnew\s+system\s+prompt\s*[:=]`,
			Keywords:    []string{"system"},
		},
		{
			ID:          "chat-template-tokens",
			Description: "chat template control tokens that fake a new conversation turn",
			Regexp:      `<\|(?:im_start|im_end|system|endoftext|start_header_id|end_header_id|eot_id)\|>|\[/?inst\]|<<sys>>`,
			Keywords:    []string{"<|", "inst]", "<<sys>>"},
		},
		{
			ID:          "hide-from-user",
			Description: "an instruction to keep something from the user",
			Regexp:      `\b(?:do\s+not|don['’]t|never)\s+(?:tell|inform)\s+the\s+user\b|\bwithout\s+(?:telling|informing)\s+the\s+user\b`,
			Keywords:    []string{"user"},
		},
		{
			ID:          "exfil-secret-env",
			Description: "curl or wget sending an environment variable that holds a key, token, secret or password",
			Regexp:      `\b(?:curl|wget)\b[^\n]*` + secretVar + `|` + secretVar + `[^\n]*\|\s*(?:curl|wget)\b`,
			Keywords:    []string{"curl", "wget"},
		},
		{
			ID:          "exfil-env-dump",
			Description: "the whole environment piped or posted to the network",
			Regexp:      `\b(?:env|printenv|set)\s*\|\s*(?:curl|wget|nc|ncat|netcat)\b|\b(?:curl|wget)\b[^\n]*\$\(\s*(?:env|printenv)\s*\)`,
			Keywords:    []string{"curl", "wget", "nc", "netcat"},
		},
		{
			ID:          "ssh-authorized-keys",
			Description: "a write to an ssh authorized_keys file",
			Regexp:      `(?:>>?|\btee\b|\bcp\b|\bmv\b|\bscp\b|\brsync\b|\binstall\b|\bssh-copy-id\b|\b(?:add|append|write|insert|put)\b[^\n]*\bto\b)[^\n]*authorized_keys2?\b`,
			Keywords:    []string{"authorized_keys"},
		},
		{
			ID:          "read-hermes-env",
			Description: "reading the agent's own secrets file ~/.hermes/.env",
			Regexp:      `\b(?:cat|less|more|head|tail|source|grep|awk|sed|base64|xxd|od|strings|cp|scp|rsync|curl|wget|dump|send|upload|post|exfiltrate)\b[^\n]*\.hermes/\.env\b|\bopen\s*\([^\n]*\.hermes/\.env\b|(?m:^|[\s;&|(])\.\s+\S*\.hermes/\.env\b`,
			Keywords:    []string{".hermes/.env"},
		},
	}
}

// secretVar is a shell variable whose name says it holds a credential:
// $API_KEY, ${GITHUB_TOKEN}, $OPENAI_API_KEY, $DB_PASSWORD ...
const secretVar = `\$\{?(?:\w*_)?(?:api_?)?(?:key|token|secret|passw(?:or)?d|credentials?|auth)(?:_\w*)?\}?\b`

type compiledPattern struct {
	Pattern
	re       *regexp.Regexp
	keywords [][]byte
}

type scanner struct {
	patterns []compiledPattern
}

func newScanner(ps []Pattern) (*scanner, error) {
	s := &scanner{patterns: make([]compiledPattern, 0, len(ps))}
	seen := make(map[string]bool, len(ps))
	for _, p := range ps {
		if p.ID == "" {
			return nil, fmt.Errorf("memguard: pattern %q: empty id", p.Regexp)
		}
		if seen[p.ID] {
			return nil, fmt.Errorf("memguard: pattern %s: duplicate id", p.ID)
		}
		seen[p.ID] = true
		re, err := regexp.Compile(`(?i)` + p.Regexp)
		if err != nil {
			return nil, fmt.Errorf("memguard: pattern %s: %w", p.ID, err)
		}
		cp := compiledPattern{Pattern: p, re: re}
		for _, k := range p.Keywords {
			if k == "" || k != strings.ToLower(k) {
				return nil, fmt.Errorf("memguard: pattern %s: keyword %q: want non-empty lower case", p.ID, k)
			}
			cp.keywords = append(cp.keywords, []byte(k))
		}
		s.patterns = append(s.patterns, cp)
	}
	return s, nil
}

type patternMatch struct {
	id   string
	text string
}

func (m *patternMatch) detail() string {
	return fmt.Sprintf("matched threat pattern %s: %q", m.id, m.text)
}

// match returns the first pattern, in table order, found in the NFKC form of b.
func (s *scanner) match(b []byte) *patternMatch {
	if len(s.patterns) == 0 {
		return nil
	}
	text := norm.NFKC.Bytes(b)
	// Lower case after NFKC folds every letter the case-insensitive regexps
	// fold (the Kelvin sign and long s became k and s in NFKC already), so
	// a keyword missing here cannot be in a match.
	lower := bytes.ToLower(text)
	for i := range s.patterns {
		p := &s.patterns[i]
		if len(p.keywords) > 0 && !containsAny(lower, p.keywords) {
			continue
		}
		if loc := p.re.FindIndex(text); loc != nil {
			return &patternMatch{id: p.ID, text: excerpt(string(text[loc[0]:loc[1]]))}
		}
	}
	return nil
}

// matchSettled returns a pattern match in valid UTF-8 text b that every
// text b is a prefix of matches too. Normalisation is settled up to the
// last boundary of b (NFKC of what precedes a boundary does not depend on
// what follows it), so the NFKC form of that part is a prefix of the NFKC
// form of any longer text. A match of that prefix that ends before its
// last character holds in the longer text as well: a match of an RE2
// regexp depends only on the text it spans and on the characters on
// either side (\b, ^, $); one that ends at the very end may not (\b,
// $, or a repetition the next bytes would extend differently), so it is
// not counted, nor is any match it overlaps and hides.
func (s *scanner) matchSettled(b []byte) *patternMatch {
	if len(s.patterns) == 0 {
		return nil
	}
	cut := norm.NFKC.LastBoundary(b)
	if cut <= 0 {
		return nil
	}
	text := norm.NFKC.Bytes(b[:cut])
	lower := bytes.ToLower(text)
	for i := range s.patterns {
		p := &s.patterns[i]
		if len(p.keywords) > 0 && !containsAny(lower, p.keywords) {
			continue
		}
		for _, loc := range p.re.FindAllIndex(text, -1) {
			if loc[1] < len(text) {
				return &patternMatch{id: p.ID, text: excerpt(string(text[loc[0]:loc[1]]))}
			}
		}
	}
	return nil
}

func containsAny(b []byte, words [][]byte) bool {
	for _, w := range words {
		if bytes.Contains(b, w) {
			return true
		}
	}
	return false
}

// excerpt bounds what a match puts into logs.
func excerpt(s string) string {
	const max = 120
	if utf8.RuneCountInString(s) <= max {
		return s
	}
	r := []rune(s)
	return strings.TrimSpace(string(r[:max])) + "…"
}
