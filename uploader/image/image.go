// Package image reads a snapshot image from a store: the logical squashfs
// image a manifest describes, served as an io.ReaderAt over the extents of
// its segments (format 4) or over its one archive object (older formats).
//
// Every segment is read through one verified, cached range reader
// (package lazy): bytes are fetched by ranged Gets in chunks, each chunk
// checked against the segment's digests before it is cached or served,
// pinned to the object (ETag) the first chunk came from, coalesced and
// read ahead. An encrypted segment's chunks are ciphertext, decrypted and
// authenticated by age per 64 KiB (package crypt). A segment whose cache
// is complete is read from its local file. Images share segments, and so
// share their caches: two snapshots opened over one cache directory fetch
// a shared segment's bytes once.
//
// Cache layout, in Options.CacheDir, for a segment key K (its base name B,
// with ".age" cut off for the plaintext):
//
//	B           the complete plaintext segment
//	B.age       an encrypted segment's complete ciphertext (until decrypted)
//	X.partial   the bytes fetched so far of X (B, or B.age), a sparse file
//	X.present   the chunks of X.partial that are durable and verified
//	X.etag      the object they came from
//	B.sums      the segment's digests (checked against the manifest)
//	B.age-header an encrypted segment's first bytes (its age header), kept
//	            to check identities against once only the plaintext is
//	            left (Image.CheckIdentities)
//
// A cache bounded in bytes (hermesfs browse, which keeps every snapshot it
// entered open): give the pool's Options.Lazy a lazy.Budget. The chunks
// of all its segments then share that bound, least recently used out
// first, and the caches are temporary (no present logs; see lazy.Budget).
//
// A segment that is gone from the store (its snapshots pruned) fails the
// reads that need bytes of it not cached, at the first answer that it is
// missing, with an *uploader.SegmentGoneError naming it (transient
// failures are retried up to the read timeout); bytes of another object
// are never served, because keys are never reused and every chunk is
// checked.
//
// A format 1 snapshot's archive has no chunk digests: it opens only with
// Options.NoDigestsChunkSize, and then its reader relies on the archive's
// block checksums.
package image

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// ErrNoDigests is a snapshot of manifest format 1 (an older hermesfs's)
// opened without Options.NoDigestsChunkSize: no chunk digests to check
// ranged reads against; download it whole into the cache directory (its
// plain name), and it opens from there.
var ErrNoDigests = errors.New("no chunk digests to read it by range (a format 1 snapshot): download it whole")

// Options configure Open.
type Options struct {
	Store uploader.Store
	// CacheDir holds the segments' caches (see the package doc); required.
	CacheDir string
	// Identities open encrypted segments.
	Identities *crypt.Identities
	// Lazy is the template of every segment's range reader: ReadTimeout,
	// Retry, parallelism, Logger, and Budget: one budget given to a pool
	// bounds the bytes all its segments' caches hold together (browse).
	// Store, Key, Size, digests, Path, Hot and OnComplete are set per
	// segment.
	Lazy lazy.Options
	// NoDigestsChunkSize, if set, reads the archive of a format 1
	// snapshot (no chunk digests) by range in chunks of this size (4 KiB
	// to 64 MiB), unchecked chunk by chunk (lazy.Options.NoDigests): the
	// archive reader above must check each block it reads against the
	// archive's own checksums. 0: such a snapshot fails to open with
	// ErrNoDigests.
	NoDigestsChunkSize int64
	Logger             *slog.Logger
	// OnComplete is called (on a fill goroutine) when every segment of
	// the image is complete locally.
	OnComplete func()
}

// Pool opens images over one cache directory and shares their segments:
// one range reader per segment, however many open images use it (two
// readers of one cache file would corrupt it). Its methods may be called
// concurrently.
type Pool struct {
	o   Options
	log *slog.Logger

	mu     sync.Mutex
	segs   map[string]*segment
	images map[*Image]bool
}

// NewPool returns a pool over o.CacheDir (created if needed); o.OnComplete
// is not used (give it to OpenImage).
func NewPool(o Options) (*Pool, error) {
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.CacheDir == "" {
		return nil, errors.New("image: no cache directory")
	}
	if err := os.MkdirAll(o.CacheDir, 0o700); err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	return &Pool{o: o, log: o.Logger, segs: map[string]*segment{}, images: map[*Image]bool{}}, nil
}

