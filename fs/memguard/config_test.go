package memguard

import (
	"fmt"
	iofs "io/fs"
	"log/slog"
	"math"
	"strings"
	"sync"
	"syscall"
	"testing"
)

// configFile is an editable config.yaml behind the ConfigYAML callback.
type configFile struct {
	mu    sync.Mutex
	data  []byte
	err   error
	reads int
}

func (c *configFile) set(data string, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.data, c.err = []byte(data), err
}

func (c *configFile) read() ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.reads++
	if c.err != nil {
		return nil, c.err
	}
	return append([]byte(nil), c.data...), nil
}

// hermesConfig is shaped like Hermes Agent's config.yaml.
const hermesConfig = `model:
  default: anthropic/claude-sonnet-4
terminal:
  backend: local
memory:
  memory_enabled: true
  user_profile_enabled: true
  memory_char_limit: %v
  user_char_limit: %v
`

// limitsOf probes the limits g applies now, through Check: n accepted and n+1
// rejected for both files.
func limitsOf(t *testing.T, g *testGuard, memory, user int) {
	t.Helper()
	g.accept(t, memFile, nil, chars("m ", memory))
	g.reject(t, memFile, nil, chars("m ", memory+1), syscall.EFBIG, ReasonLimit)
	g.accept(t, userFile, nil, chars("u ", user))
	g.reject(t, userFile, nil, chars("u ", user+1), syscall.EFBIG, ReasonLimit)
	if got := g.Limits(t.Context()); got[KindMemory] != memory || got[KindUser] != user {
		t.Fatalf("Limits = %v, want memory %d user %d", got, memory, user)
	}
}

func TestConfigLimits(t *testing.T) {
	cfg := &configFile{}
	cfg.set(fmt.Sprintf(hermesConfig, 3000, 500), nil)
	g := newTestGuard(t, Options{ConfigYAML: cfg.read, MemoryLimit: 100, UserLimit: 50})
	limitsOf(t, g, 3000, 500) // config beats flags

	// An edit takes effect at the next write, no restart.
	cfg.set(fmt.Sprintf(hermesConfig, 1000, 900), nil)
	limitsOf(t, g, 1000, 900)

	// Only one key set: the other comes from its flag.
	cfg.set("memory:\n  memory_char_limit: 4000\n", nil)
	limitsOf(t, g, 4000, 50)

	// No memory section, empty file, memory: null: flags.
	for _, c := range []string{"model:\n  default: x\n", "", "  \n", "memory:\n", "memory: ~\n"} {
		cfg.set(c, nil)
		limitsOf(t, g, 100, 50)
	}
	// Absent file: flags, and nothing to warn about.
	cfg.set("", fmt.Errorf("open config.yaml: %w", iofs.ErrNotExist))
	limitsOf(t, g, 100, 50)
	if w := g.logs.records(t, slog.LevelWarn, "config.yaml"); len(w) != 0 {
		t.Errorf("valid or absent config produced warnings: %v", w)
	}
}

func TestConfigMissingUsesFlagsThenDefaults(t *testing.T) {
	missing := func() ([]byte, error) { return nil, iofs.ErrNotExist }
	limitsOf(t, newTestGuard(t, Options{ConfigYAML: missing, MemoryLimit: 1234, UserLimit: 321}), 1234, 321)
	limitsOf(t, newTestGuard(t, Options{ConfigYAML: missing, UserLimit: 321}), DefaultMemoryLimit, 321)
	limitsOf(t, newTestGuard(t, Options{ConfigYAML: missing}), DefaultMemoryLimit, DefaultUserLimit)
	limitsOf(t, newTestGuard(t, Options{}), DefaultMemoryLimit, DefaultUserLimit)
}

