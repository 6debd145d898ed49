package archive

import (
	"bytes"
	"errors"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
)

// Pack checks its own work before it hands an archive back: a block whose
// recorded sum is not the sum of what its stored bytes decode to, whatever
// path it came by, fails the pack with a *CorruptError naming the archive
// being written and the block, instead of producing an archive that its
// own verifier (and the next pack, which trusts recorded sums) would find
// wrong. Each case alters one finished block the way a packer bug would.
func TestPackChecksItsOwnBlocks(t *testing.T) {
	src := makeTree(t)
	bs := 128 << 10
	db := append(text(3*bs, 20), noise(3*bs, 21)...)
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)
	withSums, _ := packToFile(t, src, PackOptions{})
	noSums, _ := packToFile(t, src, PackOptions{noSums: true})
	base, baseNoSums := openFile(t, withSums), openFile(t, noSums)
	// One block of the database changes: its other blocks are copied
	// from the base, found by their sums.
	copy(db[bs+5:], "changed")
	writeFile(t, filepath.Join(src, "state.db"), db, 0o644)

	flip := func(s *sum) { s[7] ^= 1 }
	compressed := func(j *job) bool { return j.word != 0 && j.word&dataUncompBit == 0 }
	for _, c := range []struct {
		name   string
		base   *Reader // BlockSource of unchanged files
		opts   PackOptions
		match  func(*job) bool
		tamper func(*job)
		what   string
	}{
		{"a new block's sum", nil, PackOptions{},
			func(j *job) bool { return j.kind == jobData && compressed(j) && j.baseOff < 0 },
			func(j *job) { flip(&j.sum) }, "data block"},
		{"a new block's bytes", nil, PackOptions{},
			func(j *job) bool { return j.kind == jobData && compressed(j) && j.baseOff < 0 },
			func(j *job) {
				j.out[len(j.out)/2] ^= 0x40
				j.crc = crc32c(j.out) // only the content is wrong
			}, "data block"},
		{"a block stored uncompressed", nil, PackOptions{},
			func(j *job) bool { return j.kind == jobData && j.word&dataUncompBit != 0 },
			func(j *job) { flip(&j.sum) }, "data block"},
		{"a hole", nil, PackOptions{},
			func(j *job) bool { return j.kind == jobData && j.word == 0 },
			func(j *job) { flip(&j.sum) }, "data block"},
		{"a fragment block's tail", nil, PackOptions{},
			func(j *job) bool { return j.kind == jobFragment && len(j.tails) > 1 },
			func(j *job) { flip(&j.tails[1].file.tailSum) }, "fragment block"},
		{"a block copied from the base by its sum", base, PackOptions{Base: base},
			func(j *job) bool { return j.kind == jobData && j.baseOff >= 0 },
			func(j *job) { flip(&j.sum) }, "data block"},
		{"a block copied from an archive without sums", baseNoSums, PackOptions{},
			func(j *job) bool { return j.kind == jobRaw && compressed(j) },
			func(j *job) { flip(&j.sum) }, "data block"},
		{"bytes changed after the check", nil, PackOptions{},
			func(j *job) bool { return j.kind == jobData && compressed(j) },
			func(j *job) { j.crc ^= 1 }, "data block"},
	} {
		t.Run(c.name, func(t *testing.T) {
			var fs iofs.FS = os.DirFS(src)
			if c.base != nil {
				fs = WithBase(fs, c.base)
			}
			// Untouched, the same pack passes its check and verifies.
			p, _ := packBase(t, fs, c.opts)
			if err := openFile(t, p).Verify(t.Context()); err != nil {
				t.Fatal(err)
			}

			var done atomic.Bool
			opts := c.opts
			opts.tamper = func(j *job) {
				if j.err == nil && c.match(j) && done.CompareAndSwap(false, true) {
					c.tamper(j)
				}
			}
			f, err := os.Create(filepath.Join(t.TempDir(), "n.sqfs"))
			if err != nil {
				t.Fatal(err)
			}
			defer f.Close()
			_, err = Pack(t.Context(), f, fs, opts)
			if !done.Load() {
				t.Fatal("no block to alter: the case tests nothing")
			}
			var ce *CorruptError
			if !errors.As(err, &ce) || !errors.Is(err, errSelfCheck) || !errors.Is(err, ErrCorrupt) {
				t.Fatalf("Pack: %v; want a *CorruptError of its own check", err)
			}
			if ce.Name != f.Name() || ce.What != c.what || ce.Offset <= 0 {
				t.Errorf("error names %q, %s at %d; want %q, a %s", ce.Name, ce.What, ce.Offset, f.Name(), c.what)
			}
			if !strings.Contains(err.Error(), "packer bug") {
				t.Errorf("error does not say what it is: %v", err)
			}
		})
	}

	// A writer that is not a file gets nothing of an archive that failed.
	var buf bytes.Buffer
	var done atomic.Bool
	_, err := Pack(t.Context(), &buf, os.DirFS(src), PackOptions{tamper: func(j *job) {
		if j.kind == jobData && compressed(j) && done.CompareAndSwap(false, true) {
			flip(&j.sum)
		}
	}})
	if !errors.Is(err, errSelfCheck) || buf.Len() != 0 {
		t.Errorf("Pack to a stream: %v, %d bytes written", err, buf.Len())
	}
}