// Image is a snapshot image. Its methods may be called concurrently.
type Image struct {
	pool *Pool
	m    uploader.Manifest
	ext  *uploader.Extents
	log  *slog.Logger
	segs map[string]*segment
	// order: the segments by first use in the image.
	order      []*segment
	onComplete func()

	mu       sync.Mutex
	complete bool
	closed   bool
}

// segment is one segment of the pool: its plaintext, and how it is read.
type segment struct {
	ref   uploader.SegmentRef
	sums  *uploader.Sums
	enc   bool
	plain string // the complete plaintext file's path
	users int    // open images using it (pool.mu)

	mu   sync.RWMutex
	ra   io.ReaderAt  // the plaintext: file or decrypted lazy reader
	size int64        // of the plaintext
	file *os.File     // the complete plaintext file, once open
	lz   *lazy.Reader // the range reader, while incomplete
	done bool
	// closed: no image uses it any more (a completion after that opens
	// nothing).
	closed bool
	// keyOK: the pool's identities opened its age header (an encrypted
	// segment opened from its ciphertext, or checked by
	// CheckIdentities).
	keyOK bool
}

// HeaderExt ends the name of the file keeping an encrypted segment's first
// bytes (its age header) in the cache: B + HeaderExt.
const HeaderExt = ".age-header"

// CheckIdentities checks that the pool's identities open every encrypted
// segment of the image. A segment read from its ciphertext was checked
// when it opened; one whose plaintext is complete in the cache is read
// without any key, so its age header is checked here: from the cache
// (B.age-header), else from the store (the object's first bytes, then
// kept). Errors: an *uploader.KeyError when they do not open it (nothing
// of the image should be served then), a CorruptError for a damaged
// header, the store's error when it is needed and does not answer.
func (im *Image) CheckIdentities(ctx context.Context) error {
	if im.m.Encryption == nil {
		return nil
	}
	for _, s := range im.order {
		s.mu.RLock()
		ok := !s.enc || s.keyOK
		s.mu.RUnlock()
		if ok {
			continue
		}
		hdr, err := im.pool.header(ctx, s)
		if err == nil {
			err = crypt.CheckIdentities(hdr, im.pool.o.Identities)
		}
		if err != nil {
			return segmentCryptError(im.m, s.ref.Key, err)
		}
		s.mu.Lock()
		s.keyOK = true
		s.mu.Unlock()
	}
	return nil
}

// header returns encrypted segment s's first bytes (crypt.HeaderMax at
// most): kept in the cache, else fetched and kept.
func (p *Pool) header(ctx context.Context, s *segment) ([]byte, error) {
	path := s.plain + HeaderExt
	if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
		return b, nil
	}
	n := int64(crypt.HeaderMax)
	if s.sums != nil && s.sums.Size > 0 {
		n = min(n, s.sums.Size)
	}
	rc, _, err := p.o.Store.Get(ctx, s.ref.Key, 0, n)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return nil, err
	}
	if err := uploader.WriteFileAtomic(path, b, 0o600); err != nil {
		p.log.Warn("image: keeping a segment's age header", "segment", s.ref.Key, "err", err)
	}
	return b, nil
}

// keepHeader keeps the first bytes of the ciphertext file src of
// encrypted segment s, before src goes.
func (p *Pool) keepHeader(s *segment, src string) {
	f, err := os.Open(src)
	if err != nil {
		return
	}
	defer f.Close()
	b := make([]byte, crypt.HeaderMax)
	n, _ := io.ReadFull(f, b)
	if n > 0 {
		uploader.WriteFileAtomic(s.plain+HeaderExt, b[:n], 0o600)
	}
}

// PlainName is the base name of segment key's plaintext in a cache
// directory.
func PlainName(key string) string { return strings.TrimSuffix(path.Base(key), uploader.EncryptedExt) }

