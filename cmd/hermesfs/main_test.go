package main

import (
	"bytes"
	"context"
	"flag"
	"reflect"
	"strings"
	"testing"
)

func TestParseInterspersed(t *testing.T) {
	for _, tc := range []struct {
		args       []string
		positional []string
		level      int
	}{
		{[]string{"a", "b"}, []string{"a", "b"}, 0},
		{[]string{"--level", "9", "a", "b"}, []string{"a", "b"}, 9},
		{[]string{"a", "b", "--level", "9"}, []string{"a", "b"}, 9},
		{[]string{"a", "--level=7", "b"}, []string{"a", "b"}, 7},
		{[]string{"a", "--", "--level", "b"}, []string{"a", "--level", "b"}, 0},
	} {
		fset := flag.NewFlagSet("t", flag.ContinueOnError)
		level := fset.Int("level", 0, "")
		got, err := parseInterspersed(fset, tc.args)
		if err != nil {
			t.Fatalf("%q: %v", tc.args, err)
		}
		if !reflect.DeepEqual(got, tc.positional) || *level != tc.level {
			t.Errorf("%q: got %q level %d, want %q level %d", tc.args, got, *level, tc.positional, tc.level)
		}
	}
}

func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	e := &env{stdout: &out, stderr: &errb, getenv: func(string) string { return "" }}
	code = e.main(context.Background(), args)
	return code, out.String(), errb.String()
}

func TestUsage(t *testing.T) {
	code, out, _ := runCLI(t, "--help")
	if code != exitOK {
		t.Fatalf("--help exit %d", code)
	}
	for _, name := range []string{"mount", "snapshot", "status", "list", "restore", "pack", "unpack", "verify", "umount"} {
		if !strings.Contains(out, "\n  "+name+" ") {
			t.Errorf("--help does not list %q:\n%s", name, out)
		}
		code, out, _ := runCLI(t, name, "--help")
		if code != exitOK || !strings.HasPrefix(out, "Usage: hermesfs "+name) {
			t.Errorf("%s --help: exit %d, output %q", name, code, out)
		}
	}
	if code, _, errOut := runCLI(t, "frobnicate"); code != exitUsage || !strings.Contains(errOut, "unknown command") {
		t.Errorf("unknown command: exit %d, stderr %q", code, errOut)
	}
	if code, _, errOut := runCLI(t, "pack", "--no-such-flag"); code != exitUsage || !strings.Contains(errOut, "--help") {
		t.Errorf("bad flag: exit %d, stderr %q", code, errOut)
	}
}
