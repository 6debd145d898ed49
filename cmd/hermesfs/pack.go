package main

import (
	"context"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
)

func init() {
	register(&command{
		name:    "pack",
		summary: "pack a directory tree into a squashfs archive",
		usage:   "[flags] DIR FILE",
		help: `Packs the tree under DIR into FILE: a standard squashfs 4.0 image that
unsquashfs and mount -t squashfs read, followed by an integrity trailer (a
checksum of every block, which those tools ignore and hermesfs checks on every
read). FILE is written atomically: it either appears complete or not at all.
The same tree always packs to the same bytes.

With --base, files whose path, size and mtime match the base archive are not
read again: their compressed blocks are copied from it (checked as they go).

With --encrypt-to, FILE is the age encryption of the archive (the archive is
packed into a temporary file beside FILE first, then encrypted and removed);
age -d, or hermesfs verify/unpack/pack --base with --identity, read it.

Examples:
  hermesfs pack ~/.hermes hermes.sqfs
  hermesfs pack --compression lz4 ~/.hermes fast-restore.sqfs
  hermesfs pack --base yesterday.sqfs ~/.hermes today.sqfs
  hermesfs pack --encrypt-to age1... ~/.hermes hermes.sqfs.age

Exit status: 0 packed, 1 failed (nothing written), 2 bad command line.`,
		flags: func(fs *flag.FlagSet) {
			fs.String("compression", "zstd", "zstd, gzip, lz4 (fastest to unpack) or none")
			fs.Int("level", 0, "compression level: zstd 1..22, gzip 1..9, lz4 0..9 (0: zstd 3, gzip 9, lz4 fast)")
			fs.String("block-size", "128K", "data block size, a power of two from 4K to 1M")
			fs.String("base", "", "earlier archive of the same tree to copy unchanged files' blocks from (an age file with --identity)")
			addEncryptToFlag(fs, "FILE")
			addIdentityFlag(fs)
		},
		run: runPack,
	})
}

func runPack(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) != 2 {
		return usageError("pack needs DIR and FILE")
	}
	dir, out := args[0], args[1]
	bs, err := parseSize(fs.Lookup("block-size").Value.String())
	if err != nil {
		return usageError("--block-size: %v", err)
	}
	if bs < 4<<10 || bs > 1<<20 || bs&(bs-1) != 0 {
		return usageError("--block-size %s: want a power of two from 4K to 1M", fs.Lookup("block-size").Value)
	}
	level, _ := strconv.Atoi(fs.Lookup("level").Value.String())
	opts := archive.PackOptions{
		Compression: archive.Compression(fs.Lookup("compression").Value.String()),
		Level:       level,
		BlockSize:   int(bs),
	}
	switch opts.Compression {
	case archive.Zstd, archive.Gzip, archive.LZ4, archive.None:
	default:
		return usageError("--compression %q: want zstd, gzip, lz4 or none", opts.Compression)
	}
	st, err := os.Stat(dir)
	if err != nil {
		return err
	}
	if !st.IsDir() {
		return usageError("%s is not a directory", dir)
	}
	absDir, _ := filepath.Abs(dir)
	absOut, _ := filepath.Abs(out)
	if rel, err := filepath.Rel(absDir, absOut); err == nil && !strings.HasPrefix(rel, "..") {
		return usageError("%s is inside %s: the archive would pack itself", out, dir)
	}
	var co uploader.CatalogOptions
	if err := cryptOptions(e, fs, &co); err != nil {
		return err
	}
	var src iofs.FS = os.DirFS(dir)
	if b := fs.Lookup("base").Value.String(); b != "" {
		base, bf, err := openArchiveAt(e, fs, b)
		if err != nil {
			return err
		}
		defer bf.Close()
		src = archive.WithBase(src, base)
	}
	start := time.Now()
	res, err := packAtomic(out, func(f *os.File) (archive.PackResult, error) {
		if co.Recipients == nil {
			return archive.Pack(ctx, f, src, opts)
		}
		return packSealed(ctx, f, src, opts, co.Recipients)
	})
	if err != nil {
		return daemon.ArchiveError(err)
	}
	ratio := 0.0
	if res.DataBytes > 0 {
		ratio = 100 * float64(res.Size) / float64(res.DataBytes)
	}
	fmt.Fprintf(e.stdout, "%s: %s (%.1f%% of %s of file data), %d files, %d dirs, %d inodes, %s\nsha256 %s\n",
		out, daemon.HumanBytes(res.Size), ratio, daemon.HumanBytes(res.DataBytes), res.Files, res.Dirs, res.Inodes,
		time.Since(start).Round(time.Millisecond), hex.EncodeToString(res.SHA256[:]))
	if co.Recipients != nil {
		fmt.Fprintf(e.stdout, "encrypted with age to %d recipient(s) (%s); the sha256 is the archive's, before encryption\n",
			co.Recipients.Len(), strings.Join(co.Recipients.Types(), ", "))
	}
	if res.ReusedBytes > 0 {
		fmt.Fprintf(e.stdout, "reused %s of compressed blocks from the base archive\n", daemon.HumanBytes(res.ReusedBytes))
	}
	return nil
}

// packSealed packs into a temporary file beside f, then writes its age
// encryption to f.
func packSealed(ctx context.Context, f *os.File, src iofs.FS, opts archive.PackOptions, r *crypt.Recipients) (archive.PackResult, error) {
	tmp, err := os.CreateTemp(filepath.Dir(f.Name()), filepath.Base(f.Name())+"-plain*")
	if err != nil {
		return archive.PackResult{}, err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	res, err := archive.Pack(ctx, tmp, src, opts)
	if err != nil {
		return res, err
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return res, err
	}
	return res, crypt.Seal(f, tmp, r)
}

// packAtomic writes an archive to out the safe way: into a temporary file
// beside it, fsynced, renamed over out, and the directory fsynced; the
// temporary file is removed on any failure.
func packAtomic(out string, pack func(f *os.File) (archive.PackResult, error)) (res archive.PackResult, err error) {
	f, err := os.CreateTemp(filepath.Dir(out), "."+filepath.Base(out)+".tmp*")
	if err != nil {
		return res, err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err = f.Chmod(0o644); err != nil {
		return res, err
	}
	if res, err = pack(f); err != nil {
		return res, err
	}
	if err = f.Sync(); err != nil {
		return res, fmt.Errorf("fsync %s: %w", f.Name(), err)
	}
	if err = f.Close(); err != nil {
		return res, err
	}
	if err = os.Rename(f.Name(), out); err != nil {
		return res, err
	}
	return res, uploader.SyncDir(filepath.Dir(out))
}

// parseSize reads a byte count with an optional binary suffix: 4096, 64K,
// 1M, 128KiB.
func parseSize(s string) (int64, error) {
	t := strings.TrimSuffix(strings.TrimSuffix(strings.ToUpper(strings.TrimSpace(s)), "IB"), "B")
	mult := int64(1)
	switch {
	case strings.HasSuffix(t, "K"):
		mult, t = 1<<10, strings.TrimSuffix(t, "K")
	case strings.HasSuffix(t, "M"):
		mult, t = 1<<20, strings.TrimSuffix(t, "M")
	case strings.HasSuffix(t, "G"):
		mult, t = 1<<30, strings.TrimSuffix(t, "G")
	}
	n, err := strconv.ParseInt(t, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("%q is not a size (e.g. 128K)", s)
	}
	if n > math.MaxInt64/mult {
		return 0, fmt.Errorf("%q is too large a size", s)
	}
	return n * mult, nil
}