// Open opens manifest m's image in a pool of its own (see Pool.Open).
func Open(ctx context.Context, m uploader.Manifest, o Options) (*Image, error) {
	p, err := NewPool(o)
	if err != nil {
		return nil, err
	}
	return p.Open(ctx, m, o.OnComplete)
}

// Open reads manifest m's extents and its segments' digests (from the
// cache directory when it holds them, else from the store, checked against
// the manifest either way) and opens every segment for reading, sharing
// the segments the pool has open already. Nothing of the image's bytes is
// fetched. onComplete, if set, is called (on a fill goroutine) once every
// segment of the image is complete locally.
func (p *Pool) Open(ctx context.Context, m uploader.Manifest, onComplete func()) (*Image, error) {
	im := &Image{pool: p, m: m, log: p.log, segs: map[string]*segment{}, onComplete: onComplete}
	enc := m.Encryption != nil
	if enc && m.Encryption.Scheme != crypt.Scheme {
		return nil, fmt.Errorf("snapshot %s is encrypted with %q; this hermesfs knows %q: upgrade it", m.ID, m.Encryption.Scheme, crypt.Scheme)
	}
	refs := m.Segments
	if !m.Segmented() {
		refs = []uploader.SegmentRef{{Key: m.Archive, Size: m.Size}}
	}
	sums := make([]*uploader.Sums, len(refs))
	for i, ref := range refs {
		s, err := im.sums(ctx, ref)
		if err != nil {
			return nil, err
		}
		sums[i] = s
	}
	if m.Segmented() {
		ext, err := im.readExtents(ctx)
		if err != nil {
			return nil, err
		}
		im.ext = ext
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, ref := range refs {
		s := p.segs[ref.Key]
		if s == nil {
			var err error
			if s, err = p.openSegment(m, ref, sums[i], enc, im.hotChunks(ref.Key, sums[i])); err != nil {
				gone := im.releaseLocked()
				p.mu.Unlock()
				closeSegments(gone)
				p.mu.Lock()
				return nil, err
			}
			p.segs[ref.Key] = s
		} else if s.enc != enc {
			gone := im.releaseLocked()
			p.mu.Unlock()
			closeSegments(gone)
			p.mu.Lock()
			return nil, &uploader.CorruptError{ID: m.ID, Err: fmt.Errorf("segment %s is used encrypted and plaintext", ref.Key)}
		}
		s.users++
		im.segs[ref.Key] = s
		im.order = append(im.order, s)
	}
	if im.ext == nil {
		// A whole archive: its plaintext is the image.
		im.ext, _ = uploader.NewExtents([]uploader.Extent{{Key: refs[0].Key, Length: im.order[0].size}})
	}
	for _, x := range im.ext.List() {
		if s := im.segs[x.Key]; x.Offset+x.Length > s.size {
			gone := im.releaseLocked()
			p.mu.Unlock()
			closeSegments(gone)
			p.mu.Lock()
			return nil, &uploader.CorruptError{ID: m.ID, Err: fmt.Errorf("extent %s %d %d past the segment's %d bytes", x.Key, x.Offset, x.Length, s.size)}
		}
	}
	im.complete = im.allDone()
	p.images[im] = true
	return im, nil
}

// releaseLocked gives back the image's segments and returns those it was
// the last user of, for the caller to close once p.mu is released (a
// range reader's Close waits for its fill, which may be waiting for p.mu
// to tell the images of a completed segment). p.mu is held.
func (im *Image) releaseLocked() []*segment {
	p := im.pool
	var gone []*segment
	for _, s := range im.order {
		if s.users--; s.users > 0 {
			continue
		}
		delete(p.segs, s.ref.Key)
		gone = append(gone, s)
	}
	im.order = nil
	delete(p.images, im)
	return gone
}

func closeSegments(segs []*segment) error {
	var errs []error
	for _, s := range segs {
		errs = append(errs, s.close())
	}
	return errors.Join(errs...)
}

func (s *segment) close() error {
	var errs []error
	if s.lz != nil {
		errs = append(errs, s.lz.Close())
	}
	s.mu.Lock()
	s.closed = true
	if s.file != nil {
		errs = append(errs, s.file.Close())
		s.file = nil
	}
	s.mu.Unlock()
	return errors.Join(errs...)
}

// allDone reports whether every segment of the image is complete.
func (im *Image) allDone() bool {
	for _, s := range im.order {
		s.mu.RLock()
		done := s.done
		s.mu.RUnlock()
		if !done {
			return false
		}
	}
	return true
}

// readExtents reads the extents list, from the cache when it has a copy
// that the manifest vouches for.
func (im *Image) readExtents(ctx context.Context) (*uploader.Extents, error) {
	local := filepath.Join(im.pool.o.CacheDir, path.Base(im.m.Extents))
	if b, err := os.ReadFile(local); err == nil {
		if e, err := uploader.ParseManifestExtents(b, im.m); err == nil {
			return e, nil
		}
	}
	e, err := uploader.ReadExtents(ctx, im.pool.o.Store, im.m)
	if err != nil {
		return nil, err
	}
	if err := uploader.WriteFileAtomic(local, e.Marshal(), 0o600); err != nil {
		im.log.Warn("image: caching the extents list", "err", err)
	}
	return e, nil
}

// sums returns a segment's digests: from the cache if it holds the ones
// the manifest names, else from the store (and then cached).
func (im *Image) sums(ctx context.Context, ref uploader.SegmentRef) (*uploader.Sums, error) {
	if !im.m.Segmented() {
		if s := uploader.LegacySums(im.m); s != nil {
			return s, nil
		}
		return nil, nil
	}
	local := filepath.Join(im.pool.o.CacheDir, PlainName(ref.Key)+uploader.SumsExt)
	if b, err := os.ReadFile(local); err == nil {
		if s, err := uploader.ParseSums(b, ref); err == nil {
			return s, nil
		}
	}
	b, err := readSumsBytes(ctx, im.pool.o.Store, ref)
	if err != nil {
		return nil, err
	}
	s, err := uploader.ParseSums(b, ref)
	if err != nil {
		return nil, &uploader.CorruptError{ID: im.m.ID, Err: err}
	}
	if err := uploader.WriteFileAtomic(local, b, 0o600); err != nil {
		im.log.Warn("image: caching segment digests", "segment", ref.Key, "err", err)
	}
	return s, nil
}

func readSumsBytes(ctx context.Context, s uploader.Store, ref uploader.SegmentRef) ([]byte, error) {
	rc, _, err := s.Get(ctx, uploader.SumsKey(ref.Key), 0, -1)
	if errors.Is(err, iofs.ErrNotExist) {
		return nil, &uploader.SegmentGoneError{Key: ref.Key, Err: err}
	}
	if err != nil {
		return nil, fmt.Errorf("read digests of %s: %w", ref.Key, err)
	}
	defer rc.Close()
	return io.ReadAll(io.LimitReader(rc, 256<<20))
}

func (p *Pool) openSegment(m uploader.Manifest, ref uploader.SegmentRef, sums *uploader.Sums, enc bool, hot []int64) (*segment, error) {
	s := &segment{ref: ref, enc: enc, plain: filepath.Join(p.o.CacheDir, PlainName(ref.Key))}
	s.sums = sums
	if sums != nil && s.ref.Size == 0 {
		s.ref.Size = sums.Size
	}
	// A complete local copy.
	if f, err := os.Open(s.plain); err == nil {
		st, err := f.Stat()
		want := int64(-1)
		if sums != nil && !enc {
			want = sums.Size
		} else if sums != nil && sums.Plain > 0 {
			want = sums.Plain
		}
		if err == nil && (want < 0 || st.Size() == want) {
			s.file, s.ra, s.size, s.done = f, f, st.Size(), true
			return s, nil
		}
		f.Close()
		p.log.Warn("image: a cached segment has the wrong size; fetching it again", "segment", ref.Key, "path", s.plain)
		os.Remove(s.plain)
	}
	lo := p.o.Lazy
	lo.Store = p.o.Store
	lo.Key = ref.Key
	switch {
	case sums != nil:
		lo.Size = sums.Size
		lo.ChunkSize = sums.ChunkSize
		lo.Chunks = sums.Chunks
		lo.SHA256 = sums.SHA256
	case m.Segmented() || enc || p.o.NoDigestsChunkSize <= 0:
		return nil, fmt.Errorf("segment %s: %w", ref.Key, ErrNoDigests)
	default:
		// A format 1 archive: checked block by block by its reader.
		lo.Size = m.Size
		lo.ChunkSize = p.o.NoDigestsChunkSize
		lo.SHA256 = m.SHA256
		lo.NoDigests = true
	}
	lo.Path = s.plain
	if enc {
		lo.Path = s.plain + uploader.EncryptedExt
	}
	if lo.Logger == nil {
		lo.Logger = p.log
	}
	lo.Hot = hot
	lo.OnComplete = func(path string) { p.segmentComplete(s, path) }
	if enc {
		// A complete ciphertext a crash left before it was decrypted:
		// trusted only if it is what the digests say.
		if f, err := os.Open(lo.Path); err == nil {
			ok := uploader.VerifySums(f, sums) == nil
			f.Close()
			if !ok {
				p.log.Warn("image: a cached ciphertext does not match its digests; fetching it again", "segment", ref.Key, "path", lo.Path)
				os.Remove(lo.Path)
			}
		}
	}
	lz, err := lazy.Open(lo)
	if err != nil {
		return nil, fmt.Errorf("segment %s: %w", ref.Key, err)
	}
	s.lz = lz
	if !enc {
		s.ra, s.size = lz, lo.Size
		return s, nil
	}
	pr, n, err := crypt.Open(lz, lo.Size, p.o.Identities)
	if err != nil {
		lz.Close()
		return nil, segmentCryptError(m, ref.Key, err)
	}
	s.ra, s.size, s.keyOK = pr, n, true
	if lz.Complete() {
		p.finishSegment(s, lo.Path) // p.mu is held: no image to tell yet
	}
	return s, nil
}

// segmentCryptError says what failed of an encrypted segment: a key that
// does not open it (KeyError), or damage (CorruptError).
func segmentCryptError(m uploader.Manifest, key string, err error) error {
	if ke, ok := errors.AsType[*crypt.KeyError](err); ok {
		return &uploader.KeyError{ID: m.ID, Err: ke}
	}
	switch {
	case errors.Is(err, crypt.ErrAuth) || errors.Is(err, crypt.ErrHeader) || errors.Is(err, lazy.ErrDigest):
		return &uploader.CorruptError{ID: m.ID, Err: fmt.Errorf("segment %s: %w", key, err)}
	case errors.Is(err, iofs.ErrNotExist):
		return &uploader.SegmentGoneError{Key: key, Err: err}
	}
	return fmt.Errorf("segment %s: %w", key, err)
}

// segmentComplete switches a segment to its complete local file (see
// finishSegment), and tells the images it completes.
func (p *Pool) segmentComplete(s *segment, path string) {
	if !p.finishSegment(s, path) {
		return
	}
	var done []func()
	p.mu.Lock()
	for im := range p.images {
		if im.segs[s.ref.Key] == nil {
			continue
		}
		im.mu.Lock()
		if !im.complete && im.allDone() {
			im.complete = true
			if im.onComplete != nil {
				done = append(done, im.onComplete)
			}
		}
		im.mu.Unlock()
	}
	p.mu.Unlock()
	for _, fn := range done {
		fn()
	}
}

// finishSegment switches a segment whose range reader completed the cache
// file at path to its complete plaintext file: an encrypted segment's
// ciphertext is decrypted into it first. It reports whether it did.
func (p *Pool) finishSegment(s *segment, path string) bool {
	if s.enc {
		p.keepHeader(s, path)
		if err := decryptFile(path, s.plain, p.o.Identities); err != nil {
			p.log.Warn("image: decrypting a complete segment; reads stay on the ciphertext cache", "segment", s.ref.Key, "err", err)
			return false
		}
	}
	f, err := os.Open(s.plain)
	if err != nil {
		p.log.Warn("image: opening a complete segment", "segment", s.ref.Key, "err", err)
		return false
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		f.Close()
		return false
	}
	s.file, s.ra, s.done = f, f, true
	s.mu.Unlock()
	if s.enc {
		os.Remove(path)
	}
	return true
}

// decryptFile decrypts the age file src into dst (atomically).
func decryptFile(src, dst string, ids *crypt.Identities) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	r, err := crypt.NewReader(in, ids)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+".tmp-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, r); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), dst)
}

