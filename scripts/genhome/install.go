package main

// The installed agent (-install): what Hermes' installer, run as a normal
// user (its default), adds to ~/.hermes beside the agent's data:
//
//	hermes-agent/               a git clone of the agent (objects packed)
//	hermes-agent/venv/          its Python virtual environment
//	hermes-agent/node_modules/  its npm install
//	node/                       the managed Node.js runtime
//
// The installer makes the venv with `uv venv venv` in the checkout, so the
// directory is venv, not .venv. Real content where a benchmark runs it:
// the venv's stdlib and a set of site-packages are copies of the Python
// that runs genhome (with their __pycache__, whose timestamps stay valid
// because the copies keep their mtimes), so that interpreter, given
// PYTHONHOME=venv, imports them from the home; the node runtime is a copy
// of the node binary on PATH and of its npm and corepack trees, and npm's
// own dependencies are also in the checkout's node_modules, so node can
// require real packages there. The rest is generated to the entry count
// asked for, shaped like the real thing: Python packages of small modules
// that compile (with their .pyc, .dist-info and a few large binary
// extension-sized files), npm packages of small CommonJS modules that
// require one another (package.json each, nested node_modules, scoped
// packages, .bin symlinks), and the checkout's ~6,500 tracked files of a
// Python project with a few commits of history, packed by git gc.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// installSalt keeps the install's random stream apart from the home's, so
// the home part of a tree is the same with and without -install.
const installSalt = 0x696e7374616c6c // "install"

// checkoutFiles is the number of files git tracks in the full-size
// checkout (Hermes' own repository has about that many).
const checkoutFiles = 6500

// Import and require targets the benchmarks use; the generator makes sure
// each is in the tree (copied from the machine's Python and node).
var (
	// BenchImports are the 20 modules the import benchmark loads from the
	// venv; realSitePackages holds them and everything they import.
	BenchImports = []string{"yaml", "requests", "jinja2", "pydantic", "prompt_toolkit", "pygments.lexers.python", "click", "dotenv",
		"dateutil.parser", "attrs", "jsonschema", "cryptography.fernet", "sniffio", "regex", "orjson", "werkzeug", "flask", "docutils.core",
		"pyparsing", "wrapt"}
	// BenchRequires are the 12 packages the require benchmark loads from
	// the checkout's node_modules (npm's own dependencies, copied).
	BenchRequires = []string{"@npmcli/arborist", "pacote", "cacache", "make-fetch-happen", "tar", "glob", "semver", "minimatch",
		"chalk", "debug", "lru-cache", "npm-registry-fetch"}
)

// realSitePackages are the top-level names copied from the machine's
// site-packages into the venv (with their .dist-info): the benchmark's
// imports and their dependencies, plus pip and setuptools as every venv
// has.
var realSitePackages = []string{
	"yaml", "_yaml", "requests", "urllib3", "idna", "charset_normalizer", "certifi", "jinja2", "markupsafe",
	"pydantic", "pydantic_core", "annotated_types", "typing_extensions.py", "typing_inspection", "prompt_toolkit", "wcwidth",
	"pygments", "click", "dotenv", "dateutil", "six.py", "attr", "attrs", "jsonschema", "referencing", "rpds",
	"jsonschema_specifications", "cryptography", "cffi", "pycparser", "sniffio", "regex", "orjson", "werkzeug", "flask",
	"blinker", "itsdangerous", "docutils", "pyparsing", "wrapt", "pip", "setuptools", "pkg_resources", "_distutils_hack",
	"distutils-precedence.pth",
}

type installer struct {
	g        *gen // the home's generator: its text helpers, with the install's rng
	root     string
	entries  int    // asked for
	python   string // interpreter whose stdlib and site-packages are copied
	node     string // node binary copied as the runtime
	pyVer    string // "3.11"
	pyHome   string // the interpreter's stdlib directory
	pySite   string // its site-packages
	cacheTag string // its .pyc tag (cpython-311)
	clock    time.Time
	count    int      // entries made so far (files, directories, symlinks)
	compile  []string // .py files to compile (relative to root)
	names    map[string]bool
	npmPkgs  []string // top-level npm packages made so far (dependency candidates)
}

