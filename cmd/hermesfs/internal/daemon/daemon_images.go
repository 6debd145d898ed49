package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/image"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// Snapshot images in the state dir.
//
// Every snapshot image the daemon reads (the base the mount sits on, the
// last one it published, which the next is packed on) is opened from one
// image pool over cache/segments: the segments the store holds, complete
// or fetched lazily, shared between the images that use them (package
// image). cache/<id>.json keeps each open image's manifest, so a restart
// opens it without the store. An open image stands for the archive file
// cache/<id>.sqfs, which does not exist: OpenArchive and the mount find it
// in the registry below (lazyArchives), and read it through the pool.
//
// A state dir an older hermesfs left (cache/<id>.sqfs whole or partly
// fetched, pack/<id>.sqfs) is moved into cache/segments at boot: such an
// archive is the one segment of its snapshot's image.

// segmentsDir is the image pool's cache directory.
func (s *stateDir) segmentsDir() string { return filepath.Join(s.cacheDir(), "segments") }

// manifestPath is where an open image's manifest is kept.
func (s *stateDir) manifestPath(id string) string { return filepath.Join(s.cacheDir(), id+".json") }

// openImage is an image the daemon has open, and its archive reader.
type openImage struct {
	im   *image.Image
	once sync.Once
	r    *archive.Reader
	err  error
}

// archive opens the image's archive reader, once.
func (o *openImage) archive() (*archive.Reader, error) {
	o.once.Do(func() {
		m := o.im.Manifest()
		o.r, o.err = archive.Open(o.im, o.im.Size(), archive.ReaderOptions{Name: m.ID})
		o.err = ArchiveError(o.err)
	})
	return o.r, o.err
}

// images are the images the daemon has open, by snapshot id.
type images struct {
	pool *image.Pool
	mu   sync.Mutex
	open map[string]*openImage
}

// newImages opens the pool over the state dir's cache.
func (d *daemon) newImages(dir string) error {
	a, ok := d.cat.(imageCatalog)
	if !ok {
		return errors.New("internal error: the catalog cannot read images")
	}
	pool, err := image.NewPool(image.Options{
		Store: a.Store(), CacheDir: dir, Identities: a.Identities(),
		Lazy:   lazy.Options{ReadTimeout: d.cfg.ReadTimeout},
		Logger: d.base.With("component", "lazy"),
	})
	if err != nil {
		return err
	}
	d.imgs = &images{pool: pool, open: map[string]*openImage{}}
	return nil
}

// imageCatalog is what the image pool needs of the catalog.
type imageCatalog interface {
	Store() uploader.Store
	Identities() *crypt.Identities
}

// image returns snapshot id's open image, opening it (manifest from the
// cache, else the store; cached either way) if needed, and registers it
// as the archive cache/<id>.sqfs. m, if its ID is id, is the manifest to
// use.
func (d *daemon) image(ctx context.Context, id string, m *uploader.Manifest) (*openImage, error) {
	ims := d.imgs
	ims.mu.Lock()
	defer ims.mu.Unlock()
	if o := ims.open[id]; o != nil {
		return o, nil
	}
	var man uploader.Manifest
	switch {
	case m != nil && m.ID == id:
		man = *m
	default:
		var err error
		if man, err = d.cachedManifest(ctx, id); err != nil {
			return nil, err
		}
	}
	im, err := ims.pool.Open(ctx, man, func() { d.imageComplete(id) })
	if err != nil {
		return nil, err
	}
	if err := d.saveManifest(man); err != nil {
		d.log.Warn("cache the manifest", "id", id, "err", err)
	}
	o := &openImage{im: im}
	ims.open[id] = o
	lazyArchives.Store(filepath.Clean(d.sd.cached(id)), sizedReaderAt(im))
	return o, nil
}

