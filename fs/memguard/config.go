package memguard

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"math"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"unicode"

	"gopkg.in/yaml.v3"
)

// configKeys names, per kind, the key under config.yaml's "memory" section.
var configKeys = map[Kind]string{
	KindMemory: "memory_char_limit",
	KindUser:   "user_char_limit",
}

// configCache resolves the limits config.yaml sets. It re-reads the file at
// every call but parses (and warns about) each distinct content only once.
type configCache struct {
	read func() ([]byte, error)
	log  *slog.Logger

	mu       sync.Mutex
	sum      [sha256.Size]byte
	have     bool
	cached   map[Kind]int
	problems []string // what the cached content set that could not be read
	lastErr  string   // the last read error reported, so it is reported once
}

func newConfigCache(read func() ([]byte, error), log *slog.Logger) *configCache {
	return &configCache{read: read, log: log}
}

// limits returns the limits config.yaml sets validly, by kind; an absent,
// unreadable or malformed file, or an absent or invalid key, sets nothing.
func (c *configCache) limits() map[Kind]int {
	if c.read == nil {
		return nil
	}
	data, err := c.read()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		c.have = false
		c.problems = nil
		if errors.Is(err, iofs.ErrNotExist) {
			c.lastErr = ""
			return nil
		}
		if msg := err.Error(); msg != c.lastErr {
			c.lastErr = msg
			c.log.Warn("cannot read config.yaml, using flag or default memory limits", "err", err)
		}
		return nil
	}
	c.lastErr = ""
	sum := sha256.Sum256(data)
	if c.have && sum == c.sum {
		return c.cached
	}
	lim, problems := parseLimits(data)
	for _, p := range problems {
		c.log.Warn("config.yaml: ignoring memory limit, using flag or default", "problem", p)
	}
	c.sum, c.have, c.cached, c.problems = sum, true, lim, problems
	return lim
}

// trouble returns, after reading config.yaml again, why it sets limits
// hermesfs cannot use: its read error, or the values it ignores. Empty when
// every limit it sets is in force (or it sets none).
func (c *configCache) trouble() []string {
	if c.read == nil {
		return nil
	}
	c.limits()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lastErr != "" {
		return []string{"cannot read config.yaml: " + c.lastErr}
	}
	return append([]string(nil), c.problems...)
}

// How Hermes Agent reads the limits, mirrored here. Its tools/memory_tool.py
// function load_on_disk_store (the store the gateway, the desktop app and the
// bare CLI use; agent_init builds the live agent's from the same section)
// does, in one try block:
//
//	config = load_config()            # config.yaml by PyYAML's safe_load, deep-merged over the defaults
//	mem_cfg = config["memory"] if it is a dict, else {}
//	memory_char_limit = int(mem_cfg.get("memory_char_limit", 2200))
//	user_char_limit   = int(mem_cfg.get("user_char_limit", 1375))
//	except Exception: both limits are the defaults
//
// So: a file that is not YAML, or whose top level or memory section is not
// a mapping, sets nothing; a key that is absent keeps its default; a value
// is what PyYAML (YAML 1.1) makes of it, passed to Python's int(); and one
// value int() refuses makes Hermes use the defaults for BOTH limits. hermesfs
// applies the same rules, with its flags (--memory-limit, --user-limit,
// default the same numbers) in place of Hermes' defaults.

// parseLimits returns the limits config.yaml sets for Hermes, by kind (nil:
// none, the flags apply), and what is wrong with it or worth a warning.
func parseLimits(data []byte) (map[Kind]int, []string) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, nil
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var doc yaml.Node
	if err := dec.Decode(&doc); errors.Is(err, io.EOF) {
		return nil, nil // comments only
	} else if err != nil {
		return nil, []string{fmt.Sprintf("not valid YAML (%v): Hermes Agent uses its default memory limits, and hermesfs the flag or default ones", err)}
	}
	var more yaml.Node
	if err := dec.Decode(&more); err == nil {
		return nil, []string{"more than one YAML document (---): Hermes Agent cannot load it and uses its default memory limits, and hermesfs the flag or default ones"}
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) == 0 {
		return nil, nil // comments only
	}
	root := deref(doc.Content[0])
	if isNull(root) {
		return nil, nil
	}
	if root.Kind != yaml.MappingNode {
		return nil, []string{fmt.Sprintf("line %d: the top level is not a mapping: Hermes Agent cannot load it and uses its default memory limits, and hermesfs the flag or default ones", root.Line)}
	}
	sec := lookup(root, "memory")
	if sec == nil || isNull(sec) {
		return nil, nil
	}
	if sec.Kind != yaml.MappingNode {
		return nil, []string{fmt.Sprintf("line %d: memory: not a mapping: Hermes Agent ignores it and uses its default memory limits, and hermesfs the flag or default ones", sec.Line)}
	}
	lim := map[Kind]int{}
	var problems, bad []string
	for _, kind := range []Kind{KindMemory, KindUser} {
		name := configKeys[kind]
		val := lookup(sec, name)
		if val == nil {
			continue
		}
		n, note, err := limitValue(val)
		if err != nil {
			bad = append(bad, fmt.Sprintf("line %d: memory.%s: %v", val.Line, name, err))
			continue
		}
		if note != "" {
			problems = append(problems, fmt.Sprintf("line %d: memory.%s: %s", val.Line, name, note))
		}
		lim[kind] = n
	}
	if len(bad) > 0 {
		// int() raised inside Hermes' try block: both limits fall back.
		for i := range bad {
			bad[i] += "; Hermes Agent then uses its default limits for BOTH files (memory 2200, user 1375), and hermesfs the flag or default ones"
		}
		return nil, bad
	}
	if len(lim) == 0 {
		lim = nil
	}
	return lim, problems
}

