package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// verifySnapshot verifies the snapshot with the given id in the store named by
// the command's store flags: the manifest's size and sha256, then every block.
// `hermesfs verify` calls it when its argument is not an existing file; that
// command must declare the store flags with addStoreFlags.
func verifySnapshot(ctx context.Context, e *env, fs *flag.FlagSet, id string) error {
	if err := uploader.ValidID(id); err != nil {
		return usageError("%s: no such file, and not a snapshot id", id)
	}
	cat, loc, err := openCatalog(ctx, e, fs)
	if err != nil {
		return err
	}
	if err := checkNamedSnapshot(ctx, cat, loc, id); err != nil {
		return err
	}
	tmp, err := os.MkdirTemp("", "hermesfs-verify-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	p := newProgress(e.stderr, "download "+id)
	res, err := cat.Restore(ctx, filepath.Join(tmp, id+uploader.ArchiveExt), uploader.RestoreOptions{ID: id, Verify: verifyArchive, Progress: p.update,
		Image: image.Opener(cat.Store(), cat.Identities(), tmp)})
	p.done()
	if err != nil {
		return snapshotError(fmt.Errorf("snapshot %s in %s: %w", id, loc, err))
	}
	m := res.Manifest
	if m.Segmented() {
		fmt.Fprintf(e.stdout, "snapshot %s: ok (%s image of %d segments, %s, every chunk and every block checked)\n",
			m.ID, daemon.HumanBytes(m.Size), len(m.Segments), filesOrEncrypted(m))
		return nil
	}
	if m.Encryption != nil {
		fmt.Fprintf(e.stdout, "snapshot %s: ok (%s, %s, ciphertext sha256 %s, every chunk authenticated and every block checked)\n",
			m.ID, daemon.HumanBytes(m.Size), filesOrEncrypted(m), m.SHA256)
		return nil
	}
	if m.SHA256 == "" {
		// Published without all its bytes at hand: the manifest has chunk
		// digests only, each checked on the download.
		fmt.Fprintf(e.stdout, "snapshot %s: ok (%s, sha256 %s, every chunk and every block checked)\n", m.ID, daemon.HumanBytes(m.Size), res.SHA256)
		return nil
	}
	fmt.Fprintf(e.stdout, "snapshot %s: ok (%s, sha256 %s, every block checked)\n", m.ID, daemon.HumanBytes(m.Size), m.SHA256)
	return nil
}
