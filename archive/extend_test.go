package archive

import (
	"errors"
	iofs "io/fs"
	"maps"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

// A one-line change to a file deep in a tree: the extended image holds
// the tree, every reader reads it, unchanged objects keep their numbers,
// and the segment holds little more than the change.
func TestExtendOneChange(t *testing.T) {
	src := makeTree(t)
	basePath, _ := packToFile(t, src, PackOptions{})
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)

	tr := newTracker(src, base)
	calls := &callLog{changeTracker: tr}
	p := filepath.Join(src, "sessions", "small.json")
	data, _ := os.ReadFile(p)
	writeFile(t, p, append(data, "one more line\n"...), 0o644)
	when := time.Date(2026, 5, 1, 0, 0, 0, 0, time.UTC)
	os.Chtimes(p, when, when)
	tr.touch("sessions/small.json")

	img, _, res := extendImage(t, calls, base, baseBytes, PackOptions{})
	t.Logf("extended: %s, image %d bytes, segment %d, runs %d", res.Base, res.Size, res.SegmentSize, len(res.Runs))
	if res.Base != BaseExtended {
		t.Fatalf("Base = %q (%s), want extended", res.Base, res.ExtendFallback)
	}
	// The pack walked the change: the directories on its path listed,
	// their entries stat'ed, the changed file read; nothing else.
	if got, want := calls.list("ReadDir"), []string{".", "sessions"}; !slices.Equal(got, want) {
		t.Errorf("listed %v, want %v", got, want)
	}
	if got := slices.Compact(calls.list("Open")); !slices.Equal(got, []string{"sessions/small.json"}) {
		t.Errorf("opened %v, want only sessions/small.json", got)
	}
	for _, p := range calls.list("Lstat") {
		if d := path.Dir(p); p != "." && d != "." && d != "sessions" {
			t.Errorf("stat'ed %s, below a directory that did not change", p)
		}
	}
	r := checkImage(t, img, scanTree(t, src))
	for _, name := range []string{"config.yaml", "sessions/big.json", "memories/MEMORY.md", "sessions/small.json", "sessions", "."} {
		a, err := base.resolve("t", name, false)
		if err != nil {
			t.Fatal(err)
		}
		b, err := r.resolve("t", name, false)
		if err != nil {
			t.Fatal(err)
		}
		if a.Ino != b.Ino {
			t.Errorf("%s: inode %d, was %d", name, b.Ino, a.Ino)
		}
	}
	if g := r.Generation(); g != 1 {
		t.Errorf("generation %d", g)
	}
	if res.SegmentSize > 64<<10 {
		t.Errorf("segment of %d bytes for a one-line change", res.SegmentSize)
	}
}

// Compact of an image extended many times: the same tree and inode
// numbers, its lineage, generation 0 and no garbage, data copied by
// reference in long runs, and much less image than the extended one
// carried.
func TestCompact(t *testing.T) {
	src := makeTree(t)
	basePath, _ := packToFile(t, src, PackOptions{})
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	lineage, _ := base.Lineage()
	tr := newTracker(src, base)
	for i := range 6 {
		p := filepath.Join(src, "sessions", "big.json")
		writeFile(t, p, text(3*128<<10+i*1000, 30+i), 0o644)
		tr.touch("sessions/big.json")
		os.Remove(filepath.Join(src, "sessions", "dup-of-small.json"))
		writeFile(t, filepath.Join(src, "sessions", "dup-of-small.json"), text(2000+i, i), 0o644)
		tr.created("sessions/dup-of-small.json")
		img, data, res := extendImage(t, tr, base, baseBytes, PackOptions{})
		if res.Base != BaseExtended {
			t.Fatalf("round %d: %s (%s)", i, res.Base, res.ExtendFallback)
		}
		base, baseBytes = checkImage(t, img, scanTree(t, src)), data
		tr.reset(base)
	}
	if base.GarbageBytes() == 0 || base.Generation() != 6 {
		t.Fatalf("after 6 extending packs: generation %d, garbage %d", base.Generation(), base.GarbageBytes())
	}
	want := scanTree(t, src)
	img, _, res := compactImage(t, base, baseBytes, PackOptions{})
	r := checkImage(t, img, want)
	t.Logf("extended image %d bytes (garbage estimate %d), compacted %d bytes, segment %d, %d runs", len(baseBytes), base.GarbageBytes(), res.Size, res.SegmentSize, len(res.Runs))
	if l, _ := r.Lineage(); l != lineage || r.Generation() != 0 || r.GarbageBytes() != 0 {
		t.Errorf("compacted: generation %d, garbage %d, lineage kept %v", r.Generation(), r.GarbageBytes(), l == lineage)
	}
	if res.Size >= int64(len(baseBytes)) {
		t.Errorf("compacted image of %d bytes, the extended one had %d", res.Size, len(baseBytes))
	}
	walkBoth(t, base, r, func(name string, a, b Attr) {
		if a.Ino != b.Ino {
			t.Errorf("%s: inode %d after compaction, was %d", name, b.Ino, a.Ino)
		}
	})
	// Data blocks are copied, not written: the segment holds metadata,
	// the trailer and repacked fragment tails.
	var copied int64
	for _, run := range res.Runs {
		if run.Source != nil {
			copied += run.Length
		}
	}
	if copied < res.Size/2 {
		t.Errorf("only %d of %d bytes copied by reference", copied, res.Size)
	}
}

