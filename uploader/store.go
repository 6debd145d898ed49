package uploader

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
)

// Store is a flat namespace of immutable-while-read objects: a local
// directory, an S3 bucket prefix. Keys are slash-separated relative paths
// (see ValidKey).
//
// All methods may be called concurrently. Errors:
//   - a missing key satisfies errors.Is(err, io/fs.ErrNotExist);
//   - a failed put condition satisfies errors.Is(err, ErrPrecondition);
//   - errors that cannot succeed on retry are marked (IsPermanent); anything
//     else may be transient, and WithRetry retries it.
type Store interface {
	// Put stores the object read from r under key. size is the number of
	// bytes r yields, or -1 if unknown; a reader that yields a different
	// number fails the put. Readers of key see the previous object or the
	// whole new one, never a part, and a failed put leaves the previous
	// object in place. r is read from its current position; Put does not
	// close it. The returned ObjectInfo has Key, Size and ETag set (ModTime
	// may be zero).
	Put(ctx context.Context, key string, r io.Reader, size int64, opts PutOptions) (ObjectInfo, error)

	// Get opens length bytes of key from offset off (length -1: to the end;
	// a range past the end is cut at the end). off may equal the size
	// (an empty read); a larger off fails with ErrInvalidRange. The
	// ObjectInfo describes the whole object whose bytes the reader returns
	// (Size is its total size), so a caller can resume a broken read with
	// a second Get and check the ETag is unchanged. The caller closes the
	// reader.
	Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, ObjectInfo, error)

	// Stat describes key.
	Stat(ctx context.Context, key string) (ObjectInfo, error)

	// List calls fn for each object whose key starts with prefix (any
	// string, not only a directory), in ascending byte order of keys,
	// serially on the caller's goroutine. Objects put or deleted while List
	// runs may or may not be seen. An error from fn stops the listing and
	// is returned as is.
	List(ctx context.Context, prefix string, fn func(ObjectInfo) error) error

	// Delete removes key. Deleting a missing key is not an error.
	Delete(ctx context.Context, key string) error
}

// PutOptions are conditions on a Put, checked atomically with the write
// (across processes and hosts, as far as the store allows: S3 conditional
// writes, an flock for the local store).
type PutOptions struct {
	// IfNoneMatch makes the put create-only: it fails with ErrPrecondition
	// if key exists.
	IfNoneMatch bool
	// IfMatch, if set, is the ETag the current object must have; the put
	// fails with ErrPrecondition otherwise (including when key is missing).
	IfMatch string
}

// ObjectInfo describes one stored object.
type ObjectInfo struct {
	Key  string
	Size int64
	// ETag identifies the object's content version; it is opaque: compare
	// it only for equality, and only with ETags from the same store.
	ETag    string
	ModTime time.Time
	// StoreTime is the store's own clock when it answered (an HTTP Date
	// header), on the same clock as ModTime; zero when unknown. Comparing
	// the two measures an object's age without trusting this host's clock.
	StoreTime time.Time
}

var (
	// ErrPrecondition is a failed PutOptions condition (HTTP 412, or the
	// key already exists for IfNoneMatch).
	ErrPrecondition = errors.New("precondition failed")
	// ErrInvalidRange is a Get whose offset is past the end of the object.
	ErrInvalidRange = errors.New("invalid range")
	// ErrInvalidKey is a key that ValidKey rejects.
	ErrInvalidKey = errors.New("invalid key")
)

// ValidKey reports whether key may name an object in every Store: a
// non-empty slash-separated relative path without empty, "." or ".."
// components, without NUL bytes, and without components starting with
// ".hermesfs-" (reserved for the local store's temporary and lock files).
func ValidKey(key string) error {
	if key == "" || len(key) > 1024 {
		return fmt.Errorf("%w %q: empty or longer than 1024 bytes", ErrInvalidKey, key)
	}
	if strings.ContainsRune(key, 0) {
		return fmt.Errorf("%w %q: contains NUL", ErrInvalidKey, key)
	}
	for c := range strings.SplitSeq(key, "/") {
		switch {
		case c == "" || c == "." || c == "..":
			return fmt.Errorf("%w %q: empty, \".\" or \"..\" path component", ErrInvalidKey, key)
		case strings.HasPrefix(c, reservedPrefix):
			return fmt.Errorf("%w %q: names starting with %q are reserved", ErrInvalidKey, key, reservedPrefix)
		}
	}
	return nil
}

const reservedPrefix = ".hermesfs-"

// checkPutArgs validates what every Put implementation checks first.
func checkPutArgs(key string, opts PutOptions) error {
	if err := ValidKey(key); err != nil {
		return Permanent(err)
	}
	if opts.IfNoneMatch && opts.IfMatch != "" {
		return Permanent(fmt.Errorf("put %s: IfNoneMatch and IfMatch together: %w", key, ErrInvalidKey))
	}
	return nil
}

