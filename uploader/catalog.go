package uploader

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hermesfs/hermesfs/uploader/crypt"
)

// Keys of the catalog, relative to the store's prefix.
const (
	LatestKey       = "LATEST"
	LeaseKey        = "lease"
	SnapshotsPrefix = "snapshots/"
	ArchiveExt      = ".sqfs"
	ManifestExt     = ".json"
)

// ArchiveKey is the key of snapshot id's archive.
func ArchiveKey(id string) string { return SnapshotsPrefix + id + ArchiveExt }

// ManifestKey is the key of snapshot id's manifest.
func ManifestKey(id string) string { return SnapshotsPrefix + id + ManifestExt }

// ManifestFormat is the version of the manifest's JSON layout.
// Format 2 adds the chunk digests (ChunkSize, Chunks, MetaOffset) a lazy
// reader needs, the hot set and the shared prefix; format 1 manifests,
// without them, stay valid and are restored by a full download. Format 3
// is format 2 without the whole-archive sha256 (a snapshot published
// with a hole, see hole.go): written only for those, so that a hermesfs
// that requires the sha256 asks to be upgraded instead of taking the
// snapshot for a corrupt one and falling back to an older one. Format 4
// stores the image as extents of shared segments (extents.go,
// segments.go): Extents, ExtentsSHA256 and Segments replace Archive and
// SHA256.
const ManifestFormat = 4

// manifestFormatSegments is the first format whose image is extents.
const manifestFormatSegments = 4

// manifestFormatHole is the format of a manifest without a sha256.
const manifestFormatHole = 3

// Manifest describes one snapshot. It is stored as JSON next to the archive
// and holds nothing secret.
type Manifest struct {
	Format  int       `json:"format"`
	ID      string    `json:"id"`
	Created time.Time `json:"created"`
	Host    string    `json:"host"`
	// Parent is the snapshot the tree was restored from ("" for the first).
	Parent string `json:"parent,omitempty"`
	Size   int64  `json:"size"`
	// SHA256 (hex) of the whole archive. A format 3 manifest leaves it
	// out ("") when the archive was published without all of its bytes at
	// hand (packed on a base still being fetched, see hole.go): its chunk
	// digests are then the only check, and every reader verifies chunk by
	// chunk (VerifyChunks).
	SHA256      string `json:"sha256,omitempty"`
	Compression string `json:"compression"`
	Files       int64  `json:"files,omitempty"` // left out of encrypted snapshots
	Version     string `json:"hermesfs_version"`
	Archive     string `json:"archive"` // the archive's key

	// ChunkSize and Chunks: the hex sha256 of each ChunkSize slice of the
	// archive as stored (the last may be short). Absent in format 1.
	ChunkSize int64    `json:"chunk_size,omitempty"`
	Chunks    []string `json:"chunks,omitempty"`
	// MetaOffset is where the archive's metadata tail starts (0: unknown).
	MetaOffset int64 `json:"meta_offset,omitempty"`
	// Hot lists chunk indexes the session before this snapshot read first,
	// in first-read order (at most MaxHot): the next boot fetches them
	// first.
	Hot []int64 `json:"hot,omitempty"`
	// SharedPrefix is how many leading bytes of the archive are the bytes
	// of the archive it was packed on (format 2 and 3; 0: none known).
	SharedPrefix int64 `json:"shared_prefix,omitempty"`
	// Encryption is set when the archive object is encrypted (see
	// encrypt.go); Size and SHA256 are then the ciphertext's. In format 4
	// every segment is encrypted so, and Size is the plaintext image's.
	Encryption *Encryption `json:"encryption,omitempty"`

	// Format 4. Extents is the key of the extents list (ExtentsSHA256 its
	// hex sha256, ExtentCount its lines); Segments every segment it
	// names. Size is the image's size; ChunkSize the chunk size of the
	// image that Hot counts in; Archive is empty unless the image was
	// also stored whole (Standalone).
	Extents       string       `json:"extents,omitempty"`
	ExtentsSHA256 string       `json:"extents_sha256,omitempty"`
	ExtentCount   int          `json:"extent_count,omitempty"`
	Segments      []SegmentRef `json:"segments,omitempty"`
	// NewBytes is how many image bytes this snapshot's own segment holds
	// (what its publish uploaded, before encryption).
	NewBytes int64 `json:"new_bytes,omitempty"`
	// Standalone is set when Archive holds the whole image as one object
	// besides the extents (--standalone).
	Standalone bool `json:"standalone,omitempty"`
	// Compacts names the snapshot (the parent) whose tree this one holds
	// unchanged, laid out anew to drop what that image carried unused
	// (archive.Compact): a compaction, not a change of the tree.
	Compacts string `json:"compacts,omitempty"`
}

