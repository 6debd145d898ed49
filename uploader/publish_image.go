package uploader

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"time"

	"github.com/hermesfs/hermesfs/uploader/crypt"
)

// ImageInput is a snapshot to publish as extents of segments (format 4).
type ImageInput struct {
	// Segment is the local file with the image bytes no earlier segment
	// holds (plaintext): the snapshot's own segment. Extents with an empty
	// Key are ranges of it.
	Segment string
	// Extents lay the image out in order: ranges of the new segment (Key
	// "") and of segments of the Sources' images.
	Extents []Extent
	// Sources are the manifests of the snapshots whose segments Extents
	// name (the previous snapshot, the mounted base): they say what the
	// store holds under those keys. A format 2 or 3 snapshot's archive is
	// used as a segment; its digests object is written on first use.
	Sources []Manifest
	// Local, if set, returns a complete local copy of a source's archive
	// object (key). A format 1 snapshot's manifest has no chunk digests:
	// its archive is used as a segment only if Local has it, its digests
	// computed from that copy (which must have the manifest's sha256).
	// (Format 1 predates encryption: such an archive is plaintext.)
	Local func(key string) (path string, ok bool)

	// Parent is recorded in the manifest; Expect is what LATEST must still
	// name ("" = no LATEST) for the publish to win.
	Parent, Expect string
	// Files and Compression are recorded (Compression default "zstd").
	Files       int64
	Compression string
	// Lease, if set, must still be held when LATEST is about to move.
	Lease *Lease
	// MetaOffset is where the image's metadata tables start.
	MetaOffset int64
	// Hot lists image chunk indexes (of ChunkSize, default
	// DefaultChunkSize) a boot should fetch first.
	Hot       []int64
	ChunkSize int64
	// Standalone also stores the whole image as one object,
	// snapshots/<id>.sqfs, that unsquashfs reads straight from the
	// bucket: composed by the store from the segments' ranges where it
	// can copy (S3: part copies of extents of 5 MiB or more; a local
	// store: its own files), the rest read from Image. Encrypted, it is
	// one age file of the image, uploaded whole. Image is the image's
	// plaintext (required with Standalone).
	Standalone bool
	Image      io.ReaderAt
	// Compacts, recorded in the manifest, names the snapshot whose tree
	// this image holds unchanged (a compaction of it; it is the Parent).
	Compacts string

	// Progress, if set, is told how many bytes of the new segment the
	// store has read for its upload (a retry reads some again; never more
	// than total is reported) and the segment's total (its ciphertext when
	// encrypted). It may be called concurrently from the store's
	// goroutines and must return quickly.
	Progress func(sent, total int64)
}

// publishSegment is the new segment as uploaded.
type publishSegment struct {
	ref  SegmentRef
	sums []byte
	sent int64 // bytes put (the ciphertext when encrypted)
	// header is an encrypted segment's first bytes (its age header).
	header []byte
}

