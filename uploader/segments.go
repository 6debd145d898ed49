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
	iofs "io/fs"
	"strings"
)

// Segments (format 4).
//
// A segment is an immutable object holding image bytes that some
// snapshot's extents name: segments/<id>.seg, the bytes new in snapshot
// id, or segments/<id>.seg.age, the same encrypted as one age file (the
// extents address its plaintext). A snapshot of format 3 or older is a
// whole image, snapshots/<id>.sqfs, which later snapshots use as a
// segment too. Beside each segment used by a format 4 snapshot lies
// <key>.sums: the segment's size as stored and the sha256 of each
// ChunkSize slice of it as stored (the ciphertext, when encrypted), which
// a reader checks every fetched range against. The manifest records the
// sha256 of the .sums object, so the chain from the manifest to every
// byte served is checked.

// Key layout of segments.
const (
	SegmentsPrefix = "segments/"
	SegmentExt     = ".seg"
	EncryptedExt   = ".age"
	SumsExt        = ".sums"
	ExtentsExt     = ".extents"
)

// SegmentKey is the key of the segment snapshot id uploads.
func SegmentKey(id string, encrypted bool) string {
	k := SegmentsPrefix + id + SegmentExt
	if encrypted {
		k += EncryptedExt
	}
	return k
}

// SumsKey is the key of a segment's digests.
func SumsKey(segment string) string { return segment + SumsExt }

// ExtentsKey is the key of snapshot id's extents list.
func ExtentsKey(id string) string { return SnapshotsPrefix + id + ExtentsExt }

// IsSegmentKey reports whether key names a segment (new or a whole
// legacy image), not its digests or anything else.
func IsSegmentKey(key string) bool {
	switch {
	case strings.HasPrefix(key, SegmentsPrefix):
		return strings.HasSuffix(key, SegmentExt) || strings.HasSuffix(key, SegmentExt+EncryptedExt)
	case strings.HasPrefix(key, SnapshotsPrefix):
		return strings.HasSuffix(key, ArchiveExt)
	}
	return false
}

// SegmentRef is a segment as a format 4 manifest names it.
type SegmentRef struct {
	Key string `json:"key"`
	// Size is the object's size as stored.
	Size int64 `json:"size"`
	// SumsSHA256 is the hex sha256 of the object at SumsKey(Key).
	SumsSHA256 string `json:"sums_sha256"`
	// Bytes is how many image bytes the snapshot takes from it.
	Bytes int64 `json:"bytes"`
}

// Sums are a segment's digests, stored as JSON at SumsKey(Key).
type Sums struct {
	Key       string   `json:"key"`
	Size      int64    `json:"size"`
	ChunkSize int64    `json:"chunk_size"`
	Chunks    []string `json:"chunks"`
	// SHA256 of the whole object as stored, when known (a format 3
	// image used as a segment has none).
	SHA256 string `json:"sha256,omitempty"`
	// Plain is the plaintext's size when the segment is encrypted.
	Plain int64 `json:"plain_size,omitempty"`
}

func (s *Sums) check() error {
	switch {
	case s.Size < 0:
		return fmt.Errorf("negative size %d", s.Size)
	case !ValidChunkSize(s.ChunkSize):
		return fmt.Errorf("chunk_size %d is not a power of two between 64 KiB and 64 MiB", s.ChunkSize)
	case len(s.Chunks) != NumChunks(s.Size, s.ChunkSize):
		return fmt.Errorf("%d chunk digests for %d chunks", len(s.Chunks), NumChunks(s.Size, s.ChunkSize))
	case s.SHA256 != "" && len(s.SHA256) != 64:
		return fmt.Errorf("sha256 %q is not a hex sha256", s.SHA256)
	}
	for i, c := range s.Chunks {
		if len(c) != 64 {
			return fmt.Errorf("chunk %d digest %q is not a hex sha256", i, c)
		}
		if _, err := hex.DecodeString(c); err != nil {
			return fmt.Errorf("chunk %d digest %q is not a hex sha256", i, c)
		}
	}
	return nil
}

func (s *Sums) marshal() []byte {
	b, _ := json.Marshal(s)
	return append(b, '\n')
}