// hotChunks are the chunks of segment key (plaintext, with digests sums)
// that hold the image's hot chunks, in the image's hot order. An encrypted
// segment's are left out: its ciphertext chunks are not known before its
// header is read.
func (im *Image) hotChunks(key string, sums *uploader.Sums) []int64 {
	cs := im.m.ChunkSize
	if cs <= 0 || len(im.m.Hot) == 0 || sums == nil || im.m.Encryption != nil {
		return nil
	}
	ext := im.ext
	if ext == nil {
		ext, _ = uploader.NewExtents([]uploader.Extent{{Key: key, Length: sums.Size}})
	}
	var out []int64
	seen := map[int64]bool{}
	for _, h := range im.m.Hot {
		for _, x := range ext.Slice(h*cs, cs) {
			if x.Key != key {
				continue
			}
			for c := x.Offset / sums.ChunkSize; c <= (x.Offset+x.Length-1)/sums.ChunkSize; c++ {
				if !seen[c] {
					seen[c] = true
					out = append(out, c)
				}
			}
		}
	}
	return out
}

// Manifest is the snapshot's manifest.
func (im *Image) Manifest() uploader.Manifest { return im.m }

// Extents is the image's layout.
func (im *Image) Extents() *uploader.Extents { return im.ext }

// Size is the image's size.
func (im *Image) Size() int64 { return im.ext.Size() }

