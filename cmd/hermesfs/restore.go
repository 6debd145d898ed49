package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

func init() {
	register(&command{
		name:    "restore",
		summary: "download, verify and extract a snapshot into a directory",
		usage:   "[flags] DIR",
		help: `Downloads a snapshot (the one LATEST names, or --snapshot ID), checks its
size and sha256 against its manifest and every block of the archive, then
extracts it into DIR, which must be empty or not exist. If the newest snapshot
is corrupt, the newest older one that verifies is restored instead, with a
warning naming what was skipped (exit status 3 if none verifies). An encrypted
snapshot needs --identity; with none that opens it the restore stops with exit
status 6 (it never falls back to an older snapshot it could read). A
--snapshot ID the store does not hold: exit status 7 ('hermesfs list' shows
the ids it holds).

Examples:
  hermesfs restore ~/hermes-copy
  hermesfs restore --snapshot 20261122T134501.123Z-box-1a2b3c4d /tmp/old
  hermesfs restore --store s3://my-bucket/alice ./alice
  hermesfs restore --snapshot ID --path memories/MEMORY.md ./MEMORY.md

With --path, only that file (DIR is then the file to create, or an existing
directory to create it in) or directory subtree (DIR must be new or empty) is
extracted, and only the parts of the archive it needs are fetched, by range.

Without hermesfs, the same is: read LATEST for the id, put the image
together from snapshots/ID.extents (one "segment offset length" a line,
each a ranged GET of a segment; an encrypted segment through age -d), and
unsquashfs it; the README shows the commands. 'hermesfs export' writes
the image whole.

` + storeHelp,
		flags: func(fs *flag.FlagSet) {
			addStoreFlags(fs)
			addIdentityFlag(fs)
			fs.String("snapshot", "", "snapshot id to restore (default: the newest that verifies)")
			fs.String("path", "", "extract only this file or directory of the snapshot (e.g. memories/MEMORY.md), reading just its part of the archive from the store")
		},
		run: runRestore,
	})
}

func runRestore(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) != 1 {
		return usageError("restore needs exactly one DIR")
	}
	dir, err := filepath.Abs(args[0])
	if err != nil {
		return err
	}
	id := fs.Lookup("snapshot").Value.String()
	if id != "" {
		if err := uploader.ValidID(id); err != nil {
			return usageError("--snapshot: %v", err)
		}
	}
	if p := fs.Lookup("path").Value.String(); p != "" {
		return restorePath(ctx, e, fs, id, p, dir)
	}
	// Refuse a non-empty target before downloading anything.
	if ents, err := os.ReadDir(dir); err == nil && len(ents) > 0 {
		return usageError("%s is not empty; restore into a new or empty directory", dir)
	} else if err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	parent := filepath.Dir(dir)
	if err := os.MkdirAll(parent, 0o755); err != nil {
		return err
	}
	cat, loc, err := openCatalog(ctx, e, fs)
	if err != nil {
		return err
	}
	if err := checkNamedSnapshot(ctx, cat, loc, id); err != nil {
		return err
	}
	// The archive is downloaded next to DIR: same file system, and no
	// assumption that /tmp can hold it.
	tmpDir, err := os.MkdirTemp(parent, ".hermesfs-restore-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmpDir)
	archivePath := filepath.Join(tmpDir, "snapshot.sqfs")

	p := newProgress(e.stderr, "download")
	res, err := cat.Restore(ctx, archivePath, uploader.RestoreOptions{ID: id, Verify: verifyArchive, Progress: p.update,
		Image: image.Opener(cat.Store(), cat.Identities(), tmpDir)})
	p.done()
	for _, skipped := range res.Skipped {
		fmt.Fprintf(e.stderr, "WARNING: %v\n", skipped)
	}
	if err != nil {
		return snapshotError(fmt.Errorf("restore from %s: %w", loc, err))
	}
	m := res.Manifest
	if len(res.Skipped) > 0 {
		fmt.Fprintf(e.stderr, "WARNING: the newest snapshot is corrupt; restoring the older %s instead\n", m.ID)
	}
	if res.NoLatest {
		fmt.Fprintf(e.stderr, "WARNING: the store has no LATEST pointer; restoring the newest snapshot with a manifest, %s\n", m.ID)
	}

	f, err := os.Open(archivePath)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	r, err := archive.Open(f, fi.Size(), archive.ReaderOptions{Name: m.ID})
	if err != nil {
		return snapshotError(fmt.Errorf("open snapshot %s: %w", m.ID, err))
	}
	up := newProgress(e.stderr, "extract ")
	err = archive.Unpack(ctx, r, dir, archive.UnpackOptions{Logger: cliLogger(e), Progress: up.update})
	up.done()
	if err != nil {
		return snapshotError(fmt.Errorf("extract snapshot %s into %s (the partial tree is left there): %w", m.ID, dir, err))
	}
	fmt.Fprintf(e.stdout, "restored snapshot %s (%s, %s, from %s) into %s\n", m.ID, daemon.HumanBytes(m.Size), filesOrEncrypted(m), m.Host, dir)
	return nil
}