// install adds the installed agent to the home at g.root, about entries
// entries in all (files, directories and symlinks under hermes-agent/ and
// node/). The home's own content (g.run) must be there already: its root
// directory keeps the mtime it had.
func install(g *gen, seed uint64, entries int, python, node string) (*installer, error) {
	rootInfo, err := os.Stat(g.root)
	if err != nil {
		return nil, err
	}
	in, err := newInstaller(g, seed, entries, python, node)
	if err != nil {
		return nil, err
	}
	steps := []func() error{in.checkout, in.venvBase, in.nodeRuntime, in.realNodeModules, in.synthetic, in.compileAll, in.setTimes}
	for _, step := range steps {
		if err := step(); err != nil {
			return nil, err
		}
	}
	// The count, exactly: what is there.
	in.count = 0
	for _, top := range []string{"hermes-agent", "node"} {
		err := filepath.WalkDir(filepath.Join(in.root, top), func(string, fs.DirEntry, error) error {
			in.count++
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	mt := rootInfo.ModTime()
	return in, os.Chtimes(g.root, mt, mt)
}

// newInstaller checks for the tools and asks them where their files are.
func newInstaller(g *gen, seed uint64, entries int, python, node string) (*installer, error) {
	for _, tool := range []string{"git", python, node} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("-install needs %s: %w", tool, err)
		}
	}
	in := &installer{
		g:       &gen{root: g.root, rng: rand.New(rand.NewPCG(seed^installSalt, 0x4845524d4553))},
		root:    g.root,
		entries: entries,
		clock:   time.Date(2026, 2, 2, 10, 0, 0, 0, time.UTC),
		names:   map[string]bool{},
	}
	in.g.clock = in.clock
	return in, in.findTools(python, node)
}

// findTools asks the interpreter where its stdlib and site-packages are,
// and resolves node to its file.
func (in *installer) findTools(python, node string) error {
	out, err := exec.Command(python, "-c", `import sys, sysconfig
print("%d.%d" % sys.version_info[:2]); print(sysconfig.get_path("stdlib")); print(sysconfig.get_path("purelib")); print(sys.executable); print(sys.implementation.cache_tag)`).Output()
	if err != nil {
		return fmt.Errorf("asking %s for its stdlib: %w", python, err)
	}
	f := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(f) != 5 {
		return fmt.Errorf("%s: unexpected answer %q", python, out)
	}
	in.pyVer, in.pyHome, in.pySite, in.cacheTag = f[0], f[1], f[2], f[4]
	if in.python, err = filepath.EvalSymlinks(f[3]); err != nil {
		return err
	}
	p, err := exec.LookPath(node)
	if err != nil {
		return err
	}
	in.node, err = filepath.EvalSymlinks(p)
	return err
}

func (in *installer) tick() time.Time {
	in.clock = in.clock.Add(time.Duration(1+in.g.rng.IntN(900)) * time.Millisecond)
	return in.clock
}

// mkdir makes rel's directory and those above it, counting the new ones.
func (in *installer) mkdir(rel string) error {
	p := filepath.Join(in.root, rel)
	if _, err := os.Lstat(p); err == nil {
		return nil
	}
	if err := in.mkdir(filepath.Dir(rel)); err != nil {
		return err
	}
	if err := os.Mkdir(p, 0o755); err != nil {
		return err
	}
	in.count++
	return nil
}

// write writes one file with the next install time as its mtime.
func (in *installer) write(rel string, data []byte, mode os.FileMode) error {
	if err := in.mkdir(filepath.Dir(rel)); err != nil {
		return err
	}
	p := filepath.Join(in.root, rel)
	if err := os.WriteFile(p, data, mode); err != nil {
		return err
	}
	if err := os.Chmod(p, mode); err != nil {
		return err
	}
	in.count++
	t := in.tick()
	return os.Chtimes(p, t, t)
}

func (in *installer) symlink(target, rel string) error {
	if err := in.mkdir(filepath.Dir(rel)); err != nil {
		return err
	}
	if err := os.Symlink(target, filepath.Join(in.root, rel)); err != nil {
		return err
	}
	in.count++
	return nil
}

// copyTree copies src to rel (files keep their mode and mtime; symlinks
// are copied as symlinks), skipping what skip says to.
func (in *installer) copyTree(src, rel string, skip func(srcRel string, d fs.DirEntry) bool) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		sr, _ := filepath.Rel(src, p)
		if skip != nil && sr != "." && skip(sr, d) {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		dst := filepath.Join(rel, sr)
		switch {
		case d.IsDir():
			return in.mkdir(dst)
		case d.Type()&fs.ModeSymlink != 0:
			t, err := os.Readlink(p)
			if err != nil {
				return err
			}
			return in.symlink(t, dst)
		case d.Type().IsRegular():
			return in.copyFile(p, dst)
		}
		return nil // sockets, fifos: nothing an install has
	})
}

func (in *installer) copyFile(src, rel string) error {
	if err := in.mkdir(filepath.Dir(rel)); err != nil {
		return err
	}
	s, err := os.Open(src)
	if err != nil {
		return err
	}
	defer s.Close()
	fi, err := s.Stat()
	if err != nil {
		return err
	}
	p := filepath.Join(in.root, rel)
	d, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, fi.Mode().Perm())
	if err != nil {
		return err
	}
	_, err = io.Copy(d, s)
	if cerr := d.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	if err := os.Chmod(p, fi.Mode().Perm()); err != nil {
		return err
	}
	in.count++
	return os.Chtimes(p, fi.ModTime(), fi.ModTime())
}

// ---- the checkout ----

// checkoutDirs are the source directories of the checkout with the share
// of its files each gets and the kind of file it holds.
var checkoutDirs = []struct {
	dir   string
	share int // per mille of the tracked files
	kinds string
}{
	{"agent", 60, "py"}, {"tools", 90, "py"}, {"tools/environments", 20, "py"}, {"gateway", 25, "py"},
	{"gateway/platforms", 30, "py"}, {"hermes_cli", 70, "py"}, {"cron", 10, "py"}, {"acp_adapter", 10, "py"},
	{"plugins", 40, "py"}, {"environments", 40, "py"}, {"tests", 200, "py"}, {"skills", 150, "md"},
	{"optional-skills", 60, "md"}, {"docs", 40, "md"}, {"website/docs", 70, "md"}, {"website/src", 40, "ts"},
	{"web/src", 25, "ts"}, {"scripts", 10, "sh"}, {"datagen-config-examples", 10, "yaml"},
}

func (in *installer) checkoutSize() int {
	return min(checkoutFiles, max(200, int(math.Round(float64(checkoutFiles)*float64(in.entries)/120000))))
}