// deref follows an alias to the node it names.
func deref(n *yaml.Node) *yaml.Node {
	for n != nil && n.Kind == yaml.AliasNode {
		n = n.Alias
	}
	return n
}

func isNull(n *yaml.Node) bool {
	if n.Kind != yaml.ScalarNode {
		return false
	}
	v := pyScalar(n)
	return v.kind == pyNone
}

// lookup returns the value of key in mapping m as PyYAML builds the dict:
// merge keys ("<<") first, then the mapping's own pairs, the last one of a
// repeated key winning. Nil when absent.
func lookup(m *yaml.Node, key string) *yaml.Node {
	var found *yaml.Node
	for _, p := range pairs(m, 0) {
		k := deref(p[0])
		if k.Kind == yaml.ScalarNode {
			if v := pyScalar(k); v.kind == pyStr && v.s == key {
				found = p[1]
			}
		}
	}
	return deref(found)
}

// pairs flattens mapping m's key/value pairs in the order PyYAML's
// flatten_mapping leaves them: what "<<" merges in (of a list of mappings,
// the first one winning), then m's own pairs.
func pairs(m *yaml.Node, depth int) [][2]*yaml.Node {
	m = deref(m)
	if m == nil || m.Kind != yaml.MappingNode || depth > 16 {
		return nil
	}
	var merged, own [][2]*yaml.Node
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := deref(m.Content[i]), deref(m.Content[i+1])
		if k.Kind == yaml.ScalarNode && k.Style&(yaml.SingleQuotedStyle|yaml.DoubleQuotedStyle|yaml.TaggedStyle) == 0 && k.Value == "<<" {
			switch v.Kind {
			case yaml.MappingNode:
				merged = append(merged, pairs(v, depth+1)...)
			case yaml.SequenceNode:
				for j := len(v.Content) - 1; j >= 0; j-- {
					merged = append(merged, pairs(v.Content[j], depth+1)...)
				}
			}
			continue
		}
		own = append(own, [2]*yaml.Node{k, v})
	}
	return append(merged, own...)
}

// limitValue turns a limit's YAML value into the limit Hermes enforces, as
// Python's int() turns the value PyYAML built. err is int()'s refusal; note,
// if not empty, says why a value it accepts is still worth a warning. A
// negative limit admits nothing, as 0 does; one past 2^31-1 admits
// everything a memory file can hold.
func limitValue(val *yaml.Node) (n int, note string, err error) {
	var v pyValue
	switch val.Kind {
	case yaml.ScalarNode:
		v = pyScalar(val)
	case yaml.SequenceNode:
		v = pyValue{kind: pyOther, what: "a list"}
	default:
		v = pyValue{kind: pyOther, what: "a mapping"}
	}
	i, err := v.int()
	if err != nil {
		return 0, "", err
	}
	switch {
	case v.kind == pyBool:
		note = fmt.Sprintf("%s is the number %d to Hermes Agent (a YAML boolean), and so the limit; write a number", val.Value, i)
	case i <= 0:
		note = fmt.Sprintf("%s leaves no room: Hermes Agent refuses every addition, and hermesfs every change that does not shorten the file", val.Value)
	}
	return int(min(max(i, 0), math.MaxInt32)), note, nil
}

// The Python types a YAML scalar becomes under PyYAML's safe_load.
const (
	pyNone = iota
	pyBool
	pyInt
	pyFloat
	pyStr
	pyOther // a date, binary, a list, a mapping...
)

// pyValue is a scalar as PyYAML constructs it. Ints saturate at the int64
// range (Python's do not; no limit comes near).
type pyValue struct {
	kind int
	b    bool
	i    int64
	f    float64
	s    string
	what string // pyOther: what it is, for messages
	bad  string // the constructor itself failed (PyYAML then loads nothing)
}

