package fs

import (
	"errors"
	"os"
	"syscall"
	"testing"
)

// TestRefuseWritesThenAllow mounts an upper layer with changes with
// RefuseWrites: the merged tree shows, every kind of change fails with
// EROFS although the kernel mount is writable, and the upper layer stays
// as it was; after AllowWrites, on the same mount, changes go through.
func TestRefuseWritesThenAllow(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	e.write("upper.txt", "changed before")
	must(t, os.Remove(e.path("secret.txt")))
	e.unmount()
	before := stateOfDir(t, e.upper)

	e.opts.RefuseWrites = true
	e.mount()
	if !e.m.WritesRefused() {
		t.Fatal("WritesRefused is false on a mount made with RefuseWrites")
	}
	var sfs syscall.Statfs_t
	must(t, syscall.Statfs(e.mnt, &sfs))
	if sfs.Flags&0x1 != 0 { // ST_RDONLY
		t.Fatal("the kernel mount is read-only: AllowWrites could not make it writable")
	}
	if got := e.read("upper.txt"); got != "changed before" {
		t.Errorf("upper file reads %q", got)
	}
	if got := e.read("a/b/two.txt"); got != "two" {
		t.Errorf("lower file reads %q", got)
	}
	e.missing("secret.txt")
	for what, err := range roAttempts(e.mnt) {
		if !errors.Is(err, syscall.EROFS) {
			t.Errorf("%s while writes are refused: %v, want EROFS", what, err)
		}
	}
	if err := syscall.Access(e.path("top.txt"), 2); !errors.Is(err, syscall.EROFS) && err != nil {
		t.Errorf("access(W_OK): %v, want EROFS or ok", err)
	}
	diffStates(t, "upper layer while writes are refused", stateOfDir(t, e.upper), before)

	e.m.AllowWrites()
	if e.m.WritesRefused() {
		t.Fatal("WritesRefused after AllowWrites")
	}
	e.write("new.txt", "written once allowed")
	must(t, os.WriteFile(e.path("top.txt"), []byte("changed after"), 0o644))
	must(t, os.Mkdir(e.path("d"), 0o755))
	must(t, os.Rename(e.path("a/one.txt"), e.path("d/one.txt")))
	if got := e.read("new.txt"); got != "written once allowed" {
		t.Errorf("new file reads %q", got)
	}
	e.remount()
	if got := e.read("top.txt"); got != "changed after" {
		t.Errorf("after a remount top.txt reads %q", got)
	}
}