// PublishImage publishes a format 4 snapshot: its new segment and the
// segment's digests, its extents list and its manifest, each created
// once (a create-only put: nothing published is ever overwritten), then
// moves LATEST to it with a conditional write against the LATEST it read.
// A crash or error at any step leaves LATEST on the previous complete
// snapshot; what was uploaded is an orphan until Prune removes it. The
// store should be wrapped in WithRetry: PublishImage does not retry.
//
// With CatalogOptions.Recipients the new segment is one age file, and
// every other segment Extents name must be encrypted too (the caller
// rewrites plaintext ones into the new segment); without, every segment
// must be plaintext.
func (c *Catalog) PublishImage(ctx context.Context, in ImageInput) (Published, error) {
	start := time.Now()
	latest, etag, err := c.readLatest(ctx)
	if err != nil {
		return Published{}, fmt.Errorf("publish: %w", err)
	}
	if !c.expected(latest, in.Expect) {
		return Published{}, &ConflictError{Expected: in.Expect, Latest: latest}
	}
	enc, err := c.checkEncryption(ctx, latest)
	if err != nil {
		return Published{}, fmt.Errorf("publish: %w", err)
	}
	refs, err := c.sourceRefs(ctx, in.Sources, enc != nil, in.Local)
	if err != nil {
		return Published{}, fmt.Errorf("publish: %w", err)
	}
	id := c.newID(latest, in.Parent)
	segKey := SegmentKey(id, enc != nil)

	// The extents, with the new segment named.
	var b Builder
	var newBytes int64
	for _, x := range in.Extents {
		if x.Key == "" {
			x.Key = segKey
			newBytes += x.Length
		} else if _, ok := refs[x.Key]; !ok {
			return Published{}, fmt.Errorf("publish: extent of segment %s, which no source snapshot names", x.Key)
		}
		b.Add(x)
	}
	ext, err := b.Extents()
	if err != nil {
		return Published{}, fmt.Errorf("publish: %w", err)
	}
	if ext.Size() == 0 {
		return Published{}, errors.New("publish: an empty image")
	}

	p := Published{}
	var seg *publishSegment
	if newBytes > 0 {
		if seg, err = c.putSegment(ctx, segKey, in.Segment, newBytes, in.Progress); err != nil {
			return Published{}, fmt.Errorf("publish %s: %w", id, err)
		}
		refs[segKey] = seg.ref
		p.Sent += seg.sent
		p.Segment, p.SegmentSums, p.SegmentHeader = segKey, seg.sums, seg.header
	}

	keys, bytesOf := ext.Segments()
	m := Manifest{
		Format:      manifestFormatSegments,
		ID:          id,
		Created:     c.opts.Now().UTC(),
		Host:        c.opts.Host,
		Parent:      in.Parent,
		Size:        ext.Size(),
		Compression: cmp(in.Compression, "zstd"),
		Files:       in.Files,
		Version:     c.opts.Version,
		Encryption:  enc,
		MetaOffset:  in.MetaOffset,
		Extents:     ExtentsKey(id),
		ExtentCount: ext.Len(),
		NewBytes:    newBytes,
		Compacts:    in.Compacts,
	}
	if enc != nil {
		m.Files = 0
	}
	if len(in.Hot) > 0 {
		m.ChunkSize = cmp64(in.ChunkSize, DefaultChunkSize)
		m.Hot = cleanHot(in.Hot, m.Size, m.ChunkSize)
	}
	for _, k := range keys {
		r := refs[k]
		r.Bytes = bytesOf[k]
		m.Segments = append(m.Segments, r)
	}
	text := ext.Marshal()
	sum := sha256.Sum256(text)
	m.ExtentsSHA256 = hex.EncodeToString(sum[:])
	if err := m.checkSegments(); err != nil {
		return Published{}, fmt.Errorf("publish %s: internal error: %w", id, err)
	}
	if err := c.createSmall(ctx, m.Extents, text); err != nil {
		return Published{}, fmt.Errorf("publish %s: upload extents: %w", id, err)
	}
	if in.Standalone {
		sent, err := c.putStandalone(ctx, ArchiveKey(id), ext, in.Image)
		if err != nil {
			return Published{}, fmt.Errorf("publish %s: standalone image: %w", id, err)
		}
		m.Standalone, m.Archive = true, ArchiveKey(id)
		p.Sent += sent
	}
	mj, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return Published{}, err
	}
	mj = append(mj, '\n')
	if err := c.createSmall(ctx, ManifestKey(id), mj); err != nil {
		return Published{}, fmt.Errorf("publish %s: upload manifest: %w", id, err)
	}
	p.Sent += int64(len(text) + len(mj))
	if in.Lease != nil {
		if err := in.Lease.Err(); err != nil {
			return Published{}, fmt.Errorf("publish %s: uploaded but not published: %w", id, err)
		}
	}
	if err := c.moveLatest(ctx, id, in.Expect, latest, etag); err != nil {
		return Published{}, err
	}
	p.Manifest = m
	p.Copied = m.Size - newBytes
	p.ExtentsList = text
	c.log.Info("published snapshot", "id", id, "parent", in.Parent, "size", m.Size, "new_bytes", newBytes, "sent", p.Sent,
		"segments", len(m.Segments), "extents", m.ExtentCount, "files", m.Files, "encrypted", enc != nil,
		"took", time.Since(start).Round(time.Millisecond))
	return p, nil
}

