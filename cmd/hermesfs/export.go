package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/image"
)

func init() {
	register(&command{
		name:    "export",
		summary: "write a snapshot as one standalone squashfs image (or age file)",
		usage:   "[flags] FILE|-",
		help: `Writes a snapshot (the one LATEST names, or --snapshot ID) as one standard
squashfs image: what unsquashfs and mount -t squashfs read. In the store a
snapshot is a list of extents over segments it shares with other snapshots
(see the README's "Snapshots and the store"); export puts the image back
together, checking every chunk it fetches against the segments' digests and
then every block of the image, and writes it to FILE (atomically: a
temporary file renamed into place) or to standard output (-). An encrypted
snapshot needs --identity; with --encrypt-to the output is an age file
(age -d gives the image back).

Examples:
  hermesfs export ./home.sqfs && unsquashfs -d ./home ./home.sqfs
  hermesfs export --snapshot 20261122T134501.123Z-box-1a2b3c4d - | ssh backup 'cat > home.sqfs'
  hermesfs export --identity key.txt --encrypt-to age1... ./home.sqfs.age

Exit status: 0 written, 1 failed (I/O, store unreachable), 2 bad command
line, 3 corrupt (nothing is left at FILE), 6 encrypted and no --identity
opens it, 7 the store has no snapshot ID ('hermesfs list' shows its ids).

` + storeHelp,
		flags: func(fs *flag.FlagSet) {
			addStoreFlags(fs)
			addIdentityFlag(fs)
			addEncryptToFlag(fs, "the exported image")
			fs.String("snapshot", "", "snapshot id to export (default: the one LATEST names)")
		},
		run: runExport,
	})
}

func runExport(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) != 1 {
		return usageError("export needs exactly one FILE (or - for standard output)")
	}
	out := args[0]
	id := fs.Lookup("snapshot").Value.String()
	if id != "" {
		if err := uploader.ValidID(id); err != nil {
			return usageError("--snapshot: %v", err)
		}
	}
	if out == "-" {
		if isTerminal(e.stdout) {
			return usageError("refusing to write a binary image to a terminal: name a FILE, or redirect standard output")
		}
	} else if _, err := os.Lstat(out); err == nil {
		return usageError("%s exists; export writes a new file", out)
	}
	cat, loc, err := openCatalog(ctx, e, fs)
	if err != nil {
		return err
	}
	if err := checkNamedSnapshot(ctx, cat, loc, id); err != nil {
		return err
	}
	if id == "" {
		if id, err = cat.LatestID(ctx); err != nil {
			return snapshotError(fmt.Errorf("store %s: %w", loc, err))
		}
		if id == "" {
			return snapshotError(fmt.Errorf("store %s: %w", loc, uploader.ErrNoSnapshots))
		}
	}
	m, err := cat.Manifest(ctx, id)
	if err != nil {
		return snapshotError(fmt.Errorf("snapshot %s in %s: %w", id, loc, err))
	}
	var recipients *crypt.Recipients
	if rs := cryptSettings(e, fs, "encrypt-to"); len(rs) > 0 {
		if recipients, err = crypt.ParseRecipients(rs); err != nil {
			return usageError("--encrypt-to: %v", err)
		}
	}
	cache, err := os.MkdirTemp("", "hermesfs-export-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(cache)
	im, err := image.Open(ctx, m, image.Options{Store: cat.Store(), CacheDir: cache, Identities: cat.Identities(), Logger: cliLogger(e)})
	if err != nil {
		return snapshotError(daemon.CryptError(fmt.Errorf("snapshot %s: %w", id, err)))
	}
	defer im.Close()

	write := func(w io.Writer) error {
		p := newProgress(e.stderr, "export "+id)
		defer p.done()
		src := io.Reader(uploader.ContextReader(ctx, io.NewSectionReader(im, 0, im.Size())))
		pw := &progressCounter{w: w, total: im.Size(), fn: p.update}
		if recipients != nil {
			return crypt.Seal(pw, src, recipients)
		}
		_, err := io.CopyBuffer(pw, src, make([]byte, 8<<20))
		return err
	}
	if out == "-" {
		err = write(e.stdout)
	} else {
		err = writeAtomic(out, write)
	}
	if err != nil {
		return snapshotError(fmt.Errorf("export %s: %w", id, err))
	}
	// Every block, from the chunks fetched (and checked) on the way.
	r, err := archive.Open(im, im.Size(), archive.ReaderOptions{Name: id})
	if err == nil {
		err = r.Verify(ctx)
	}
	if err != nil {
		if out != "-" {
			os.Remove(out)
		}
		return snapshotError(withCode(exitCorrupt, fmt.Errorf("snapshot %s: %w", id, err)))
	}
	what := "squashfs image"
	if recipients != nil {
		what = "age file of the squashfs image"
	}
	if out != "-" {
		fmt.Fprintf(e.stderr, "exported snapshot %s (%s, %s) as a %s to %s\n", id, daemon.HumanBytes(im.Size()), filesOrEncrypted(m), what, out)
	}
	return nil
}

// progressCounter reports the bytes written through it.
type progressCounter struct {
	w     io.Writer
	done  int64
	total int64
	fn    func(done, total int64)
}

func (p *progressCounter) Write(b []byte) (int, error) {
	n, err := p.w.Write(b)
	p.done += int64(n)
	p.fn(min(p.done, p.total), p.total)
	return n, err
}

// writeAtomic writes path through a temporary file beside it, fsynced
// and renamed into place; nothing is left on failure.
func writeAtomic(path string, write func(io.Writer) error) error {
	abs, err := filepath.Abs(path)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp(filepath.Dir(abs), "."+filepath.Base(abs)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Link(f.Name(), abs); err != nil {
		return err // never over a file that appeared meanwhile
	}
	return uploader.SyncDir(filepath.Dir(abs))
}