// CheckGetArgs validates a Get's key and range; Store implementations
// outside this package use it too.
func CheckGetArgs(key string, off, length int64) error {
	if err := ValidKey(key); err != nil {
		return Permanent(err)
	}
	if off < 0 || length < -1 {
		return Permanent(fmt.Errorf("get %s: offset %d length %d: %w", key, off, length, ErrInvalidRange))
	}
	return nil
}

// CheckPutArgs is checkPutArgs for Store implementations outside this
// package.
func CheckPutArgs(key string, opts PutOptions) error { return checkPutArgs(key, opts) }

// emptyReader is the body of a zero-length Get.
type emptyReader struct{}

func (emptyReader) Read([]byte) (int, error) { return 0, io.EOF }
func (emptyReader) Close() error             { return nil }

// EmptyBody is a ReadCloser with no bytes, for zero-length Gets.
func EmptyBody() io.ReadCloser { return emptyReader{} }

// Composer is an optional Store capability: putting an object whose bytes
// are partly a copy of another object in the same store, which the store
// copies itself instead of receiving them again. A new snapshot archive
// that shares most of its bytes with the previous one (see package
// archive, "Snapshots that cost what changed") goes up as the bytes that
// changed.
//
// Stores that implement it decide how: S3 assembles a multipart upload
// from server-side copies of the source's ranges and parts sent from
// local. Decorators (Retry) implement it too and report errors.ErrUnsupported
// when the store they wrap does not.
type Composer interface {
	// PutComposed stores under key the size bytes of local, exactly as Put
	// would (atomically, with the same conditions), but may take the
	// ranges of local that ranges say are copies of src from src instead
	// of sending them. Ranges must be sorted by Offset, disjoint, and lie
	// within local's size and src.Size.
	//
	// src names the object as the caller knows it: the copy happens only
	// if key src.Key still has src.ETag and src.Size, else PutComposed
	// fails with ErrPrecondition (a missing source: io/fs.ErrNotExist)
	// and stores nothing; a store whose copy turns out not to hold the
	// bytes local holds fails with ErrComposeMismatch. Either way the
	// caller can fall back to Put. A store may put plainly when too few
	// bytes can be copied to be worth it; ComposeResult says what it did.
	PutComposed(ctx context.Context, key string, local io.ReaderAt, size int64, src ComposeSource, ranges []ComposeRange, opts PutOptions) (ComposeResult, error)
	// CanCompose reports whether PutComposed may copy at all now; when it
	// is false, callers need not prepare a composed put.
	CanCompose() bool
}

// ComposeSource is the object a composed put copies from.
type ComposeSource struct {
	Key  string
	ETag string
	Size int64
}

// ComposeRange says that local's bytes [Offset, Offset+Length) are the
// source's bytes [SourceOffset, SourceOffset+Length): the source the call
// names, or Source when set (an image put together from the ranges of
// several segments).
type ComposeRange struct {
	Offset, SourceOffset, Length int64
	Source                       *ComposeSource
	// Unchecked: local does not hold these bytes at hand (reading them
	// there may fetch them from afar), so the store copies them without
	// comparing them with local's. Whoever relies on the copy checks it
	// otherwise (a snapshot's chunk digests, taken from the source's
	// manifest). A store that cannot copy them reads them from local.
	Unchecked bool
}

// ComposeResult is what a composed put did.
type ComposeResult struct {
	ObjectInfo
	// Sent is the bytes sent to the store, Copied the bytes it copied from
	// the source; they add up to the object's size.
	Sent, Copied int64
}

// ErrComposeMismatch is a composed put whose copied bytes the store
// reported as different from the local bytes they stand for.
var ErrComposeMismatch = errors.New("store copied bytes that differ from the local ones")

// CheckComposeArgs validates a PutComposed's key, source and ranges; Store
// implementations outside this package use it.
func CheckComposeArgs(key string, size int64, src ComposeSource, ranges []ComposeRange, opts PutOptions) error {
	if err := checkPutArgs(key, opts); err != nil {
		return err
	}
	if src.Key != "" {
		if err := ValidKey(src.Key); err != nil {
			return Permanent(err)
		}
	}
	var end int64
	for _, r := range ranges {
		from := r.SourceOf(src)
		if from.Key == "" || ValidKey(from.Key) != nil {
			return Permanent(fmt.Errorf("put %s: copy range %+v: no valid source", key, r))
		}
		if r.Length <= 0 || r.Offset < end || r.Offset+r.Length > size || r.SourceOffset < 0 || r.SourceOffset+r.Length > from.Size {
			return Permanent(fmt.Errorf("put %s: copy range %+v out of order or out of bounds (size %d, source %d)", key, r, size, from.Size))
		}
		end = r.Offset + r.Length
	}
	return nil
}

// SourceOf is the object range r copies from: its own Source, else src.
func (r ComposeRange) SourceOf(src ComposeSource) ComposeSource {
	if r.Source != nil {
		return *r.Source
	}
	return src
}
