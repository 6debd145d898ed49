package main

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// installed generates a small home with an installed agent of entries
// entries; it skips (or, under HERMESFS_TEST_STRICT, fails) without git,
// python3 or node.
func installed(t *testing.T, seed uint64, entries int) (string, *installer) {
	t.Helper()
	for _, tool := range []string{"git", "python3", "node"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("HERMESFS_TEST_STRICT") == "1" {
				t.Fatalf("%s not installed", tool)
			}
			t.Skipf("%s not installed", tool)
		}
	}
	dir, g := generate(t, 1<<20, seed)
	in, err := install(g, seed, entries, "python3", "node")
	if err != nil {
		t.Fatal(err)
	}
	return dir, in
}

// installDigest is a digest without the git index's hash, which records
// the checkout's inode numbers and change times (no generator sets those).
func installDigest(d string) string {
	var b strings.Builder
	for _, line := range strings.SplitAfter(d, "\n") {
		if strings.HasPrefix(line, filepath.Join("hermes-agent", ".git", "index")+" ") {
			line = line[:strings.LastIndex(line, " ")] + "\n"
		}
		b.WriteString(line)
	}
	return b.String()
}

// homeDigest is a digest of a home with an install without the install
// (its two top-level directories): the home's own content.
func homeDigest(d string) string {
	var b strings.Builder
	for _, line := range strings.SplitAfter(d, "\n") {
		rel, _, _ := strings.Cut(line, " ")
		if top, _, _ := strings.Cut(rel, string(filepath.Separator)); top == "hermes-agent" || top == "node" {
			continue
		}
		b.WriteString(line)
	}
	return b.String()
}

func run(t *testing.T, dir string, env []string, name string, args ...string) string {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, stderr.Bytes())
	}
	return string(out)
}

// TestInstall makes one install (the slow part: several seconds, more
// with -race on a busy machine) and checks it twice at once: the tree it
// is (checkInstall), and that the same seed makes it again, another seed
// another one, and the home's own content does not change with -install
// (checkDeterministic).
func TestInstall(t *testing.T) {
	t.Parallel()
	const seed, entries = 5, 20000
	dir, in := installed(t, seed, entries)
	// What checkDeterministic compares, taken before checkInstall runs
	// git (whose status may rewrite the index), python and node in it.
	d := digest(t, dir)
	sum, own := installDigest(d), homeDigest(d)
	t.Run("tree", func(t *testing.T) {
		t.Parallel()
		checkInstall(t, dir, in, entries)
	})
	t.Run("deterministic", func(t *testing.T) {
		t.Parallel()
		checkDeterministic(t, dir, seed, entries, sum, own)
	})
}

