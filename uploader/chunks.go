package uploader

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
)

// Chunk digests (manifest format 2). A lazy reader fetches an archive in
// aligned chunks and checks each against its digest on arrival, so it never
// has to trust the store, nor the archive's own checksums, which live in a
// part of the archive it has not verified yet.

// DefaultChunkSize is the chunk size Publish records digests for.
const DefaultChunkSize = 256 << 10

// MaxHot bounds Manifest.Hot in a manifest read: a manifest may name this
// many hot chunks (as an older hermesfs wrote them). Publish and a lazy
// reader keep at most HotLimit.
const MaxHot = 4096

// The hot set's byte bound (README "Lazy boot"): an eighth of the archive,
// at most MaxHotBytes and at least minHotBytes. See HotLimit.
const (
	MaxHotBytes = 64 << 20
	minHotBytes = 4 << 20
	hotShare    = 8
)

// HotLimit is the most chunks of chunkSize a hot set of an archive of size
// bytes holds: min(MaxHotBytes, max(minHotBytes, size/8)) in whole chunks,
// at least one, at most MaxHot.
//
// The hot set is fetched before the rest of the fill, so it pays off only
// while it is a small part of the archive: a hot set of most of the
// archive says nothing more than "fetch it all", and while it is fetched
// the fill does not follow sequential reads. What a startup reads first is
// small (README "Lazy boot", BENCHMARKS.md); a session that read more
// keeps what it read first.
func HotLimit(size, chunkSize int64) int {
	if chunkSize <= 0 || size <= 0 {
		return 0
	}
	b := min(MaxHotBytes, max(minHotBytes, size/hotShare))
	return max(1, min(int(b/chunkSize), MaxHot, NumChunks(size, chunkSize)))
}

// ValidChunkSize reports whether cs may be a manifest's chunk size: a power
// of two of at least 64 KiB (and at most 64 MiB).
func ValidChunkSize(cs int64) bool {
	return cs >= 64<<10 && cs <= 64<<20 && cs&(cs-1) == 0
}

// NumChunks is the number of chunks of an object of size bytes.
func NumChunks(size, chunkSize int64) int {
	if size <= 0 {
		return 0
	}
	return int((size + chunkSize - 1) / chunkSize)
}

// Lazy reports whether the manifest has what a lazy reader needs: a chunk
// digest for every chunk of the archive.
func (m Manifest) Lazy() bool {
	return m.ChunkSize > 0 && len(m.Chunks) == NumChunks(m.Size, m.ChunkSize) && m.Size > 0
}

// checkChunks validates the format 2 fields of a manifest read from the
// store.
func (m Manifest) checkChunks() error {
	if m.ChunkSize == 0 && len(m.Chunks) == 0 {
		return nil
	}
	if !ValidChunkSize(m.ChunkSize) {
		return fmt.Errorf("chunk_size %d is not a power of two between 64 KiB and 64 MiB", m.ChunkSize)
	}
	if n := NumChunks(m.Size, m.ChunkSize); len(m.Chunks) != n {
		return fmt.Errorf("%d chunk digests for %d chunks", len(m.Chunks), n)
	}
	for i, c := range m.Chunks {
		if len(c) != 64 {
			return fmt.Errorf("chunk %d digest %q is not a hex sha256", i, c)
		}
		if _, err := hex.DecodeString(c); err != nil {
			return fmt.Errorf("chunk %d digest %q is not a hex sha256", i, c)
		}
	}
	if m.MetaOffset < 0 || m.MetaOffset > m.Size {
		return fmt.Errorf("meta_offset %d outside the %d-byte archive", m.MetaOffset, m.Size)
	}
	if len(m.Hot) > MaxHot {
		return fmt.Errorf("%d hot chunks, more than %d", len(m.Hot), MaxHot)
	}
	return nil
}

// cleanHot keeps the hot chunk indexes that name a chunk of an object of
// size bytes, once each, in their order, at most HotLimit: the first ones.
func cleanHot(hot []int64, size, chunkSize int64) []int64 {
	n := int64(NumChunks(size, chunkSize))
	limit := HotLimit(size, chunkSize)
	seen := make(map[int64]bool, len(hot))
	var out []int64
	for _, h := range hot {
		if len(out) >= limit {
			break
		}
		if h < 0 || h >= n || seen[h] {
			continue
		}
		seen[h] = true
		out = append(out, h)
	}
	return out
}