// Segmented reports whether the manifest describes its image as extents
// of segments (format 4) rather than one archive object.
func (m Manifest) Segmented() bool { return m.Format >= manifestFormatSegments }

var (
	// ErrNoSnapshots is returned when the store holds no snapshot. It
	// satisfies errors.Is(err, io/fs.ErrNotExist) too.
	ErrNoSnapshots = fmt.Errorf("no snapshot in the store: %w", iofs.ErrNotExist)
	// ErrConflict is a publish that lost: LATEST no longer names the
	// snapshot the publisher expected. See ConflictError.
	ErrConflict = errors.New("snapshot conflict")
	// ErrCorrupt is a snapshot that failed verification. See CorruptError.
	ErrCorrupt = errors.New("corrupted snapshot")
)

// ConflictError tells the loser of a publish race what happened.
type ConflictError struct {
	ID       string // the snapshot we uploaded; "" if we stopped before uploading
	Expected string // what LATEST named when our tree was taken ("" = nothing)
	Latest   string // what LATEST names now
}

func (e *ConflictError) Error() string {
	msg := fmt.Sprintf("another host published: LATEST names %s, expected %s", orNone(e.Latest), orNone(e.Expected))
	if e.ID != "" {
		msg += fmt.Sprintf("; snapshot %s is in the store but not published", e.ID)
	}
	return msg
}

func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

// CorruptError names a snapshot that failed verification and why.
type CorruptError struct {
	ID  string
	Err error
}

func (e *CorruptError) Error() string        { return fmt.Sprintf("corrupted snapshot %s: %v", e.ID, e.Err) }
func (e *CorruptError) Unwrap() error        { return e.Err }
func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }

func orNone(id string) string {
	if id == "" {
		return "(none)"
	}
	return id
}

// CatalogOptions configures a Catalog. The zero value works.
type CatalogOptions struct {
	// Host names this writer in snapshot ids, manifests and the lease;
	// default os.Hostname.
	Host string
	// Machine is the machine the catalog runs on, recorded in the writer
	// lease it takes and compared with the one it finds held; default
	// LocalMachine(). Tests set another to play another machine.
	Machine Machine
	// Version is the hermesfs version recorded in manifests.
	Version string
	// Logger; nil discards.
	Logger *slog.Logger
	// Now is the clock; nil means time.Now. Tests inject one. It stamps
	// ids and manifests; no lease decision compares it with another
	// host's clock.
	Now func() time.Time
	// Mono is the local monotonic clock: the time elapsed since any fixed
	// origin. nil means the runtime's monotonic clock. The lease holder
	// measures its lease's life on it.
	Mono func() time.Duration
	// OrphanGrace is how old an archive without a manifest must be before
	// Prune deletes it: younger ones may be a publish in progress
	// (default one hour).
	OrphanGrace time.Duration
	// Recipients, if set, encrypt every archive Publish uploads;
	// Identities decrypt encrypted snapshots on Restore; AllowPlaintext
	// lets Publish put a plaintext snapshot over an encrypted LATEST.
	// See encrypt.go.
	Recipients     *crypt.Recipients
	Identities     *crypt.Identities
	AllowPlaintext bool
}

// Catalog is the snapshots of one store prefix. Its methods may be called
// concurrently, also with other hosts' catalogs on the same prefix.
type Catalog struct {
	store Store
	opts  CatalogOptions
	log   *slog.Logger

	mu     sync.Mutex
	lastID string // the newest id this catalog made, to keep ids increasing
	// manifests read by prune, by id (a manifest never changes).
	manifests map[string]Manifest
	// leaseSeen is the lease object's ETag as first seen, and when on
	// Mono: how long it has stayed unchanged.
	leaseSeen struct {
		etag string
		at   time.Duration
	}
	// unconfirmed maps a snapshot id whose move of LATEST failed with an
	// error that may have come after the write landed, and whose check
	// read failed too, to the Expect of that publish. A later publish that
	// expects the same finds LATEST naming one of these: its own snapshot,
	// not another host's (see expected).
	unconfirmed map[string]string
}

