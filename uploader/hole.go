package uploader

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
)

// Publishing an archive with a hole (PublishInput.Hole). A snapshot packed
// on a base that is still being fetched (lazy boot) leaves the base's
// shared prefix unwritten in the local file, chunk-aligned: those bytes are
// the Delta source's at the same offsets. Publish then takes their chunk
// digests from the source's manifest instead of hashing them, never sends
// them when the store can copy them from the source (S3 part copies, the
// local store's own object), and reads them from Fill — a reader that
// verifies what it fetches — only for what a store must receive. The
// manifest of such a snapshot has no whole-archive sha256: every consumer
// checks it chunk by chunk (see Manifest.SHA256).
//
// The store copies the hole only from the source object Fill vouches for
// (SourceChecker): the one whose chunks it fetched and found intact. An
// object replaced in the store since (another ETag: overwritten by hand,
// a bucket restored) does not hold the bytes those digests describe, so
// the archive then goes up whole, its hole read through Fill, which
// refuses such bytes: the publish fails rather than record digests the
// copied bytes do not have.

// Hole is the byte range [From, To) of an archive file left unwritten.
type Hole struct{ From, To int64 }

// Len is the hole's length.
func (h Hole) Len() int64 { return h.To - h.From }

// SourceChecker is implemented by a PublishInput.Fill that can say which
// object of the store its bytes come from. CheckSource fetches a chunk of
// the hole's source it lacks, checks it, and returns the ETag of the
// object that delivered it intact, if that is the object it read from all
// along (lazy.Reader does). Publish calls it right before the copy.
type SourceChecker interface {
	CheckSource(ctx context.Context) (etag string, err error)
}

// holeSource is the ETag of the Delta source's archive as in.Fill vouches
// for it, "" (and why) when the store must not copy the hole.
func holeSource(ctx context.Context, in PublishInput) (string, error) {
	sc, ok := in.Fill.(SourceChecker)
	if !ok {
		return "", errors.New("the reader of the hole cannot tell which object of the store its bytes come from")
	}
	etag, err := sc.CheckSource(ctx)
	if err == nil && etag == "" {
		err = errors.New("the reader of the hole vouches for no object of the store")
	}
	if err != nil {
		return "", fmt.Errorf("source of the hole: %w", err)
	}
	return etag, nil
}

// holeReader reads the archive: the file outside the hole, fill inside.
type holeReader struct {
	f    io.ReaderAt
	fill io.ReaderAt
	hole Hole
}

func (r holeReader) ReadAt(p []byte, off int64) (int, error) {
	n := 0
	for len(p) > 0 {
		src, end := r.f, int64(-1)
		switch {
		case off < r.hole.From:
			end = r.hole.From
		case off < r.hole.To:
			src, end = r.fill, r.hole.To
		}
		k := len(p)
		if end >= 0 && int64(k) > end-off {
			k = int(end - off)
		}
		m, err := src.ReadAt(p[:k], off)
		n += m
		if err != nil {
			return n, err
		}
		p, off = p[k:], off+int64(k)
	}
	return n, nil
}

// holeDigests checks that in's hole can be published and returns the
// digests of the chunks it covers, from the Delta source's manifest.
func (c *Catalog) holeDigests(ctx context.Context, in PublishInput, cs int64) ([]string, error) {
	h, d := in.Hole, in.Delta
	if h.From%cs != 0 || h.To%cs != 0 || h.From <= 0 || h.To <= h.From {
		return nil, fmt.Errorf("hole [%d, %d) is not a range of whole %d-byte chunks past the first", h.From, h.To, cs)
	}
	if in.Fill == nil {
		return nil, errors.New("an archive with a hole needs a reader of the bytes that belong there")
	}
	if d == nil || len(d.Ranges) == 0 {
		return nil, errors.New("an archive with a hole needs the delta source it shares them with")
	}
	if r := d.Ranges[0]; r.Offset != r.SourceOffset || r.Offset > h.From || r.Offset+r.Length < h.To {
		return nil, fmt.Errorf("hole [%d, %d) is not within the range %+v shared with %s at the same offsets", h.From, h.To, r, d.Source)
	}
	sm, err := c.Manifest(ctx, d.Source)
	if err != nil {
		return nil, fmt.Errorf("source snapshot of the hole: %w", err)
	}
	if !sm.Lazy() || sm.ChunkSize != cs || sm.Encryption != nil || sm.Size < h.To {
		return nil, fmt.Errorf("source snapshot %s has no %d-byte chunk digests of its plaintext up to %d", d.Source, cs, h.To)
	}
	return sm.Chunks[h.From/cs : h.To/cs], nil
}

// holeChunkSums is fileChunkSums for a file whose chunks in the hole have
// the digests given: it returns the chunk digests and where the metadata
// starts, and no whole-file sha256.
func holeChunkSums(ctx context.Context, f *os.File, size, cs int64, h Hole, digests []string) ([]string, int64, error) {
	n := NumChunks(size, cs)
	chunks := make([]string, 0, n)
	buf := make([]byte, cs)
	for i := range int64(n) {
		if err := ctx.Err(); err != nil {
			return nil, 0, err
		}
		off := i * cs
		if off >= h.From && off < h.To {
			chunks = append(chunks, digests[(off-h.From)/cs])
			continue
		}
		k := min(cs, size-off)
		if _, err := f.ReadAt(buf[:k], off); err != nil {
			return nil, 0, fmt.Errorf("hash %s: %w", f.Name(), err)
		}
		s := sha256.Sum256(buf[:k])
		chunks = append(chunks, hex.EncodeToString(s[:]))
	}
	return chunks, SquashfsMetaOffset(f, size), nil
}

// fillHole writes the hole's bytes, read from fill, into the file at path:
// it then holds the whole archive.
func fillHole(ctx context.Context, path string, h Hole, fill io.ReaderAt) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	w := io.NewOffsetWriter(f, h.From)
	if _, err := io.CopyBuffer(w, ContextReader(ctx, io.NewSectionReader(fill, h.From, h.Len())), make([]byte, 1<<20)); err != nil {
		f.Close()
		return fmt.Errorf("fill the archive's hole [%d, %d): %w", h.From, h.To, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// splitHole splits the delta's ranges at the hole's ends and marks the
// part inside it Unchecked: the local file does not hold those bytes.
func splitHole(ranges []ComposeRange, h Hole) []ComposeRange {
	var out []ComposeRange
	for _, r := range ranges {
		end := r.Offset + r.Length
		for _, cut := range []int64{h.From, h.To} {
			if cut > r.Offset && cut < end {
				out = append(out, ComposeRange{Offset: r.Offset, SourceOffset: r.SourceOffset, Length: cut - r.Offset,
					Unchecked: r.Offset >= h.From && cut <= h.To})
				r.SourceOffset += cut - r.Offset
				r.Length -= cut - r.Offset
				r.Offset = cut
			}
		}
		r.Unchecked = r.Offset >= h.From && end <= h.To
		out = append(out, r)
	}
	return out
}