func TestConfigMalformedFallsBackWithOneWarning(t *testing.T) {
	cfg := &configFile{}
	g := newTestGuard(t, Options{ConfigYAML: cfg.read, MemoryLimit: 700})
	warnings := func() int { return len(g.logs.records(t, slog.LevelWarn, "config.yaml")) }

	cfg.set("memory:\n  memory_char_limit: [unclosed\n", nil)
	limitsOf(t, g, 700, DefaultUserLimit)
	limitsOf(t, g, 700, DefaultUserLimit)
	if n := warnings(); n != 1 {
		t.Fatalf("malformed config read %d times, warned %d times; want once", cfg.reads, n)
	}
	if w := g.logs.records(t, slog.LevelWarn, "config.yaml")[0]; !strings.Contains(fmt.Sprint(w["problem"]), "not valid YAML") {
		t.Errorf("warning does not say what is wrong: %v", w)
	}

	// A different malformed content is a new warning, once.
	cfg.set("memory: {\n", nil)
	limitsOf(t, g, 700, DefaultUserLimit)
	limitsOf(t, g, 700, DefaultUserLimit)
	if n := warnings(); n != 2 {
		t.Fatalf("second malformed content: %d warnings, want 2", n)
	}

	// A value Hermes' int() refuses makes Hermes use its defaults for both
	// limits (load_on_disk_store): the flags apply to both, the good key
	// beside it included.
	for _, bad := range []string{`"lots"`, "[1, 2]", "{a: 1}", "3e3", "~", ".nan"} {
		before := warnings()
		cfg.set(fmt.Sprintf(hermesConfig, bad, 800), nil)
		limitsOf(t, g, 700, DefaultUserLimit)
		limitsOf(t, g, 700, DefaultUserLimit)
		if n := warnings() - before; n != 1 {
			t.Errorf("memory_char_limit: %s: %d warnings, want 1", bad, n)
		}
	}
	last := g.logs.records(t, slog.LevelWarn, "config.yaml")
	if p := fmt.Sprint(last[len(last)-1]["problem"]); !strings.Contains(p, "memory.memory_char_limit") || !strings.Contains(p, "line 8") || !strings.Contains(p, "BOTH") {
		t.Errorf("warning %q does not name the key and line, or say that both limits fall back", p)
	}

	// memory is not a mapping.
	cfg.set("memory: 3000\n", nil)
	limitsOf(t, g, 700, DefaultUserLimit)

	// Repaired: honoured again.
	cfg.set(fmt.Sprintf(hermesConfig, 1500, 600), nil)
	limitsOf(t, g, 1500, 600)
}

func TestConfigReadErrorFallsBack(t *testing.T) {
	cfg := &configFile{}
	cfg.set("", fmt.Errorf("read config.yaml: %w", syscall.EIO))
	g := newTestGuard(t, Options{ConfigYAML: cfg.read, MemoryLimit: 900})
	limitsOf(t, g, 900, DefaultUserLimit)
	limitsOf(t, g, 900, DefaultUserLimit)
	w := g.logs.records(t, slog.LevelWarn, "cannot read config.yaml")
	if len(w) != 1 {
		t.Fatalf("read error warned %d times, want 1", len(w))
	}
	if !strings.Contains(fmt.Sprint(w[0]["err"]), "input/output error") {
		t.Errorf("warning lacks the error: %v", w[0])
	}
	// Recovers when the file reads again.
	cfg.set(fmt.Sprintf(hermesConfig, 2000, 1000), nil)
	limitsOf(t, g, 2000, 1000)
}

func TestParseLimitsReportsNothingForValid(t *testing.T) {
	lim, problems := parseLimits([]byte(fmt.Sprintf(hermesConfig, 2200, 1375)))
	if len(problems) != 0 || lim[KindMemory] != 2200 || lim[KindUser] != 1375 {
		t.Fatalf("parseLimits = %v, %v", lim, problems)
	}
	if _, problems := parseLimits([]byte("\tmemory: x\n")); len(problems) != 1 {
		t.Fatalf("tab-indented YAML: problems %v", problems)
	}
}

