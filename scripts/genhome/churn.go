package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

const churnUsage = `genhome churn applies rounds of a busy agent's activity to a Hermes home.

Usage:
  genhome churn -dir DIR -round N [-rounds K] [-seed S]

One round, the same for the same round number and seed (whatever the
directory is: a plain copy or a hermesfs mount), each step with the text
statistics of genhome's tree:
  - 10 session files (sessions/session_*.json) appended to: a message of
    200 B - 4 KiB each;
  - 200 rows inserted into state.db's messages (100 B - 3 KiB of content
    each) under a new session row, in one transaction (the sqlite3 command);
  - memories/MEMORY.md rewritten (temp file, fsync, rename): its oldest
    entry dropped, a new one added;
  - 2 skills added (skills/<category>/<name>/SKILL.md, 1 - 8 KiB);
  - 1 file deleted: the oldest cron output (cron/output/*/*.md), or, once
    there are none, the oldest session file.
-rounds K applies rounds N to N+K-1 in turn (default 1).
`

const churnSalt = 0x636875726e // "churn"

func churnMain(args []string) int {
	fs := flag.NewFlagSet("genhome churn", flag.ContinueOnError)
	fs.Usage = func() { fmt.Fprint(os.Stderr, churnUsage) }
	dir := fs.String("dir", "", "")
	round := fs.Int("round", -1, "")
	rounds := fs.Int("rounds", 1, "")
	seed := fs.Uint64("seed", 1, "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *dir == "" || *round < 0 || *rounds < 1 || fs.NArg() != 0 {
		fmt.Fprint(os.Stderr, churnUsage)
		return 2
	}
	for r := *round; r < *round+*rounds; r++ {
		if err := churnRound(*dir, r, *seed); err != nil {
			fmt.Fprintf(os.Stderr, "genhome churn: round %d: %v\n", r, err)
			return 1
		}
	}
	return 0
}

// churnRound applies round r to the home at dir.
func churnRound(dir string, r int, seed uint64) error {
	g := &gen{root: dir, rng: rand.New(rand.NewPCG(seed^churnSalt, uint64(r)))}
	// The round's own clock: message timestamps and ids sort after the
	// generated tree's and after every earlier round's.
	g.clock = time.Date(2026, 3, 1, 0, 0, 0, 0, time.UTC).Add(time.Duration(r) * 15 * time.Minute)
	for _, step := range []func(int) error{g.appendSessions, g.insertRows, g.rewriteMemory, g.addSkills, g.deleteOne} {
		if err := step(r); err != nil {
			return err
		}
	}
	return nil
}

// sorted lists the files matching pattern under the home, sorted.
func (g *gen) sorted(pattern string) ([]string, error) {
	m, err := filepath.Glob(filepath.Join(g.root, pattern))
	sort.Strings(m)
	return m, err
}

func (g *gen) appendSessions(int) error {
	all, err := g.sorted("sessions/session_*.json")
	if err != nil {
		return err
	}
	if len(all) == 0 {
		return errors.New("no sessions/session_*.json to append to")
	}
	roles := []string{"user", "assistant", "tool", "assistant"}
	for i, k := range g.rng.Perm(len(all))[:min(10, len(all))] {
		m := g.message(roles[i%len(roles)], 200+g.rng.IntN(4000))
		b, err := json.Marshal(m)
		if err != nil {
			return err
		}
		f, err := os.OpenFile(all[k], os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			return err
		}
		_, err = f.Write(append(append([]byte("\n"), b...), '\n'))
		if err == nil {
			err = f.Sync()
		}
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func (g *gen) insertRows(r int) error {
	var sql bytes.Buffer
	id := g.tick().Format("20060102_150405") + "_" + g.hex(6)
	started := float64(g.clock.UnixNano()) / 1e9
	fmt.Fprintf(&sql, "BEGIN;\nINSERT INTO sessions VALUES(%s,'cli',%s,'anthropic/claude-sonnet-4','{}',%s,NULL,%.6f,NULL,NULL,200,0,0,0,%s);\n",
		sqlQuote(id), sqlQuote("u"+g.hex(8)), sqlQuote(g.prose(300)), started, sqlQuote(fmt.Sprintf("busy agent, round %d", r)))
	roles := []string{"user", "assistant", "tool", "assistant"}
	for k := range 200 {
		m := g.message(roles[k%4], 100+g.rng.IntN(3000))
		calls, tool := "NULL", "NULL"
		if len(m.ToolCalls) > 0 {
			b, _ := json.Marshal(m.ToolCalls)
			calls, tool = sqlQuote(string(b)), sqlQuote(m.ToolCalls[0].Function.Name)
		}
		fmt.Fprintf(&sql, "INSERT INTO messages(session_id,role,content,tool_call_id,tool_calls,tool_name,timestamp,token_count,finish_reason) VALUES(%s,%s,%s,%s,%s,%s,%.6f,%d,'stop');\n",
			sqlQuote(id), sqlQuote(m.Role), sqlQuote(m.Content), sqlQuote(m.ToolCallID), calls, tool, float64(g.clock.UnixNano())/1e9, len(m.Content)/4)
	}
	sql.WriteString("COMMIT;\n")
	cmd := exec.Command("sqlite3", "-bail", filepath.Join(g.root, "state.db"))
	cmd.Stdin = &sql
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("sqlite3: %v: %s", err, strings.TrimSpace(stderr.String()))
	}
	return nil
}

func (g *gen) rewriteMemory(int) error {
	p := filepath.Join(g.root, "memories", "MEMORY.md")
	old, err := os.ReadFile(p)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	var entries []string
	if len(old) > 0 {
		entries = strings.Split(string(old), "\n§\n")
	}
	entries = append(entries, strings.TrimSpace(g.prose(60+g.rng.IntN(200))))
	// Oldest entries go until the file is within 90% of Hermes' limit
	// (memory_char_limit 2200).
	for len(entries) > 1 && len([]rune(strings.Join(entries, "\n§\n"))) > 2200*9/10 {
		entries = entries[1:]
	}
	tmp := p + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return err
	}
	w := bufio.NewWriter(f)
	w.WriteString(strings.Join(entries, "\n§\n"))
	err = w.Flush()
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

func (g *gen) addSkills(r int) error {
	for k := range 2 {
		cat := categories[g.rng.IntN(len(categories))]
		name := fmt.Sprintf("%s-%s-r%d-%d", g.word(), g.word(), r, k)
		skill := fmt.Sprintf("---\nname: %s\ndescription: %s\nversion: 1.0.0\nmetadata:\n  hermes:\n    tags: [%s, %s]\n---\n\n# %s\n\n%s\n",
			name, g.prose(100), g.word(), g.word(), name, g.prose(1<<10+g.rng.IntN(7<<10)))
		p := filepath.Join(g.root, "skills", cat, name, "SKILL.md")
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(skill), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func (g *gen) deleteOne(int) error {
	for _, pat := range []string{"cron/output/*/*.md", "sessions/session_*.json"} {
		all, err := g.sorted(pat)
		if err != nil {
			return err
		}
		if len(all) == 0 {
			continue
		}
		// The oldest: names start with their date.
		oldest := all[0]
		for _, p := range all[1:] {
			if filepath.Base(p) < filepath.Base(oldest) {
				oldest = p
			}
		}
		return os.Remove(oldest)
	}
	return nil
}