// cachedManifest reads snapshot id's manifest from the cache, else the
// store.
func (d *daemon) cachedManifest(ctx context.Context, id string) (uploader.Manifest, error) {
	if b, err := os.ReadFile(d.sd.manifestPath(id)); err == nil {
		var m uploader.Manifest
		if json.Unmarshal(b, &m) == nil && m.ID == id {
			return m, nil
		}
	}
	return d.cat.Manifest(ctx, id)
}

// saveManifest keeps m in the cache.
func (d *daemon) saveManifest(m uploader.Manifest) error {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	return uploader.WriteFileAtomic(d.sd.manifestPath(m.ID), append(b, '\n'), 0o600)
}

// closeImage closes snapshot id's image, unless it is the base or the
// last published one.
func (d *daemon) closeImage(id string) {
	d.mu.Lock()
	keep := id == d.st.Base || id == d.st.LastPublished
	d.mu.Unlock()
	if keep || d.imgs == nil {
		return
	}
	ims := d.imgs
	ims.mu.Lock()
	o := ims.open[id]
	delete(ims.open, id)
	ims.mu.Unlock()
	if o != nil {
		lazyArchives.Delete(filepath.Clean(d.sd.cached(id)))
		o.im.Close()
	}
}

// closeImages closes every image (at exit).
func (d *daemon) closeImages() {
	if d.imgs == nil {
		return
	}
	ims := d.imgs
	ims.mu.Lock()
	defer ims.mu.Unlock()
	for id, o := range ims.open {
		lazyArchives.Delete(filepath.Clean(d.sd.cached(id)))
		o.im.Close()
		delete(ims.open, id)
	}
}

// openedImage returns snapshot id's image if it is open.
func (d *daemon) openedImage(id string) *openImage {
	if d.imgs == nil {
		return nil
	}
	d.imgs.mu.Lock()
	defer d.imgs.mu.Unlock()
	return d.imgs.open[id]
}

// imageComplete runs when every segment of snapshot id's image is local.
func (d *daemon) imageComplete(id string) {
	d.log.Info("snapshot image complete in the cache: reads need the store no more", "id", id)
}

// migrateCache moves what an older hermesfs kept in the state dir into
// cache/segments: cache/<id>.sqfs (whole, or partly fetched with its
// present log), a complete ciphertext cache/<id>.sqfs.age, and the last
// published archive pack/<id>.sqfs. Each is its snapshot's one segment,
// named as the store names it (snapshots/<id>.sqfs).
func (d *daemon) migrateCache() error {
	dst := d.sd.segmentsDir()
	if err := os.MkdirAll(dst, 0o700); err != nil {
		return err
	}
	move := func(from string) {
		name := filepath.Base(from)
		id, _, ok := strings.Cut(name, uploader.ArchiveExt)
		if !ok || uploader.ValidID(id) != nil {
			return
		}
		to := filepath.Join(dst, name)
		if _, err := os.Stat(to); err == nil {
			os.Remove(from)
			return
		}
		if err := os.Rename(from, to); err != nil {
			d.log.Warn("moving an archive into cache/segments", "from", from, "err", err)
			return
		}
		d.log.Info("moved an archive of an older hermesfs into cache/segments", "from", from, "to", to)
	}
	for _, pat := range []string{filepath.Join(d.sd.cacheDir(), "*.sqfs*"), filepath.Join(d.sd.packDir(), "*.sqfs")} {
		olds, _ := filepath.Glob(pat)
		for _, o := range olds {
			move(o)
		}
	}
	return uploader.SyncDir(dst)
}

