package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
)

func init() {
	register(&command{
		name:    "unpack",
		summary: "extract a squashfs archive into a directory",
		usage:   "[flags] FILE DIR",
		help: `Extracts the archive FILE into DIR, which must be empty or not exist. Every
block is checked against the archive's checksums before any of it is written
(archives from other tools, such as mksquashfs images, have none and are
extracted unchecked). Modes, mtimes, symlinks, hard links and fifos are
restored; owners and device nodes too when run as root. Nothing is written
outside DIR, whatever the archive contains.

Examples:
  hermesfs unpack hermes.sqfs ~/hermes-copy
  hermesfs unpack --no-owners snapshot.sqfs /tmp/look

FILE may be an age-encrypted archive (a snapshot object copied from the store):
give --identity; it is decrypted chunk by chunk as it is read.

Exit status: 0 extracted, 1 failed, 2 bad command line, 3 the archive is
corrupt (the message names the first bad block; DIR keeps what was extracted),
6 encrypted and no --identity opens it.`,
		flags: func(fs *flag.FlagSet) {
			fs.Bool("no-owners", false, "do not restore owners, even as root")
			addIdentityFlag(fs)
		},
		run: runUnpack,
	})
}

func runUnpack(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) != 2 {
		return usageError("unpack needs FILE and DIR")
	}
	file, dir := args[0], args[1]
	if ents, err := os.ReadDir(dir); err == nil && len(ents) > 0 {
		return usageError("%s is not empty; unpack into a new or empty directory", dir)
	}
	r, f, err := openArchiveAt(e, fs, file)
	if err != nil {
		return err
	}
	defer f.Close()
	start := time.Now()
	p := newProgress(e.stderr, "unpack "+file)
	var written int64
	err = archive.Unpack(ctx, r, dir, archive.UnpackOptions{
		NoOwners: fs.Lookup("no-owners").Value.String() == "true",
		Progress: func(done, total int64) { written = done; p.update(done, total) },
	})
	p.done()
	if err != nil {
		return daemon.CryptError(daemon.ArchiveError(err))
	}
	check := "every block checked"
	if !r.Checksummed() {
		check = "no checksums in this archive"
	}
	fmt.Fprintf(e.stdout, "%s: %d inodes, %s of file data into %s (%s), %s\n",
		file, r.Inodes(), daemon.HumanBytes(written), dir, check, time.Since(start).Round(time.Millisecond))
	return nil
}
