package memguard_test

import (
	"os"
	"strings"
	"syscall"
	"testing"

	"github.com/hermesfs/hermesfs/fs/memguard"
	"golang.org/x/sys/unix"
)

// TestMountMemoryStaysPut: memories/ and its guarded files cannot be
// renamed away (the limits would stop applying, and Hermes would start with
// no memory); renames between guarded names and deletes are allowed; every
// one of them is in the audit log with the process.
func TestMountMemoryStaysPut(t *testing.T) {
	h := mountHome(t, memguard.Options{}, true, nil)
	h.mustWrite(t, memRel, []byte("Prefers tea."))
	h.mustWrite(t, userRel, []byte("Name: Ada."))

	wantErrno(t, "mv memories mem2", os.Rename(h.path("memories"), h.path("mem2")), syscall.EPERM)
	wantErrno(t, "mv memories/MEMORY.md elsewhere", os.Rename(h.path(memRel), h.path("notes.md")), syscall.EPERM)
	if err := os.Mkdir(h.path("other"), 0o755); err != nil {
		t.Fatal(err)
	}
	wantErrno(t, "exchange memories with another directory",
		unix.Renameat2(unix.AT_FDCWD, h.path("other"), unix.AT_FDCWD, h.path("memories"), unix.RENAME_EXCHANGE), syscall.EPERM)
	h.expect(t, memRel, []byte("Prefers tea."))
	h.expect(t, userRel, []byte("Name: Ada."))

	// The whole scenario that stranded memory: nothing moves.
	out, err := h.shell(t, "cd "+h.root+" && mv memories mem2")
	if err == nil || !strings.Contains(out, "Operation not permitted") {
		t.Errorf("mv memories mem2: %v %s", err, out)
	}
	if _, err := os.Stat(h.path(memRel)); err != nil {
		t.Fatalf("memories/ gone: %v", err)
	}

	// Within the guarded names: allowed, the content checked for its new place.
	if err := os.Rename(h.path(userRel), h.path(memRel)); err != nil {
		t.Fatalf("USER.md over MEMORY.md: %v", err)
	}
	h.expect(t, memRel, []byte("Name: Ada."))
	if err := os.Remove(h.path(memRel)); err != nil {
		t.Fatalf("delete: %v", err)
	}

	var trail []string
	for _, e := range h.events(t)[2:] {
		trail = append(trail, e.File+":"+e.Verdict+":"+e.Reason)
		if e.PID == 0 || e.Process == "" {
			t.Errorf("event without the process: %+v", e)
		}
	}
	want := "memories:rejected:move-away memories/MEMORY.md:rejected:move-away memories:rejected:move-away memories:rejected:move-away " +
		"memories/MEMORY.md:accepted:ok memories/USER.md:accepted:renamed memories/MEMORY.md:accepted:deleted"
	if got := strings.Join(trail, " "); got != want {
		t.Errorf("audit trail\n got %s\nwant %s", got, want)
	}
}

// TestMountControlCharacters: C0 controls other than tab, newline and
// carriage return break Hermes' reading of the file: refused, including
// the NULs a file grown with ftruncate is filled with.
func TestMountControlCharacters(t *testing.T) {
	h := mountHome(t, memguard.Options{}, true, nil)
	h.mustWrite(t, memRel, []byte("Line one.\r\n§\n\tIndented."))
	for _, c := range []byte{0x00, 0x01, 0x08, 0x0B, 0x0C, 0x1B, 0x1F} {
		wantErrno(t, "write with a control character", h.write(memRel, []byte("a"+string(rune(c))+"b")), syscall.EPERM)
	}
	f := h.open(t, memRel, os.O_RDWR, 0)
	if err := f.Truncate(100); err != nil {
		t.Fatalf("ftruncate up within the limit: %v", err)
	}
	wantErrno(t, "close after ftruncate filled NULs", f.Close(), syscall.EPERM)
	h.expect(t, memRel, []byte("Line one.\r\n§\n\tIndented."))
	if ev := h.lastEvent(t); ev.Reason != "char U+0000" || !strings.Contains(ev.Detail, "NUL") {
		t.Errorf("audit of the NULs: %+v", ev)
	}
	wantErrno(t, "truncate(2) up", os.Truncate(h.path(memRel), 50), syscall.EPERM)
	h.mustWrite(t, memRel, []byte("DEL \x7f and tabs\tare text."))
}
