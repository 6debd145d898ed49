package scripttest

import (
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
)

// TestDemoSaysHowToReachIt: `make demo` leaves its binary in bin/, not on
// PATH, and keeps its store in DEMO_DIR/store, not the default one; so the
// commands it tells the user to try from another terminal name the binary
// and the store by their full paths. (The README's quick start says the
// same; cmd/hermesfs's TestDocumentedCommandLinesParse checks its lines.)
func TestDemoSaysHowToReachIt(t *testing.T) {
	_, file, _, _ := runtime.Caller(0)
	script := filepath.Join(filepath.Dir(file), "..", "demo.sh")
	dir := t.TempDir()
	demo := filepath.Join(dir, "demo")
	for _, d := range []string{"home", "store", "bin"} {
		if err := os.MkdirAll(filepath.Join(demo, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// A stand-in for the hermesfs the demo built: it records how it was
	// run. Relative, as make passes it.
	args := filepath.Join(dir, "args")
	if err := os.WriteFile(filepath.Join(demo, "bin", "hermesfs"), []byte("#!/bin/sh\necho \"$*\" >"+args+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("sh", script, "demo/bin/hermesfs", "demo")
	cmd.Dir = dir
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("demo.sh: %v\n%s", err, out)
	}
	bin := filepath.Join(demo, "bin", "hermesfs")
	for _, want := range []string{
		bin + " status " + filepath.Join(demo, "home"),
		bin + " snapshot " + filepath.Join(demo, "home"),
		bin + " list --store " + filepath.Join(demo, "store"),
	} {
		if !strings.Contains(string(out), "\n  "+want+"\n") {
			t.Errorf("demo.sh does not tell the user to run %q:\n%s", want, out)
		}
	}
	got, err := os.ReadFile(args)
	if err != nil {
		t.Fatalf("demo.sh did not run the binary: %v\n%s", err, out)
	}
	if want := "mount --interval 1m " + filepath.Join(demo, "home"); strings.TrimSpace(string(got)) != want {
		t.Errorf("demo.sh ran %q, want %q", got, want)
	}
}

// TestDemoDocsNameItsBinaryAndStore: `make help` says where the demo keeps
// its store (DEMO_DIR/store, apart from the default store), and the
// README's quick start runs the demo's binary by its path (bin/hermesfs:
// `make demo` puts nothing on PATH, so a bare `hermesfs status` is
// "command not found").
func TestDemoDocsNameItsBinaryAndStore(t *testing.T) {
	_, file, _, _ := runtime.Caller(0)
	root := filepath.Join(filepath.Dir(file), "..", "..")
	demoDir := filepath.Join(t.TempDir(), "demo")
	out, err := exec.Command("make", "-s", "-C", root, "help", "DEMO_DIR="+demoDir).CombinedOutput()
	if err != nil {
		t.Fatalf("make help: %v\n%s", err, out)
	}
	line := ""
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "make demo") {
			line = l
		}
	}
	if !strings.Contains(line, filepath.Join(demoDir, "store")) || strings.Contains(line, "default") {
		t.Errorf("make help's demo line does not name the demo's store %s:\n%s", filepath.Join(demoDir, "store"), out)
	}

	readme, err := os.ReadFile(filepath.Join(root, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	start := strings.Index(string(readme), "\n## Quick start\n")
	if start < 0 {
		t.Fatal("README.md has no Quick start section")
	}
	quick := string(readme)[start+1:]
	if end := strings.Index(quick, "\n## "); end >= 0 {
		quick = quick[:end]
	}
	// Code spans (which may wrap) and indented code lines.
	var code []string
	for i, span := range strings.Split(quick, "`") {
		if i%2 == 1 {
			code = append(code, strings.Join(strings.Fields(span), " "))
		}
	}
	for _, l := range strings.Split(quick, "\n") {
		if strings.HasPrefix(l, "    ") {
			code = append(code, strings.TrimSpace(l))
		}
	}
	runs := 0
	for _, c := range code {
		for _, cmd := range strings.FieldsFunc(c, func(r rune) bool { return r == '&' || r == '|' || r == ';' }) {
			switch w := strings.Fields(cmd); {
			case len(w) == 0:
			case w[0] == "hermesfs":
				t.Errorf("the quick start runs %q: no hermesfs is on PATH after make demo (bin/hermesfs is)", strings.TrimSpace(cmd))
			case w[0] == "bin/hermesfs":
				runs++
			}
		}
	}
	if runs == 0 {
		t.Errorf("the quick start runs no bin/hermesfs command; its code:\n%q", code)
	}
}
