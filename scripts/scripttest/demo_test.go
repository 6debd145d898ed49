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