func cmp64(v, def int64) int64 {
	if v == 0 {
		return def
	}
	return v
}

// checkEncryption decides how the new snapshot is stored: encrypted with
// the catalog's recipients, or plaintext, which a plaintext publish over
// an encrypted LATEST must be allowed to do (a forgotten --encrypt-to).
func (c *Catalog) checkEncryption(ctx context.Context, latest string) (*Encryption, error) {
	var prev *Encryption
	prevKnown := false
	if latest != "" {
		if m, err := c.Manifest(ctx, latest); err == nil {
			prev, prevKnown = m.Encryption, true
		} else if ctx.Err() != nil {
			return nil, err
		}
	}
	r := c.opts.Recipients
	if r == nil {
		if prev != nil && !c.opts.AllowPlaintext {
			return nil, fmt.Errorf("%w: LATEST (%s) is encrypted to %s recipients; pass --encrypt-to (or HERMESFS_ENCRYPT_TO), or --allow-plaintext to publish unencrypted on purpose",
				ErrPlaintext, latest, strings.Join(prev.RecipientTypes, ", "))
		}
		if prev != nil {
			c.log.Warn("publishing a plaintext snapshot over an encrypted LATEST (allowed by --allow-plaintext)", "latest", latest)
		}
		return nil, nil
	}
	if prevKnown && prev == nil {
		c.log.Info("first encrypted snapshot in this store: the older ones stay plaintext until pruned", "latest", latest, "recipient_types", strings.Join(r.Types(), ","))
	}
	return &Encryption{Scheme: crypt.Scheme, RecipientTypes: r.Types()}, nil
}

// SourceSegments returns what the store holds of every segment the
// snapshots in sources name, keyed by segment key, ensuring the digests
// object of a format 2 or 3 archive used as a segment exists. Segments of
// the other kind than encrypted (plaintext when encrypting, encrypted
// when not) are left out: the caller rewrites their bytes into the new
// segment.
func (c *Catalog) SourceSegments(ctx context.Context, sources []Manifest, encrypted bool) (map[string]SegmentRef, error) {
	return c.sourceRefs(ctx, sources, encrypted, nil)
}

func (c *Catalog) sourceRefs(ctx context.Context, sources []Manifest, encrypted bool, local func(string) (string, bool)) (map[string]SegmentRef, error) {
	refs := map[string]SegmentRef{}
	for _, m := range sources {
		if (m.Encryption != nil) != encrypted {
			continue
		}
		if m.Segmented() {
			for _, r := range m.Segments {
				if strings.HasPrefix(r.Key, SegmentsPrefix) && strings.HasSuffix(r.Key, EncryptedExt) != encrypted {
					continue
				}
				r.Bytes = 0
				refs[r.Key] = r
			}
			continue
		}
		if _, ok := refs[m.Archive]; ok {
			continue // named by a newer source already
		}
		s := LegacySums(m)
		if s == nil {
			// Format 1: no digests to read it by range, unless a local
			// copy gives them.
			var err error
			if s, err = localSums(ctx, m, local); err != nil {
				return nil, err
			}
			if s == nil {
				continue
			}
		}
		b := s.marshal()
		if err := c.createSmall(ctx, SumsKey(s.Key), b); err != nil {
			if !errors.Is(err, ErrPrecondition) {
				return nil, fmt.Errorf("digests of %s: %w", s.Key, err)
			}
			// Written by an earlier publish: use what is there, if it
			// describes the same object.
			got, _, gerr := getSmall(ctx, c.store, SumsKey(s.Key), maxSmall)
			if gerr != nil {
				return nil, fmt.Errorf("digests of %s: %w", s.Key, gerr)
			}
			if _, perr := ParseSums(got, SegmentRef{Key: s.Key, Size: s.Size}); perr != nil {
				return nil, perr
			}
			b = got
		}
		sum := sha256.Sum256(b)
		refs[s.Key] = SegmentRef{Key: s.Key, Size: s.Size, SumsSHA256: hex.EncodeToString(sum[:])}
	}
	return refs, nil
}