// checkout writes the agent's source tree and commits it in a few steps
// (each adding files and changing some), then packs the objects.
func (in *installer) checkout() error {
	const co = "hermes-agent"
	n := in.checkoutSize()
	files := in.checkoutPlan(n)
	// The first commit has 85% of the files; the others add the rest and
	// change a few each.
	commits := 6
	first := len(files) * 85 / 100
	if err := in.git("init", "-q", "-b", "main"); err != nil {
		return err
	}
	next := 0
	for c := 0; c < commits; c++ {
		upto := first
		if c > 0 {
			upto = first + (len(files)-first)*c/(commits-1)
		}
		for ; next < upto; next++ {
			if err := in.write(filepath.Join(co, files[next].rel), files[next].data(), files[next].mode); err != nil {
				return err
			}
		}
		if c > 0 {
			for k := 0; k < 30; k++ {
				f := files[in.g.rng.IntN(next)]
				if f.mode&0o111 != 0 || !strings.HasSuffix(f.rel, ".py") {
					continue
				}
				p := filepath.Join(in.root, co, f.rel)
				old, err := os.ReadFile(p)
				if err != nil {
					return err
				}
				// Rewrite (not append), so the file's own mtime is set
				// again after.
				if err := os.Remove(p); err != nil {
					return err
				}
				in.count--
				if err := in.write(filepath.Join(co, f.rel), append(old, []byte(in.pyFunction(k))...), f.mode); err != nil {
					return err
				}
			}
		}
		if err := in.git("add", "-A"); err != nil {
			return err
		}
		msg := []string{"Initial import", "tools: browser and terminal backends", "gateway: platform adapters", "skills: bundled skills", "docs: website", "fix: memory limits"}[c]
		if err := in.git("commit", "-q", "-m", msg); err != nil {
			return err
		}
	}
	if err := in.git("update-ref", "refs/remotes/origin/main", "HEAD"); err != nil {
		return err
	}
	for _, kv := range [][2]string{{"remote.origin.url", "https://github.com/NousResearch/hermes-agent.git"},
		{"remote.origin.fetch", "+refs/heads/*:refs/remotes/origin/*"}, {"branch.main.remote", "origin"}, {"branch.main.merge", "refs/heads/main"}} {
		if err := in.git("config", kv[0], kv[1]); err != nil {
			return err
		}
	}
	if err := in.git("-c", "pack.threads=1", "gc", "-q"); err != nil {
		return err
	}
	// What git made under .git counts too.
	return filepath.WalkDir(filepath.Join(in.root, co, ".git"), func(p string, d fs.DirEntry, err error) error {
		if err == nil {
			in.count++
		}
		return err
	})
}

