package memguard

import (
	"fmt"
	iofs "io/fs"
	"log/slog"
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

	// Bad values are ignored key by key: a good key beside them still counts.
	for _, bad := range []string{`"lots"`, "-5", "0", "[1, 2]", "{a: 1}", "99999999999999999999999", "true"} {
		before := warnings()
		cfg.set(fmt.Sprintf(hermesConfig, bad, 800), nil)
		limitsOf(t, g, 700, 800)
		limitsOf(t, g, 700, 800)
		if n := warnings() - before; n != 1 {
			t.Errorf("memory_char_limit: %s: %d warnings, want 1", bad, n)
		}
	}
	last := g.logs.records(t, slog.LevelWarn, "config.yaml")
	if p := fmt.Sprint(last[len(last)-1]["problem"]); !strings.Contains(p, "memory.memory_char_limit") || !strings.Contains(p, "line 8") {
		t.Errorf("warning %q does not name the key and line", p)
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

// TestLimitValues: every form Hermes Agent takes a limit in is read as it
// reads it; what cannot be read is reported, never taken for another number.
func TestLimitValues(t *testing.T) {
	for _, c := range []struct {
		value string
		want  int // 0: refused, reported
	}{
		{"3000", 3000},
		{"'3000'", 3000},
		{`"3000"`, 3000},
		{"' 3000 '", 3000},
		{"'+3000'", 3000},
		{"'3_000'", 3000},
		{"3_000", 3000},
		{"2200.5", 2200},
		{"3.0e3", 3000},
		{"0x10", 16},
		{"!!int '2500'", 2500},
		{"'3,000'", 0},
		{"'3000.0'", 0},
		{"'3e3'", 0},
		{"'_3000'", 0},
		{"'3__000'", 0},
		{"'lots'", 0},
		{"''", 0},
		{"", 0},
		{"~", 0},
		{"true", 0},
		{"'-5'", 0},
		{"0", 0},
		{"-5", 0},
		{".inf", 0},
		{".nan", 0},
		{"99999999999999999999999", 0},
		{"'99999999999999999999999'", 0},
		{"[3000]", 0},
		{"{n: 3000}", 0},
	} {
		doc := fmt.Sprintf("memory:\n  memory_char_limit: %s\n  user_char_limit: 900\n", c.value)
		lim, problems := parseLimits([]byte(doc))
		if lim[KindUser] != 900 {
			t.Errorf("%s: user limit %d, want 900 (one bad key must not hide the other)", c.value, lim[KindUser])
		}
		got, ok := lim[KindMemory]
		switch {
		case c.want == 0 && (ok || len(problems) != 1):
			t.Errorf("%s: limit %d (set %v), problems %q; want it refused and reported", c.value, got, ok, problems)
		case c.want != 0 && (got != c.want || len(problems) != 0):
			t.Errorf("%s: limit %d, problems %q; want %d", c.value, got, problems, c.want)
		}
		if c.want == 0 && len(problems) == 1 && !strings.Contains(problems[0], "memory.memory_char_limit") {
			t.Errorf("%s: problem %q does not name the key", c.value, problems[0])
		}
	}
	// The nesting Hermes reads: only the top-level memory mapping.
	for doc, want := range map[string]int{
		"memory_char_limit: 3000\n":                        0,
		"agent:\n  memory:\n    memory_char_limit: 3000\n": 0,
		"memory:\n  memory_char_limit: 3000\n":             3000,
		"memory: {memory_char_limit: '3000'}\n":            3000,
	} {
		if lim, _ := parseLimits([]byte(doc)); lim[KindMemory] != want {
			t.Errorf("%q: memory limit %d, want %d", doc, lim[KindMemory], want)
		}
	}
}

// TestConfigProblemsReported: what config.yaml sets but cannot be used is
// there to show (status), and goes away once repaired.
func TestConfigProblemsReported(t *testing.T) {
	cfg := &configFile{}
	cfg.set(fmt.Sprintf(hermesConfig, "'3000'", "lots"), nil)
	g := newTestGuard(t, Options{ConfigYAML: cfg.read})
	limitsOf(t, g, 3000, DefaultUserLimit)
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