// ReadAt implements io.ReaderAt over the image.
func (im *Image) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("image %s: negative offset %d", im.m.ID, off)
	}
	if off >= im.Size() {
		return 0, io.EOF
	}
	xs := im.ext.Slice(off, int64(len(p)))
	n := min(int64(len(p)), im.Size()-off)
	if len(xs) == 1 {
		if err := im.readExtent(p[:n], xs[0]); err != nil {
			return 0, err
		}
	} else {
		// Extents of different segments are fetched in parallel.
		errs := make([]error, len(xs))
		var wg sync.WaitGroup
		at := int64(0)
		for i, x := range xs {
			dst := p[at : at+x.Length]
			at += x.Length
			wg.Go(func() { errs[i] = im.readExtent(dst, x) })
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return 0, err
		}
	}
	if n < int64(len(p)) {
		return int(n), io.EOF
	}
	return int(n), nil
}

func (im *Image) readExtent(dst []byte, x uploader.Extent) error {
	s := im.segs[x.Key]
	s.mu.RLock()
	ra := s.ra
	s.mu.RUnlock()
	k, err := ra.ReadAt(dst, x.Offset)
	if k == len(dst) {
		return nil
	}
	if err == nil || err == io.EOF {
		err = io.ErrUnexpectedEOF
	}
	return im.classify(x.Key, fmt.Errorf("image %s: read %d bytes of segment %s at %d: %w", im.m.ID, len(dst), x.Key, x.Offset, err))
}