// The implicit resolvers of PyYAML (YAML 1.1), resolver.py: a plain scalar
// is the first type whose expression matches. Unlike YAML 1.2, "3e3" and
// "3.0e3" are strings (an exponent needs a dot and a sign), "yes"/"on"
// are booleans, "010" is octal and "1:30" is base 60; "0o17" is a string.
var (
	pyBoolRE  = regexp.MustCompile(`^(?:yes|Yes|YES|no|No|NO|true|True|TRUE|false|False|FALSE|on|On|ON|off|Off|OFF)$`)
	pyFloatRE = regexp.MustCompile(`^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?|\.[0-9_]+(?:[eE][-+][0-9]+)?|[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$`)
	pyIntRE   = regexp.MustCompile(`^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+|[-+]?[1-9][0-9_]*(?::[0-5]?[0-9])+)$`)
	pyNullRE  = regexp.MustCompile(`^(?:~|null|Null|NULL|)$`)
	pyTimeRE  = regexp.MustCompile(`^(?:[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9]|[0-9][0-9][0-9][0-9]-[0-9][0-9]?-[0-9][0-9]?(?:[Tt]|[ \t]+)[0-9][0-9]?:[0-9][0-9]:[0-9][0-9](?:\.[0-9]*)?(?:[ \t]*(?:Z|[-+][0-9][0-9]?(?::[0-9][0-9])?))?)$`)
)

// pyScalar constructs scalar node n as PyYAML's SafeConstructor does: an
// explicit standard tag decides the type, a quoted or block scalar is a
// string, a plain one goes through the implicit resolvers.
func pyScalar(n *yaml.Node) pyValue {
	s := n.Value
	tag := ""
	switch {
	case n.Style&yaml.TaggedStyle != 0:
		tag = n.ShortTag()
	case n.Style&(yaml.SingleQuotedStyle|yaml.DoubleQuotedStyle|yaml.LiteralStyle|yaml.FoldedStyle) != 0:
		tag = "!!str"
	case pyBoolRE.MatchString(s):
		tag = "!!bool"
	case pyFloatRE.MatchString(s):
		tag = "!!float"
	case pyIntRE.MatchString(s):
		tag = "!!int"
	case pyNullRE.MatchString(s):
		tag = "!!null"
	case pyTimeRE.MatchString(s):
		tag = "!!timestamp"
	default:
		tag = "!!str"
	}
	switch tag {
	case "!!str":
		return pyValue{kind: pyStr, s: s}
	case "!!null":
		return pyValue{kind: pyNone}
	case "!!bool":
		switch strings.ToLower(s) {
		case "yes", "true", "on":
			return pyValue{kind: pyBool, b: true}
		case "no", "false", "off":
			return pyValue{kind: pyBool}
		}
		return pyValue{kind: pyOther, bad: fmt.Sprintf("%q is not a YAML boolean", s)}
	case "!!int":
		if i, ok := pyYAMLInt(s); ok {
			return pyValue{kind: pyInt, i: i}
		}
		return pyValue{kind: pyOther, bad: fmt.Sprintf("%q is not a YAML integer", s)}
	case "!!float":
		if f, ok := pyYAMLFloat(s); ok {
			return pyValue{kind: pyFloat, f: f}
		}
		return pyValue{kind: pyOther, bad: fmt.Sprintf("%q is not a YAML float", s)}
	case "!!timestamp":
		return pyValue{kind: pyOther, what: "a date"}
	}
	return pyValue{kind: pyOther, what: "tagged " + tag}
}

// int is Python's int(v).
func (v pyValue) int() (int64, error) {
	switch v.kind {
	case pyNone:
		return 0, errors.New("empty (null), which is not a number")
	case pyBool:
		if v.b {
			return 1, nil
		}
		return 0, nil
	case pyInt:
		return v.i, nil
	case pyFloat:
		switch {
		case math.IsNaN(v.f):
			return 0, errors.New("NaN is not a number")
		case math.IsInf(v.f, 0):
			return 0, errors.New("infinity has no integer value")
		case v.f >= math.MaxInt64:
			return math.MaxInt64, nil
		case v.f <= math.MinInt64:
			return math.MinInt64, nil
		}
		return int64(v.f), nil // toward zero, as int() truncates
	case pyStr:
		if i, ok := pythonInt(v.s); ok {
			return i, nil
		}
		return 0, fmt.Errorf("%q is text, not a whole number (unquoted, YAML 1.1 reads 3e3 and 3.0e3 as text too; write 3000)", v.s)
	}
	if v.bad != "" {
		return 0, errors.New(v.bad)
	}
	return 0, fmt.Errorf("%s, not a number", v.what)
}

