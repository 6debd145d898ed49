package memguard

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
	"math"
	"strings"
	"sync"

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

// parseLimits reads memory.memory_char_limit and memory.user_char_limit. Each
// key is taken on its own: one bad key does not discard the other. problems
// lists what was ignored and why.
func parseLimits(data []byte) (map[Kind]int, []string) {
	if len(bytes.TrimSpace(data)) == 0 {
		return nil, nil
	}
	var doc struct {
		Memory yaml.Node `yaml:"memory"`
	}
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, []string{fmt.Sprintf("not valid YAML: %v", err)}
	}
	sec := &doc.Memory
	if sec.Kind == 0 || (sec.Kind == yaml.ScalarNode && sec.Tag == "!!null") {
		return nil, nil
	}
	if sec.Kind != yaml.MappingNode {
		return nil, []string{fmt.Sprintf("line %d: memory: not a mapping", sec.Line)}
	}
	var lim map[Kind]int
	var problems []string
	for i := 0; i+1 < len(sec.Content); i += 2 {
		key, val := sec.Content[i], sec.Content[i+1]
		for kind, name := range configKeys {
			if key.Value != name {
				continue
			}
			n, err := limitValue(val)
			if err != nil {
				problems = append(problems, fmt.Sprintf("line %d: memory.%s: %v", val.Line, name, err))
				continue
			}
			if lim == nil {
				lim = make(map[Kind]int, len(configKeys))
			}
			lim[kind] = n
		}
	}
	return lim, problems
}

// limitValue reads a limit as Hermes Agent does: it passes the YAML value
// (as PyYAML loads it) on to its memory store, which compares character
// counts with it and turns it into an int the way Python's int() does. So a
// quoted number counts ("3000", " 3000 ", "3_000", "+3000"), and a float
// counts rounded down (Hermes' check len > 2200.5 is len > 2200). Booleans,
// empty values, other text, lists and mappings are refused with the reason;
// so are limits that are not positive, which leave Hermes no room either.
func limitValue(val *yaml.Node) (int, error) {
	if val.Kind != yaml.ScalarNode {
		return 0, errors.New("not a number (a list or mapping)")
	}
	var n int64
	switch val.ShortTag() {
	case "!!int":
		if err := val.Decode(&n); err != nil {
			return 0, fmt.Errorf("%q: out of range", val.Value)
		}
	case "!!float":
		var f float64
		if err := val.Decode(&f); err != nil || math.IsNaN(f) || math.IsInf(f, 0) || f >= math.MaxInt32 {
			return 0, fmt.Errorf("%q: not a usable number", val.Value)
		}
		n = int64(math.Floor(f))
	case "!!str":
		var ok bool
		if n, ok = pythonInt(val.Value); !ok {
			return 0, fmt.Errorf("%q is not a whole number", val.Value)
		}
	case "!!null":
		return 0, errors.New("empty (Hermes cannot use it either)")
	default:
		return 0, fmt.Errorf("%q is not a number", val.Value)
	}
	if n <= 0 {
		return 0, fmt.Errorf("%d: not a positive number", n)
	}
	if n > math.MaxInt32 {
		return 0, fmt.Errorf("%q: out of range", val.Value)
	}
	return int(n), nil
}

// pythonInt parses s as Python's int(s) does in base 10: surrounding
// whitespace, an optional sign, digits with single underscores between
// them. (Python also takes the decimal digits of other scripts; those are
// refused here, loudly, like any value hermesfs cannot read.)
func pythonInt(s string) (int64, bool) {
	s = strings.TrimSpace(s)
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
		if r < '0' || r > '9' {
			return 0, false
		}
		d := int(r - '0')
		if n > (math.MaxInt64-int64(d))/10 {
			return 0, false
		}
		n = n*10 + int64(d)
	}
	if neg {
		n = -n
	}
	return n, true
}