// localSums computes the digests of format 1 snapshot m's archive from
// the local copy local has of it (nil if it has none), checked against the
// manifest's size and sha256.
func localSums(ctx context.Context, m Manifest, local func(string) (string, bool)) (*Sums, error) {
	if local == nil || m.Encryption != nil {
		return nil, nil
	}
	path, ok := local(m.Archive)
	if !ok {
		return nil, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("digests of %s: %w", m.Archive, err)
	}
	defer f.Close()
	whole, chunks, n, err := ChunkSums(ctx, f, DefaultChunkSize)
	if err != nil {
		return nil, fmt.Errorf("digests of %s: %w", m.Archive, err)
	}
	if n != m.Size || whole != m.SHA256 {
		return nil, fmt.Errorf("digests of %s: the local copy %s (%d bytes, sha256 %s) is not the archive of its manifest (%d bytes, sha256 %s)",
			m.Archive, path, n, whole, m.Size, m.SHA256)
	}
	return &Sums{Key: m.Archive, Size: m.Size, ChunkSize: DefaultChunkSize, Chunks: chunks, SHA256: whole}, nil
}

// createSmall puts b under key, create-only. A create that finds the key
// holding exactly b (its own earlier attempt, landed before an error
// reached us) succeeded; anything else there is a precondition failure.
func (c *Catalog) createSmall(ctx context.Context, key string, b []byte) error {
	_, err := c.store.Put(ctx, key, bytes.NewReader(b), int64(len(b)), PutOptions{IfNoneMatch: true})
	if err == nil || !errors.Is(err, ErrPrecondition) {
		return err
	}
	got, _, gerr := getSmall(ctx, c.store, key, int64(len(b)))
	if gerr == nil && bytes.Equal(got, b) {
		return nil
	}
	return err
}

// putSegment uploads the first n bytes of the file at path as segment
// key (encrypted when the catalog has recipients), then its digests.
func (c *Catalog) putSegment(ctx context.Context, key, path string, n int64, progress func(sent, total int64)) (*publishSegment, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if st.Size() != n {
		return nil, fmt.Errorf("segment file %s has %d bytes, its extents name %d", path, st.Size(), n)
	}
	body := io.ReaderAt(f)
	size := n
	plain := int64(0)
	var header []byte
	if r := c.opts.Recipients; r != nil {
		tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-age-*")
		if err != nil {
			return nil, err
		}
		defer os.Remove(tmp.Name())
		defer tmp.Close()
		cw := &countWriter{w: tmp}
		if err := crypt.Seal(cw, &ctxReader{ctx: ctx, r: io.NewSectionReader(f, 0, n)}, r); err != nil {
			return nil, err
		}
		body, size, plain = tmp, cw.n, n
		header = make([]byte, min(size, crypt.HeaderMax))
		if _, err := tmp.ReadAt(header, 0); err != nil {
			return nil, fmt.Errorf("read the sealed segment's header: %w", err)
		}
	}
	whole, chunks, got, err := ChunkSums(ctx, io.NewSectionReader(body, 0, size), DefaultChunkSize)
	if err != nil {
		return nil, fmt.Errorf("hash segment: %w", err)
	}
	if got != size {
		return nil, fmt.Errorf("segment file %s changed while it was hashed", path)
	}
	if progress != nil {
		body = &progressReaderAt{r: body, total: size, fn: progress}
	}
	info, err := c.store.Put(ctx, key, io.NewSectionReader(body, 0, size), size, PutOptions{IfNoneMatch: true})
	if errors.Is(err, ErrPrecondition) {
		// Our own earlier attempt, if it has our size: ids are unique.
		if st, serr := c.store.Stat(ctx, key); serr == nil && st.Size == size {
			info, err = st, nil
		}
	}
	if err != nil {
		return nil, fmt.Errorf("upload segment: %w", err)
	}
	if info.Size != size {
		return nil, fmt.Errorf("upload segment: the store holds %d bytes of the %d-byte segment", info.Size, size)
	}
	s := Sums{Key: key, Size: size, ChunkSize: DefaultChunkSize, Chunks: chunks, SHA256: whole, Plain: plain}
	b := s.marshal()
	if err := c.createSmall(ctx, SumsKey(key), b); err != nil {
		return nil, fmt.Errorf("upload digests of the segment: %w", err)
	}
	sum := sha256.Sum256(b)
	return &publishSegment{ref: SegmentRef{Key: key, Size: size, SumsSHA256: hex.EncodeToString(sum[:])}, sums: b, sent: size + int64(len(b)), header: header}, nil
}