// pyYAMLInt is PyYAML's construct_yaml_int: underscores dropped, then
// 0b binary, 0x hex, a leading 0 octal, colons base 60, else decimal.
func pyYAMLInt(s string) (int64, bool) {
	s = strings.ReplaceAll(s, "_", "")
	neg := false
	if s != "" && (s[0] == '-' || s[0] == '+') {
		neg, s = s[0] == '-', s[1:]
	}
	var n int64
	var ok bool
	switch {
	case s == "0":
		return 0, true
	case strings.HasPrefix(s, "0b"):
		n, ok = digits(s[2:], 2)
	case strings.HasPrefix(s, "0x"):
		n, ok = digits(s[2:], 16)
	case strings.HasPrefix(s, "0"):
		n, ok = digits(s, 8)
	case strings.Contains(s, ":"):
		ok = true
		for _, part := range strings.Split(s, ":") {
			d, dok := digits(part, 10)
			ok = ok && dok
			n = satAdd(satMul(n, 60), d)
		}
	default:
		n, ok = digits(s, 10)
	}
	if neg {
		n = -n
	}
	return n, ok
}

// pyYAMLFloat is PyYAML's construct_yaml_float.
func pyYAMLFloat(s string) (float64, bool) {
	s = strings.ToLower(strings.ReplaceAll(s, "_", ""))
	sign := 1.0
	if s != "" && (s[0] == '-' || s[0] == '+') {
		if s[0] == '-' {
			sign = -1
		}
		s = s[1:]
	}
	switch {
	case s == ".inf":
		return sign * math.Inf(1), true
	case s == ".nan":
		return math.NaN(), true
	case strings.Contains(s, ":"):
		var f float64
		for _, part := range strings.Split(s, ":") {
			d, err := strconv.ParseFloat(part, 64)
			if err != nil {
				return 0, false
			}
			f = f*60 + d
		}
		return sign * f, true
	}
	f, err := strconv.ParseFloat(s, 64)
	return sign * f, err == nil
}

// digits parses ASCII digits of base, saturating at the int64 range.
func digits(s string, base int64) (int64, bool) {
	if s == "" {
		return 0, false
	}
	var n int64
	for _, r := range s {
		d := int64(-1)
		switch {
		case r >= '0' && r <= '9':
			d = int64(r - '0')
		case r >= 'a' && r <= 'f':
			d = int64(r-'a') + 10
		case r >= 'A' && r <= 'F':
			d = int64(r-'A') + 10
		}
		if d < 0 || d >= base {
			return 0, false
		}
		n = satAdd(satMul(n, base), d)
	}
	return n, true
}

// satMul and satAdd are a*b and a+b of non-negative a and positive b,
// saturating at math.MaxInt64.
func satMul(a, b int64) int64 {
	if a > math.MaxInt64/b {
		return math.MaxInt64
	}
	return a * b
}

func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// pythonInt parses s as Python's int(s) does: surrounding whitespace, an
// optional sign, decimal digits (of any script: "３０００" is 3000) with
// single underscores between them.
func pythonInt(s string) (int64, bool) {
	s = strings.TrimFunc(s, pySpace)
	neg := false
	if s != "" && (s[0] == '+' || s[0] == '-') {
		neg = s[0] == '-'
		s = s[1:]
	}
	if s == "" || strings.HasPrefix(s, "_") || strings.HasSuffix(s, "_") || strings.Contains(s, "__") {
		return 0, false
	}
	var n int64
	for _, r := range s {
		if r == '_' {
			continue
		}
		d, ok := decimalValue(r)
		if !ok {
			return 0, false
		}
		n = satAdd(satMul(n, 10), int64(d))
	}
	if neg {
		n = -n
	}
	return n, true
}

// pySpace is Python's str.isspace: Go's unicode.IsSpace plus the ASCII
// information separators U+001C..U+001F.
func pySpace(r rune) bool {
	return unicode.IsSpace(r) || r >= 0x1c && r <= 0x1f
}

// decimalValue is the value of a decimal digit of any script (Unicode
// category Nd, which comes in runs of ten from zero to nine).
func decimalValue(r rune) (int, bool) {
	if r >= '0' && r <= '9' {
		return int(r - '0'), true
	}
	if !unicode.Is(unicode.Nd, r) {
		return 0, false
	}
	for _, rg := range unicode.Nd.R16 {
		if r >= rune(rg.Lo) && r <= rune(rg.Hi) {
			return int(r-rune(rg.Lo)) % 10, true
		}
	}
	for _, rg := range unicode.Nd.R32 {
		if r >= rune(rg.Lo) && r <= rune(rg.Hi) {
			return int(r-rune(rg.Lo)) % 10, true
		}
	}
	return 0, false
}
