// Command genhome writes a synthetic Hermes Agent home directory (~/.hermes)
// shaped like a heavy user's, for benchmarks and tests: a large SQLite
// state.db with real rows (made with the sqlite3 command), thousands of
// session JSON files, cron outputs, skills, rotating logs, config, memory
// files, a few symlinks and a state-snapshots/ copy of the database. The
// same -size and -seed always give the same tree (file contents and mtimes).
//
//	go run ./scripts/genhome -size 1G -out /var/tmp/home
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

const usage = `genhome writes a synthetic Hermes Agent home (~/.hermes) of about -size bytes.

Usage:
  go run ./scripts/genhome -size SIZE -out DIR [-seed N] [-install [-entries N]]
  go run ./scripts/genhome churn -dir DIR -round N   (a busy agent's round; see churn -h)

Flags:
  -size SIZE   total size, e.g. 50M, 1G (default 1G). Counts reach their full
               values at 1G (~5,000 sessions, ~2,000 cron outputs, ~1,000
               skill files) and shrink below it; file sizes scale to fill SIZE.
  -out DIR     where to write; must not exist or be empty
  -seed N      the same seed and size always give the same tree (default 1)
  -install     also lay out an installed agent, as Hermes' installer does for
               a normal user: hermes-agent/ (a git clone with packed objects,
               ~6,500 tracked files), hermes-agent/venv/ (the stdlib and some
               site-packages copied from -python, so it imports them with
               PYTHONHOME=venv; generated packages with .pyc and .dist-info),
               hermes-agent/node_modules/ (npm's own dependencies copied from
               -node's install, then generated packages that require one
               another, nested node_modules, .bin symlinks) and node/ (the
               Node.js runtime: -node's binary, npm, corepack). The home's
               own content is the same with and without it.
  -entries N   files, directories and symlinks of the install (default
               120k; 1M for a large one); the copies (~17k entries) are
               fixed, the checkout has 6,500 tracked files from 120k up (fewer
               below), generated packages fill the rest
  -python P    the Python to copy (default python3); needs the packages the
               import benchmark loads (BenchImports in install.go)
  -node P      the node to copy (default node), with npm beside it

What it writes (shares of SIZE):
  state.db                     25%  SQLite, sessions and messages tables (sqlite3)
  state-snapshots/state-*.db   25%  a byte-for-byte copy of state.db
  sessions/*.json              33%  session transcripts, 1 KB - 1 MB each
  cron/output/<job>/*.md        5%  cron job outputs, plus cron/jobs.json
  logs/*.log, *.log.1..5        6%  rotating logs
  skills/<cat>/<skill>/...      3%  SKILL.md, references, scripts
  image_cache/*.png             3%  incompressible bytes (screenshots)
  config.yaml (memory: memory_char_limit 2200, user_char_limit 1375), .env and
  auth.json (0600), SOUL.md, memories/MEMORY.md and USER.md (entries joined by
  "\n§\n", within their limits), and symlinks (one dangling).

Text compresses like real JSON and prose (about 3-4x with zstd), not like
random bytes or zeros. Requires the sqlite3 command.
`

