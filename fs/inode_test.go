package fs

import (
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// memoriesLower is a lower layer holding both memory files, as a snapshot
// of a Hermes home does.
func memoriesLower(t *testing.T) Lower {
	lower, _ := packLower(t, func(dir string) {
		os.MkdirAll(filepath.Join(dir, "memories"), 0o755)
		os.WriteFile(filepath.Join(dir, "memories/MEMORY.md"), []byte("lower memory"), 0o644)
		os.WriteFile(filepath.Join(dir, "memories/USER.md"), []byte("lower user"), 0o644)
		os.WriteFile(filepath.Join(dir, "notes.txt"), []byte("notes"), 0o644)
	})
	return lower
}

// inoOf is the st_ino of path, a test failure if it cannot be stat'ed.
func inoOf(t *testing.T, p string) uint64 {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		t.Fatal(err)
	}
	return st.Ino
}

// TestGuardedRecreateDistinctInodes is the report's scenario: both memory
// files of the snapshot deleted and written again by a shell. A guarded
// file's first content is committed over the empty file its creation
// made, and keeps that file's number, whose upper inode is then free: the
// next file the upper file system made got it and reported the same
// number. cp and mv between the two said "are the same file".
func TestGuardedRecreateDistinctInodes(t *testing.T) {
	t.Parallel()
	e := mountEnv(t, memoriesLower(t), Options{Guard: &testGuard{max: 4096}})
	sh := func(script string) {
		t.Helper()
		cmd := exec.Command("sh", "-c", script)
		cmd.Dir = e.mnt
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", script, err, out)
		}
	}
	sh(`rm -f memories/MEMORY.md memories/USER.md && printf 'fact one\n' > memories/MEMORY.md && printf 'user one\n' > memories/USER.md && printf 'x\n' > memories/other.txt && mkdir memories/d`)
	names := []string{"memories/MEMORY.md", "memories/USER.md", "memories/other.txt", "memories/d", "memories", "notes.txt", "."}
	seen := map[uint64]string{}
	inos := map[string]uint64{}
	for _, n := range names {
		ino := inoOf(t, e.path(n))
		if o, dup := seen[ino]; dup {
			t.Fatalf("%s and %s both report st_ino %d", o, n, ino)
		}
		seen[ino] = n
		inos[n] = ino
	}
	// The real tools that compare st_ino.
	sh(`cp memories/MEMORY.md memories/USER.md`)
	if got := e.read("memories/USER.md"); got != "fact one\n" {
		t.Fatalf("USER.md after cp: %q", got)
	}
	if ino := inoOf(t, e.path("memories/USER.md")); ino != inos["memories/USER.md"] {
		t.Errorf("cp over USER.md changed its st_ino from %d to %d", inos["memories/USER.md"], ino)
	}
	sh(`printf 'user two\n' > memories/USER.md && mv memories/USER.md memories/MEMORY.md`)
	if ino := inoOf(t, e.path("memories/MEMORY.md")); ino != inos["memories/USER.md"] {
		t.Errorf("MEMORY.md after mv reports %d, want the moved file's %d", ino, inos["memories/USER.md"])
	}
	e.remount()
	if ino := inoOf(t, e.path("memories/MEMORY.md")); ino != inos["memories/USER.md"] {
		t.Errorf("after a remount MEMORY.md reports %d, want %d", ino, inos["memories/USER.md"])
	}
	if got := e.read("memories/MEMORY.md"); got != "user two\n" {
		t.Errorf("MEMORY.md: %q", got)
	}
	// Recreated after the remount: still a number of its own.
	sh(`printf 'user three\n' > memories/USER.md`)
	seen = map[uint64]string{}
	for _, n := range []string{"memories/MEMORY.md", "memories/USER.md", "memories/other.txt", "memories/d", "memories", "notes.txt"} {
		ino := inoOf(t, e.path(n))
		if o, dup := seen[ino]; dup {
			t.Fatalf("after a remount, %s and %s both report st_ino %d", o, n, ino)
		}
		seen[ino] = n
	}
}

// inoModel is what TestInodeNumbersRandom expects of the mount: every
// object by path, with an identity that hard links share and that a
// copy-up, a guarded commit or a rename keeps.
type inoModel struct {
	files   map[string]int // path -> identity
	dirs    map[string]int
	content map[int]string // of files, by identity
	ino     map[int]uint64 // st_ino first seen, by identity
	next    int
}

func (m *inoModel) newID() int { m.next++; return m.next }

func (m *inoModel) links(id int) int {
	k := 0
	for _, f := range m.files {
		if f == id {
			k++
		}
	}
	return k
}