// SegmentGoneError is a segment, or its digests, missing from the store:
// the snapshot that needs it was pruned (or the store damaged). It
// satisfies errors.Is(err, io/fs.ErrNotExist) and ErrCorrupt.
type SegmentGoneError struct {
	Key string
	Err error
}

func (e *SegmentGoneError) Error() string {
	return fmt.Sprintf("segment %s is no longer in the store (its snapshot was pruned, or the store lost it): %v", e.Key, e.Err)
}
func (e *SegmentGoneError) Unwrap() []error { return []error{e.Err, ErrCorrupt} }

// getSmall reads a whole small object (at most max bytes).
func getSmall(ctx context.Context, s Store, key string, max int64) ([]byte, ObjectInfo, error) {
	rc, info, err := s.Get(ctx, key, 0, max+1)
	if err != nil {
		return nil, info, err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return nil, info, err
	}
	if int64(len(b)) > max {
		return nil, info, fmt.Errorf("%s: larger than %d bytes", key, max)
	}
	return b, info, nil
}

// maxSmall bounds an extents list or digests object read from a store.
const maxSmall = 256 << 20

// ReadSums reads a segment's digests and checks them against the sha256 a
// manifest recorded ("" checks only their form).
func ReadSums(ctx context.Context, s Store, ref SegmentRef) (*Sums, error) {
	b, _, err := getSmall(ctx, s, SumsKey(ref.Key), maxSmall)
	if errors.Is(err, iofs.ErrNotExist) {
		return nil, &SegmentGoneError{Key: ref.Key, Err: err}
	}
	if err != nil {
		return nil, fmt.Errorf("read digests of %s: %w", ref.Key, err)
	}
	return ParseSums(b, ref)
}

// ParseSums decodes and checks a digests object read as b.
func ParseSums(b []byte, ref SegmentRef) (*Sums, error) {
	if ref.SumsSHA256 != "" {
		if got := sha256.Sum256(b); hex.EncodeToString(got[:]) != ref.SumsSHA256 {
			return nil, fmt.Errorf("digests of segment %s: sha256 %x, the manifest says %s: %w", ref.Key, got, ref.SumsSHA256, ErrCorrupt)
		}
	}
	var sm Sums
	if err := json.Unmarshal(b, &sm); err != nil {
		return nil, fmt.Errorf("digests of segment %s: %v: %w", ref.Key, err, ErrCorrupt)
	}
	if err := sm.check(); err != nil {
		return nil, fmt.Errorf("digests of segment %s: %v: %w", ref.Key, err, ErrCorrupt)
	}
	if sm.Key != ref.Key || ref.Size != 0 && sm.Size != ref.Size {
		return nil, fmt.Errorf("digests of segment %s describe %s of %d bytes: %w", ref.Key, sm.Key, sm.Size, ErrCorrupt)
	}
	return &sm, nil
}

// ReadExtents reads snapshot m's extents list and checks it against the
// manifest.
func ReadExtents(ctx context.Context, s Store, m Manifest) (*Extents, error) {
	if !m.Segmented() {
		return LegacyExtents(m), nil
	}
	b, _, err := getSmall(ctx, s, m.Extents, maxSmall)
	if errors.Is(err, iofs.ErrNotExist) {
		return nil, &CorruptError{ID: m.ID, Err: fmt.Errorf("extents list %s missing: %w", m.Extents, err)}
	}
	if err != nil {
		return nil, fmt.Errorf("read extents of %s: %w", m.ID, err)
	}
	return ParseManifestExtents(b, m)
}

// ParseManifestExtents decodes an extents list read as b and checks it
// against manifest m.
func ParseManifestExtents(b []byte, m Manifest) (*Extents, error) {
	if got := sha256.Sum256(b); hex.EncodeToString(got[:]) != m.ExtentsSHA256 {
		return nil, &CorruptError{ID: m.ID, Err: fmt.Errorf("extents list has sha256 %x, the manifest says %s", got, m.ExtentsSHA256)}
	}
	e, err := ParseExtents(bytes.NewReader(b))
	if err != nil {
		return nil, &CorruptError{ID: m.ID, Err: err}
	}
	if e.Size() != m.Size {
		return nil, &CorruptError{ID: m.ID, Err: fmt.Errorf("extents add up to %d bytes, the image has %d", e.Size(), m.Size)}
	}
	known := map[string]bool{}
	for _, r := range m.Segments {
		known[r.Key] = true
	}
	for _, x := range e.List() {
		if !known[x.Key] {
			return nil, &CorruptError{ID: m.ID, Err: fmt.Errorf("extents name segment %s, which the manifest does not list", x.Key)}
		}
	}
	return e, nil
}