func main() {
	if len(os.Args) > 1 && os.Args[1] == "churn" {
		os.Exit(churnMain(os.Args[2:]))
	}
	fs := flag.NewFlagSet("genhome", flag.ContinueOnError)
	fs.Usage = func() { fmt.Fprint(os.Stderr, usage) }
	sizeFlag := fs.String("size", "1G", "total size")
	out := fs.String("out", "", "output directory")
	seed := fs.Uint64("seed", 1, "random seed")
	withInstall := fs.Bool("install", false, "add an installed agent")
	entriesFlag := fs.String("entries", "120k", "entries of the install")
	python := fs.String("python", "python3", "Python to copy into the venv")
	node := fs.String("node", "node", "node to copy as the runtime")
	if err := fs.Parse(os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		os.Exit(2)
	}
	size, err := parseSize(*sizeFlag)
	entries, cerr := parseCount(*entriesFlag)
	if err == nil && cerr != nil {
		err = fmt.Errorf("-entries %q: %w", *entriesFlag, cerr)
	}
	if err != nil || *out == "" || fs.NArg() != 0 {
		if err != nil {
			fmt.Fprintln(os.Stderr, "genhome:", err)
		}
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	start := time.Now()
	g := &gen{root: *out, size: size, rng: rand.New(rand.NewPCG(*seed, 0x4845524d4553))}
	if err := g.run(); err != nil {
		fmt.Fprintln(os.Stderr, "genhome:", err)
		os.Exit(1)
	}
	fmt.Printf("genhome: %s: %d files, %s in %s\n", *out, g.files, human(g.bytes), time.Since(start).Round(time.Millisecond))
	if *withInstall {
		start = time.Now()
		in, err := install(g, *seed, entries, *python, *node)
		if err != nil {
			fmt.Fprintln(os.Stderr, "genhome: -install:", err)
			os.Exit(1)
		}
		fmt.Printf("genhome: %s: installed agent: %d entries (%d asked), python %s, node %s, in %s\n", *out, in.count, entries, in.python, in.node, time.Since(start).Round(time.Millisecond))
	}
}

func parseSize(s string) (int64, error) {
	t := strings.ToUpper(strings.TrimSuffix(strings.TrimSuffix(strings.TrimSpace(s), "B"), "i"))
	mult := int64(1)
	for suf, m := range map[string]int64{"K": 1 << 10, "M": 1 << 20, "G": 1 << 30} {
		if strings.HasSuffix(t, suf) {
			mult, t = m, strings.TrimSuffix(t, suf)
		}
	}
	n, err := strconv.ParseFloat(t, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("-size %q: want e.g. 50M or 1G", s)
	}
	return int64(n * float64(mult)), nil
}

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%d KiB", n>>10)
}

type gen struct {
	root  string
	size  int64
	rng   *rand.Rand
	files int
	bytes int64
	times []pathTime
	clock time.Time
}

type pathTime struct {
	path string
	t    time.Time
}

// scale is the share of the full-size (1 GiB) counts this size gets.
func (g *gen) scale() float64 { return math.Min(1, float64(g.size)/float64(1<<30)) }

func (g *gen) count(full int, least int) int {
	return max(least, int(math.Round(float64(full)*g.scale())))
}

func (g *gen) run() error {
	if ents, err := os.ReadDir(g.root); err == nil && len(ents) > 0 {
		return fmt.Errorf("%s is not empty", g.root)
	}
	if _, err := exec.LookPath("sqlite3"); err != nil {
		return errors.New("sqlite3 not found (apt-get install sqlite3)")
	}
	g.clock = time.Date(2026, 1, 5, 9, 0, 0, 0, time.UTC)
	if err := os.MkdirAll(g.root, 0o700); err != nil {
		return err
	}
	steps := []func() error{g.config, g.memories, g.sessions, g.cron, g.skills, g.logs, g.images, g.database, g.symlinks}
	for _, step := range steps {
		if err := step(); err != nil {
			return err
		}
	}
	return g.setTimes()
}

// tick advances the fake clock, so mtimes are distinct and deterministic
// (and, at 1 GiB, span a few weeks of 2026 rather than years).
func (g *gen) tick() time.Time {
	g.clock = g.clock.Add(time.Duration(1+g.rng.IntN(20))*time.Second + time.Duration(g.rng.IntN(1e9)))
	return g.clock
}