func sortedKeys(m map[string]int) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// TestInodeNumbersRandom runs random creates, deletes, renames (of files
// and directories, over existing files too), hard links, copy-ups,
// guarded replacements and recreations, and remounts, on a mount with a
// guard, and checks after each step that all live objects have distinct
// st_ino (hard links one), that each object keeps its st_ino for its
// whole life, across copy-up, rename, guarded commits and remounts, and
// that directory listings give the same numbers (d_ino).
func TestInodeNumbersRandom(t *testing.T) {
	t.Parallel()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("HERMESFS_INO_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	t.Logf("seed %d (HERMESFS_INO_SEED)", seed)
	rng := rand.New(rand.NewPCG(seed, 7))
	m := &inoModel{files: map[string]int{}, dirs: map[string]int{}, content: map[int]string{}, ino: map[int]uint64{}}
	lower, _ := packLower(t, func(dir string) {
		for _, d := range []string{"memories", "a", "a/sub", "b"} {
			os.MkdirAll(filepath.Join(dir, d), 0o755)
		}
		files := map[string]string{"memories/MEMORY.md": "lower memory", "memories/USER.md": "lower user"}
		for i := range 4 {
			files[fmt.Sprintf("a/f%d", i)] = fmt.Sprintf("a%d", i)
			files[fmt.Sprintf("a/sub/s%d", i)] = fmt.Sprintf("s%d", i)
			files[fmt.Sprintf("b/g%d", i)] = fmt.Sprintf("b%d", i)
			files[fmt.Sprintf("t%d", i)] = fmt.Sprintf("t%d", i)
		}
		for p, c := range files {
			os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644)
		}
	})
	for _, d := range []string{"", "memories", "a", "a/sub", "b"} {
		m.dirs[d] = m.newID()
	}
	e := mountEnv(t, lower, Options{Guard: &testGuard{max: 4096}})
	// The lower files, by walking the mount once.
	must(t, filepath.WalkDir(e.mnt, func(p string, d fs.DirEntry, err error) error {
		must(t, err)
		rel, _ := filepath.Rel(e.mnt, p)
		if !d.IsDir() {
			id := m.newID()
			m.files[rel] = id
			b, err := os.ReadFile(p)
			must(t, err)
			m.content[id] = string(b)
		}
		return nil
	}))
	guarded := func(p string) bool { return p == "memories/MEMORY.md" || p == "memories/USER.md" }
	var step string
	check := func(full bool) {
		t.Helper()
		got := map[string]uint64{}
		dino := map[string]uint64{}
		err := filepath.WalkDir(e.mnt, func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			rel, _ := filepath.Rel(e.mnt, p)
			if rel == "." {
				rel = ""
			}
			var st unix.Stat_t
			if err := unix.Lstat(p, &st); err != nil {
				return err
			}
			got[rel] = st.Ino
			if d.IsDir() && full {
				fd, err := unix.Open(p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
				if err != nil {
					return err
				}
				ents, err := readDirents(fd)
				unix.Close(fd)
				if err != nil {
					return err
				}
				for _, de := range ents {
					if de.name != "." && de.name != ".." {
						dino[path.Join(rel, de.name)] = de.ino
					}
				}
			}
			return nil
		})
		if err != nil {
			t.Fatalf("%s: walk: %v", step, err)
		}
		byIno := map[uint64]int{}
		for _, kind := range []map[string]int{m.files, m.dirs} {
			for p, id := range kind {
				ino, ok := got[p]
				if !ok {
					t.Fatalf("%s: %q missing from the mount", step, p)
				}
				delete(got, p)
				if other, dup := byIno[ino]; dup && other != id {
					t.Fatalf("%s: %q reports st_ino %d, which another live object reports too", step, p, ino)
				}
				byIno[ino] = id
				if want, ok := m.ino[id]; ok && want != ino {
					t.Fatalf("%s: %q reports st_ino %d, earlier %d", step, p, ino, want)
				}
				m.ino[id] = ino
				if d, ok := dino[p]; ok && d != ino {
					t.Errorf("%s: %q: d_ino %d, st_ino %d", step, p, d, ino)
				}
			}
		}
		if len(got) > 0 {
			t.Fatalf("%s: unexpected objects in the mount: %v", step, got)
		}
	}
	check(true)
	pick := func(keys []string) string { return keys[rng.IntN(len(keys))] }
	fileNames := func(filter func(string) bool) []string {
		var out []string
		for _, p := range sortedKeys(m.files) {
			if filter == nil || filter(p) {
				out = append(out, p)
			}
		}
		return out
	}
	// A directory other than memories (whose guarded names the renames
	// below would have to respect) and its subtree.
	plainDirs := func() []string {
		var out []string
		for _, d := range sortedKeys(m.dirs) {
			if d != "memories" && !strings.HasPrefix(d, "memories/") {
				out = append(out, d)
			}
		}
		return out
	}
	names := 0
	newName := func(dir string) string { names++; return path.Join(dir, fmt.Sprintf("n%d", names)) }
	write := func(p, c string, flags int) {
		t.Helper()
		f, err := os.OpenFile(e.path(p), flags, 0o644)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		if _, err := f.WriteString(c); err != nil {
			t.Fatalf("%s: write: %v", step, err)
		}
		if err := f.Close(); err != nil {
			t.Fatalf("%s: close: %v", step, err)
		}
	}
	for i := range 300 {
		switch k := rng.IntN(100); {
		case k < 14: // create
			p := newName(pick(plainDirs()))
			step = fmt.Sprintf("step %d: create %s", i, p)
			write(p, "new", os.O_WRONLY|os.O_CREATE|os.O_EXCL)
			id := m.newID()
			m.files[p], m.content[id] = id, "new"
		case k < 24: // delete
			cands := fileNames(nil)
			if len(cands) == 0 {
				continue
			}
			p := pick(cands)
			step = fmt.Sprintf("step %d: delete %s", i, p)
			must(t, os.Remove(e.path(p)))
			delete(m.files, p)
		case k < 38: // rename a file, to a new name or over another file
			cands := fileNames(func(p string) bool { return !guarded(p) })
			if len(cands) == 0 {
				continue
			}
			from := pick(cands)
			to := newName(pick(plainDirs()))
			if rng.IntN(2) == 0 {
				to = pick(fileNames(nil))
			}
			if to == from || m.files[to] == m.files[from] || guarded(to) && m.links(m.files[from]) > 1 {
				continue
			}
			step = fmt.Sprintf("step %d: rename %s over %s", i, from, to)
			must(t, os.Rename(e.path(from), e.path(to)))
			m.files[to] = m.files[from]
			delete(m.files, from)
		case k < 46: // hard link
			cands := fileNames(func(p string) bool { return !guarded(p) })
			if len(cands) == 0 {
				continue
			}
			from, to := pick(cands), newName(pick(plainDirs()))
			step = fmt.Sprintf("step %d: link %s to %s", i, from, to)
			must(t, os.Link(e.path(from), e.path(to)))
			m.files[to] = m.files[from]
		case k < 60: // change a file in place: a copy-up if it is a lower one
			cands := fileNames(func(p string) bool { return !guarded(p) })
			if len(cands) == 0 {
				continue
			}
			p := pick(cands)
			step = fmt.Sprintf("step %d: append to %s", i, p)
			if rng.IntN(3) == 0 {
				must(t, os.Chmod(e.path(p), 0o640))
			} else {
				write(p, "+", os.O_WRONLY|os.O_APPEND)
				m.content[m.files[p]] += "+"
			}
		case k < 76: // guarded replace (or recreation) by a shell-style write
			p := "memories/MEMORY.md"
			if rng.IntN(2) == 0 {
				p = "memories/USER.md"
			}
			c := fmt.Sprintf("fact %d\n", i)
			step = fmt.Sprintf("step %d: write %s", i, p)
			write(p, c, os.O_WRONLY|os.O_CREATE|os.O_TRUNC)
			id, ok := m.files[p]
			if !ok {
				id = m.newID()
				m.files[p] = id
			}
			m.content[id] = c
		case k < 82: // delete both memory files and write them again
			step = fmt.Sprintf("step %d: recreate the memory files", i)
			for _, p := range []string{"memories/MEMORY.md", "memories/USER.md"} {
				if err := os.Remove(e.path(p)); err != nil && !os.IsNotExist(err) {
					t.Fatalf("%s: %v", step, err)
				}
				delete(m.files, p)
			}
			for _, p := range []string{"memories/MEMORY.md", "memories/USER.md"} {
				write(p, "again\n", os.O_WRONLY|os.O_CREATE|os.O_TRUNC)
				id := m.newID()
				m.files[p], m.content[id] = id, "again\n"
			}
		case k < 87: // mkdir
			d := newName(pick(plainDirs()))
			step = fmt.Sprintf("step %d: mkdir %s", i, d)
			must(t, os.Mkdir(e.path(d), 0o755))
			m.dirs[d] = m.newID()
		case k < 93: // rename a directory (an archive one too) to a new name
			ds := plainDirs()
			from := pick(ds)
			if from == "" {
				continue
			}
			var targets []string
			for _, d := range ds {
				if d != from && !strings.HasPrefix(d, from+"/") {
					targets = append(targets, d)
				}
			}
			to := newName(pick(targets))
			step = fmt.Sprintf("step %d: rename directory %s to %s", i, from, to)
			must(t, os.Rename(e.path(from), e.path(to)))
			move := func(mm map[string]int) {
				for _, p := range sortedKeys(mm) {
					if p == from || strings.HasPrefix(p, from+"/") {
						mm[to+strings.TrimPrefix(p, from)] = mm[p]
						delete(mm, p)
					}
				}
			}
			move(m.dirs)
			move(m.files)
		case k < 96: // remount
			step = fmt.Sprintf("step %d: remount", i)
			e.remount()
		default: // remove an empty directory
			for _, d := range plainDirs() {
				if d == "" {
					continue
				}
				empty := true
				for p := range m.files {
					if strings.HasPrefix(p, d+"/") {
						empty = false
					}
				}
				for p := range m.dirs {
					if strings.HasPrefix(p, d+"/") {
						empty = false
					}
				}
				if empty {
					step = fmt.Sprintf("step %d: rmdir %s", i, d)
					must(t, os.Remove(e.path(d)))
					delete(m.dirs, d)
					break
				}
			}
		}
		check(i%10 == 0)
	}
	e.remount()
	step = "after the last remount"
	check(true)
	for p, id := range m.files {
		if got := e.read(p); got != m.content[id] {
			t.Errorf("%s: %q, want %q", p, got, m.content[id])
		}
	}
}