// ChunkSums reads f from its start and returns the hex sha256 of the whole
// file and of each chunkSize slice of it.
func ChunkSums(ctx context.Context, f io.Reader, chunkSize int64) (whole string, chunks []string, size int64, err error) {
	if !ValidChunkSize(chunkSize) {
		return "", nil, 0, fmt.Errorf("chunk size %d: not a power of two between 64 KiB and 64 MiB", chunkSize)
	}
	h := sha256.New()
	buf := make([]byte, chunkSize)
	r := &ctxReader{ctx: ctx, r: f}
	for {
		n, err := io.ReadFull(r, buf)
		if n > 0 {
			h.Write(buf[:n])
			s := sha256.Sum256(buf[:n])
			chunks = append(chunks, hex.EncodeToString(s[:]))
			size += int64(n)
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			break
		}
		if err != nil {
			return "", nil, 0, err
		}
	}
	return hex.EncodeToString(h.Sum(nil)), chunks, size, nil
}

// SquashfsMetaOffset returns where the metadata of the squashfs image at
// the start of f begins: the smallest table start the superblock records
// (the tables follow the data blocks). 0 if f is not a squashfs image or
// records nothing usable.
func SquashfsMetaOffset(f io.ReaderAt, size int64) int64 {
	var sb [96]byte
	if _, err := f.ReadAt(sb[:], 0); err != nil {
		return 0
	}
	if binary.LittleEndian.Uint32(sb[0:]) != 0x73717368 {
		return 0
	}
	var best uint64
	for off := 48; off <= 88; off += 8 {
		v := binary.LittleEndian.Uint64(sb[off:])
		if v < 96 || v == ^uint64(0) || v >= uint64(size) {
			continue
		}
		if best == 0 || v < best {
			best = v
		}
	}
	return int64(best)
}

// fileChunkSums is ChunkSums over the file at path.
func fileChunkSums(ctx context.Context, path string, chunkSize int64) (string, []string, int64, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", nil, 0, 0, err
	}
	defer f.Close()
	whole, chunks, size, err := ChunkSums(ctx, f, chunkSize)
	if err != nil {
		return "", nil, 0, 0, fmt.Errorf("hash %s: %w", path, err)
	}
	return whole, chunks, size, SquashfsMetaOffset(f, size), nil
}

// chunkVerifier is a Writer that checks what passes through it, in order,
// against the manifest's chunk digests: the check of an archive whose
// manifest has no whole-archive sha256.
type chunkVerifier struct {
	m   Manifest
	h   hash.Hash
	in  int64 // bytes of the current chunk written
	i   int   // the current chunk
	err error
}

func newChunkVerifier(m Manifest) *chunkVerifier {
	return &chunkVerifier{m: m, h: sha256.New()}
}

func (v *chunkVerifier) Write(p []byte) (int, error) {
	n := len(p)
	for len(p) > 0 && v.err == nil {
		k := min(int64(len(p)), v.m.ChunkSize-v.in)
		v.h.Write(p[:k])
		v.in += k
		p = p[k:]
		if v.in == v.m.ChunkSize {
			v.endChunk()
		}
	}
	return n, nil // the first mismatch is reported by Close
}

func (v *chunkVerifier) endChunk() {
	if v.i >= len(v.m.Chunks) {
		v.err = fmt.Errorf("archive longer than its %d chunk digests", len(v.m.Chunks))
		return
	}
	if got := hex.EncodeToString(v.h.Sum(nil)); got != v.m.Chunks[v.i] {
		v.err = fmt.Errorf("chunk %d (bytes %d-%d) has sha256 %s, the manifest says %s", v.i, int64(v.i)*v.m.ChunkSize,
			int64(v.i)*v.m.ChunkSize+v.in-1, got, v.m.Chunks[v.i])
		return
	}
	v.i++
	v.in = 0
	v.h.Reset()
}

// Close checks the last (short) chunk and that every chunk was seen.
func (v *chunkVerifier) Close() error {
	if v.err == nil && v.in > 0 {
		v.endChunk()
	}
	if v.err == nil && v.i != len(v.m.Chunks) {
		v.err = fmt.Errorf("archive ends after %d of its %d chunks", v.i, len(v.m.Chunks))
	}
	return v.err
}

// VerifyChunks checks the archive read from r against m's chunk digests.
func VerifyChunks(ctx context.Context, r io.Reader, m Manifest) error {
	if !m.Lazy() {
		return errors.New("the manifest has no chunk digests")
	}
	v := newChunkVerifier(m)
	if _, err := io.CopyBuffer(v, ContextReader(ctx, r), make([]byte, 1<<20)); err != nil {
		return err
	}
	return v.Close()
}
