package main

import (
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"
)

// contents maps every regular file of the tree to its size and sha256
// (mtimes left out: churned files get the time they were written).
func contents(t *testing.T, root string) map[string]string {
	t.Helper()
	m := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		m[rel] = fmt.Sprintf("%d %x", len(data), sha256.Sum256(data))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func rows(t *testing.T, db string) string {
	t.Helper()
	out, err := exec.Command("sqlite3", db, "PRAGMA integrity_check; SELECT count(*) FROM messages; SELECT count(*) FROM sessions;").CombinedOutput()
	if err != nil {
		t.Fatalf("sqlite3: %v: %s", err, out)
	}
	return string(out)
}

func TestChurn(t *testing.T) {
	dir, _ := generate(t, 4<<20, 3)
	copyDir := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.Command("cp", "-a", dir, copyDir).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	before := contents(t, dir)
	dbBefore := rows(t, filepath.Join(dir, "state.db"))

	if err := churnRound(dir, 0, 1); err != nil {
		t.Fatal(err)
	}
	after := contents(t, dir)
	var appended, added, deleted, changed []string
	for p, v := range before {
		w, ok := after[p]
		switch {
		case !ok:
			deleted = append(deleted, p)
		case v != w && strings.HasPrefix(p, "sessions/"):
			appended = append(appended, p)
		case v != w:
			changed = append(changed, p)
		}
	}
	for p := range after {
		if _, ok := before[p]; !ok {
			added = append(added, p)
		}
	}
	if len(appended) != 10 {
		t.Errorf("%d session files changed, want 10: %v", len(appended), appended)
	}
	for _, p := range appended {
		var n, m int
		fmt.Sscan(before[p], &n)
		fmt.Sscan(after[p], &m)
		if m <= n {
			t.Errorf("%s: %d bytes, then %d: not appended to", p, n, m)
		}
	}
	if len(deleted) != 1 || !strings.HasPrefix(deleted[0], "cron/output/") {
		t.Errorf("deleted %v, want one cron output", deleted)
	}
	if len(added) != 2 || !strings.HasSuffix(added[0], "/SKILL.md") || !strings.HasSuffix(added[1], "/SKILL.md") {
		t.Errorf("added %v, want 2 SKILL.md", added)
	}
	want := map[string]bool{"state.db": true, "memories/MEMORY.md": true}
	if len(changed) != len(want) || !want[changed[0]] || !want[changed[1]] {
		t.Errorf("changed %v, want state.db and MEMORY.md", changed)
	}
	var msgs, sess, msgs2, sess2 int
	var ok, ok2 string
	fmt.Sscan(dbBefore, &ok, &msgs, &sess)
	fmt.Sscan(rows(t, filepath.Join(dir, "state.db")), &ok2, &msgs2, &sess2)
	if ok2 != "ok" || msgs2 != msgs+200 || sess2 != sess+1 {
		t.Errorf("state.db: %s, %d messages, %d sessions; before %d, %d", ok2, msgs2, sess2, msgs, sess)
	}
	mem, _ := os.ReadFile(filepath.Join(dir, "memories/MEMORY.md"))
	if n := utf8.RuneCount(mem); n > 2200 || !strings.Contains(string(mem), "\n§\n") {
		t.Errorf("MEMORY.md: %d characters (limit 2200)", n)
	}

	// The same round on a copy gives the same content; a second round
	// changes it again.
	if err := churnRound(copyDir, 0, 1); err != nil {
		t.Fatal(err)
	}
	if a, b := fmt.Sprint(after), fmt.Sprint(contents(t, copyDir)); a != b {
		t.Error("round 0 on two copies of one tree gave different contents")
	}
	if err := churnRound(dir, 1, 1); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(contents(t, dir)) == fmt.Sprint(after) {
		t.Error("round 1 changed nothing")
	}
}
