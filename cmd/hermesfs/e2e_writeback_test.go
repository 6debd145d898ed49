package main

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
)

// publishedLine finds the pack and upload times of each published snapshot
// in the daemon's log.
var publishedLine = regexp.MustCompile(`msg="snapshot published" .* pack=(\S+) upload=(\S+)`)

// TestE2EWriteBackKill9: with --write-back, a host that vanishes (kill -9 of
// the daemon and its state dir gone with its disk) loses only the last
// seconds: a new host sees every write acknowledged more than D plus a
// publish or two before the kill.
func TestE2EWriteBackKill9(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	const D = time.Second
	storeDir := e2eDir(t, "store")
	store := "file://" + storeDir
	mp := e2eDir(t, "home")
	a := newHost(t, store)
	d := a.mount(mp, "--interval", "0", "--write-back", D.String())
	dir := filepath.Join(mp, "w")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}

	// A writer: a numbered file every 50ms, fsynced and renamed into
	// place; its number printed once all of that returned.
	script := `i=0; while :; do i=$((i+1)); printf 'content %s\n' $i > "$1/f$i.tmp" && sync "$1/f$i.tmp" && mv "$1/f$i.tmp" "$1/f$i" && sync "$1" && echo $i || exit 1; sleep 0.05; done`
	w := exec.Command("sh", "-c", script, "sh", dir)
	w.Dir = "/"
	out, err := w.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := w.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.Process.Kill(); w.Wait() })
	type ack struct {
		n  int
		at time.Time // when the test read it: after the write returned
	}
	acks := make(chan ack, 1<<16)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			n, _ := strconv.Atoi(sc.Text())
			acks <- ack{n, time.Now()}
		}
		close(acks)
	}()

	// Writes for a while, then the host vanishes.
	time.Sleep(6 * time.Second)
	killed := time.Now()
	d.cmd.Process.Kill()
	d.wait()
	w.Process.Kill()
	w.Wait()
	var all []ack
	for a := range acks {
		all = append(all, a)
	}
	if err := os.RemoveAll(a.state); err != nil {
		t.Fatal(err)
	}
	if fs.IsMountpoint(mp) {
		syscall.Unmount(mp, syscall.MNT_DETACH) // the dead mount
	}

	// One publish: the longest the daemon logged.
	var publish time.Duration
	pubs := publishedLine.FindAllStringSubmatch(d.stderr.String(), -1)
	for _, m := range pubs {
		p, _ := time.ParseDuration(m[1])
		u, _ := time.ParseDuration(m[2])
		publish = max(publish, p+u)
	}
	if len(pubs) < 2 {
		t.Fatalf("%d snapshots published in 6s of writes with --write-back %s:\n%s", len(pubs), D, d.stderr)
	}
	// A change is in a snapshot that starts within D and a poll (or right
	// after the one running then ends) and is published one publish
	// later; a second of margin for the loop.
	cutoff := killed.Add(-(D + D/10 + 2*publish + time.Second))
	var must []ack
	for _, a := range all {
		if a.at.Before(cutoff) {
			must = append(must, a)
		}
	}
	if len(must) == 0 {
		t.Fatalf("no write acknowledged before %s ahead of the kill (%d in all)", killed.Sub(cutoff), len(all))
	}

	// A new host: a fresh state dir, the same store.
	mpB := e2eDir(t, "homeB")
	b := newHost(t, store)
	db := b.mount(mpB, "--read-only")
	newest := 0
	for _, a := range all {
		if got, err := os.ReadFile(filepath.Join(mpB, "w", fmt.Sprintf("f%d", a.n))); err == nil && string(got) == fmt.Sprintf("content %d\n", a.n) {
			newest = a.n
		}
	}
	for _, a := range must {
		got, err := os.ReadFile(filepath.Join(mpB, "w", fmt.Sprintf("f%d", a.n)))
		if err != nil || string(got) != fmt.Sprintf("content %d\n", a.n) {
			t.Errorf("f%d, acknowledged %s before the kill, is not on the new host: %q %v (newest there f%d of %d acknowledged)",
				a.n, killed.Sub(a.at).Round(time.Millisecond), got, err, newest, len(all))
			break
		}
	}
	lost := time.Duration(0)
	if newest < len(all) {
		lost = killed.Sub(all[newest].at) // the first write missing
	}
	t.Logf("%d writes acknowledged, newest on the new host f%d; writes of the last %s lost; %d snapshots, longest publish %s",
		len(all), newest, lost.Round(time.Millisecond), len(pubs), publish)
	if code := db.stop(syscall.SIGTERM); code != 0 {
		t.Errorf("read-only stop: %d", code)
	}
}

// TestWriteBackDefault: a mount given no --write-back and no
// HERMESFS_WRITE_BACK publishes a change by itself, about 10s after it is
// made, with no interval snapshot and no 'hermesfs snapshot' to do it.
func TestWriteBackDefault(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	a := newHost(t, "file://"+storeDir)
	a.extraEnv = append(a.extraEnv, "HERMESFS_WRITE_BACK=") // unset: the default
	d := a.mount(mp, "--interval", "0")
	if r, _ := a.statusJSON(mp); r.WriteBack != defaultWriteBack {
		t.Fatalf("write-back %s by default, want %s", r.WriteBack, defaultWriteBack)
	}
	// An empty home publishes nothing at its first mount: LATEST may not
	// exist yet.
	latest := func() string {
		b, _ := os.ReadFile(filepath.Join(storeDir, "LATEST"))
		return string(b)
	}
	seed := latest()
	if err := os.WriteFile(filepath.Join(mp, "note.txt"), []byte("kept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for latest() == seed {
		if time.Now().After(deadline) {
			t.Fatalf("no snapshot 2 minutes after a change with the default write-back:\n%s", d.stderr)
		}
		time.Sleep(200 * time.Millisecond)
	}
	got, err := os.ReadFile(filepath.Join(unsquashLatest(t, storeDir), "note.txt"))
	if err != nil || string(got) != "kept\n" {
		t.Fatalf("the write-back snapshot's note.txt: %q, %v", got, err)
	}
	d.stopOK(t)
}