// putStandalone stores the image laid out by ext (its plaintext readable
// from image) as the one object key, and returns the bytes sent.
func (c *Catalog) putStandalone(ctx context.Context, key string, ext *Extents, image io.ReaderAt) (int64, error) {
	if image == nil {
		return 0, errors.New("no image to read")
	}
	size := ext.Size()
	if r := c.opts.Recipients; r != nil {
		// One age file of the whole image: nothing of it is in the store.
		pr, pw := io.Pipe()
		go func() {
			pw.CloseWithError(crypt.Seal(pw, &ctxReader{ctx: ctx, r: io.NewSectionReader(image, 0, size)}, r))
		}()
		cw := &countWriter{w: io.Discard}
		info, err := c.store.Put(ctx, key, io.TeeReader(pr, cw), -1, PutOptions{IfNoneMatch: true})
		pr.Close()
		if err != nil {
			return 0, err
		}
		return info.Size, nil
	}
	comp, ok := c.store.(Composer)
	if ok && comp.CanCompose() {
		var ranges []ComposeRange
		sources := map[string]*ComposeSource{}
		var at int64
		for _, x := range ext.List() {
			src := sources[x.Key]
			if src == nil {
				info, err := c.store.Stat(ctx, x.Key)
				if err != nil {
					return 0, fmt.Errorf("segment %s: %w", x.Key, err)
				}
				src = &ComposeSource{Key: x.Key, ETag: info.ETag, Size: info.Size}
				sources[x.Key] = src
			}
			ranges = append(ranges, ComposeRange{Offset: at, SourceOffset: x.Offset, Length: x.Length, Source: src, Unchecked: true})
			at += x.Length
		}
		res, err := comp.PutComposed(ctx, key, image, size, ComposeSource{}, ranges, PutOptions{IfNoneMatch: true})
		if err == nil {
			return res.Sent, nil
		}
		if ctx.Err() != nil {
			return 0, err
		}
		c.log.Warn("publish: the store could not put the standalone image together from the segments; uploading it whole", "key", key, "err", err)
	}
	info, err := c.store.Put(ctx, key, io.NewSectionReader(image, 0, size), size, PutOptions{IfNoneMatch: true})
	if err != nil {
		return 0, err
	}
	return info.Size, nil
}

// progressReaderAt counts the bytes read through it for
// ImageInput.Progress; safe for concurrent ReadAt.
type progressReaderAt struct {
	r     io.ReaderAt
	n     atomic.Int64
	total int64
	fn    func(sent, total int64)
}

func (p *progressReaderAt) ReadAt(b []byte, off int64) (int, error) {
	n, err := p.r.ReadAt(b, off)
	p.fn(min(p.n.Add(int64(n)), p.total), p.total)
	return n, err
}
