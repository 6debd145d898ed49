package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/browse"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/lazy"
	"github.com/hermesfs/hermesfs/uploader/ranged"
)

func init() {
	register(&command{
		name:    "browse",
		summary: "mount every snapshot read-only, each read from the store on demand",
		usage:   "[flags] MOUNTPOINT",
		help: `Mounts the store's snapshots as a read-only tree:

  MOUNTPOINT/<snapshot-id>/...   each snapshot's files
  MOUNTPOINT/latest              -> the snapshot LATEST names
  MOUNTPOINT/2026-11-24T1015     -> the snapshot taken in that minute (UTC;
                                    "-2", "-3"... for more in one minute)

The root is listed from the store's listing alone: no archive is read until
a snapshot is entered, and then only the parts read (metadata first, then
the blocks of the files opened), by ranged GETs through a local cache of at
most --cache-size bytes (least recently used out first). Writes fail with
EROFS. Runs in the foreground; Ctrl-C, SIGTERM or 'hermesfs umount
MOUNTPOINT' unmounts it.

Examples:
  hermesfs browse /mnt/history
  diff -r /mnt/history/latest/memories ~/.hermes/memories
  cp -a /mnt/history/2026-11-24T1015/memories/MEMORY.md ~/.hermes/memories/

` + storeHelp,
		flags: func(fs *flag.FlagSet) {
			addStoreFlags(fs)
			addIdentityFlag(fs)
			fs.String("cache-size", "1G", "bound on the local cache of archive chunks")
			fs.String("chunk-size", "256K", "unit of the ranged reads and of the cache, for archives whose manifest has no chunk digests")
			fs.String("cache-dir", "", "where to make the cache's directory, removed at exit (default: the temporary directory)")
			fs.Duration("read-timeout", ranged.DefaultFetchTimeout, "give up on a chunk the store has not delivered in this long (retries included): the read fails with EIO")
			fs.Duration("refresh", 30*time.Second, "list the store again when the root is read after this long")
			fs.Bool("debug", false, "log every FUSE request")
		},
		run: runBrowse,
	})
}

func runBrowse(ctx context.Context, e *env, fset *flag.FlagSet, args []string) error {
	if len(args) != 1 {
		return usageError("browse needs exactly one MOUNTPOINT")
	}
	mp, err := filepath.Abs(args[0])
	if err != nil {
		return err
	}
	if st, err := os.Stat(mp); err != nil || !st.IsDir() {
		return usageError("mountpoint %s is not a directory", mp)
	}
	size, err := parseSize(fset.Lookup("cache-size").Value.String())
	if err != nil {
		return usageError("--cache-size: %v", err)
	}
	chunk, err := parseSize(fset.Lookup("chunk-size").Value.String())
	if err != nil || chunk < 4<<10 || chunk > 64<<20 {
		return usageError("--chunk-size %s: want a size from 4K to 64M", fset.Lookup("chunk-size").Value)
	}
	refresh := fset.Lookup("refresh").Value.(flag.Getter).Get().(time.Duration)
	if refresh <= 0 {
		return usageError("--refresh must be positive")
	}
	readTimeout := fset.Lookup("read-timeout").Value.(flag.Getter).Get().(time.Duration)
	if readTimeout <= 0 {
		return usageError("--read-timeout must be positive")
	}
	cat, loc, err := openCatalog(ctx, e, fset)
	if err != nil {
		return err
	}
	log := cliLogger(e).With("component", "browse")
	cache, err := ranged.New(cat.Store(), ranged.Options{Dir: fset.Lookup("cache-dir").Value.String(), MaxBytes: size, ChunkSize: chunk,
		FetchTimeout: readTimeout, Logger: log})
	if err != nil {
		return err
	}
	defer cache.Close()
	pool, err := image.NewPool(image.Options{Store: cat.Store(), CacheDir: filepath.Join(cache.Dir(), "segments"), Identities: cat.Identities(),
		Lazy: lazy.Options{ReadTimeout: readTimeout}, Logger: log})
	if err != nil {
		return err
	}
	src := &catalogSource{cat: cat, open: rangedOpener(cat, cache, pool), log: log}
	m, err := browse.Mount(ctx, mp, browse.Options{Source: src, RefreshAfter: refresh, Logger: log,
		Debug: fset.Lookup("debug").Value.String() == "true"})
	if err != nil {
		return fmt.Errorf("browse %s: %w", loc, err)
	}
	fmt.Fprintf(e.stdout, "ready %s store=%s\n", mp, loc)
	select {
	case <-ctx.Done():
	case <-m.Done():
	}
	uctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err = m.Unmount(uctx)
	st := cache.Stats()
	log.Info("stopped", "gets", st.Gets, "bytes_fetched", st.BytesFetched, "cache_hits", st.Hits, "cache_misses", st.Misses)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "unmounted %s (fetched %s in %d requests)\n", mp, daemon.HumanBytes(st.BytesFetched), st.Gets)
	return nil
}

// objectOpener gives random access to a snapshot's archive (its size too:
// an encrypted object is larger than the archive it holds) without
// downloading it whole. It is the seam where another reader of store
// objects (a persistent lazy cache) can replace the ranged cache.
type objectOpener func(ctx context.Context, m uploader.Manifest) (io.ReaderAt, int64, error)