// git runs git in the checkout with a fixed identity and clock and no
// user or system configuration, so the same seed gives the same commits.
func (in *installer) git(args ...string) error {
	dir := filepath.Join(in.root, "hermes-agent")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if args[0] == "init" {
		in.count++ // the checkout's directory; .git is counted after gc
	}
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	date := fmt.Sprintf("@%d +0000", in.tick().Unix())
	// No automatic gc or maintenance detached in the background: it
	// would write into .git after genhome is done.
	cmd.Env = append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1", "GIT_CONFIG_GLOBAL=/dev/null", "GIT_TERMINAL_PROMPT=0",
		"GIT_CONFIG_COUNT=2", "GIT_CONFIG_KEY_0=gc.auto", "GIT_CONFIG_VALUE_0=0", "GIT_CONFIG_KEY_1=maintenance.auto", "GIT_CONFIG_VALUE_1=false",
		"GIT_AUTHOR_NAME=Hermes Developer", "GIT_AUTHOR_EMAIL=dev@hermes.invalid", "GIT_AUTHOR_DATE="+date,
		"GIT_COMMITTER_NAME=Hermes Developer", "GIT_COMMITTER_EMAIL=dev@hermes.invalid", "GIT_COMMITTER_DATE="+date)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("git %s: %v: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

type plannedFile struct {
	rel  string
	mode os.FileMode
	data func() []byte
}

// checkoutPlan lists the checkout's n tracked files in the order they are
// committed, contents drawn when written.
func (in *installer) checkoutPlan(n int) []plannedFile {
	g := in.g
	var out []plannedFile
	add := func(rel string, mode os.FileMode, data func() []byte) {
		out = append(out, plannedFile{rel, mode, data})
	}
	add(".gitignore", 0o644, func() []byte {
		return []byte("__pycache__/\n*.py[cod]\nvenv/\n.venv/\nnode_modules/\n.env\n*.egg-info/\ndist/\nbuild/\n.pytest_cache/\nlogs/\n")
	})
	add("README.md", 0o644, func() []byte { return []byte("# Hermes Agent\n\n" + g.prose(6000) + "\n") })
	add("LICENSE", 0o644, func() []byte { return []byte("MIT License\n\n" + g.prose(900) + "\n") })
	add("pyproject.toml", 0o644, func() []byte {
		return []byte("[project]\nname = \"hermes-agent\"\nversion = \"0.9.0\"\nrequires-python = \">=3.11\"\ndependencies = [\n  \"openai\", \"anthropic\", \"httpx\", \"pydantic\", \"rich\", \"prompt_toolkit\", \"pyyaml\", \"requests\", \"jinja2\", \"python-dotenv\",\n]\n\n[project.scripts]\nhermes = \"hermes_cli.main:main\"\n")
	})
	add("package.json", 0o644, func() []byte {
		return []byte("{\n  \"name\": \"hermes-agent\",\n  \"private\": true,\n  \"dependencies\": {\n    \"agent-browser\": \"^0.6.0\"\n  }\n}\n")
	})
	for _, name := range []string{"cli.py", "run_agent.py", "model_tools.py", "toolsets.py", "batch_runner.py", "hermes_state.py", "hermes_constants.py", "utils.py"} {
		add(name, 0o644, func() []byte { return []byte(in.pyModule(2000 + g.rng.IntN(40000))) })
	}
	add("hermes", 0o755, func() []byte { return []byte("#!/usr/bin/env python3\nfrom hermes_cli.main import main\n\nmain()\n") })
	rest := n - len(out)
	for _, cd := range checkoutDirs {
		k := rest * cd.share / 1000
		subs := []string{cd.dir}
		for s := 1; s < k/25; s++ {
			subs = append(subs, filepath.Join(cd.dir, in.ident()))
		}
		for i := 0; i < k; i++ {
			sub := subs[i%len(subs)]
			size := int(math.Exp(math.Log(300) + g.rng.Float64()*(math.Log(30000)-math.Log(300))))
			var rel string
			var data func() []byte
			mode := os.FileMode(0o644)
			switch cd.kinds {
			case "py":
				rel = filepath.Join(sub, fmt.Sprintf("%s_%d.py", in.ident(), i))
				if strings.HasPrefix(cd.dir, "tests") {
					rel = filepath.Join(sub, fmt.Sprintf("test_%s_%d.py", in.ident(), i))
				}
				if i < len(subs) {
					rel = filepath.Join(sub, "__init__.py")
				}
				data = func() []byte { return []byte(in.pyModule(size)) }
			case "md":
				rel = filepath.Join(sub, fmt.Sprintf("%s_%d.md", in.ident(), i))
				data = func() []byte { return []byte("# " + g.word() + "\n\n" + g.prose(size) + "\n") }
			case "ts":
				rel = filepath.Join(sub, fmt.Sprintf("%s%d.tsx", in.camel(), i))
				data = func() []byte { return []byte(in.jsModule(size, nil, nil)) }
			case "sh":
				rel, mode = filepath.Join(sub, fmt.Sprintf("%s_%d.sh", in.ident(), i)), 0o755
				data = func() []byte { return []byte("#!/bin/sh\nset -eu\n" + g.shell() + "\n") }
			default:
				rel = filepath.Join(sub, fmt.Sprintf("%s_%d.yaml", in.ident(), i))
				data = func() []byte {
					return []byte(fmt.Sprintf("name: %s\nmodel: anthropic/claude-sonnet-4\nprompt: |\n  %s\n", g.word(), g.prose(size)))
				}
			}
			add(rel, mode, data)
		}
	}
	// Top the list up to n with test files.
	for i := 0; len(out) < n; i++ {
		add(fmt.Sprintf("tests/extra/test_%s_%d.py", in.ident(), i), 0o644, func() []byte { return []byte(in.pyModule(300 + g.rng.IntN(6000))) })
	}
	return out[:n]
}

// ---- Python ----

var pyKeywords = map[string]bool{"and": true, "as": true, "for": true, "from": true, "if": true, "in": true, "is": true,
	"not": true, "or": true, "with": true, "while": true, "return": true, "import": true, "class": true, "def": true,
	"pass": true, "else": true, "try": true}

// ident is a lower-case identifier made of vocabulary words (never a
// Python keyword).
func (in *installer) ident() string {
	for {
		a, b := in.g.word(), in.g.word()
		if a == b || pyKeywords[a] || pyKeywords[b] {
			continue
		}
		return a + "_" + b
	}
}

func (in *installer) camel() string {
	parts := strings.Split(in.ident(), "_")
	return parts[0] + strings.ToUpper(parts[1][:1]) + parts[1][1:]
}

func (in *installer) pyFunction(k int) string {
	g := in.g
	return fmt.Sprintf("\n\ndef %s_%d(value, option=None):\n    \"\"\"%s\"\"\"\n    result = {%q: value}\n    for item in option or []:\n        result[item] = len(str(item))\n    return result\n",
		in.ident(), k, strings.ReplaceAll(g.prose(80), "\"", "'"), g.word())
}

// pyModule is valid Python of about n bytes: a docstring, stdlib imports,
// a constant, functions and classes.
func (in *installer) pyModule(n int) string {
	g := in.g
	var b strings.Builder
	fmt.Fprintf(&b, "\"\"\"%s\"\"\"\n\nfrom __future__ import annotations\n\nimport json\nimport os\nimport re\nfrom typing import Any\n\n", strings.ReplaceAll(g.prose(60+g.rng.IntN(300)), "\"", "'"))
	fmt.Fprintf(&b, "%s = {%q: %d, %q: %q}\n", strings.ToUpper(in.ident()), g.word(), g.rng.IntN(1000), g.word(), g.word())
	for k := 0; b.Len() < n; k++ {
		if k%3 == 2 {
			cls := in.camel()
			fmt.Fprintf(&b, "\n\nclass %s%d:\n    \"\"\"%s\"\"\"\n\n    def __init__(self, value: Any = None) -> None:\n        self.value = value\n        self.pattern = re.compile(r%q)\n\n    def %s(self, other: Any) -> dict:\n        data = {\"value\": self.value, \"other\": other, \"cwd\": os.getcwd()}\n        return json.loads(json.dumps(data, default=str))\n",
				strings.ToUpper(cls[:1])+cls[1:], k, strings.ReplaceAll(g.prose(120), "\"", "'"), g.word()+"[0-9]+", in.ident())
			continue
		}
		b.WriteString(in.pyFunction(k))
	}
	b.WriteString("\n")
	return b.String()
}

// venvBase makes the venv: pyvenv.cfg, bin/, the stdlib copied from the
// interpreter (with lib-dynload and __pycache__; not its test suite nor
// its static library), and the real site-packages.
func (in *installer) venvBase() error {
	venv := filepath.Join("hermes-agent", "venv")
	lib := filepath.Join(venv, "lib", "python"+in.pyVer)
	cfg := fmt.Sprintf("home = %s\nimplementation = CPython\nuv = 0.8.3\nversion_info = %s\ninclude-system-site-packages = false\nprompt = hermes-agent\n", filepath.Dir(in.python), in.pyVer)
	if err := in.write(filepath.Join(venv, "pyvenv.cfg"), []byte(cfg), 0o644); err != nil {
		return err
	}
	for _, l := range [][2]string{{in.python, "bin/python"}, {"python", "bin/python3"}, {"python", "bin/python" + in.pyVer}, {"lib", "lib64"}} {
		if err := in.symlink(l[0], filepath.Join(venv, l[1])); err != nil {
			return err
		}
	}
	// Console scripts name the venv's interpreter by its absolute path,
	// here the one a user named hermes would have.
	const abs = "/home/hermes/.hermes/hermes-agent/venv"
	for _, s := range []string{"activate", "activate.csh", "activate.fish", "pip", "pip3", "hermes", "normalizer", "pygmentize", "flask", "dotenv", "httpx", "openai"} {
		body := fmt.Sprintf("#!%s/bin/python\nimport sys\nfrom %s import main\nif __name__ == \"__main__\":\n    sys.exit(main())\n", abs, s)
		if strings.HasPrefix(s, "activate") {
			body = "# This file must be used with \"source bin/activate\"\nVIRTUAL_ENV=" + abs + "\nexport VIRTUAL_ENV\nPATH=\"$VIRTUAL_ENV/bin:$PATH\"\n"
		}
		if err := in.write(filepath.Join(venv, "bin", s), []byte(body), 0o755); err != nil {
			return err
		}
	}
	site := filepath.Clean(in.pySite)
	err := in.copyTree(in.pyHome, lib, func(sr string, d fs.DirEntry) bool {
		return filepath.Join(in.pyHome, sr) == site || sr == "site-packages" || sr == "test" || strings.HasPrefix(sr, "config-")
	})
	if err != nil {
		return fmt.Errorf("copying the stdlib of %s: %w", in.python, err)
	}
	return in.realSite(site, filepath.Join(lib, "site-packages"))
}

// realSite copies the distributions of site that provide the names in
// realSitePackages: each one's .dist-info and every top-level entry its
// RECORD lists (a compiled package's shared runtime included).
func (in *installer) realSite(site, dst string) error {
	want := map[string]bool{}
	for _, n := range realSitePackages {
		want[n] = true
	}
	infos, err := filepath.Glob(filepath.Join(site, "*.dist-info"))
	if err != nil {
		return err
	}
	sort.Strings(infos)
	done := map[string]bool{}
	cp := func(name string) error {
		if done[name] {
			return nil
		}
		done[name] = true
		src := filepath.Join(site, name)
		fi, err := os.Lstat(src)
		if err != nil {
			return nil // listed in RECORD, not there (a script outside site-packages)
		}
		if fi.IsDir() {
			return in.copyTree(src, filepath.Join(dst, name), nil)
		}
		if err := in.copyFile(src, filepath.Join(dst, name)); err != nil {
			return err
		}
		// A single-file module's compiled form.
		if mod, ok := strings.CutSuffix(name, ".py"); ok {
			pycs, _ := filepath.Glob(filepath.Join(site, "__pycache__", mod+".*.pyc"))
			for _, pyc := range pycs {
				if err := in.copyFile(pyc, filepath.Join(dst, "__pycache__", filepath.Base(pyc))); err != nil {
					return err
				}
			}
		}
		return nil
	}
	for _, info := range infos {
		record, err := os.ReadFile(filepath.Join(info, "RECORD"))
		if err != nil {
			continue
		}
		tops := map[string]bool{}
		for _, line := range strings.Split(string(record), "\n") {
			path, _, _ := strings.Cut(line, ",")
			if path == "" || strings.HasPrefix(path, "..") {
				continue
			}
			top, _, _ := strings.Cut(path, "/")
			if top != "__pycache__" {
				tops[top] = true
			}
		}
		use := false
		for t := range tops {
			use = use || want[t]
		}
		if !use {
			continue
		}
		names := make([]string, 0, len(tops))
		for t := range tops {
			names = append(names, t)
		}
		sort.Strings(names)
		for _, t := range names {
			if err := cp(t); err != nil {
				return err
			}
		}
	}
	var missing []string
	for _, n := range realSitePackages {
		if !done[n] {
			missing = append(missing, n)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("%s lacks site-packages the venv copies for the import benchmark: %s; install them for that Python or pass -python", in.python, strings.Join(missing, ", "))
	}
	return nil
}

// ---- node ----

// nodeRuntime makes ~/.hermes/node as the official tarball lays it out:
// bin/node (the machine's node), bin/npm and npx, lib/node_modules/npm
// and corepack, include/node.
func (in *installer) nodeRuntime() error {
	if err := in.copyFile(in.node, "node/bin/node"); err != nil {
		return err
	}
	prefix := filepath.Dir(filepath.Dir(in.node))
	mods := filepath.Join(prefix, "lib", "node_modules")
	if _, err := os.Stat(filepath.Join(mods, "npm", "package.json")); err != nil {
		return fmt.Errorf("node at %s: no npm beside it (%s): %w", in.node, mods, err)
	}
	for _, m := range []string{"npm", "corepack"} {
		if _, err := os.Stat(filepath.Join(mods, m)); err != nil {
			continue
		}
		if err := in.copyTree(filepath.Join(mods, m), filepath.Join("node", "lib", "node_modules", m), nil); err != nil {
			return err
		}
	}
	if st, err := os.Stat(filepath.Join(prefix, "include", "node")); err == nil && st.IsDir() {
		if err := in.copyTree(filepath.Join(prefix, "include", "node"), filepath.Join("node", "include", "node"), nil); err != nil {
			return err
		}
	}
	for _, l := range [][2]string{{"../lib/node_modules/npm/bin/npm-cli.js", "npm"}, {"../lib/node_modules/npm/bin/npx-cli.js", "npx"}, {"../lib/node_modules/corepack/dist/corepack.js", "corepack"}} {
		if err := in.symlink(l[0], filepath.Join("node", "bin", l[1])); err != nil {
			return err
		}
	}
	for _, f := range []string{"README.md", "LICENSE", "CHANGELOG.md"} {
		if err := in.write(filepath.Join("node", f), []byte(in.g.prose(4000+in.g.rng.IntN(60000))), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// realNodeModules copies npm's own dependencies into the checkout's
// node_modules: real packages that require one another.
func (in *installer) realNodeModules() error {
	src := filepath.Join(filepath.Dir(filepath.Dir(in.node)), "lib", "node_modules", "npm", "node_modules")
	ents, err := os.ReadDir(src)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := in.copyTree(filepath.Join(src, e.Name()), filepath.Join("hermes-agent", "node_modules", e.Name()), nil); err != nil {
			return err
		}
		in.names[e.Name()] = true
	}
	for _, r := range BenchRequires {
		if _, err := os.Stat(filepath.Join(in.root, "hermes-agent", "node_modules", r, "package.json")); err != nil {
			return fmt.Errorf("npm beside %s has no %s among its dependencies (for the require benchmark)", in.node, r)
		}
	}
	return nil
}

// ---- the generated packages ----

// synthetic fills the entries left with generated Python packages (40%)
// and npm packages (60%).
func (in *installer) synthetic() error {
	later := in.checkoutPyc()
	left := in.entries - in.count - later
	if left <= 0 {
		return nil
	}
	pyBudget := in.count + left*40/100
	site := filepath.Join("hermes-agent", "venv", "lib", "python"+in.pyVer, "site-packages")
	for i := 0; in.count < pyBudget; i++ {
		if err := in.pyPackage(site, i, pyBudget-in.count); err != nil {
			return err
		}
	}
	end := in.entries - later
	for i := 0; in.count < end; i++ {
		if err := in.npmPackage(filepath.Join("hermes-agent", "node_modules"), i, end-in.count, 0); err != nil {
			return err
		}
	}
	return nil
}

// checkoutPyc is the number of entries compiling the checkout adds: a
// .pyc per module and a __pycache__ per directory of modules.
func (in *installer) checkoutPyc() int {
	n := 0
	dirs := map[string]bool{}
	filepath.WalkDir(filepath.Join(in.root, "hermes-agent"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "venv" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if strings.HasSuffix(p, ".py") && d.Type().IsRegular() {
			n++
			dirs[filepath.Dir(p)] = true
		}
		return nil
	})
	return n + len(dirs)
}

// pyPackage writes one generated package of at most about budget entries:
// modules (to be compiled), a .dist-info, now and then a large binary
// extension file.
func (in *installer) pyPackage(site string, i, budget int) error {
	g := in.g
	var name string
	for name == "" || in.names["py:"+name] {
		name = fmt.Sprintf("%s%d", strings.ReplaceAll(in.ident(), "_", ""), i)
	}
	in.names["py:"+name] = true
	version := fmt.Sprintf("%d.%d.%d", g.rng.IntN(5), g.rng.IntN(30), g.rng.IntN(12))
	// Modules: most packages are small, a few large (Zipf-like).
	nmod := 2 + int(math.Pow(g.rng.Float64(), 3)*120)
	// Each module costs 2 entries (.py, .pyc), each directory 2 (itself,
	// __pycache__), the dist-info 6.
	nmod = max(1, min(nmod, (budget-10)/2))
	subs := []string{""}
	for s := 0; s < nmod/15; s++ {
		subs = append(subs, in.ident())
	}
	for k := 0; k < nmod; k++ {
		sub := subs[k%len(subs)]
		dir := filepath.Join(site, name, sub)
		mod := "__init__.py"
		if k >= len(subs) {
			mod = fmt.Sprintf("%s_%d.py", in.ident(), k)
		}
		src := in.pyModule(int(math.Exp(math.Log(200) + g.rng.Float64()*(math.Log(16000)-math.Log(200)))))
		if mod == "__init__.py" && sub == "" {
			src = fmt.Sprintf("\"\"\"%s\"\"\"\n\n__version__ = %q\n", strings.ReplaceAll(g.prose(200), "\"", "'"), version)
		}
		rel := filepath.Join(dir, mod)
		if err := in.write(rel, []byte(src), 0o644); err != nil {
			return err
		}
		in.compile = append(in.compile, rel)
		in.count++ // its .pyc
		if k < len(subs) {
			in.count++ // the directory's __pycache__
		}
	}
	if g.rng.IntN(40) == 0 {
		so := fmt.Sprintf("_speedups.cpython-%s-x86_64-linux-gnu.so", strings.ReplaceAll(in.pyVer, ".", ""))
		if err := in.write(filepath.Join(site, name, so), in.binary(64<<10+g.rng.IntN(4<<20)), 0o755); err != nil {
			return err
		}
	}
	di := filepath.Join(site, fmt.Sprintf("%s-%s.dist-info", name, version))
	meta := fmt.Sprintf("Metadata-Version: 2.1\nName: %s\nVersion: %s\nSummary: %s\nRequires-Python: >=3.8\n\n%s\n", name, version, g.prose(60), g.prose(500+g.rng.IntN(3000)))
	for _, f := range [][2]string{{"METADATA", meta}, {"WHEEL", "Wheel-Version: 1.0\nGenerator: bdist_wheel (0.43.0)\nRoot-Is-Purelib: true\nTag: py3-none-any\n"},
		{"INSTALLER", "uv\n"}, {"top_level.txt", name + "\n"}, {"RECORD", name + "/__init__.py,sha256=" + g.hex(43) + ",120\n"}} {
		if err := in.write(filepath.Join(di, f[0]), []byte(f[1]), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// binary is n bytes shaped like machine code: it compresses about 2x.
func (in *installer) binary(n int) []byte {
	b := make([]byte, n)
	for k := 0; k < n; k += 8 {
		v := in.g.rng.Uint64()
		if k%64 >= 32 {
			v &= 0x00ff00ff00ff00ff
		}
		for j := 0; j < 8 && k+j < n; j++ {
			b[k+j] = byte(v >> (8 * j))
		}
	}
	copy(b, "\x7fELF\x02\x01\x01")
	return b
}

// jsModule is CommonJS of about n bytes requiring deps (package names)
// and local (relative paths), exporting its functions.
func (in *installer) jsModule(n int, deps, local []string) string {
	g := in.g
	var b strings.Builder
	fmt.Fprintf(&b, "'use strict';\n/**\n * %s\n */\n", strings.ReplaceAll(g.prose(80+g.rng.IntN(200)), "\n", "\n * "))
	var vars []string
	for i, d := range append(append([]string{}, deps...), local...) {
		v := fmt.Sprintf("dep%d", i)
		fmt.Fprintf(&b, "const %s = require(%q);\n", v, d)
		vars = append(vars, v)
	}
	var names []string
	for k := 0; b.Len() < n || k == 0; k++ {
		fn := in.camel() + strconv.Itoa(k)
		names = append(names, fn)
		use := "null"
		if len(vars) > 0 {
			use = vars[k%len(vars)]
		}
		fmt.Fprintf(&b, "\nfunction %s(value, options = {}) {\n  // %s\n  const out = { value, used: typeof %s };\n  for (const key of Object.keys(options)) {\n    out[key] = String(options[key]).length;\n  }\n  return out;\n}\n", fn, strings.ReplaceAll(g.prose(60), "\n", " "), use)
	}
	fmt.Fprintf(&b, "\nmodule.exports = { %s };\n", strings.Join(names, ", "))
	return b.String()
}

// npmPackage writes one generated package under dir (node_modules) of at
// most about budget entries: package.json, index.js requiring its lib
// files and dependencies (packages made before it, so never a cycle),
// README, LICENSE, type declarations, now and then a bin (with its .bin
// symlink), a dist bundle or nested node_modules of its own.
func (in *installer) npmPackage(dir string, i, budget, depth int) error {
	g := in.g
	var name string
	for name == "" || in.names[name] && depth == 0 {
		name = strings.ReplaceAll(in.ident(), "_", "-")
		if g.rng.IntN(8) == 0 {
			name = "@" + g.word() + "-" + strconv.Itoa(i%50) + "/" + name
		} else {
			name += "-" + strconv.Itoa(i)
		}
	}
	if depth == 0 {
		in.names[name] = true
	}
	pkg := filepath.Join(dir, name)
	version := fmt.Sprintf("%d.%d.%d", g.rng.IntN(9), g.rng.IntN(40), g.rng.IntN(20))
	nlib := max(0, min(1+int(math.Pow(g.rng.Float64(), 3)*60), budget-6))
	var deps []string
	if depth == 0 && len(in.npmPkgs) > 0 {
		for d := g.rng.IntN(5); d > 0; d-- {
			deps = append(deps, in.npmPkgs[g.rng.IntN(len(in.npmPkgs))])
		}
		sort.Strings(deps)
		deps = dedupe(deps)
	}
	depMap := map[string]string{}
	for _, d := range deps {
		depMap[d] = "^1.0.0"
	}
	var libs []string
	for k := 0; k < nlib; k++ {
		rel := fmt.Sprintf("lib/%s-%d.js", strings.ReplaceAll(in.ident(), "_", "-"), k)
		var local []string
		if k > 0 && g.rng.IntN(2) == 0 {
			local = []string{"./" + filepath.Base(libs[g.rng.IntN(len(libs))])}
		}
		if err := in.write(filepath.Join(pkg, rel), []byte(in.jsModule(int(math.Exp(math.Log(150)+g.rng.Float64()*(math.Log(9000)-math.Log(150)))), nil, local)), 0o644); err != nil {
			return err
		}
		libs = append(libs, rel)
	}
	var local []string
	for k := 0; k < min(len(libs), 4); k++ {
		local = append(local, "./"+libs[k])
	}
	if err := in.write(filepath.Join(pkg, "index.js"), []byte(in.jsModule(300+g.rng.IntN(3000), deps, local)), 0o644); err != nil {
		return err
	}
	meta := map[string]any{"name": name, "version": version, "description": g.prose(60), "main": "index.js", "license": "MIT",
		"types": "index.d.ts", "repository": map[string]string{"type": "git", "url": "git+https://github.com/" + g.word() + "/" + filepath.Base(name) + ".git"},
		"dependencies": depMap, "engines": map[string]string{"node": ">=14"}}
	hasBin := depth == 0 && g.rng.IntN(25) == 0
	if _, err := os.Lstat(filepath.Join(in.root, dir, ".bin", filepath.Base(name))); hasBin && err == nil {
		hasBin = false // a scoped package's command of the same name has it
	}
	if hasBin {
		meta["bin"] = map[string]string{filepath.Base(name): "bin/cli.js"}
	}
	pj, _ := json.MarshalIndent(meta, "", "  ")
	files := [][2]string{{"package.json", string(pj) + "\n"}, {"README.md", "# " + name + "\n\n" + g.prose(300+g.rng.IntN(5000)) + "\n"},
		{"LICENSE", "MIT License\n\nCopyright (c) " + g.word() + "\n\n" + g.prose(700) + "\n"}, {"index.d.ts", "export declare function " + in.camel() + "(value: unknown): object;\n"}}
	if g.rng.IntN(3) == 0 {
		files = append(files, [2]string{"CHANGELOG.md", "# Changelog\n\n" + g.prose(500+g.rng.IntN(8000)) + "\n"})
	}
	for _, f := range files {
		if err := in.write(filepath.Join(pkg, f[0]), []byte(f[1]), 0o644); err != nil {
			return err
		}
	}
	if g.rng.IntN(15) == 0 {
		if err := in.write(filepath.Join(pkg, "dist", "index.min.js"), []byte(in.jsModule(20000+g.rng.IntN(400000), nil, nil)), 0o644); err != nil {
			return err
		}
	}
	if hasBin {
		if err := in.write(filepath.Join(pkg, "bin", "cli.js"), []byte("#!/usr/bin/env node\n'use strict';\nconsole.log(Object.keys(require('..')).length);\n"), 0o755); err != nil {
			return err
		}
		if err := in.symlink(filepath.Join("..", name, "bin", "cli.js"), filepath.Join(dir, ".bin", filepath.Base(name))); err != nil {
			return err
		}
	}
	// Nested node_modules: another version of a package this one needs
	// (npm could not hoist it), two levels deep at most.
	if depth < 2 && g.rng.IntN(8) == 0 && budget > 60 {
		nested := filepath.Join(pkg, "node_modules")
		for k := g.rng.IntN(3); k >= 0; k-- {
			if err := in.npmPackage(nested, i*10+k, 20, depth+1); err != nil {
				return err
			}
		}
	}
	if depth == 0 {
		in.npmPkgs = append(in.npmPkgs, name)
	}
	return nil
}

func dedupe(s []string) []string {
	out := s[:0]
	for i, v := range s {
		if i == 0 || v != s[i-1] {
			out = append(out, v)
		}
	}
	return out
}

// compileAll compiles the generated site-packages and the checkout's
// modules with the interpreter (timestamp .pyc in __pycache__, as pip and
// a first run leave them), in one process. The name recorded in each is
// the module's path from the home (the interpreter puts the real path in
// at import), so the same seed gives the same bytes wherever the home is.
func (in *installer) compileAll() error {
	co := filepath.Join(in.root, "hermes-agent")
	var checkout []string
	dirs := map[string]bool{}
	err := filepath.WalkDir(co, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && p != co && (d.Name() == ".git" || d.Name() == "venv" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if strings.HasSuffix(p, ".py") && d.Type().IsRegular() {
			rel, _ := filepath.Rel(in.root, p)
			checkout = append(checkout, rel)
			dirs[filepath.Dir(rel)] = true
		}
		return nil
	})
	if err != nil {
		return err
	}
	// The generated packages' entries were counted as they were written.
	in.count += len(checkout) + len(dirs)
	in.compile = append(in.compile, checkout...)
	sort.Strings(in.compile)
	var list bytes.Buffer
	for _, c := range in.compile {
		list.WriteString(c + "\n")
	}
	const script = `import py_compile, sys
bad = 0
for rel in sys.stdin.read().split("\n"):
    if rel:
        try:
            py_compile.compile(rel, dfile="~/.hermes/" + rel, doraise=True)
        except py_compile.PyCompileError as e:
            print(e.msg, file=sys.stderr); bad += 1
sys.exit(1 if bad else 0)
`
	cmd := exec.Command(in.python, "-c", script)
	cmd.Dir = in.root
	cmd.Env = append(os.Environ(), "PYTHONHASHSEED=0")
	cmd.Stdin = &list
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("compiling the generated modules with %s: %v: %s", in.python, err, out)
	}
	return nil
}

// setTimes gives what git and the compiler wrote, and every directory and
// symlink of the install, deterministic times: .pyc files and git's files
// after the sources (the index after the files it records, or git would
// take them for racily clean and hash them all again).
func (in *installer) setTimes() error {
	compiled := map[string]bool{}
	for _, c := range in.compile {
		stem := strings.TrimSuffix(filepath.Base(c), ".py")
		compiled[filepath.Join(in.root, filepath.Dir(c), "__pycache__", stem+"."+in.cacheTag+".pyc")] = true
	}
	var dirs []string
	for _, top := range []string{"hermes-agent", "node"} {
		err := filepath.WalkDir(filepath.Join(in.root, top), func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			switch {
			case d.IsDir() || d.Type()&fs.ModeSymlink != 0:
				dirs = append(dirs, p)
			case compiled[p]:
				t := in.tick()
				return os.Chtimes(p, t, t)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	gitDir := filepath.Join(in.root, "hermes-agent", ".git")
	err := filepath.WalkDir(gitDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		t := in.tick()
		return os.Chtimes(p, t, t)
	})
	if err != nil {
		return err
	}
	sort.Sort(sort.Reverse(sort.StringSlice(dirs)))
	for _, p := range dirs {
		ts := unix.NsecToTimespec(in.tick().UnixNano())
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, p, []unix.Timespec{ts, ts}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("utimes %s: %w", p, err)
		}
	}
	return nil
}

// parseCount reads an entry count: 120000, 120k, 1M.
func parseCount(s string) (int, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	mult := 1
	switch {
	case strings.HasSuffix(t, "K"):
		mult, t = 1000, strings.TrimSuffix(t, "K")
	case strings.HasSuffix(t, "M"):
		mult, t = 1000000, strings.TrimSuffix(t, "M")
	}
	f, err := strconv.ParseFloat(t, 64)
	if err != nil || f <= 0 {
		return 0, errors.New("want a count such as 120000, 120k or 1M")
	}
	return int(f * float64(mult)), nil
}