// LegacyExtents is a format 3 or older snapshot as extents: its whole
// archive object.
func LegacyExtents(m Manifest) *Extents {
	e, _ := NewExtents([]Extent{{Key: m.Archive, Length: m.Size}})
	return e
}

// LegacySums are the digests of a format 2 or 3 snapshot's archive, from
// its manifest (nil for format 1, which has none).
func LegacySums(m Manifest) *Sums {
	if !m.Lazy() {
		return nil
	}
	return &Sums{Key: m.Archive, Size: m.Size, ChunkSize: m.ChunkSize, Chunks: m.Chunks, SHA256: m.SHA256}
}

// checkSegments validates the format 4 fields of a manifest read from the
// store.
func (m Manifest) checkSegments() error {
	switch {
	case m.Size <= 0:
		return fmt.Errorf("image size %d", m.Size)
	case m.Extents != ExtentsKey(m.ID):
		return fmt.Errorf("extents list %q, want %q", m.Extents, ExtentsKey(m.ID))
	case len(m.ExtentsSHA256) != 64:
		return fmt.Errorf("extents_sha256 %q is not a hex sha256", m.ExtentsSHA256)
	case len(m.Segments) == 0:
		return errors.New("no segments")
	case m.MetaOffset < 0 || m.MetaOffset > m.Size:
		return fmt.Errorf("meta_offset %d outside the %d-byte image", m.MetaOffset, m.Size)
	case len(m.Hot) > MaxHot:
		return fmt.Errorf("%d hot chunks, more than %d", len(m.Hot), MaxHot)
	case len(m.Hot) > 0 && !ValidChunkSize(m.ChunkSize):
		return fmt.Errorf("chunk_size %d is not a power of two between 64 KiB and 64 MiB", m.ChunkSize)
	case m.Standalone && m.Archive != ArchiveKey(m.ID):
		return fmt.Errorf("standalone image %q, want %q", m.Archive, ArchiveKey(m.ID))
	case !m.Standalone && m.Archive != "":
		return fmt.Errorf("archive %q without standalone", m.Archive)
	}
	var total int64
	seen := map[string]bool{}
	for _, r := range m.Segments {
		switch {
		case !IsSegmentKey(r.Key) || ValidKey(r.Key) != nil:
			return fmt.Errorf("segment key %q", r.Key)
		case seen[r.Key]:
			return fmt.Errorf("segment %s listed twice", r.Key)
		case r.Size <= 0 || r.Bytes <= 0:
			return fmt.Errorf("segment %s: size %d, bytes %d", r.Key, r.Size, r.Bytes)
		case len(r.SumsSHA256) != 64:
			return fmt.Errorf("segment %s: sums_sha256 %q is not a hex sha256", r.Key, r.SumsSHA256)
		case (m.Encryption != nil) != strings.HasSuffix(r.Key, EncryptedExt) && strings.HasPrefix(r.Key, SegmentsPrefix):
			return fmt.Errorf("segment %s: encryption does not match the manifest's", r.Key)
		}
		seen[r.Key] = true
		total += r.Bytes
	}
	if total != m.Size {
		return fmt.Errorf("segments give %d bytes, the image has %d", total, m.Size)
	}
	return nil
}

// VerifySums checks the object read from r (from its start) against its
// digests: every chunk, and the whole sha256 when known.
func VerifySums(r io.Reader, s *Sums) error {
	m := Manifest{Size: s.Size, ChunkSize: s.ChunkSize, Chunks: s.Chunks}
	h := sha256.New()
	v := newChunkVerifier(m)
	if _, err := io.CopyBuffer(io.MultiWriter(h, v), r, make([]byte, 1<<20)); err != nil {
		return err
	}
	if err := v.Close(); err != nil {
		return fmt.Errorf("%s: %w", s.Key, err)
	}
	if s.SHA256 != "" && hex.EncodeToString(h.Sum(nil)) != s.SHA256 {
		return fmt.Errorf("%s: sha256 %x, its digests say %s", s.Key, h.Sum(nil), s.SHA256)
	}
	return nil
}