// walkBoth calls fn for every path of a with its attributes in a and b.
func walkBoth(t *testing.T, a, b *Reader, fn func(name string, x, y Attr)) {
	t.Helper()
	iofs.WalkDir(a.FS(), ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		x, err := a.resolve("t", p, false)
		if err != nil {
			t.Fatal(err)
		}
		y, err := b.resolve("t", p, false)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		fn(p, x, y)
		return nil
	})
}

// numbersOf maps every path of r to its inode number, failing when two
// objects that are not hard links of one file share a number.
func numbersOf(t *testing.T, r *Reader) map[string]Inode {
	t.Helper()
	out := map[string]Inode{}
	names := map[Inode][]string{}
	attrs := map[Inode]Attr{}
	err := iofs.WalkDir(r.FS(), ".", func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		a, err := r.resolve("t", p, false)
		if err != nil {
			return err
		}
		out[p] = a.Ino
		names[a.Ino] = append(names[a.Ino], p)
		attrs[a.Ino] = a
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	// A number named by several paths must be one hard-linked file with
	// as many links.
	for ino, ps := range names {
		if a := attrs[ino]; len(ps) > 1 && (a.Mode.IsDir() || int(a.Nlink) != len(ps)) {
			t.Errorf("inode %d (%v, %d links) is named by %v", ino, a.Mode, a.Nlink, ps)
		}
	}
	return out
}

// Inode numbers along a lineage: unchanged, changed and moved objects
// keep theirs across extending packs and Compact; a new object at the
// path of one it replaces (an atomic write-and-rename) takes its number;
// other new objects get numbers no image of the lineage used, so the
// numbers of objects that went are never given to others, and those are
// not found; no two live objects share one; the kernel reports them.
func TestExtendInodeNumbers(t *testing.T) {
	src := makeTree(t)
	writeFile(t, filepath.Join(src, "sessions", "replaced.json"), text(3000, 1), 0o644)
	writeFile(t, filepath.Join(src, "sessions", "gone.json"), text(300, 2), 0o644)
	writeFile(t, filepath.Join(src, "was-file"), text(30, 3), 0o644)
	writeFile(t, filepath.Join(src, "olddir", "x"), text(30, 4), 0o644)
	basePath, _ := packToFile(t, src, PackOptions{})
	baseBytes, _ := os.ReadFile(basePath)
	base := openFile(t, basePath)
	n0 := numbersOf(t, base)
	next0 := base.tr2.root.nextInode
	tr := newTracker(src, base)
	abs := func(p string) string { return filepath.Join(src, filepath.FromSlash(p)) }

	// Generation 1.
	writeFile(t, abs("sessions/small.json"), text(1200, 5), 0o644)
	tr.touch("sessions/small.json")
	writeFile(t, abs("sessions/replaced.json.tmp"), text(2500, 6), 0o600)
	tr.created("sessions/replaced.json.tmp")
	if err := os.Rename(abs("sessions/replaced.json.tmp"), abs("sessions/replaced.json")); err != nil {
		t.Fatal(err)
	}
	tr.moved("sessions/replaced.json.tmp", "sessions/replaced.json")
	os.Remove(abs("sessions/gone.json"))
	tr.removed("sessions/gone.json")
	writeFile(t, abs("sessions/new.json"), text(700, 7), 0o644)
	tr.created("sessions/new.json")
	os.Mkdir(abs("conf"), 0o755)
	tr.created("conf")
	if err := os.Rename(abs("config.yaml"), abs("conf/config.yaml")); err != nil {
		t.Fatal(err)
	}
	tr.moved("config.yaml", "conf/config.yaml")
	if err := os.Rename(abs("olddir"), abs("sessions/olddir")); err != nil {
		t.Fatal(err)
	}
	tr.moved("olddir", "sessions/olddir")
	os.Remove(abs("was-file"))
	tr.removed("was-file")
	os.Mkdir(abs("was-file"), 0o700)
	tr.created("was-file")

	img, data, res := extendImage(t, tr, base, baseBytes, PackOptions{})
	if res.Base != BaseExtended {
		t.Fatalf("not extended: %s", res.ExtendFallback)
	}
	r1 := checkImage(t, img, scanTree(t, src))
	n1 := numbersOf(t, r1)
	same := map[string]string{
		"sessions/small.json": "sessions/small.json", "sessions/replaced.json": "sessions/replaced.json",
		"conf/config.yaml": "config.yaml", "sessions/olddir": "olddir", "sessions/olddir/x": "olddir/x",
		"sessions": "sessions", ".": ".", "sessions/big.json": "sessions/big.json", "memories/MEMORY.md": "memories/MEMORY.md",
		"state-snapshots/MEMORY.link": "state-snapshots/MEMORY.link", "logs/agent.log": "logs/agent.log",
	}
	for now, was := range same {
		if n1[now] != n0[was] {
			t.Errorf("%s: inode %d, %s was %d", now, n1[now], was, n0[was])
		}
	}
	for _, p := range []string{"sessions/new.json", "conf", "was-file"} {
		if uint32(n1[p]) < next0 {
			t.Errorf("new %s has inode %d, a number the lineage used (next was %d)", p, n1[p], next0)
		}
	}
	for _, gone := range []string{"sessions/gone.json", "was-file"} {
		if _, err := r1.Stat(n0[gone]); !errors.Is(err, iofs.ErrNotExist) {
			t.Errorf("Stat of the number of %s, which went: %v", gone, err)
		}
	}
	base, baseBytes = r1, data
	tr.reset(base)
	next1 := base.tr2.root.nextInode

	// Generation 2 goes through Compact: numbers stay, holes stay holes.
	img, data, _ = compactImage(t, base, baseBytes, PackOptions{})
	r2 := checkImage(t, img, scanTree(t, src))
	if n2 := numbersOf(t, r2); !maps.Equal(n1, n2) {
		t.Errorf("numbers changed by Compact:\n%v\n%v", n1, n2)
	}
	if r2.tr2.root.nextInode != next1 {
		t.Errorf("Compact: next inode %d, was %d", r2.tr2.root.nextInode, next1)
	}
	if _, err := r2.Stat(n0["sessions/gone.json"]); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("Stat of a number that went, after Compact: %v", err)
	}
	base, baseBytes = r2, data
	tr.reset(base)

	// Generation 3: an object that went gives its number to nobody.
	os.Remove(abs("sessions/new.json"))
	tr.removed("sessions/new.json")
	img, data, _ = extendImage(t, tr, base, baseBytes, PackOptions{})
	r3 := checkImage(t, img, scanTree(t, src))
	tr.reset(r3)
	writeFile(t, abs("sessions/newer.json"), text(700, 8), 0o644)
	tr.created("sessions/newer.json")
	img, _, _ = extendImage(t, tr, r3, data, PackOptions{})
	r4 := checkImage(t, img, scanTree(t, src))
	n4 := numbersOf(t, r4)
	if got := n4["sessions/newer.json"]; uint32(got) < next1 {
		t.Errorf("a new file after one went has inode %d; the lineage had used up to %d", got, next1-1)
	}
}