// checkInstall checks the tree of an install of entries entries at dir.
func checkInstall(t *testing.T, dir string, in *installer, entries int) {
	co := filepath.Join(dir, "hermes-agent")

	// Entry count: what the generator says is what is there, and it is
	// what was asked for (the fixed part is smaller than 20k).
	n := 0
	for _, top := range []string{"hermes-agent", "node"} {
		filepath.WalkDir(filepath.Join(dir, top), func(string, os.DirEntry, error) error { n++; return nil })
	}
	if n != in.count {
		t.Errorf("the generator counted %d entries; the tree has %d", in.count, n)
	}
	if n < entries*99/100 || n > entries*101/100 {
		t.Errorf("%d entries for -entries %d", n, entries)
	}

	// The checkout: a clean git clone, its history packed.
	if got, want := strings.Count(run(t, co, nil, "git", "ls-files"), "\n"), in.checkoutSize(); got != want {
		t.Errorf("git tracks %d files, want %d", got, want)
	}
	if st := run(t, co, nil, "git", "status", "--porcelain"); st != "" {
		t.Errorf("git status of the fresh checkout:\n%s", st)
	}
	if log := run(t, co, nil, "git", "log", "--oneline"); strings.Count(log, "\n") != 6 {
		t.Errorf("history:\n%s", log)
	}
	packs, _ := filepath.Glob(filepath.Join(co, ".git", "objects", "pack", "pack-*.pack"))
	loose, _ := filepath.Glob(filepath.Join(co, ".git", "objects", "[0-9a-f][0-9a-f]", "*"))
	if len(packs) != 1 || len(loose) != 0 {
		t.Errorf("objects: packs %v, %d loose", packs, len(loose))
	}
	if out := run(t, co, nil, "git", "count-objects", "-v"); !strings.Contains(out, "count: 0\n") {
		t.Errorf("git count-objects:\n%s", out)
	}

	// The venv: shaped like one, the stdlib and real packages importable
	// with PYTHONHOME pointed at it, every generated package too, and
	// their .pyc valid (the import writes nothing).
	venv := filepath.Join(co, "venv")
	site := filepath.Join(venv, "lib", "python"+in.pyVer, "site-packages")
	for _, pattern := range []string{"pyvenv.cfg", "bin/python3", "lib/python*/os.py", "lib/python*/lib-dynload/*.so", "lib/python*/__pycache__/os.*.pyc",
		"lib/python*/site-packages/*.dist-info/RECORD", "lib/python*/site-packages/*/__pycache__/*.pyc", "lib/python*/site-packages/*/*.so"} {
		if m, _ := filepath.Glob(filepath.Join(venv, pattern)); len(m) == 0 {
			t.Errorf("venv: nothing matches %s", pattern)
		}
	}
	generated := 0
	var imports []string
	ents, _ := os.ReadDir(site)
	for _, e := range ents {
		if _, err := os.Stat(filepath.Join(site, e.Name(), "__init__.py")); err == nil && in.names["py:"+e.Name()] {
			generated++
			imports = append(imports, e.Name())
			mods, _ := filepath.Glob(filepath.Join(site, e.Name(), "*.py"))
			for _, m := range mods {
				if b := filepath.Base(m); b != "__init__.py" {
					imports = append(imports, e.Name()+"."+strings.TrimSuffix(b, ".py"))
				}
			}
		}
	}
	if generated < 5 {
		t.Errorf("%d generated Python packages", generated)
	}
	before := digest(t, venv)
	script := fmt.Sprintf(`import importlib, sys
assert sys.prefix == %q, sys.prefix
for m in %s + %s:
    mod = importlib.import_module(m)
    assert mod.__file__.startswith(sys.prefix), (m, mod.__file__)
print("ok")`, venv, quoteList(BenchImports), quoteList(imports))
	py := filepath.Join(venv, "bin", "python3")
	if out := run(t, dir, []string{"PYTHONHOME=" + venv, "PYTHONNOUSERSITE=1"}, py, "-c", script); out != "ok\n" {
		t.Errorf("python: %q", out)
	}
	if after := digest(t, venv); after != before {
		t.Error("importing from the venv changed it (a stale or missing .pyc was written)")
	}

	// node_modules: real and generated packages require()d from the
	// checkout, nested node_modules, .bin symlinks that resolve.
	var pkgs []string
	tops, _ := os.ReadDir(filepath.Join(co, "node_modules"))
	for _, e := range tops {
		switch {
		case strings.HasPrefix(e.Name(), "."):
		case strings.HasPrefix(e.Name(), "@"):
			sub, _ := os.ReadDir(filepath.Join(co, "node_modules", e.Name()))
			for _, s := range sub {
				pkgs = append(pkgs, e.Name()+"/"+s.Name())
			}
		default:
			pkgs = append(pkgs, e.Name())
		}
	}
	if len(pkgs) < 150 {
		t.Errorf("%d packages in node_modules", len(pkgs))
	}
	for _, p := range pkgs {
		if _, err := os.Stat(filepath.Join(co, "node_modules", p, "package.json")); err != nil {
			t.Errorf("node_modules/%s: %v", p, err)
		}
	}
	js := fmt.Sprintf("for (const p of %s) require(p); console.log('ok')", quoteList(append(append([]string{}, BenchRequires...), pkgs...)))
	if out := run(t, co, nil, "node", "-e", js); out != "ok\n" {
		t.Errorf("node: %q", out)
	}
	nested, _ := filepath.Glob(filepath.Join(co, "node_modules", "*", "node_modules", "*", "package.json"))
	bins, _ := filepath.Glob(filepath.Join(co, "node_modules", ".bin", "*"))
	if len(nested) == 0 || len(bins) == 0 {
		t.Errorf("node_modules: %d nested packages, %d .bin entries", len(nested), len(bins))
	}
	for _, b := range bins {
		if _, err := os.Stat(b); err != nil {
			t.Errorf(".bin: %v", err)
		}
	}

	// The runtime: a node that runs, npm beside it.
	if out := run(t, dir, nil, filepath.Join(dir, "node", "bin", "node"), "-p", "1+1"); out != "2\n" {
		t.Errorf("node/bin/node: %q", out)
	}
	if _, err := os.Stat(filepath.Join(dir, "node", "bin", "npm")); err != nil {
		t.Error(err)
	}
}

