package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/fs/browse"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/lazy"
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
the blocks of the files opened), by ranged GETs of verified chunks through
one local cache of at most --cache-size bytes for all the snapshots entered
(least recently used out first). Writes fail with
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
			fs.String("cache-size", "1G", "bound on the local cache of snapshot chunks, all snapshots together")
			fs.String("chunk-size", "256K", "unit of the ranged reads of format 1 snapshots (no chunk digests; others are read in their digests' chunks)")
			fs.String("cache-dir", "", "where to make the cache's directory, removed at exit (default: the temporary directory)")
			fs.Duration("read-timeout", lazy.DefaultReadTimeout, "give up on a chunk the store has not delivered in this long (retries included): the read fails with EIO")
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
	dir, err := browseCacheDir(fset.Lookup("cache-dir").Value.String())
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	var count requestCounter
	budget := lazy.NewBudget(size)
	pool, err := image.NewPool(image.Options{
		Store: uploader.WithObserver(cat.Store(), &count), CacheDir: dir, Identities: cat.Identities(),
		Lazy: lazy.Options{ReadTimeout: readTimeout, Budget: budget}, NoDigestsChunkSize: chunk, Logger: log,
	})
	if err != nil {
		return err
	}
	src := &catalogSource{cat: cat, pool: pool, log: log}
	defer src.close()
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
	st := budget.Stats()
	log.Info("stopped", "gets", count.gets.Load(), "bytes_fetched", count.bytes.Load(), "cached_bytes", st.Used, "evicted_chunks", st.Evicted)
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stdout, "unmounted %s (fetched %s in %d requests)\n", mp, daemon.HumanBytes(count.bytes.Load()), count.gets.Load())
	return nil
}

// browseCacheDir makes the directory of a browse tree's cache, under
// parent ("": the temporary directory); the caller removes it.
func browseCacheDir(parent string) (string, error) {
	if parent != "" {
		if err := os.MkdirAll(parent, 0o700); err != nil {
			return "", fmt.Errorf("--cache-dir: %w", err)
		}
	}
	dir, err := os.MkdirTemp(parent, "hermesfs-browse-")
	if err != nil {
		return "", fmt.Errorf("--cache-dir: %w", err)
	}
	return dir, nil
}

// requestCounter counts the GETs of a store and the bytes they returned.
type requestCounter struct{ gets, bytes atomic.Int64 }

func (c *requestCounter) StoreRequest(op, _ string, _ time.Duration) {
	if op == "get" {
		c.gets.Add(1)
	}
}
func (c *requestCounter) StoreRetry(string) {}
func (c *requestCounter) StoreRead(n int64) { c.bytes.Add(n) }

// catalogSource is the store's catalog as a browse tree sees it: each
// snapshot entered is an image of the pool, read by range through the
// segments' range readers (which share the pool's cache budget) and
// checked block by block by the archive reader.
type catalogSource struct {
	cat  *uploader.Catalog
	pool *image.Pool
	log  *slog.Logger

	mu     sync.Mutex
	images []*image.Image
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
	im, err := s.pool.Open(ctx, m, nil)
	if err != nil {
		return nil, daemon.CryptError(err)
	}
	// A small block cache: a browse tree may have many snapshots open.
	r, err := archive.Open(im, im.Size(), archive.ReaderOptions{Name: m.ID, CacheBytes: 8 << 20})
	if err != nil {
		im.Close()
		return nil, daemon.ArchiveError(fmt.Errorf("open snapshot %s: %w", m.ID, err))
	}
	if err := checkedByRange(m, r); err != nil {
		im.Close()
		return nil, err
	}
	s.mu.Lock()
	s.images = append(s.images, im)
	s.mu.Unlock()
	return r, nil
}

// checkedByRange refuses a snapshot whose bytes nothing would check when
// read by range: a format 1 archive (no chunk digests) without the
// archive's block checksums.
func checkedByRange(m uploader.Manifest, r *archive.Reader) error {
	if r.Checksummed() || m.Segmented() || m.Lazy() {
		return nil
	}
	return fmt.Errorf("snapshot %s has neither chunk digests (manifest format 1) nor block checksums, so nothing checks the bytes read of it by range; "+
		"restore it whole instead ('hermesfs restore --snapshot %s DIR' checks its sha256)", m.ID, m.ID)
}

// close closes the images opened (once the tree is unmounted).
func (s *catalogSource) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, im := range s.images {
		im.Close()
	}
	s.images = nil
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