// Extend packs afresh, and says why, when it cannot extend; numbers stay
// with their objects where the source says what they were. A source
// that says an entry is unchanged when it is not fails the pack.
func TestExtendFallback(t *testing.T) {
	src := makeTree(t)
	packBaseOf := func(opts PackOptions) (*Reader, []byte) {
		p, _ := packToFile(t, src, opts)
		data, _ := os.ReadFile(p)
		return openFile(t, p), data
	}
	packWith := func(src iofs.FS, base *Reader, baseBytes []byte, opts PackOptions) (string, PackResult) {
		opts.Base, opts.Segment, opts.Extend = base, true, true
		segPath := filepath.Join(t.TempDir(), "seg")
		sf, err := os.Create(segPath)
		if err != nil {
			t.Fatal(err)
		}
		defer sf.Close()
		res, err := Pack(t.Context(), sf, src, opts)
		if err != nil {
			t.Fatal(err)
		}
		seg, _ := os.ReadFile(segPath)
		im := &image{seg: seg, runs: res.Runs, src: map[*Reader][]byte{base: baseBytes}, size: res.Size}
		p := filepath.Join(t.TempDir(), "image.sqfs")
		os.WriteFile(p, im.bytes(t), 0o644)
		return p, res
	}
	fellBack := func(res PackResult, why string) {
		t.Helper()
		if res.Base == BaseExtended || !strings.Contains(res.ExtendFallback, why) {
			t.Errorf("Base %q, ExtendFallback %q; want a fresh layout because %q", res.Base, res.ExtendFallback, why)
		}
	}
	t.Run("no ChangeFS", func(t *testing.T) {
		base, data := packBaseOf(PackOptions{})
		p, res := packWith(os.DirFS(src), base, data, PackOptions{})
		fellBack(res, "ChangeFS")
		checkImage(t, p, scanTree(t, src))
	})
	t.Run("version 1 base", func(t *testing.T) {
		base, data := packBaseOf(PackOptions{trailerV1: true})
		p, res := packWith(newTracker(src, base), base, data, PackOptions{})
		fellBack(res, "version 2")
		r := checkImage(t, p, scanTree(t, src))
		if _, ok := r.Lineage(); !ok {
			t.Error("the first image after a version 1 base starts no lineage")
		}
	})
	t.Run("other compression", func(t *testing.T) {
		base, data := packBaseOf(PackOptions{Compression: Gzip})
		p, res := packWith(newTracker(src, base), base, data, PackOptions{})
		fellBack(res, "compressed with gzip")
		checkImage(t, p, scanTree(t, src))
	})
	t.Run("other block size", func(t *testing.T) {
		base, data := packBaseOf(PackOptions{BlockSize: 64 << 10})
		p, res := packWith(newTracker(src, base), base, data, PackOptions{})
		fellBack(res, "block size")
		checkImage(t, p, scanTree(t, src))
	})
	t.Run("hard link changed", func(t *testing.T) {
		// memories/MEMORY.md and state-snapshots/MEMORY.link are one
		// file; the change is seen through the first name only.
		base, data := packBaseOf(PackOptions{})
		lineage, _ := base.Lineage()
		n0 := numbersOf(t, base)
		tr := newTracker(src, base)
		p := filepath.Join(src, "memories", "MEMORY.md")
		f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		f.WriteString("§\nentry three\n")
		f.Close()
		tr.touch("memories/MEMORY.md")
		img, res := packWith(tr, base, data, PackOptions{})
		fellBack(res, "hard link")
		r := checkImage(t, img, scanTree(t, src))
		if !maps.Equal(n0, numbersOf(t, r)) {
			t.Error("the fresh layout did not keep the lineage's numbers")
		}
		if l, ok := r.Lineage(); !ok || l != lineage {
			t.Error("the fresh layout did not keep the lineage")
		}
	})
	t.Run("source lies", func(t *testing.T) {
		base, _ := packBaseOf(PackOptions{})
		tr := newTracker(src, base)
		tr.touch("sessions/small.json") // listed, so its siblings are checked
		later := time.Date(2027, 1, 1, 0, 0, 0, 0, time.UTC)
		os.Chtimes(filepath.Join(src, "sessions", "big.json"), later, later)
		sf, _ := os.Create(filepath.Join(t.TempDir(), "seg"))
		defer sf.Close()
		_, err := Pack(t.Context(), sf, tr, PackOptions{Base: base, Segment: true, Extend: true})
		if err == nil || !strings.Contains(err.Error(), "sessions/big.json") || !strings.Contains(err.Error(), "mtime") {
			t.Errorf("a wrong unchanged entry: %v", err)
		}
	})
}