// cleanCache removes what the cache holds for snapshots other than keep
// (and the images open now): manifests, extents lists, and segments no
// kept image uses (complete, partly fetched, or their digests).
func (d *daemon) cleanCache(keep ...string) {
	ids := map[string]bool{}
	for _, k := range keep {
		if k != "" {
			ids[k] = true
		}
	}
	if d.imgs != nil {
		d.imgs.mu.Lock()
		for id := range d.imgs.open {
			ids[id] = true
		}
		d.imgs.mu.Unlock()
	}
	used := map[string]bool{} // plain names of segments in use
	for id := range ids {
		b, err := os.ReadFile(d.sd.manifestPath(id))
		if err != nil {
			continue
		}
		var m uploader.Manifest
		if json.Unmarshal(b, &m) != nil {
			continue
		}
		used[path.Base(m.Extents)] = true
		for _, r := range m.Segments {
			used[image.PlainName(r.Key)] = true
		}
		if !m.Segmented() {
			used[image.PlainName(m.Archive)] = true
		}
	}
	if len(ids) > 0 && len(used) == 0 {
		return // the manifests are unreadable: keep everything
	}
	names, _ := os.ReadDir(d.sd.segmentsDir())
	for _, e := range names {
		n := e.Name()
		// The temporary file of an atomic write (".NAME.tmp...": a
		// range reader's .etag or .present, a decryption) goes with
		// NAME: it may be a write in progress of an open image's.
		if t, ok := strings.CutPrefix(n, "."); ok {
			if i := strings.LastIndex(t, ".tmp"); i > 0 {
				n = t[:i]
			}
		}
		base := n
		for _, ext := range []string{image.HeaderExt, ".partial", ".present", ".etag", uploader.SumsExt, uploader.EncryptedExt} {
			base = strings.TrimSuffix(base, ext)
		}
		base = strings.TrimSuffix(base, uploader.EncryptedExt)
		if !used[base] && !used[n] {
			os.Remove(filepath.Join(d.sd.segmentsDir(), e.Name()))
		}
	}
	mans, _ := filepath.Glob(filepath.Join(d.sd.cacheDir(), "*.json"))
	for _, p := range mans {
		if !ids[strings.TrimSuffix(filepath.Base(p), ".json")] {
			os.Remove(p)
		}
	}
}

// bootImage opens snapshot id's image as the mount's base and fetches
// what opening its archive reads (the first chunk and the metadata tail);
// with lazy boot off, it fetches all of it first. complete: the image was
// local already when opened.
func (d *daemon) bootImage(ctx context.Context, id string, m *uploader.Manifest) (o *openImage, complete bool, err error) {
	if o, err = d.image(ctx, id, m); err != nil {
		return nil, false, err
	}
	im := o.im
	complete = im.Complete()
	tail := im.Manifest().MetaOffset
	if tail <= 0 {
		tail = max(im.Size()-1, 0)
	}
	if err := im.Prefetch(ctx, 0, min(uploader.DefaultChunkSize, im.Size())); err != nil {
		return nil, false, fmt.Errorf("fetch the image's superblock: %w", err)
	}
	if err := im.Prefetch(ctx, tail, im.Size()); err != nil {
		return nil, false, fmt.Errorf("fetch the image's metadata: %w", err)
	}
	if _, err := o.archive(); err != nil {
		return nil, false, err
	}
	if !d.cfg.Lazy && !im.Complete() {
		if err := d.fetchWhole(ctx, im); err != nil {
			return nil, false, err
		}
	}
	return o, complete, nil
}

// fetchWhole fetches every byte of im into the cache and waits for it.
func (d *daemon) fetchWhole(ctx context.Context, im *image.Image) error {
	d.notify(fmt.Sprintf("downloading snapshot %s (%s) before mounting (--lazy=false)", im.Manifest().ID, HumanBytes(im.Size())))
	if err := im.Prefetch(ctx, 0, im.Size()); err != nil {
		return fmt.Errorf("fetch the snapshot: %w", err)
	}
	im.Fill() // completes and verifies the segments' caches
	for !im.Complete() {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
	return nil
}

var _ sizedReaderAt = (*image.Image)(nil)

// lowerArchive is the mount's lower layer: its archive reader and image
// (nil for an empty lower).
func (d *daemon) lowerArchive() (*archive.Reader, *openImage) {
	d.lowMu.Lock()
	defer d.lowMu.Unlock()
	return d.lowerReader, d.lowerImage
}
