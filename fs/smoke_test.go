package fs

import (
	"os"
	"testing"
)

func TestSmoke(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	if got := e.read("top.txt"); got != "top" {
		t.Fatalf("top.txt = %q", got)
	}
	t.Log(e.names(""))
	e.write("new.txt", "hello")
	if got := e.read("new.txt"); got != "hello" {
		t.Fatalf("new.txt = %q", got)
	}
	e.write("a/one.txt", "changed")
	if got := e.read("a/one.txt"); got != "changed" {
		t.Fatalf("one = %q", got)
	}
	if err := os.Remove(e.path("top.txt")); err != nil {
		t.Fatal(err)
	}
	e.missing("top.txt")
	t.Log(e.names(""))
	e.remount()
	e.missing("top.txt")
	t.Log(e.names(""))
	if got := e.read("a/one.txt"); got != "changed" {
		t.Fatalf("one = %q", got)
	}
}