// NewCatalog returns the catalog kept in s.
func NewCatalog(s Store, o CatalogOptions) *Catalog {
	if o.Host == "" {
		o.Host, _ = os.Hostname()
	}
	if o.Machine == (Machine{}) {
		o.Machine = LocalMachine()
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.Mono == nil {
		origin := time.Now()
		o.Mono = func() time.Duration { return time.Since(origin) }
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.OrphanGrace <= 0 {
		o.OrphanGrace = time.Hour
	}
	return &Catalog{store: s, opts: o, log: o.Logger}
}

// Store is the store the catalog lives in.
func (c *Catalog) Store() Store { return c.store }

// readLatest returns the id LATEST names and the ETag of the LATEST object
// read; both "" when there is none.
func (c *Catalog) readLatest(ctx context.Context) (id, etag string, err error) {
	rc, info, err := c.store.Get(ctx, LatestKey, 0, 1024)
	if errors.Is(err, iofs.ErrNotExist) {
		return "", "", nil
	}
	if err != nil {
		return "", "", fmt.Errorf("read %s: %w", LatestKey, err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return "", "", fmt.Errorf("read %s: %w", LatestKey, err)
	}
	id = strings.TrimSpace(string(b))
	if err := ValidID(id); err != nil {
		return "", "", fmt.Errorf("%s holds %q, not a snapshot id: %w", LatestKey, b, err)
	}
	return id, info.ETag, nil
}

// LatestID returns the id LATEST names, or "" if there is no LATEST.
func (c *Catalog) LatestID(ctx context.Context) (string, error) {
	id, _, err := c.readLatest(ctx)
	return id, err
}

// Latest returns the manifest of the snapshot LATEST names, or
// ErrNoSnapshots.
func (c *Catalog) Latest(ctx context.Context) (Manifest, error) {
	id, _, err := c.readLatest(ctx)
	if err != nil {
		return Manifest{}, err
	}
	if id == "" {
		return Manifest{}, ErrNoSnapshots
	}
	return c.Manifest(ctx, id)
}

// Manifest reads snapshot id's manifest. A missing or unreadable manifest
// is a CorruptError (the snapshot cannot be verified); a missing one also
// satisfies errors.Is(err, io/fs.ErrNotExist).
func (c *Catalog) Manifest(ctx context.Context, id string) (Manifest, error) {
	if err := ValidID(id); err != nil {
		return Manifest{}, err
	}
	rc, _, err := c.store.Get(ctx, ManifestKey(id), 0, 1<<20)
	if errors.Is(err, iofs.ErrNotExist) {
		return Manifest{}, &CorruptError{ID: id, Err: fmt.Errorf("manifest missing: %w", err)}
	}
	if err != nil {
		return Manifest{}, err
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return Manifest{}, fmt.Errorf("read manifest of %s: %w", id, err)
	}
	var m Manifest
	if err := json.Unmarshal(b, &m); err != nil {
		return Manifest{}, &CorruptError{ID: id, Err: fmt.Errorf("manifest: %w", err)}
	}
	switch {
	case m.ID != id:
		return Manifest{}, &CorruptError{ID: id, Err: fmt.Errorf("manifest names snapshot %q", m.ID)}
	case m.Format > ManifestFormat:
		return Manifest{}, fmt.Errorf("manifest of %s has format %d; this hermesfs reads up to %d: upgrade it", id, m.Format, ManifestFormat)
	case m.Segmented():
		if err := m.checkSegments(); err != nil {
			return Manifest{}, &CorruptError{ID: id, Err: fmt.Errorf("manifest: %w", err)}
		}
		return m, nil
	case len(m.SHA256) != 64 && !(m.SHA256 == "" && m.Format >= manifestFormatHole && m.Lazy()) || m.Size < 0:
		return Manifest{}, &CorruptError{ID: id, Err: errors.New("manifest lacks size or sha256")}
	}
	if err := m.checkChunks(); err != nil {
		return Manifest{}, &CorruptError{ID: id, Err: fmt.Errorf("manifest: %w", err)}
	}
	if m.Archive == "" {
		m.Archive = ArchiveKey(id)
	}
	return m, nil
}

// PublishInput is one snapshot to publish.
type PublishInput struct {
	// Path is the archive file. It is read once to hash it unless SHA256
	// is given, and once to upload it.
	Path string
	// SHA256 (hex) and Size of the archive, if the packer computed them.
	SHA256 string
	Size   int64
	// Parent is recorded in the manifest: the snapshot the tree came from.
	Parent string
	// Expect is what LATEST must still name ("" = no LATEST) for this
	// publish to win; usually the same as Parent. If another host moved
	// LATEST, Publish fails with a ConflictError, before uploading if it
	// can tell then.
	Expect string
	// Files and Compression are recorded in the manifest (Compression
	// defaults to "zstd").
	Files       int64
	Compression string
	// Lease, if set, must still be held when LATEST is about to move.
	Lease *Lease
	// ChunkSize of the chunk digests recorded (default DefaultChunkSize).
	ChunkSize int64
	// Hot is recorded in the manifest (see Manifest.Hot); indexes that
	// name no chunk of this archive are dropped.
	Hot []int64
}

// Published is a published snapshot and what uploading it cost.
type Published struct {
	Manifest
	// Sent is every byte put (for an image: segment, digests, extents
	// list, manifest); Copied the image bytes taken from older segments
	// (PublishImage).
	Sent, Copied int64
	// PublishImage: the new segment's key ("" if the image had no new
	// bytes), its digests object and the extents list as stored, so the
	// publisher can read the image back without asking the store.
	Segment     string
	SegmentSums []byte
	ExtentsList []byte
	// SegmentHeader is the new segment's first bytes when it is
	// encrypted (its age header, up to crypt.HeaderMax), so that the
	// publisher, which keeps the plaintext, can check identities against
	// it later without the store.
	SegmentHeader []byte
}

// Publish uploads the archive whole as one object, then its manifest
// (format 2), then moves LATEST to it with a conditional write against the
// LATEST it read: how snapshots were stored before format 4 (PublishImage).
// hermesfs publishes images; this stays for tools and tests that need a
// store as an older hermesfs left it. A crash or error at any step leaves
// LATEST on the previous complete snapshot. The store should be wrapped in
// WithRetry: Publish itself does not retry.
func (c *Catalog) Publish(ctx context.Context, in PublishInput) (Manifest, error) {
	latest, etag, err := c.readLatest(ctx)
	if err != nil {
		return Manifest{}, fmt.Errorf("publish: %w", err)
	}
	if !c.expected(latest, in.Expect) {
		return Manifest{}, &ConflictError{Expected: in.Expect, Latest: latest}
	}
	enc, cleanup, err := c.sealInput(ctx, latest, &in)
	if err != nil {
		return Manifest{}, fmt.Errorf("publish: %w", err)
	}
	defer cleanup()
	f, err := os.Open(in.Path)
	if err != nil {
		return Manifest{}, fmt.Errorf("publish: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return Manifest{}, fmt.Errorf("publish: %w", err)
	}
	if in.SHA256 != "" && in.Size != st.Size() {
		return Manifest{}, fmt.Errorf("publish: %s has %d bytes, the packer reported %d", in.Path, st.Size(), in.Size)
	}
	cs := cmp64(in.ChunkSize, DefaultChunkSize)
	sum, chunks, n, metaOff, err := fileChunkSums(ctx, in.Path, cs)
	if err != nil {
		return Manifest{}, fmt.Errorf("publish: %w", err)
	}
	if n != st.Size() {
		return Manifest{}, fmt.Errorf("publish: %s changed while it was hashed (%d bytes, then %d)", in.Path, st.Size(), n)
	}
	if in.SHA256 != "" && in.SHA256 != sum {
		return Manifest{}, fmt.Errorf("publish: %s has sha256 %s, the packer reported %s", in.Path, sum, in.SHA256)
	}
	id := c.newID(latest, in.Parent)
	m := Manifest{
		Format:      2,
		ID:          id,
		Created:     c.opts.Now().UTC(),
		Host:        c.opts.Host,
		Parent:      in.Parent,
		Size:        st.Size(),
		SHA256:      sum,
		Compression: cmp(in.Compression, "zstd"),
		Files:       in.Files,
		Version:     c.opts.Version,
		Archive:     ArchiveKey(id),
		Encryption:  enc,

		ChunkSize:  cs,
		Chunks:     chunks,
		MetaOffset: metaOff,
		Hot:        cleanHot(in.Hot, st.Size(), cs),
	}
	if enc != nil {
		// The ciphertext has no squashfs tables to point at, and the hot
		// chunks the session read are the plaintext archive's.
		m.MetaOffset, m.Hot = 0, nil
	}
	info, err := c.store.Put(ctx, m.Archive, f, m.Size, PutOptions{})
	if err != nil {
		return Manifest{}, fmt.Errorf("publish %s: upload archive: %w", id, err)
	}
	if info.Size != m.Size {
		return Manifest{}, fmt.Errorf("publish %s: store holds %d bytes of the %d-byte archive", id, info.Size, m.Size)
	}
	mj, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return Manifest{}, err
	}
	mj = append(mj, '\n')
	if _, err := c.store.Put(ctx, ManifestKey(id), bytes.NewReader(mj), int64(len(mj)), PutOptions{}); err != nil {
		return Manifest{}, fmt.Errorf("publish %s: upload manifest: %w", id, err)
	}
	if in.Lease != nil {
		if err := in.Lease.Err(); err != nil {
			return Manifest{}, fmt.Errorf("publish %s: uploaded but not published: %w", id, err)
		}
	}
	if err := c.moveLatest(ctx, id, in.Expect, latest, etag); err != nil {
		return Manifest{}, err
	}
	c.log.Info("published snapshot", "id", id, "parent", in.Parent, "size", m.Size, "files", m.Files, "encrypted", enc != nil)
	return m, nil
}

// moveLatest points LATEST at id if it still is the object read as prev
// (etag; "" = absent). expect is the publish's PublishInput.Expect.
func (c *Catalog) moveLatest(ctx context.Context, id, expect, prev, etag string) error {
	body := []byte(id + "\n")
	opts := PutOptions{IfMatch: etag, IfNoneMatch: etag == ""}
	_, err := c.store.Put(ctx, LatestKey, bytes.NewReader(body), int64(len(body)), opts)
	if err == nil {
		c.confirmed()
		return nil
	}
	// The write may have landed before the error reached us (a connection
	// reset after the server acted; a retried write that finds its own
	// first attempt and fails its precondition): look, so that a published
	// snapshot is not taken for a failure, nor for another host's.
	now, _, rerr := c.readLatest(ctx)
	switch {
	case rerr == nil && now == id:
		c.confirmed()
		return nil
	case rerr != nil:
		// Nobody knows yet whether LATEST moved: if it did, the next
		// publish that expects what this one did finds it ours.
		c.mu.Lock()
		if c.unconfirmed == nil {
			c.unconfirmed = map[string]string{}
		}
		c.unconfirmed[id] = expect
		c.mu.Unlock()
		return fmt.Errorf("publish %s: move %s: %w; reading it back: %w", id, LatestKey, err, rerr)
	case !errors.Is(err, ErrPrecondition):
		return fmt.Errorf("publish %s: move %s: %w", id, LatestKey, err)
	}
	return &ConflictError{ID: id, Expected: prev, Latest: now}
}

// expected reports whether a publish that expects LATEST to name expect
// may go on over latest, what LATEST names: the same, or a snapshot this
// catalog published over expect without learning that LATEST moved (a
// write whose answer and check were both lost to an outage).
func (c *Catalog) expected(latest, expect string) bool {
	if latest == expect {
		return true
	}
	c.mu.Lock()
	was, ok := c.unconfirmed[latest]
	c.mu.Unlock()
	if ok && was == expect {
		c.log.Info("LATEST names a snapshot of this host whose publish was not confirmed: it was published; the next goes over it",
			"latest", latest, "expected", orNone(expect))
		return true
	}
	return false
}

// confirmed forgets the unconfirmed publishes once LATEST is known to have
// moved past them.
func (c *Catalog) confirmed() {
	c.mu.Lock()
	c.unconfirmed = nil
	c.mu.Unlock()
}

func cmp(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

const idTimeLayout = "20060102T150405.000Z"

// newID makes an id later than every id it knows of: the clock may be
// behind another host's, but a snapshot must sort after its parent.
func (c *Catalog) newID(known ...string) string {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := c.opts.Now().UTC().Truncate(time.Millisecond)
	for _, k := range append(known, c.lastID) {
		if kt, err := IDTime(k); err == nil && !t.After(kt) {
			t = kt.Add(time.Millisecond)
		}
	}
	var rnd [4]byte
	rand.Read(rnd[:])
	id := t.Format(idTimeLayout) + "-" + sanitizeHost(c.opts.Host) + "-" + hex.EncodeToString(rnd[:])
	c.lastID = id
	return id
}

// sanitizeHost keeps an id to [a-z0-9-] and at most 40 bytes of host.
func sanitizeHost(h string) string {
	b := []byte(strings.ToLower(h))
	for i, ch := range b {
		if !(ch >= 'a' && ch <= 'z' || ch >= '0' && ch <= '9' || ch == '-') {
			b[i] = '-'
		}
	}
	s := strings.Trim(string(b[:min(len(b), 40)]), "-")
	if s == "" {
		s = "host"
	}
	return s
}

// IDTime is the creation time encoded at the start of a snapshot id.
// Ids sort bytewise in creation order.
func IDTime(id string) (time.Time, error) {
	if len(id) < len(idTimeLayout) {
		return time.Time{}, fmt.Errorf("snapshot id %q: too short", id)
	}
	return time.Parse(idTimeLayout, id[:len(idTimeLayout)])
}

// ValidID checks that id has the shape of a snapshot id
// (20261122T134501.123Z-host-1a2b3c4d), so it cannot name other keys.
func ValidID(id string) error {
	if _, err := IDTime(id); err != nil {
		return fmt.Errorf("invalid snapshot id %q", id)
	}
	rest := id[len(idTimeLayout):]
	if len(id) > 100 || len(rest) < 2 || rest[0] != '-' || strings.ContainsAny(rest, "/. \t\n") {
		return fmt.Errorf("invalid snapshot id %q", id)
	}
	return nil
}

// Snapshot is one entry of the catalog's listing.
type Snapshot struct {
	Manifest
	// Latest marks the snapshot LATEST names.
	Latest bool
	// Incomplete: the manifest, or the archive or extents list it
	// describes, is missing (a publish in progress, or one that crashed).
	Incomplete bool
	// ModTime is when the archive (else the extents list, else the
	// manifest) was stored.
	ModTime time.Time
	// Err is set if the manifest could not be read.
	Err error
}

type objects struct {
	archive, manifest, extents *ObjectInfo
}

// complete: a manifest and the image it describes (a whole archive, or an
// extents list).
func (o *objects) complete() bool {
	return o.manifest != nil && (o.archive != nil || o.extents != nil)
}

// stored is when the snapshot's first object was stored, as listed.
func (o *objects) stored() time.Time {
	for _, x := range []*ObjectInfo{o.archive, o.extents, o.manifest} {
		if x != nil {
			return x.ModTime
		}
	}
	return time.Time{}
}

// scan lists the snapshot keys by id.
func (c *Catalog) scan(ctx context.Context) (map[string]*objects, error) {
	byID := map[string]*objects{}
	err := c.store.List(ctx, SnapshotsPrefix, func(o ObjectInfo) error {
		name := strings.TrimPrefix(o.Key, SnapshotsPrefix)
		var id string
		var slot func(*objects) **ObjectInfo
		switch {
		case strings.HasSuffix(name, ArchiveExt):
			id, slot = strings.TrimSuffix(name, ArchiveExt), func(x *objects) **ObjectInfo { return &x.archive }
		case strings.HasSuffix(name, ManifestExt):
			id, slot = strings.TrimSuffix(name, ManifestExt), func(x *objects) **ObjectInfo { return &x.manifest }
		case strings.HasSuffix(name, ExtentsExt):
			id, slot = strings.TrimSuffix(name, ExtentsExt), func(x *objects) **ObjectInfo { return &x.extents }
		default:
			return nil
		}
		if ValidID(id) != nil {
			return nil
		}
		if byID[id] == nil {
			byID[id] = &objects{}
		}
		*slot(byID[id]) = &o
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	return byID, nil
}

// Snapshots lists the catalog, newest first.
func (c *Catalog) Snapshots(ctx context.Context) ([]Snapshot, error) {
	latest, _, err := c.readLatest(ctx)
	if err != nil {
		return nil, err
	}
	byID, err := c.scan(ctx)
	if err != nil {
		return nil, err
	}
	ids := sortedIDs(byID)
	out := make([]Snapshot, len(ids))
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for i, id := range ids {
		o := byID[id]
		s := &out[i]
		s.ID, s.Latest, s.Incomplete = id, id == latest, !o.complete()
		s.ModTime = o.stored()
		if o.archive != nil {
			s.Size = o.archive.Size
		}
		if o.manifest == nil {
			continue
		}
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			m, err := c.Manifest(ctx, id)
			if err != nil {
				s.Err = err
				return
			}
			s.Manifest = m
		})
	}
	wg.Wait()
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// sortedIDs returns the ids newest first.
func sortedIDs(byID map[string]*objects) []string {
	ids := make([]string, 0, len(byID))
	for id := range byID {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	slices.Reverse(ids)
	return ids
}