func (g *gen) write(rel string, data []byte, mode os.FileMode) error {
	p := filepath.Join(g.root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(p, data, mode); err != nil {
		return err
	}
	if err := os.Chmod(p, mode); err != nil {
		return err
	}
	g.files++
	g.bytes += int64(len(data))
	g.times = append(g.times, pathTime{p, g.tick()})
	return nil
}

func (g *gen) config() error {
	cfg := `model:
  default: anthropic/claude-sonnet-4
  provider: openrouter
terminal:
  backend: local
  cwd: ~/work
  timeout: 180
memory:
  memory_enabled: true
  user_profile_enabled: true
  memory_char_limit: 2200
  user_char_limit: 1375
compression:
  enabled: true
  threshold: 0.85
display:
  tool_progress: all
`
	if err := g.write("config.yaml", []byte(cfg), 0o644); err != nil {
		return err
	}
	env := "OPENROUTER_API_KEY=sk-or-v1-" + g.hex(48) + "\nFIRECRAWL_API_KEY=fc-" + g.hex(32) + "\nTELEGRAM_BOT_TOKEN=" + strconv.Itoa(1e9+g.rng.IntN(1e9)) + ":" + g.hex(35) + "\n"
	if err := g.write(".env", []byte(env), 0o600); err != nil {
		return err
	}
	auth := fmt.Sprintf(`{"providers": {"nous": {"access_token": "%s", "refresh_token": "%s", "expires_at": %d}}}`+"\n", g.hex(64), g.hex(64), 1790000000+g.rng.IntN(1e6))
	if err := g.write("auth.json", []byte(auth), 0o600); err != nil {
		return err
	}
	return g.write("SOUL.md", []byte("# Soul\n\n"+g.prose(1500)+"\n"), 0o644)
}

// memories writes MEMORY.md and USER.md: entries joined by "\n§\n", kept
// under the character limits Hermes enforces (2200 and 1375 code points).
func (g *gen) memories() error {
	build := func(limit int) string {
		var entries []string
		total := 0
		for {
			e := strings.TrimSpace(g.prose(60 + g.rng.IntN(200)))
			add := len([]rune(e))
			if len(entries) > 0 {
				add += len([]rune("\n§\n"))
			}
			if total+add > limit*9/10 {
				break
			}
			entries = append(entries, e)
			total += add
		}
		return strings.Join(entries, "\n§\n")
	}
	if err := g.write("memories/MEMORY.md", []byte(build(2200)), 0o644); err != nil {
		return err
	}
	return g.write("memories/USER.md", []byte(build(1375)), 0o644)
}

// sizes draws n sizes log-uniformly in [lo, hi] and scales them to sum to
// about total.
func (g *gen) sizes(n int, lo, hi float64, total int64) []int {
	raw := make([]float64, n)
	sum := 0.0
	for i := range raw {
		raw[i] = math.Exp(math.Log(lo) + g.rng.Float64()*(math.Log(hi)-math.Log(lo)))
		sum += raw[i]
	}
	out := make([]int, n)
	k := float64(total) / sum
	for i := range raw {
		out[i] = max(256, int(raw[i]*k))
	}
	return out
}

type toolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

type message struct {
	Role       string     `json:"role"`
	Content    string     `json:"content"`
	ToolCalls  []toolCall `json:"tool_calls,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
	Timestamp  string     `json:"timestamp"`
}

type session struct {
	SessionID    string    `json:"session_id"`
	Model        string    `json:"model"`
	Platform     string    `json:"platform"`
	SessionStart string    `json:"session_start"`
	LastUpdated  string    `json:"last_updated"`
	SystemPrompt string    `json:"system_prompt"`
	MessageCount int       `json:"message_count"`
	Messages     []message `json:"messages"`
}

var tools = []string{"terminal", "read_file", "write_file", "search_files", "web_search", "web_extract", "browser_navigate", "memory", "skill_view", "execute_code", "patch", "todo"}

func (g *gen) message(role string, n int) message {
	m := message{Role: role, Timestamp: g.tick().Format(time.RFC3339Nano)}
	switch role {
	case "assistant":
		m.Content = g.prose(n)
		if g.rng.IntN(3) > 0 {
			tc := toolCall{ID: "call_" + g.hex(24), Type: "function"}
			tc.Function.Name = tools[g.rng.IntN(len(tools))]
			args, _ := json.Marshal(map[string]string{"command": g.shell(), "path": g.path()})
			tc.Function.Arguments = string(args)
			m.ToolCalls = []toolCall{tc}
		}
	case "tool":
		m.ToolCallID = "call_" + g.hex(24)
		m.Content = g.toolOutput(n)
	default:
		m.Content = g.prose(n)
	}
	return m
}

func (g *gen) sessions() error {
	n := g.count(5000, 20)
	sizes := g.sizes(n, 1<<10, 1<<20, g.size*33/100)
	var newest string
	for i, sz := range sizes {
		t := g.tick()
		id := t.Format("20060102_150405") + "_" + g.hex(6)
		s := session{SessionID: id, Model: "anthropic/claude-sonnet-4", Platform: []string{"cli", "telegram", "discord", "cron"}[g.rng.IntN(4)],
			SessionStart: t.Format(time.RFC3339), SystemPrompt: "You are Hermes, an agent. " + g.prose(200)}
		body := 300
		roles := []string{"user", "assistant", "tool", "assistant"}
		for k := 0; body < sz; k++ {
			m := g.message(roles[k%len(roles)], min(sz-body, 200+g.rng.IntN(4000)))
			body += len(m.Content) + 120
			s.Messages = append(s.Messages, m)
		}
		s.MessageCount = len(s.Messages)
		s.LastUpdated = g.clock.Format(time.RFC3339)
		data, err := json.MarshalIndent(s, "", "  ")
		if err != nil {
			return err
		}
		name := "sessions/session_" + id + ".json"
		if err := g.write(name, data, 0o644); err != nil {
			return err
		}
		if i == len(sizes)-1 {
			newest = "session_" + id + ".json"
		}
	}
	return os.Symlink(newest, filepath.Join(g.root, "sessions", "latest.json"))
}

func (g *gen) cron() error {
	jobs := g.count(40, 3)
	n := g.count(2000, 10)
	sizes := g.sizes(n, 512, 64<<10, g.size*5/100)
	type job struct {
		ID       string `json:"id"`
		Name     string `json:"name"`
		Schedule string `json:"schedule"`
		Prompt   string `json:"prompt"`
	}
	var list []job
	for j := range jobs {
		list = append(list, job{ID: g.hex(12), Name: fmt.Sprintf("job-%02d", j), Schedule: fmt.Sprintf("%d */%d * * *", g.rng.IntN(60), 1+g.rng.IntN(6)), Prompt: g.prose(150)})
	}
	data, _ := json.MarshalIndent(map[string]any{"jobs": list}, "", "  ")
	if err := g.write("cron/jobs.json", data, 0o644); err != nil {
		return err
	}
	for i, sz := range sizes {
		j := list[i%jobs]
		t := g.tick()
		body := fmt.Sprintf("# Cron job: %s\n\n**Job ID:** %s\n**Run Time:** %s\n**Schedule:** %s\n\n## Prompt\n\n%s\n\n## Response\n\n%s\n",
			j.Name, j.ID, t.Format(time.RFC3339), j.Schedule, j.Prompt, g.prose(sz))
		if err := g.write(fmt.Sprintf("cron/output/%s/%s.md", j.ID, t.Format("2006-01-02_15-04-05")), []byte(body), 0o644); err != nil {
			return err
		}
	}
	return nil
}

var categories = []string{"productivity", "research", "software-development", "devops", "data-science", "creative", "mlops", "github", "media", "note-taking"}

func (g *gen) skills() error {
	n := g.count(1000, 10)
	sizes := g.sizes(n, 512, 32<<10, g.size*3/100)
	perSkill := 4
	for i := 0; i < n; i += perSkill {
		cat := categories[(i/perSkill)%len(categories)]
		name := fmt.Sprintf("%s-%s-%d", g.word(), g.word(), i/perSkill)
		dir := filepath.Join("skills", cat, name)
		skill := fmt.Sprintf("---\nname: %s\ndescription: %s\nversion: 1.%d.0\nmetadata:\n  hermes:\n    tags: [%s, %s]\n---\n\n# %s\n\n%s\n",
			name, g.prose(100), g.rng.IntN(9), g.word(), g.word(), name, g.prose(sizes[i]))
		if err := g.write(filepath.Join(dir, "SKILL.md"), []byte(skill), 0o644); err != nil {
			return err
		}
		for k := 1; k < perSkill && i+k < n; k++ {
			var rel string
			var data string
			if k == perSkill-1 {
				rel, data = filepath.Join(dir, "scripts", "run.py"), g.code(sizes[i+k])
			} else {
				rel, data = filepath.Join(dir, "references", fmt.Sprintf("%s.md", g.word())), g.prose(sizes[i+k])
			}
			mode := os.FileMode(0o644)
			if strings.HasSuffix(rel, ".py") {
				mode = 0o755
			}
			if err := g.write(rel, []byte(data), mode); err != nil {
				return err
			}
		}
	}
	return os.Symlink(categories[0], filepath.Join(g.root, "skills", "active"))
}

func (g *gen) logs() error {
	total := g.size * 6 / 100
	names := []string{"agent", "gateway", "errors"}
	for i, name := range names {
		share := total / int64(len(names))
		for r := 0; r <= 5; r++ {
			rel := "logs/" + name + ".log"
			if r > 0 {
				rel += "." + strconv.Itoa(r)
			}
			var b bytes.Buffer
			for int64(b.Len()) < share/6 {
				lvl := []string{"INFO", "INFO", "INFO", "DEBUG", "WARNING", "ERROR"}[g.rng.IntN(6)]
				fmt.Fprintf(&b, "%s - %s - hermes.%s - %s\n", g.tick().Format("2006-01-02 15:04:05,000"), lvl, []string{"agent", "tools", "gateway", "cron", "memory"}[g.rng.IntN(5)], g.prose(40+g.rng.IntN(200)))
			}
			if err := g.write(rel, b.Bytes(), 0o644); err != nil {
				return err
			}
		}
		_ = i
	}
	return os.Symlink("agent.log", filepath.Join(g.root, "logs", "current.log"))
}

func (g *gen) images() error {
	total := g.size * 3 / 100
	n := g.count(60, 2)
	for i, sz := range g.sizes(n, 20<<10, 2<<20, total) {
		data := make([]byte, sz)
		for k := 0; k < len(data); k += 8 {
			v := g.rng.Uint64()
			for j := 0; j < 8 && k+j < len(data); j++ {
				data[k+j] = byte(v >> (8 * j))
			}
		}
		copy(data, "\x89PNG\r\n\x1a\n")
		if err := g.write(fmt.Sprintf("image_cache/screenshot_%04d_%s.png", i, g.hex(8)), data, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// database writes state.db through the sqlite3 command (real SQLite pages,
// indexes and free space) and copies it into state-snapshots/.
func (g *gen) database() error {
	dbPath := filepath.Join(g.root, "state.db")
	cmd := exec.Command("sqlite3", dbPath)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return err
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return err
	}
	w := bufio.NewWriterSize(stdin, 1<<20)
	werr := g.sql(w, g.size*25/100)
	if werr == nil {
		werr = w.Flush()
	}
	stdin.Close()
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("sqlite3: %v: %s", err, stderr.String())
	}
	if werr != nil {
		return werr
	}
	st, err := os.Stat(dbPath)
	if err != nil {
		return err
	}
	g.files++
	g.bytes += st.Size()
	g.times = append(g.times, pathTime{dbPath, g.tick()})
	data, err := os.ReadFile(dbPath)
	if err != nil {
		return err
	}
	snap := "state-snapshots/state-" + g.clock.Format("20060102-150405") + ".db"
	return g.write(snap, data, 0o644)
}

func sqlQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func (g *gen) sql(w io.Writer, target int64) error {
	fmt.Fprint(w, `PRAGMA page_size=4096;
PRAGMA journal_mode=DELETE;
CREATE TABLE sessions (id TEXT PRIMARY KEY, source TEXT NOT NULL, user_id TEXT, model TEXT,
  model_config TEXT, system_prompt TEXT, parent_session_id TEXT, started_at REAL NOT NULL,
  ended_at REAL, end_reason TEXT, message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0,
  input_tokens INTEGER DEFAULT 0, output_tokens INTEGER DEFAULT 0, title TEXT);
CREATE TABLE messages (id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
  role TEXT NOT NULL, content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT,
  timestamp REAL NOT NULL, token_count INTEGER, finish_reason TEXT);
CREATE INDEX idx_messages_session ON messages(session_id, timestamp);
CREATE INDEX idx_sessions_started ON sessions(started_at DESC);
BEGIN;
`)
	// Row overhead and indexes make the file about 10% larger than the
	// text inserted.
	var written int64
	budget := target * 88 / 100
	for s := 0; written < budget; s++ {
		id := g.tick().Format("20060102_150405") + "_" + g.hex(6)
		started := float64(g.clock.UnixNano()) / 1e9
		nmsg := 4 + g.rng.IntN(60)
		fmt.Fprintf(w, "INSERT INTO sessions VALUES(%s,%s,%s,'anthropic/claude-sonnet-4','{}',%s,NULL,%.6f,%.6f,'user_exit',%d,%d,%d,%d,%s);\n",
			sqlQuote(id), sqlQuote([]string{"cli", "telegram", "discord"}[g.rng.IntN(3)]), sqlQuote("u"+g.hex(8)),
			sqlQuote(g.prose(300)), started, started+float64(60+g.rng.IntN(7200)), nmsg, g.rng.IntN(nmsg), g.rng.IntN(200000), g.rng.IntN(50000), sqlQuote(g.prose(40)))
		roles := []string{"user", "assistant", "tool", "assistant"}
		for k := 0; k < nmsg && written < budget; k++ {
			m := g.message(roles[k%4], 100+g.rng.IntN(3000))
			calls := "NULL"
			tool := "NULL"
			if len(m.ToolCalls) > 0 {
				b, _ := json.Marshal(m.ToolCalls)
				calls, tool = sqlQuote(string(b)), sqlQuote(m.ToolCalls[0].Function.Name)
			}
			line := fmt.Sprintf("INSERT INTO messages(session_id,role,content,tool_call_id,tool_calls,tool_name,timestamp,token_count,finish_reason) VALUES(%s,%s,%s,%s,%s,%s,%.6f,%d,'stop');\n",
				sqlQuote(id), sqlQuote(m.Role), sqlQuote(m.Content), sqlQuote(m.ToolCallID), calls, tool, float64(g.clock.UnixNano())/1e9, len(m.Content)/4)
			if _, err := io.WriteString(w, line); err != nil {
				return err
			}
			written += int64(len(line))
		}
	}
	_, err := fmt.Fprint(w, "COMMIT;\nPRAGMA user_version=7;\n")
	return err
}

func (g *gen) symlinks() error {
	// An absolute link to a place that does not exist in the archive's world.
	if err := os.Symlink("/tmp/hermes-workspace", filepath.Join(g.root, "workspace")); err != nil {
		return err
	}
	return os.Symlink("memories/MEMORY.md", filepath.Join(g.root, "MEMORY.md"))
}

// setTimes gives files their fake mtimes, then every directory (deepest
// first) and symlink a deterministic one, so packing the tree twice gives
// the same archive.
func (g *gen) setTimes() error {
	for _, pt := range g.times {
		if err := os.Chtimes(pt.path, pt.t, pt.t); err != nil {
			return err
		}
	}
	var others []string
	err := filepath.WalkDir(g.root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || d.Type()&os.ModeSymlink != 0 {
			others = append(others, p)
		}
		return nil
	})
	if err != nil {
		return err
	}
	sort.Sort(sort.Reverse(sort.StringSlice(others)))
	for _, p := range others {
		ts := unix.NsecToTimespec(g.tick().UnixNano())
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("utimes %s: %w", p, err)
		}
	}
	return nil
}

// Text generators. Words follow a Zipf-like distribution over a fixed
// vocabulary, which gives text the redundancy of real prose and JSON.

var vocab = strings.Fields(`the a to of and in is for that it on with as this be you are can by
or from at an not have will your we if all use file run should when has more one which
session memory agent tool call result user assistant model context prompt skill cron task
output error config command terminal directory path python script function value return
data test build deploy server request response token cache search web page browser code
update install package version review summary plan next step check found created changed
database query table index schema migration commit branch repository issue pull merge
message channel gateway telegram discord schedule job report daily weekly status done
hermes provider api key limit character entry note project workspace document markdown
json yaml list item field string number true false null error warning info debug trace
because however therefore while after before during about between through without
first second last new old same different important useful simple complex quick careful`)

func (g *gen) word() string {
	// Zipf-ish: small indexes far more often.
	i := int(math.Floor(math.Pow(g.rng.Float64(), 2.2) * float64(len(vocab))))
	return vocab[min(i, len(vocab)-1)]
}

func (g *gen) prose(n int) string {
	var b strings.Builder
	b.Grow(n + 16)
	for b.Len() < n {
		words := 6 + g.rng.IntN(18)
		for w := 0; w < words; w++ {
			if w > 0 {
				b.WriteByte(' ')
			}
			switch g.rng.IntN(40) {
			case 0:
				b.WriteString(strconv.Itoa(g.rng.IntN(100000)))
			case 1:
				b.WriteString("`" + g.path() + "`")
			default:
				b.WriteString(g.word())
			}
		}
		b.WriteString(". ")
		if g.rng.IntN(6) == 0 {
			b.WriteString("\n\n")
		}
	}
	return b.String()[:n]
}

func (g *gen) path() string {
	parts := []string{"~", "work", g.word(), g.word() + []string{".py", ".md", ".json", ".ts", ".go"}[g.rng.IntN(5)]}
	return strings.Join(parts, "/")
}

func (g *gen) shell() string {
	cmds := []string{"ls -la ", "cat ", "grep -rn " + g.word() + " ", "python3 ", "git diff ", "pytest -q ", "npm run build --prefix "}
	return cmds[g.rng.IntN(len(cmds))] + g.path()
}

func (g *gen) toolOutput(n int) string {
	var b strings.Builder
	for b.Len() < n {
		switch g.rng.IntN(3) {
		case 0:
			fmt.Fprintf(&b, "-rw-r--r-- 1 agent agent %7d Jan %2d %02d:%02d %s\n", g.rng.IntN(1e6), 1+g.rng.IntN(28), g.rng.IntN(24), g.rng.IntN(60), g.path())
		case 1:
			fmt.Fprintf(&b, "%s:%d: %s\n", g.path(), 1+g.rng.IntN(900), g.prose(60))
		default:
			fmt.Fprintf(&b, "{\"id\": \"%s\", \"status\": \"%s\", \"count\": %d}\n", g.hex(16), g.word(), g.rng.IntN(1000))
		}
	}
	return b.String()[:n]
}

func (g *gen) code(n int) string {
	var b strings.Builder
	b.WriteString("#!/usr/bin/env python3\nimport json\nimport sys\n\n")
	for b.Len() < n {
		fn := g.word() + "_" + g.word()
		fmt.Fprintf(&b, "def %s(%s, %s=None):\n    \"\"\"%s\"\"\"\n    result = {\"%s\": %s}\n    for item in %s or []:\n        result[item] = len(item)\n    return result\n\n",
			fn, g.word(), g.word(), g.prose(60), g.word(), g.word(), g.word())
	}
	return b.String()[:n]
}

func (g *gen) hex(n int) string {
	const digits = "0123456789abcdef"
	b := make([]byte, n)
	for i := range b {
		b[i] = digits[g.rng.IntN(16)]
	}
	return string(b)
}