// TestLimitValues: every rule of Hermes Agent's load_on_disk_store
// (tools/memory_tool.py: PyYAML safe_load of config.yaml, then int() of each
// value inside one try block that falls back to the defaults for both
// limits), one row each. user_char_limit is 900 beside every value, so a row
// also shows whether the value takes the other limit down with it.
func TestLimitValues(t *testing.T) {
	const both = -1 // int() refuses it: both limits fall back (nil, one problem)
	for _, c := range []struct {
		value string
		want  int  // the memory limit; both: none set
		warn  bool // accepted, but worth a warning
	}{
		// ints, as YAML 1.1 writes them
		{"3000", 3000, false},
		{"+3000", 3000, false},
		{"3_000", 3000, false},
		{"0x10", 16, false},
		{"010", 8, false}, // a leading zero is octal in YAML 1.1
		{"0b11", 3, false},
		{"1:30", 90, false}, // base 60
		{"0o17", both, false},
		{"99999999999999999999999", math.MaxInt32, false},
		// quoted numbers: strings, which int() reads
		{"'3000'", 3000, false},
		{`"3000"`, 3000, false},
		{"' 3000 '", 3000, false},
		{"'+3000'", 3000, false},
		{"'3_000'", 3000, false},
		{"'３０００'", 3000, false}, // int() reads the digits of every script
		{"'٣٠٠٠'", 3000, false},
		{"|\n    3000", 3000, false}, // a block scalar: "3000\n"
		{"'3,000'", both, false},
		{"'3000.0'", both, false},
		{"'_3000'", both, false},
		{"'3__000'", both, false},
		{"'lots'", both, false},
		{"lots", both, false},
		{"''", both, false},
		// floats: int() truncates toward zero
		{"2200.5", 2200, false},
		{"2200.", 2200, false},
		{"3.0e+3", 3000, false},
		{"1_000.9", 1000, false},
		{".inf", both, false},
		{".nan", both, false},
		// exponents without a dot or a sign are text to PyYAML
		{"3e3", both, false},
		{"3.0e3", both, false},
		{"'3e3'", both, false},
		// booleans: int(True) is 1
		{"true", 1, true},
		{"yes", 1, true},
		{"On", 1, true},
		{"false", 0, true},
		{"no", 0, true},
		{"'yes'", both, false},
		// zero and negative: Hermes adds nothing
		{"0", 0, true},
		{"-5", 0, true},
		{"'-5'", 0, true},
		{"-0.5", 0, true},
		// null and other types int() refuses
		{"", both, false},
		{"~", both, false},
		{"null", both, false},
		{"2026-01-01", both, false},
		{"[3000]", both, false},
		{"{n: 3000}", both, false},
		// explicit tags
		{"!!int '2500'", 2500, false},
		{"!!str 3000", 3000, false},
		{"!!float '3000'", 3000, false},
	} {
		doc := fmt.Sprintf("memory:\n  memory_char_limit: %s\n  user_char_limit: 900\n", c.value)
		lim, problems := parseLimits([]byte(doc))
		switch {
		case c.want == both:
			if lim != nil || len(problems) != 1 || !strings.Contains(problems[0], "memory.memory_char_limit") || !strings.Contains(problems[0], "BOTH") {
				t.Errorf("%s: limits %v, problems %q; want none set (both fall back) and one problem naming the key", c.value, lim, problems)
			}
		case lim[KindMemory] != c.want || lim[KindUser] != 900 || len(lim) != 2:
			t.Errorf("%s: limits %v (problems %q); want memory %d, user 900", c.value, lim, problems, c.want)
		case c.warn != (len(problems) == 1) || len(problems) > 1:
			t.Errorf("%s: problems %q; want a warning: %v", c.value, problems, c.warn)
		}
	}
}

