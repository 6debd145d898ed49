package main

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// archiveTree makes a small tree; big.bin does not compress, so its first
// block is stored as is right after the superblock and compressor options.
func archiveTree(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "home")
	os.MkdirAll(filepath.Join(dir, "memories"), 0o755)
	big := make([]byte, 300<<10)
	rand.Read(big)
	for name, data := range map[string][]byte{
		"big.bin":            big,
		"config.yaml":        []byte("memory:\n  memory_char_limit: 2200\n"),
		"memories/MEMORY.md": []byte("one\n§\ntwo\n"),
	} {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.Chmod(filepath.Join(dir, "config.yaml"), 0o600)
	os.Symlink("memories/MEMORY.md", filepath.Join(dir, "mem.link"))
	return dir
}

func sameTree(t *testing.T, a, b string) {
	t.Helper()
	err := filepath.WalkDir(a, func(p string, d iofs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(a, p)
		q := filepath.Join(b, rel)
		fa, _ := os.Lstat(p)
		fb, err := os.Lstat(q)
		if err != nil {
			t.Errorf("%s: %v", rel, err)
			return nil
		}
		if fa.Mode() != fb.Mode() {
			t.Errorf("%s: mode %v, want %v", rel, fb.Mode(), fa.Mode())
		}
		if !fa.ModTime().Equal(fb.ModTime()) && !fa.IsDir() {
			t.Errorf("%s: mtime %v, want %v", rel, fb.ModTime(), fa.ModTime())
		}
		switch {
		case fa.Mode().IsRegular():
			x, _ := os.ReadFile(p)
			y, _ := os.ReadFile(q)
			if string(x) != string(y) {
				t.Errorf("%s: content differs", rel)
			}
		case fa.Mode()&iofs.ModeSymlink != 0:
			x, _ := os.Readlink(p)
			y, _ := os.Readlink(q)
			if x != y {
				t.Errorf("%s: target %q, want %q", rel, y, x)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestPackUnpackVerifyCommands(t *testing.T) {
	src := archiveTree(t)
	outDir := t.TempDir()
	file := filepath.Join(outDir, "home.sqfs")

	code, out, errOut := runCLI(t, "pack", src, file, "--level", "5")
	if code != exitOK {
		t.Fatalf("pack: exit %d: %s", code, errOut)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	if !strings.Contains(out, "sha256 "+hex.EncodeToString(sum[:])) || !strings.Contains(out, "3 files") {
		t.Errorf("pack output does not report the archive: %q", out)
	}
	if ents, _ := os.ReadDir(outDir); len(ents) != 1 {
		t.Errorf("pack left %d entries next to the archive", len(ents))
	}

	code, out, errOut = runCLI(t, "verify", file)
	if code != exitOK || !strings.Contains(out, "ok") {
		t.Fatalf("verify: exit %d: %s %s", code, out, errOut)
	}

	dst := filepath.Join(t.TempDir(), "restored")
	code, _, errOut = runCLI(t, "unpack", file, dst)
	if code != exitOK {
		t.Fatalf("unpack: exit %d: %s", code, errOut)
	}
	sameTree(t, src, dst)
	if code, _, _ := runCLI(t, "unpack", file, dst); code != exitUsage {
		t.Errorf("unpack into a non-empty directory: exit %d", code)
	}

	// Packing again with the first archive as base reuses big.bin's blocks
	// and gives the same bytes.
	again := filepath.Join(outDir, "again.sqfs")
	code, out, errOut = runCLI(t, "pack", "--base", file, "--level=5", src, again)
	if code != exitOK || !strings.Contains(out, "reused") {
		t.Fatalf("pack --base: exit %d: %s %s", code, out, errOut)
	}
	data2, _ := os.ReadFile(again)
	if string(data2) != string(data) {
		t.Error("pack with a base archive gave different bytes")
	}

	// Other compressions work from the command line too.
	for _, c := range []string{"gzip", "lz4", "none"} {
		f := filepath.Join(outDir, c+".sqfs")
		if code, _, errOut := runCLI(t, "pack", "--compression", c, "--block-size", "64K", src, f); code != exitOK {
			t.Fatalf("pack --compression %s: exit %d: %s", c, code, errOut)
		}
		if code, out, _ := runCLI(t, "verify", f); code != exitOK || !strings.Contains(out, c) {
			t.Errorf("verify %s: exit %d: %s", c, code, out)
		}
	}
}

func TestVerifyCorruptArchive(t *testing.T) {
	src := archiveTree(t)
	file := filepath.Join(t.TempDir(), "home.sqfs")
	if code, _, errOut := runCLI(t, "pack", src, file); code != exitOK {
		t.Fatalf("pack: %s", errOut)
	}
	// big.bin is the first file in data order and does not compress: its
	// first block starts right after the superblock (96 bytes) and the
	// zstd compressor options (2+4 bytes).
	f, _ := os.OpenFile(file, os.O_RDWR, 0)
	b := make([]byte, 1)
	f.ReadAt(b, 5000)
	b[0] ^= 0xff
	f.WriteAt(b, 5000)
	f.Close()

	code, out, errOut := runCLI(t, "verify", file)
	if code != exitCorrupt {
		t.Fatalf("verify of a corrupt archive: exit %d: %s %s", code, out, errOut)
	}
	if !strings.Contains(errOut, "data block at offset 102") {
		t.Errorf("verify does not name the bad block: %s", errOut)
	}
	code, _, errOut = runCLI(t, "unpack", file, filepath.Join(t.TempDir(), "x"))
	if code != exitCorrupt || !strings.Contains(errOut, "offset 102") {
		t.Errorf("unpack of a corrupt archive: exit %d: %s", code, errOut)
	}
}

func TestArchiveCommandErrors(t *testing.T) {
	src := archiveTree(t)
	tmp := t.TempDir()
	for _, tc := range []struct {
		args []string
		code int
		msg  string
	}{
		{[]string{"pack", src}, exitUsage, "DIR and FILE"},
		{[]string{"pack", "--compression", "brotli", src, filepath.Join(tmp, "a")}, exitUsage, "brotli"},
		{[]string{"pack", "--block-size", "3K", src, filepath.Join(tmp, "a")}, exitUsage, "power of two"},
		{[]string{"pack", "--block-size", "lots", src, filepath.Join(tmp, "a")}, exitUsage, "not a size"},
		{[]string{"pack", "--level", "40", src, filepath.Join(tmp, "a")}, exitFailure, "out of range"},
		{[]string{"pack", src, filepath.Join(src, "self.sqfs")}, exitUsage, "inside"},
		{[]string{"pack", filepath.Join(tmp, "missing"), filepath.Join(tmp, "a")}, exitFailure, "no such file"},
		{[]string{"unpack", filepath.Join(tmp, "missing.sqfs"), filepath.Join(tmp, "o")}, exitFailure, "no such file"},
		{[]string{"unpack", filepath.Join(src, "config.yaml"), filepath.Join(tmp, "o")}, exitCorrupt, "corrupt"},
		{[]string{"verify", filepath.Join(src, "config.yaml")}, exitCorrupt, "corrupt"},
		{[]string{"verify", "not an id/../x"}, exitUsage, "no such file"},
	} {
		code, _, errOut := runCLI(t, tc.args...)
		if code != tc.code || !strings.Contains(errOut, tc.msg) {
			t.Errorf("%q: exit %d (want %d), stderr %q (want %q)", tc.args, code, tc.code, errOut, tc.msg)
		}
	}
	if _, err := os.Stat(filepath.Join(tmp, "a")); err == nil {
		t.Error("a failed pack left its output behind")
	}
	if ents, _ := os.ReadDir(tmp); len(ents) != 0 {
		t.Errorf("failed commands left %d entries behind", len(ents))
	}
}

func TestArchiveCommandHelp(t *testing.T) {
	for _, name := range []string{"pack", "unpack", "verify"} {
		code, out, _ := runCLI(t, name, "--help")
		if code != exitOK || !strings.Contains(out, "Examples:") || !strings.Contains(out, "Exit status") {
			t.Errorf("%s --help does not teach examples and exit codes:\n%s", name, out)
		}
	}
}
