package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
)

// restorePathChunk is the unit of ranged reads of a format 1 snapshot (no
// chunk digests) by restore --path: small, since one file of a home is
// usually small; a large one is read ahead sequentially.
const restorePathChunk = 64 << 10

// restorePath extracts the file or directory rel of snapshot id (LATEST's
// if "") to dest, reading only what it needs of the archive by range.
func restorePath(ctx context.Context, e *env, fset *flag.FlagSet, id, rel, dest string) error {
	rel = strings.Trim(rel, "/")
	if rel == "" || !iofs.ValidPath(rel) {
		return usageError("--path %q: want a relative path inside the snapshot, like memories/MEMORY.md", rel)
	}
	cat, loc, err := openCatalog(ctx, e, fset)
	if err != nil {
		return err
	}
	if err := checkNamedSnapshot(ctx, cat, loc, id); err != nil {
		return err
	}
	var m uploader.Manifest
	if id == "" {
		m, err = cat.Latest(ctx)
	} else {
		m, err = cat.Manifest(ctx, id)
	}
	if err != nil {
		return snapshotError(fmt.Errorf("restore from %s: %w", loc, err))
	}
	tmp, err := os.MkdirTemp("", "hermesfs-restore-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	im, err := image.Open(ctx, m, image.Options{Store: cat.Store(), CacheDir: tmp, Identities: cat.Identities(),
		NoDigestsChunkSize: restorePathChunk, Logger: cliLogger(e)})
	if err != nil {
		return snapshotError(daemon.CryptError(err))
	}
	defer im.Close()
	r, err := archive.Open(im, im.Size(), archive.ReaderOptions{Name: m.ID})
	if err != nil {
		return snapshotError(daemon.ArchiveError(fmt.Errorf("open snapshot %s: %w", m.ID, err)))
	}
	if err := checkedByRange(m, r); err != nil {
		return err
	}
	a, err := lookupArchivePath(r, rel)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", m.ID, err)
	}
	target := dest
	switch {
	case a.Mode.IsDir():
		if ents, err := os.ReadDir(dest); err == nil && len(ents) > 0 {
			return usageError("%s is not empty; restore a directory into a new or empty directory", dest)
		} else if err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if err := os.MkdirAll(filepath.Dir(dest), 0o755); err != nil {
			return err
		}
		err = archive.Unpack(ctx, r, dest, archive.UnpackOptions{Dir: a.Ino, Logger: cliLogger(e)})
	case a.Mode.IsRegular() || a.Mode&iofs.ModeSymlink != 0:
		if st, err := os.Stat(dest); err == nil && st.IsDir() {
			target = filepath.Join(dest, path.Base(rel))
		}
		if _, err := os.Lstat(target); err == nil {
			return usageError("%s exists; restore to a new name or into a directory", target)
		}
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		if a.Mode.IsRegular() {
			err = extractFile(ctx, r, a, target)
		} else {
			var link string
			if link, err = r.Readlink(a.Ino); err == nil {
				err = os.Symlink(link, target)
			}
		}
	default:
		return fmt.Errorf("snapshot %s: %s is a %v, not a file, symlink or directory", m.ID, rel, a.Mode.Type())
	}
	if err != nil {
		return snapshotError(daemon.ArchiveError(fmt.Errorf("extract %s of snapshot %s into %s: %w", rel, m.ID, target, err)))
	}
	st := im.Stats()
	fmt.Fprintf(e.stdout, "restored %s of snapshot %s into %s (fetched %s of the %s image)\n",
		rel, m.ID, target, daemon.HumanBytes(st.PresentBytes), daemon.HumanBytes(im.Size()))
	return nil
}

// lookupArchivePath finds rel in r without following symlinks.
func lookupArchivePath(r *archive.Reader, rel string) (archive.Attr, error) {
	a, err := r.Stat(r.Root())
	if err != nil {
		return a, err
	}
	for i, name := range strings.Split(rel, "/") {
		if !a.Mode.IsDir() {
			return a, fmt.Errorf("%s: %w", path.Join(strings.Split(rel, "/")[:i]...), syscall.ENOTDIR)
		}
		if a, err = r.Lookup(a.Ino, name); errors.Is(err, iofs.ErrNotExist) {
			return a, fmt.Errorf("%s: no such file or directory in the snapshot", rel)
		} else if err != nil {
			return a, err
		}
	}
	return a, nil
}

// extractFile writes regular file a of r to the new file target, with its
// mode, mtime and (as root) owner; a failure removes the partial file.
func extractFile(ctx context.Context, r *archive.Reader, a archive.Attr, target string) (err error) {
	f, err := os.OpenFile(target, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(target)
		}
	}()
	buf := make([]byte, 1<<20)
	for off := int64(0); off < a.Size; {
		if err := ctx.Err(); err != nil {
			return err
		}
		n, rerr := r.ReadAt(a.Ino, buf[:min(int64(len(buf)), a.Size-off)], off)
		if n > 0 {
			if _, err := f.Write(buf[:n]); err != nil {
				return err
			}
			off += int64(n)
		}
		if rerr != nil && (rerr != io.EOF || off < a.Size) {
			return rerr
		}
	}
	if os.Geteuid() == 0 {
		if err := f.Chown(int(a.Uid), int(a.Gid)); err != nil {
			return err
		}
	}
	mode := a.Mode & (iofs.ModePerm | iofs.ModeSetuid | iofs.ModeSetgid | iofs.ModeSticky)
	if err := f.Chmod(mode); err != nil {
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Chtimes(target, a.Mtime, a.Mtime)
}