// rangedOpener reads archives by range through cache, checking each chunk
// against the manifest's chunk digests when it has them; without them the
// archive's own block checksums catch damage as blocks are read. An
// encrypted snapshot is decrypted with the catalog's identities, each age
// chunk authenticated as it is read.
func rangedOpener(cat *uploader.Catalog, cache *ranged.Cache, pool *image.Pool) objectOpener {
	return func(ctx context.Context, m uploader.Manifest) (io.ReaderAt, int64, error) {
		if m.Segmented() {
			im, err := pool.Open(ctx, m, nil)
			if err != nil {
				return nil, 0, daemon.CryptError(err)
			}
			return im, im.Size(), nil
		}
		d, err := manifestDigests(ctx, cat.Store(), m.ID)
		if err != nil {
			return nil, 0, err
		}
		ra, err := cache.Object(m.Archive, m.Size, d)
		if err != nil || m.Encryption == nil {
			return ra, m.Size, err
		}
		ids := cat.Identities()
		if ids == nil {
			return nil, 0, daemon.CryptError(&uploader.KeyError{ID: m.ID, Err: &crypt.KeyError{Types: m.Encryption.RecipientTypes, Err: crypt.ErrNoIdentity}})
		}
		plain, n, err := crypt.Open(ra, m.Size, ids)
		if err != nil {
			return nil, 0, daemon.LazyCryptError(m, err)
		}
		return plain, n, nil
	}
}

// manifestDigests reads the optional per-chunk digests of a snapshot's
// manifest ("chunk_size", "chunks"); a manifest without them gives none.
func manifestDigests(ctx context.Context, store uploader.Store, id string) (ranged.Digests, error) {
	rc, _, err := store.Get(ctx, uploader.ManifestKey(id), 0, 16<<20)
	if err != nil {
		return ranged.Digests{}, fmt.Errorf("read manifest of %s: %w", id, err)
	}
	defer rc.Close()
	var v struct {
		ChunkSize int64    `json:"chunk_size"`
		Chunks    []string `json:"chunks"`
	}
	if err := json.NewDecoder(rc).Decode(&v); err != nil {
		return ranged.Digests{}, &uploader.CorruptError{ID: id, Err: fmt.Errorf("manifest: %w", err)}
	}
	if len(v.Chunks) == 0 {
		return ranged.Digests{}, nil
	}
	if v.ChunkSize == 0 {
		v.ChunkSize = ranged.DefaultChunkSize
	}
	return ranged.Digests{ChunkSize: v.ChunkSize, SHA256: v.Chunks}, nil
}

// openSnapshotReader opens snapshot m's archive for random access through
// open. Its block cache is small: a browse mount may have many open.
func openSnapshotReader(ctx context.Context, open objectOpener, m uploader.Manifest) (*archive.Reader, error) {
	ra, size, err := open(ctx, m)
	if err != nil {
		return nil, err
	}
	r, err := archive.Open(ra, size, archive.ReaderOptions{Name: m.ID, CacheBytes: 8 << 20})
	if err != nil {
		return nil, daemon.ArchiveError(fmt.Errorf("open snapshot %s: %w", m.ID, err))
	}
	return r, nil
}

// catalogSource is the store's catalog as a browse tree sees it.
type catalogSource struct {
	cat  *uploader.Catalog
	open objectOpener
	log  *slog.Logger
}

func (s *catalogSource) Snapshots(ctx context.Context) ([]browse.Snapshot, error) {
	refs, err := s.cat.Complete(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]browse.Snapshot, len(refs))
	for i, r := range refs {
		out[i] = browse.Snapshot{ID: r.ID, Created: r.Created, Latest: r.Latest}
	}
	return out, nil
}

func (s *catalogSource) Open(ctx context.Context, id string) (fs.Lower, error) {
	m, err := s.cat.Manifest(ctx, id)
	if err != nil {
		return nil, err
	}
	r, err := openSnapshotReader(ctx, s.open, m)
	if err != nil {
		return nil, err
	}
	if !r.Checksummed() {
		s.log.Warn("snapshot archive carries no block checksums; its bytes are not verified", "id", id)
	}
	return r, nil
}

// isBrowseMount reports whether path is the mountpoint of a browse tree
// (from /proc/self/mountinfo, which does not touch the mount).
func isBrowseMount(path string) bool {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(line, " - ")
		f, g := strings.Fields(pre), strings.Fields(post)
		if ok && len(f) > 4 && len(g) > 0 && fs.UnescapeMountinfo(f[4]) == path && g[0] == "fuse."+browse.FsName {
			return true
		}
	}
	return false
}

// umountBrowse detaches the browse tree at mountpoint, if that is what is
// mounted there; its process sees the mount go and exits.
func umountBrowse(e *env, mountpoint string) (bool, error) {
	mp, err := filepath.Abs(mountpoint)
	if err != nil || !isBrowseMount(mp) {
		return false, nil
	}
	if err := fs.Detach(mp); err != nil {
		return true, fmt.Errorf("%s: %w", mp, err)
	}
	fmt.Fprintf(e.stdout, "unmounted the browse tree at %s\n", mp)
	return true, nil
}
