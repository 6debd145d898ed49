package memguard

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	iofs "io/fs"
	"log/slog"
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

	mu      sync.Mutex
	sum     [sha256.Size]byte
	have    bool
	cached  map[Kind]int
	lastErr string // the last read error reported, so it is reported once
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
	c.sum, c.have, c.cached = sum, true, lim
	return lim
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
			var n int
			if val.Kind != yaml.ScalarNode || val.Tag != "!!int" || val.Decode(&n) != nil || n <= 0 {
				problems = append(problems, fmt.Sprintf("line %d: memory.%s: %q is not a positive integer", val.Line, name, val.Value))
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