// classify marks what a segment's reads found: a segment gone from the
// store (SegmentGoneError), or bytes that are not what the manifest
// describes (CorruptError); other errors (the store failing) stay as they
// are.
func (im *Image) classify(key string, err error) error {
	switch {
	case err == nil || errors.Is(err, uploader.ErrCorrupt):
	case errors.Is(err, iofs.ErrNotExist):
		err = &uploader.SegmentGoneError{Key: key, Err: err}
	case errors.Is(err, lazy.ErrDigest) || errors.Is(err, crypt.ErrAuth):
		err = &uploader.CorruptError{ID: im.m.ID, Err: err}
	}
	return err
}

// Prefetch fetches image bytes [off, end) into the caches (on-demand
// priority) and returns the first error.
func (im *Image) Prefetch(ctx context.Context, off, end int64) error {
	// The ranges of each segment that the image's bytes [off, end) use,
	// merged where they touch or nearly do: an image lays out a segment's
	// blocks in runs of many extents, and one fetch a run (the range
	// reader splits and coalesces it) beats one request an extent.
	type span struct {
		key    string
		lz     *lazy.Reader
		ra     io.ReaderAt // the plaintext, when encrypted
		enc    bool
		lo, hi int64
	}
	by := map[string][]span{}
	var keys []string
	for _, x := range im.ext.Slice(off, end-off) {
		s := im.segs[x.Key]
		s.mu.RLock()
		lz, ra, done := s.lz, s.ra, s.done
		s.mu.RUnlock()
		if lz == nil || done {
			continue
		}
		if _, ok := by[x.Key]; !ok {
			keys = append(keys, x.Key)
		}
		by[x.Key] = append(by[x.Key], span{x.Key, lz, ra, s.enc, x.Offset, x.Offset + x.Length})
	}
	var spans []span
	for _, k := range keys {
		ss := by[k]
		slices.SortFunc(ss, func(a, b span) int { return cmp.Compare(a.lo, b.lo) })
		cur := ss[0]
		for _, x := range ss[1:] {
			if x.lo <= cur.hi+prefetchGap {
				cur.hi = max(cur.hi, x.hi)
				continue
			}
			spans = append(spans, cur)
			cur = x
		}
		spans = append(spans, cur)
	}
	var errs []error
	var mu sync.Mutex
	fail := func(key string, err error) {
		mu.Lock()
		errs = append(errs, im.classify(key, err))
		mu.Unlock()
	}
	sem := make(chan struct{}, prefetchParallel)
	var wg sync.WaitGroup
	for _, x := range spans {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			if !x.enc {
				if err := x.lz.Prefetch(ctx, x.lo, x.hi); err != nil {
					fail(x.key, err)
				}
				return
			}
			// Decrypting reads them (the chunks are authenticated), a
			// bounded piece at a time.
			b := make([]byte, min(x.hi-x.lo, prefetchPiece))
			for at := x.lo; at < x.hi; at += int64(len(b)) {
				if ctx.Err() != nil {
					fail(x.key, ctx.Err())
					return
				}
				b = b[:min(int64(cap(b)), x.hi-at)]
				if n, err := x.ra.ReadAt(b, at); n < len(b) || err != nil && err != io.EOF {
					if err == nil || err == io.EOF {
						err = io.ErrUnexpectedEOF
					}
					fail(x.key, err)
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

const (
	// prefetchGap: ranges of a segment this close are fetched as one
	// (the bytes between are the segment's, fetched at little cost).
	prefetchGap = 1 << 20
	// prefetchParallel bounds the ranges Prefetch fetches at once, and
	// prefetchPiece the buffer of each while it decrypts.
	prefetchParallel = 4
	prefetchPiece    = 4 << 20
)

// Fill completes every segment's cache in the background (hot chunks
// first); OnComplete is called when all are complete.
func (im *Image) Fill() {
	for _, s := range im.order {
		s.mu.RLock()
		lz, done := s.lz, s.done
		s.mu.RUnlock()
		if lz != nil && !done {
			lz.Fill()
		}
	}
}

// StopFill stops every background fill (reads go on).
func (im *Image) StopFill() {
	for _, s := range im.order {
		if s.lz != nil {
			s.lz.StopFill()
		}
	}
}

// Stats adds up the segments' range readers' figures (a complete local
// segment counts as present).
func (im *Image) Stats() lazy.Stats {
	var t lazy.Stats
	t.Complete = true
	for _, s := range im.order {
		s.mu.RLock()
		lz, done := s.lz, s.done
		s.mu.RUnlock()
		if lz == nil {
			t.TotalBytes += s.ref.Size
			t.PresentBytes += s.ref.Size
			continue
		}
		st := lz.Stats()
		t.TotalBytes += st.TotalBytes
		t.PresentBytes += st.PresentBytes
		if done {
			st.Complete, t.PresentBytes = true, t.PresentBytes-st.PresentBytes+st.TotalBytes
		}
		t.OnDemandChunks += st.OnDemandChunks
		t.FillChunks += st.FillChunks
		t.Waiting += st.Waiting
		t.Errors += st.Errors
		t.Evicted += st.Evicted
		t.Complete = t.Complete && st.Complete
	}
	return t
}

// SegmentPath returns the complete local plaintext file of segment key, if
// the image holds it complete.
func (im *Image) SegmentPath(key string) (string, bool) {
	s := im.segs[key]
	if s == nil {
		return "", false
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.plain, s.done
}

// Close gives the image's segments back to the pool, which closes those
// no other open image uses (and itself, when the image has a pool of its
// own).
func (im *Image) Close() error {
	p := im.pool
	p.mu.Lock()
	if im.closed {
		p.mu.Unlock()
		return nil
	}
	im.closed = true
	gone := im.releaseLocked()
	p.mu.Unlock()
	return closeSegments(gone)
}

// Complete reports whether every segment of the image is complete locally.
func (im *Image) Complete() bool { return im.allDone() }

// Composed is an image not yet published, read as the hot set and the
// checks need it: extents of a new segment (Key "", the local file) and of
// segments open in the pool.
type Composed struct {
	pool  *Pool
	fresh *os.File
	ext   []uploader.Extent
	start []int64
	size  int64
	segs  map[string]*segment
}

// Compose reads the image laid out by ext: ranges of the file at fresh
// where Key is "", and of the pool's open segments elsewhere. Close it
// before the images that hold those segments are closed.
func (p *Pool) Compose(ext []uploader.Extent, fresh string) (*Composed, error) {
	f, err := os.Open(fresh)
	if err != nil {
		return nil, err
	}
	c := &Composed{pool: p, fresh: f, ext: ext, segs: map[string]*segment{}}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, x := range ext {
		c.start = append(c.start, c.size)
		c.size += x.Length
		if x.Key == "" || c.segs[x.Key] != nil {
			continue
		}
		s := p.segs[x.Key]
		if s == nil {
			f.Close()
			return nil, fmt.Errorf("image: segment %s is not open", x.Key)
		}
		c.segs[x.Key] = s
	}
	return c, nil
}

// Size is the image's size.
func (c *Composed) Size() int64 { return c.size }

// ReadAt implements io.ReaderAt.
func (c *Composed) ReadAt(p []byte, off int64) (int, error) {
	if off < 0 || off >= c.size {
		return 0, io.EOF
	}
	end := min(off+int64(len(p)), c.size)
	i := sort.Search(len(c.start), func(i int) bool { return c.start[i] > off }) - 1
	n := 0
	for ; i < len(c.ext) && c.start[i] < end; i++ {
		x := c.ext[i]
		lo, hi := max(off, c.start[i]), min(end, c.start[i]+x.Length)
		dst := p[lo-off : hi-off]
		var err error
		if x.Key == "" {
			_, err = c.fresh.ReadAt(dst, x.Offset+lo-c.start[i])
		} else {
			s := c.segs[x.Key]
			s.mu.RLock()
			_, err = s.ra.ReadAt(dst, x.Offset+lo-c.start[i])
			s.mu.RUnlock()
		}
		if err != nil && err != io.EOF {
			return n, err
		}
		n += len(dst)
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

// Close closes the new segment's file.
func (c *Composed) Close() error { return c.fresh.Close() }

// Opener opens images for uploader.RestoreOptions.Image: each in a pool of
// its own over a temporary cache directory (under dir; "" for the
// system's) that Close removes.
func Opener(store uploader.Store, ids *crypt.Identities, dir string) func(ctx context.Context, m uploader.Manifest) (uploader.ImageReader, error) {
	return func(ctx context.Context, m uploader.Manifest) (uploader.ImageReader, error) {
		tmp, err := os.MkdirTemp(dir, "hermesfs-image-")
		if err != nil {
			return nil, err
		}
		im, err := Open(ctx, m, Options{Store: store, CacheDir: tmp, Identities: ids})
		if err != nil {
			os.RemoveAll(tmp)
			return nil, err
		}
		return &tempImage{Image: im, dir: tmp}, nil
	}
}

type tempImage struct {
	*Image
	dir string
}

func (t *tempImage) Close() error {
	err := t.Image.Close()
	os.RemoveAll(t.dir)
	return err
}