// quoteList is s as a list literal in Python and JavaScript alike.
func quoteList(s []string) string {
	q := make([]string, len(s))
	for i, v := range s {
		q[i] = fmt.Sprintf("%q", v)
	}
	return "[" + strings.Join(q, ",") + "]"
}

// checkDeterministic: the same seed gives the same tree wherever it is
// made (sum: installDigest of the install at a, taken before anything ran
// in it), another seed another one, and the home's own content (own) does
// not change with -install.
func checkDeterministic(t *testing.T, a string, seed uint64, entries int, sum, own string) {
	b, _ := installed(t, seed, entries)
	if db := installDigest(digest(t, b)); sum != db {
		la, lb := strings.Split(sum, "\n"), strings.Split(db, "\n")
		for i := range min(len(la), len(lb)) {
			if la[i] != lb[i] {
				t.Fatalf("two runs with seed %d differ; first at:\n%s\n%s", seed, la[i], lb[i])
			}
		}
		t.Fatalf("two runs with seed %d differ: %d and %d entries", seed, len(la), len(lb))
	}
	// Another seed: its checkout alone is enough to tell.
	c := filepath.Join(t.TempDir(), "home")
	if err := os.Mkdir(c, 0o755); err != nil {
		t.Fatal(err)
	}
	other, err := newInstaller(&gen{root: c}, seed+1, entries, "python3", "node")
	if err != nil {
		t.Fatal(err)
	}
	if err := other.checkout(); err != nil {
		t.Fatal(err)
	}
	ca, _ := exec.Command("git", "-C", filepath.Join(a, "hermes-agent"), "rev-parse", "HEAD").Output()
	cc, _ := exec.Command("git", "-C", filepath.Join(c, "hermes-agent"), "rev-parse", "HEAD").Output()
	if len(ca) == 0 || string(ca) == string(cc) {
		t.Errorf("seeds %d and %d gave the same checkout: %q %q", seed, seed+1, ca, cc)
	}
	plain, _ := generate(t, 1<<20, seed)
	fa, _ := os.Stat(a)
	fp, _ := os.Stat(plain)
	if !fa.ModTime().Equal(fp.ModTime()) {
		t.Errorf("the home's mtime is %v with -install, %v without", fa.ModTime(), fp.ModTime())
	}
	if own != digest(t, plain) {
		t.Error("the home's own content differs with -install")
	}
}

func TestParseCount(t *testing.T) {
	for in, want := range map[string]int{"120000": 120000, "120k": 120000, "1M": 1000000, "1.5m": 1500000} {
		if got, err := parseCount(in); err != nil || got != want {
			t.Errorf("parseCount(%q) = %d, %v", in, got, err)
		}
	}
	for _, in := range []string{"", "x", "-5", "0"} {
		if _, err := parseCount(in); err == nil {
			t.Errorf("parseCount(%q) succeeded", in)
		}
	}
}
