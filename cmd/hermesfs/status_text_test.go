package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
)

// TestStatusTextRows: every row has its label, and the figures say what
// they count.
func TestStatusTextRows(t *testing.T) {
	r := daemon.StatusReport{
		Mountpoint: "/home/u/.hermes", Running: true, PID: 42, Store: "file:///s", StateDir: "/st",
		DirtyFiles: 215, DirtyBytes: 4096, Lease: "held",
		Last:                 &daemon.SnapshotRecord{ID: "20261122T134501.123Z-h-1a2b3c4d", Time: time.Now()},
		MemoryLimits:         map[string]int{"memory": 3000, "user": 1375},
		MemoryConfigProblems: []string{`line 3: memory.user_char_limit: "lots" is not a whole number`},
	}
	r.Last.Size, r.Last.BytesUploaded, r.Last.Duration = 1<<20, 512, 1500*time.Millisecond
	var b bytes.Buffer
	if err := printStatus(&b, []daemon.StatusReport{r}, false); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), ":") {
			t.Errorf("row without a label: %q", line)
		}
	}
	for _, want := range []string{
		"last snapshot:  20261122T134501.123Z-h-1a2b3c4d at ",
		"(1.0 MiB archive, 512 B uploaded, took 1.5s)",
		"215 files or directories touched (created, written, renamed or deleted), 4.0 KiB written, since the last snapshot",
		"memory limits:  memory 3000, user 1375 characters",
		"memory config:  WARNING: line 3: memory.user_char_limit",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
}

// TestStatusRecoveryPointRows: the write-back delay, and how old the
// oldest change not in the store is, with the warning once that is past
// its bound.
func TestStatusRecoveryPointRows(t *testing.T) {
	r := daemon.StatusReport{Mountpoint: "/h", Running: true, PID: 1, Lease: "held", WriteBack: 2 * time.Second}
	show := func() string {
		var b bytes.Buffer
		printStatus(&b, []daemon.StatusReport{r}, false)
		return b.String()
	}
	out := show()
	if want := "write-back:     2s: a change reaches the store 2s after it is made"; !strings.Contains(out, want) {
		t.Errorf("status lacks %q:\n%s", want, out)
	}
	if strings.Contains(out, "unpublished") {
		t.Errorf("nothing unpublished, yet a row says so:\n%s", out)
	}
	r.WriteBack, r.Unpublished = 0, true
	r.UnpublishedSince, r.UnpublishedAge = time.Now().Add(-1500*time.Millisecond), 1500*time.Millisecond
	out = show()
	for _, want := range []string{"write-back:     off: changes reach the store at the next snapshot", "unpublished:    yes, for 1.5s: the changes since "} {
		if !strings.Contains(out, want) {
			t.Errorf("status lacks %q:\n%s", want, out)
		}
	}
	r.UnpublishedAge, r.RecoveryPointWarning = 7*time.Minute, "changes made 7m0s ago are not in the store (bound 5m2s): ..."
	if out, want := show(), "unpublished:    WARNING: changes made 7m0s ago are not in the store"; !strings.Contains(out, want) {
		t.Errorf("status lacks %q:\n%s", want, out)
	}
	// What a state dir says of a mount that is not running.
	r = daemon.StatusReport{Mountpoint: "/h", Unpublished: true, Lease: "none"}
	if out, want := show(), "unpublished:    yes: local changes not yet in any snapshot"; !strings.Contains(out, want) || strings.Contains(out, "write-back") {
		t.Errorf("status of a stopped mount: want %q and no write-back row:\n%s", want, out)
	}
}

// TestStatusNextSnapshotDate: a next snapshot due tomorrow shows its date
// (the time of day alone reads as today); one due today shows the time
// alone; --json has the instant in RFC 3339.
func TestStatusNextSnapshotDate(t *testing.T) {
	now := time.Now()
	due := now.Add(24 * time.Hour)
	r := daemon.StatusReport{Mountpoint: "/h", Running: true, PID: 1, Lease: "held", NextDue: due}
	var b bytes.Buffer
	printStatus(&b, []daemon.StatusReport{r}, false)
	if want := "due " + due.Local().Format(time.DateTime) + " (in "; !strings.Contains(b.String(), want) {
		t.Errorf("status lacks %q:\n%s", want, b.String())
	}
	b.Reset()
	printStatus(&b, []daemon.StatusReport{r}, true)
	var j struct {
		NextDue string `json:"next_due"`
	}
	if err := json.Unmarshal(b.Bytes(), &j); err != nil {
		t.Fatal(err)
	}
	if got, err := time.Parse(time.RFC3339, j.NextDue); err != nil || !got.Equal(due) {
		t.Errorf("status --json next_due %q: %v, want %s in RFC 3339", j.NextDue, err, due)
	}

	midnight := time.Date(now.Year(), now.Month(), now.Day(), 0, 0, 0, 0, time.Local)
	for _, c := range []struct {
		t    time.Time
		want string
	}{
		{midnight.Add(90 * time.Minute), midnight.Add(90 * time.Minute).Format(time.TimeOnly)},
		{midnight.Add(-time.Second), midnight.Add(-time.Second).Format(time.DateTime)},
		{midnight.Add(24 * time.Hour), midnight.Add(24 * time.Hour).Format(time.DateTime)},
	} {
		if got := clockTime(c.t, midnight.Add(12*time.Hour)); got != c.want {
			t.Errorf("clockTime(%s) = %q, want %q", c.t, got, c.want)
		}
	}
}

// TestStatusWhileBooting: a daemon that is not ready yet (a first seed)
// is shown as starting, with what it does: from the boot.json of its
// state dir while its control socket does not answer yet, not from one a
// dead daemon left.
func TestStatusWhileBooting(t *testing.T) {
	r := daemon.StatusReport{Mountpoint: "/h", StateDir: "/st", Running: true, PID: 7, Started: time.Now(),
		Boot: "seeding the store from the existing directory: packed 120 of 5000 files (1.2 MiB of 409.6 MiB)"}
	var b bytes.Buffer
	printStatus(&b, []daemon.StatusReport{r}, false)
	for _, want := range []string{"state:       starting, not ready yet (pid 7, since ", "doing:       seeding the store from the existing directory: packed 120 of 5000 files"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, b.String())
		}
	}

	dir := t.TempDir()
	mp, st := filepath.Join(dir, "home"), filepath.Join(dir, "state")
	for _, d := range []string{mp, st} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	writeBoot := func(pid int) {
		b, err := json.Marshal(daemon.BootStatus{PID: pid, Started: time.Now(), Doing: r.Boot, Updated: time.Now()})
		if err == nil {
			err = os.WriteFile(filepath.Join(st, "boot.json"), b, 0o600)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	writeBoot(os.Getpid()) // this process stands in for the booting daemon
	code, out, stderr := runCLI(t, "status", "--state-dir", st, mp)
	if want := fmt.Sprintf("starting, not ready yet (pid %d, since ", os.Getpid()); code != exitOK || !strings.Contains(out, want) || !strings.Contains(out, "packed 120 of 5000 files") {
		t.Errorf("status of a booting daemon: exit %d, want 0 and %q with what it does:\n%s%s", code, want, out, stderr)
	}
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	writeBoot(gone.Process.Pid)
	if code, out, stderr := runCLI(t, "status", "--state-dir", st, mp); code == exitOK || strings.Contains(out+stderr, "starting") {
		t.Errorf("status with the boot.json of a daemon that is gone: exit %d:\n%s%s", code, out, stderr)
	}
}
