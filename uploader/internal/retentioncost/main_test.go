package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// text returns n bytes of compressible text.
func text(rng *rand.Rand, n int) []byte {
	words := strings.Fields("the agent wrote a note about the session and its memory tool call result")
	var b bytes.Buffer
	for b.Len() < n {
		b.WriteString(words[rng.IntN(len(words))])
		b.WriteByte(' ')
	}
	return b.Bytes()[:n]
}

// TestSimulation runs two simulated days of hourly snapshots on a small
// tree that changes like an agent's home (a database changed in place, a
// log appended to, files added and deleted), and checks what the
// simulation claims: every snapshot the policy keeps is still readable
// from the store and holds the tree as it was then (the last one: the
// home now), the pruned ones are gone with the segments only they used,
// and the bytes reported are the store's.
func TestSimulation(t *testing.T) {
	dir := t.TempDir()
	home := filepath.Join(dir, "home")
	os.MkdirAll(filepath.Join(home, "sessions"), 0o755)
	rng := rand.New(rand.NewPCG(1, 2))
	db := text(rng, 3<<20)
	write := func(name string, b []byte) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(home, name), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("state.db", db)
	for i := range 20 {
		write(fmt.Sprintf("sessions/s%03d.json", i), text(rng, 1000+rng.IntN(300<<10)))
	}
	apply := func(from, n int) error {
		for r := from; r < from+n; r++ {
			// A page of the database rewritten in place, the log
			// appended to, a session added, the oldest deleted.
			copy(db[rng.IntN(len(db)-4096):], text(rng, 4096))
			write("state.db", db)
			f, err := os.OpenFile(filepath.Join(home, "sessions", "s000.json"), os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				return err
			}
			f.Write(text(rng, 2000))
			f.Close()
			write(fmt.Sprintf("sessions/new%03d.json", r), text(rng, 5000))
			if r >= 5 {
				os.Remove(filepath.Join(home, "sessions", fmt.Sprintf("new%03d.json", r-5)))
			}
		}
		return nil
	}
	c := config{home: home, store: filepath.Join(dir, "store"), cache: filepath.Join(dir, "cache"),
		days: 2, every: time.Hour, rounds: 1, apply: apply,
		// Compactions every few snapshots: the kept ones include some.
		policy: image.CompactPolicy{GarbageShare: 0.2, Extents: 40}}
	var out bytes.Buffer
	s, err := simulate(context.Background(), c, &out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	defer s.last.Close()
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	summary := lines[len(lines)-1]
	t.Log(summary)
	var compactions, extended int
	for _, l := range lines {
		switch {
		case strings.HasPrefix(l, "# compacted after"):
			compactions++
		case strings.HasPrefix(l, "# snapshot ") && strings.Contains(l, "laid out afresh"):
			t.Errorf("an extending pack fell back: %s", l)
		case !strings.HasPrefix(l, "#") && !strings.HasPrefix(l, "summary"):
			extended++
		}
	}
	if compactions == 0 {
		t.Errorf("no compaction in %d snapshots", extended)
	}
	var i int
	var when string
	var pack float64
	var segment, rewritten, sent, size, extents, kept, stored, objects, restic int64
	if _, err := fmt.Sscan(lines[len(lines)-2], &i, &when, &pack, &segment, &rewritten, &sent, &size, &extents, &kept, &stored, &objects, &restic); err != nil || i != 47 {
		t.Fatalf("last snapshot line %q: %v", lines[len(lines)-2], err)
	}
	if bytes, n, _ := du(c.store); bytes != stored || n != objects {
		t.Errorf("reported %d bytes in %d objects; the store holds %d in %d", stored, objects, bytes, n)
	}
	// Hourly 24, last 10, daily 14 of two days: 24 hours, and the first
	// day's newest.
	snaps, err := s.cat.Complete(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(snaps) != 25 || kept != 25 || !strings.Contains(summary, "kept 25;") {
		t.Errorf("%d snapshots in the store, %d reported kept (summary %q); want 25", len(snaps), kept, summary)
	}
	// Every kept snapshot reads back whole and checks.
	st, err := uploader.NewLocal(c.store)
	if err != nil {
		t.Fatal(err)
	}
	pool, err := image.NewPool(image.Options{Store: st, CacheDir: filepath.Join(dir, "check")})
	if err != nil {
		t.Fatal(err)
	}
	var segsUsed = map[string]bool{}
	for _, ref := range snaps {
		m, err := s.cat.Manifest(context.Background(), ref.ID)
		if err != nil {
			t.Fatal(err)
		}
		for _, sg := range m.Segments {
			segsUsed[sg.Key] = true
		}
		im, err := pool.Open(context.Background(), m, nil)
		if err != nil {
			t.Fatalf("open %s: %v", ref.ID, err)
		}
		r, err := archive.Open(im, im.Size(), archive.ReaderOptions{Name: ref.ID})
		if err == nil {
			err = r.Verify(context.Background())
		}
		if err != nil {
			t.Errorf("snapshot %s: %v", ref.ID, err)
		}
		if ref.ID == s.last.Manifest().ID {
			same(t, r, home)
		}
		im.Close()
	}
	// No segment stays that no kept snapshot uses.
	segs, _ := filepath.Glob(filepath.Join(c.store, "segments", "*.seg"))
	if len(segs) != len(segsUsed) {
		t.Errorf("%d segments in the store, %d used by the kept snapshots", len(segs), len(segsUsed))
	}
}

// same fails t unless the archive holds the tree at dir.
func same(t *testing.T, r *archive.Reader, dir string) {
	t.Helper()
	n := 0
	err := filepath.WalkDir(dir, func(p string, d iofs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		want, _ := os.ReadFile(p)
		f, err := r.Open(rel)
		if err != nil {
			return err
		}
		got, err := io.ReadAll(f)
		f.Close()
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s: %d bytes in the image, %d in the tree (%v)", rel, len(got), len(want), err)
		}
		n++
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("no files compared")
	}
}
