package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
)

const (
	agentUID = 1501 // the agent's user, --owner
	otherUID = 1502 // another user of the host
)

// asUser runs a shell script as uid (its own group, no supplementary
// groups) and returns its combined output and error.
func asUser(uid uint32, dir, script string, env ...string) (string, error) {
	cmd := exec.Command("/bin/sh", "-eu", "-c", script)
	cmd.Dir = dir
	cmd.Env = append([]string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/nonexistent", "LC_ALL=C"}, env...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// ownerHome makes a home directory of agentUID with mode 0750, below
// directories every user may traverse.
func ownerHome(t *testing.T, name string) string {
	t.Helper()
	for _, d := range []string{tmpRoot} {
		if err := os.Chmod(d, 0o711); err != nil {
			t.Fatal(err)
		}
	}
	base := e2eDir(t, name)
	if err := os.Chmod(base, 0o711); err != nil {
		t.Fatal(err)
	}
	mp := filepath.Join(base, "hermes")
	if err := os.Mkdir(mp, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(mp, agentUID, agentUID); err != nil {
		t.Fatal(err)
	}
	return mp
}

// agentWork is what Hermes does in its home, as its own user: atomic
// rename writes, SQLite in WAL mode from two connections at once, flock
// around a read-modify-write, a log rotated while its handler holds it
// open, a memory note.
const agentWork = `
mkdir -p sessions logs memories
i=0
while [ $i -lt 20 ]; do
	printf '{"n":%d}' $i > sessions/.tmp_state
	sync sessions/.tmp_state
	mv -f sessions/.tmp_state sessions/state.json
	i=$((i+1))
done
sqlite3 state.db 'PRAGMA journal_mode=WAL; CREATE TABLE t(w, n);' >/dev/null
for w in 1 2; do
	(
		n=0
		echo '.timeout 20000'
		while [ $n -lt 50 ]; do echo "BEGIN IMMEDIATE; INSERT INTO t VALUES($w, $n); COMMIT;"; n=$((n+1)); done
	) | sqlite3 state.db &
done
echo 0 > counter
for w in 1 2; do
	(
		n=0
		while [ $n -lt 25 ]; do
			flock counter.lock sh -c 'c=$(cat counter); echo $((c+1)) > counter'
			n=$((n+1))
		done
	) &
done
wait
exec 3>>logs/agent.log
echo a >&3
mv logs/agent.log logs/agent.log.1
echo b >&3
exec 3>>logs/agent.log
echo c >&3
exec 3>&-
printf 'Prefers short answers.' > memories/MEMORY.md
echo done
`

// agentFiles are the entries agentWork leaves, all the agent's.
var agentFiles = []string{"sessions", "sessions/state.json", "state.db", "counter", "counter.lock", "logs/agent.log", "logs/agent.log.1", "memories/MEMORY.md"}

func checkOwned(t *testing.T, root string, uid int, names ...string) {
	t.Helper()
	for _, n := range names {
		var st syscall.Stat_t
		if err := syscall.Lstat(filepath.Join(root, n), &st); err != nil {
			t.Errorf("%s: %v", n, err)
			continue
		}
		if int(st.Uid) != uid || int(st.Gid) != uid {
			t.Errorf("%s: owned by %d:%d, want %d:%d", n, st.Uid, st.Gid, uid, uid)
		}
	}
}

// TestOwnerServesAgentUser: a root daemon with --owner serves the agent's
// user, who works in the home as Hermes does; another user is kept out by
// the home's modes; what the agent made stays the agent's in the archive
// and on a new host.
func TestOwnerServesAgentUser(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "sqlite3", "flock", "unsquashfs")
	if os.Geteuid() != 0 {
		missing(t, "root")
	}
	store := e2eDir(t, "store")
	mp := ownerHome(t, "home")
	writeFile(t, filepath.Join(mp, "config.yaml"), "model: x\n", 0o600)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Chown(filepath.Join(mp, "config.yaml"), agentUID, agentUID))

	h := newHost(t, store)
	owner := fmt.Sprintf("%d:%d", agentUID, agentUID)
	d := h.mount(mp, "--owner", owner, "--interval", "0")
	var st syscall.Stat_t
	must(syscall.Stat(mp, &st))
	if st.Uid != agentUID || st.Mode&07777 != 0o750 {
		t.Fatalf("mount root: uid %d mode %o, want %d and 0750", st.Uid, st.Mode&07777, agentUID)
	}

	if out, err := asUser(agentUID, mp, agentWork); err != nil || !strings.HasSuffix(out, "done\n") {
		t.Fatalf("the agent's work as uid %d: %v\n%s", agentUID, err, out)
	}
	checkOwned(t, mp, agentUID, agentFiles...)
	integrityOK(t, filepath.Join(mp, "state.db"))
	if got := sqlite(t, filepath.Join(mp, "state.db"), "SELECT count(*) FROM t;"); got != "100" {
		t.Errorf("rows: %s, want 100", got)
	}
	for p, want := range map[string]string{"counter": "50\n", "sessions/state.json": `{"n":19}`, "logs/agent.log.1": "a\nb\n", "logs/agent.log": "c\n"} {
		if got := mustRead(t, filepath.Join(mp, p)); got != want {
			t.Errorf("%s = %q, want %q", p, got, want)
		}
	}

	// The agent's user asks for status: the daemon and its state dir are
	// root's. Status says that the mount runs, whose daemon it is, and how
	// to see the rest, with exit 0, not "not running ... a killed daemon?".
	bin := hermesfsBin(t)
	wantState := fmt.Sprintf("running (pid %d, as root)", d.cmd.Process.Pid)
	for _, args := range []string{"status " + mp, "status"} {
		out, err := asUser(agentUID, "/", bin+" "+args)
		if err != nil || !strings.Contains(out, wantState) || !strings.Contains(out, "'sudo hermesfs status "+mp+"'") {
			t.Errorf("hermesfs %s as the agent's user: %v, want %q and a pointer to sudo:\n%s", args, err, wantState, out)
		}
	}
	out, err := asUser(agentUID, "/", bin+" status --json "+mp)
	var r daemon.StatusReport
	if err != nil || json.Unmarshal([]byte(out), &r) != nil || !r.Running || r.PID != d.cmd.Process.Pid || r.RunsAs != "root" || r.Restricted == "" {
		t.Errorf("hermesfs status --json as the agent's user: %v, %+v:\n%s", err, r, out)
	}

	// Another user: the home is 0750 and not their group.
	if out, err := asUser(otherUID, "/", "ls "+mp); err == nil || !strings.Contains(out, "Permission denied") {
		t.Errorf("uid %d lists the agent's home: %v %s", otherUID, err, out)
	}
	if out, err := asUser(otherUID, "/", "cat "+filepath.Join(mp, "config.yaml")); err == nil {
		t.Errorf("uid %d reads the agent's config: %s", otherUID, out)
	}
	// The state dir stays root's.
	must(syscall.Stat(h.state, &st))
	if st.Uid != 0 || st.Mode&0o077 != 0 {
		t.Errorf("state dir: uid %d mode %o", st.Uid, st.Mode&07777)
	}
	d.stopOK(t)

	// The archive keeps the owners (unsquashfs as root restores them).
	dst := unsquashLatest(t, store)
	checkOwned(t, dst, agentUID, agentFiles...)
	checkOwned(t, dst, agentUID, ".", "config.yaml")

	// A new host: the agent finds its files its own.
	mp2 := ownerHome(t, "home2")
	h2 := newHost(t, store)
	d2 := h2.mount(mp2, "--owner", owner, "--interval", "0")
	checkOwned(t, mp2, agentUID, agentFiles...)
	if out, err := asUser(agentUID, mp2, `sqlite3 state.db 'INSERT INTO t VALUES(3, 0); SELECT count(*) FROM t;'`); err != nil || strings.TrimSpace(out) != "101" {
		t.Errorf("the agent's database on a new host: %v %s", err, out)
	}
	d2.stopOK(t)
}