// TestConfigDocumentRules: what Hermes makes of the file as a whole.
func TestConfigDocumentRules(t *testing.T) {
	const both = -1
	for _, c := range []struct {
		name, doc    string
		memory, user int // both: none set; 0: that key not set
		problem      bool
	}{
		{"one invalid key takes both down", "memory:\n  memory_char_limit: 3000\n  user_char_limit: lots\n", both, both, true},
		{"both invalid", "memory:\n  memory_char_limit: x\n  user_char_limit: y\n", both, both, true},
		{"a missing key keeps its default", "memory:\n  user_char_limit: 500\n", 0, 500, false},
		{"no memory section", "model:\n  default: x\n", both, both, false},
		{"memory: null", "memory:\n", both, both, false},
		{"memory not a mapping", "memory: 3000\n", both, both, true},
		{"memory a list", "memory: [3000]\n", both, both, true},
		{"top level a list", "- memory: 3000\n", both, both, true},
		{"top level text", "memory\n", both, both, true},
		{"only comments", "# memory:\n#   memory_char_limit: 10\n", both, both, false},
		{"not YAML", "memory:\n  memory_char_limit: [unclosed\n", both, both, true},
		{"two documents", "memory:\n  memory_char_limit: 3000\n---\nx: 1\n", both, both, true},
		{"nested elsewhere", "agent:\n  memory:\n    memory_char_limit: 3000\n", both, both, false},
		{"top-level key", "memory_char_limit: 3000\n", both, both, false},
		{"flow mapping", "memory: {memory_char_limit: '3000', user_char_limit: 10}\n", 3000, 10, false},
		{"repeated key: the last wins", "memory:\n  memory_char_limit: 10\n  memory_char_limit: 3000\n", 3000, 0, false},
		{"anchors and merge keys", "base: &b\n  memory_char_limit: 3000\n  user_char_limit: 10\nmemory:\n  <<: *b\n  user_char_limit: 20\n", 3000, 20, false},
		{"alias value", "n: &n 2500\nmemory:\n  memory_char_limit: *n\n", 2500, 0, false},
	} {
		lim, problems := parseLimits([]byte(c.doc))
		if c.problem != (len(problems) > 0) {
			t.Errorf("%s: problems %q, want some: %v", c.name, problems, c.problem)
		}
		if c.memory == both {
			if lim != nil {
				t.Errorf("%s: limits %v, want none set", c.name, lim)
			}
			continue
		}
		m, mok := lim[KindMemory]
		u, uok := lim[KindUser]
		if mok != (c.memory != 0) || m != c.memory || uok != (c.user != 0) || u != c.user {
			t.Errorf("%s: limits %v, want memory %d user %d (0: not set)", c.name, lim, c.memory, c.user)
		}
	}
}

// TestConfigProblemsReported: what config.yaml sets but cannot be used is
// there to show (status), and goes away once repaired.
func TestConfigProblemsReported(t *testing.T) {
	cfg := &configFile{}
	cfg.set(fmt.Sprintf(hermesConfig, "'3000'", "lots"), nil)
	g := newTestGuard(t, Options{ConfigYAML: cfg.read})
	limitsOf(t, g, DefaultMemoryLimit, DefaultUserLimit) // as Hermes: one bad value, both defaults
	p := g.ConfigProblems()
	if len(p) != 1 || !strings.Contains(p[0], "user_char_limit") || !strings.Contains(p[0], "lots") {
		t.Fatalf("problems %q", p)
	}
	cfg.set("", fmt.Errorf("read config.yaml: %w", syscall.EIO))
	if p := g.ConfigProblems(); len(p) != 1 || !strings.Contains(p[0], "cannot read config.yaml") {
		t.Fatalf("read error: problems %q", p)
	}
	cfg.set(fmt.Sprintf(hermesConfig, 3000, 1000), nil)
	if p := g.ConfigProblems(); len(p) != 0 {
		t.Fatalf("repaired: problems %q", p)
	}
	cfg.set("", iofs.ErrNotExist)
	if p := g.ConfigProblems(); len(p) != 0 {
		t.Fatalf("no config.yaml: problems %q", p)
	}
}
