// Package uploader keeps snapshot archives in an object store: the Store
// interface and its local-directory implementation (S3 lives in
// uploader/s3), the retry decorator, and the snapshot catalog built on any
// Store.
//
// # Stores
//
// A Store is five operations on whole objects: Put (atomic: readers see the
// old object or the new one), Get of a byte range, Stat, List in key order,
// Delete. Put takes conditions (create-only, or match an ETag) that the
// store checks atomically with the write; they are what makes the LATEST
// pointer and the lease safe between hosts. Errors use the standard
// sentinels: errors.Is(err, io/fs.ErrNotExist) for a missing key,
// ErrPrecondition for a failed condition, and IsPermanent for errors a
// retry cannot fix.
//
// Cross-cutting behaviour wraps a Store instead of living in one: WithRetry
// retries transient failures with capped exponential backoff and jitter,
// rewinds seekable Put bodies, and resumes broken Get bodies by range.
// Each request is retried on its own; the S3 store disables the SDK's
// retries so the two never multiply.
//
// # Composed puts
//
// Composer is an optional capability: put an object whose byte ranges are
// copies of ranges of other objects in the store, so that the store copies
// them instead of receiving them: how --standalone stores a snapshot's
// whole image from its segments. The S3 store implements it as a
// multipart upload whose parts are either UploadPartCopy of a range of a
// source (conditional on the source's ETag, x-amz-copy-source-if-match)
// or bytes sent from the local reader. S3 wants every part but the last
// to be at least 5 MiB: copy ranges shorter than that are sent, and a gap
// to send that is shorter takes bytes from the next copy range (always
// correct: the local reader holds every byte). A copied part's ETag, the
// MD5 of its bytes on S3 and the servers like it, is checked against the
// MD5 of the local bytes unless the range is Unchecked. The local store
// copies Unchecked ranges from its own files; WithRetry reports
// errors.ErrUnsupported for stores that cannot compose.
package uploader

// # The catalog
//
// A Catalog keeps snapshots under a store prefix (format 4):
//
//	snapshots/<id>.json     its Manifest: id, created, host, parent, image size,
//	                        compression, file count, version, segments, extents sha256
//	snapshots/<id>.extents  the image as extents, one "segment offset length" a line
//	segments/<id>.seg[.age] the segment snapshot id uploaded (immutable)
//	<segment>.sums          the segment's chunk digests
//	LATEST                  the id of the newest published snapshot, one line
//	lease                   the writer lease (JSON), see AcquireLease
//
// and reads the format 1 to 3 snapshots older versions left
// (snapshots/<id>.sqfs, one archive object each), which format 4 images
// use as segments.
//
// Ids look like 20261122T134501.123Z-host-1a2b3c4d: bytewise order is
// creation order, the random tail keeps hosts apart, and a new id always
// sorts after the LATEST it builds on even if this host's clock is behind.
//
// PublishImage uploads the snapshot's new segment, its digests, the
// extents list and the manifest, each create-only, then moves LATEST with a
// conditional put against the LATEST object it read (create-only if there
// was none). A crash at any step leaves LATEST on a complete snapshot and
// at worst objects no manifest names, which PruneWith collects; the loser
// of a race gets a ConflictError naming both snapshots. Restore writes the
// image LATEST names to a local file through the image reader it is given
// (package image), every chunk checked against its segment's digests, and
// on damage (or a failed caller-supplied Verify) reports a CorruptError
// naming the snapshot and falls back to the newest older snapshot that
// verifies, logging loudly and listing what it skipped. PruneWith applies a
// tiered RetentionPolicy (restic's keep-last/hourly/daily/weekly/monthly/
// yearly/within) and never touches LATEST, anything newer, or the writer
// lease's base; it deletes a manifest before the objects its image is made
// of, and a segment only once no manifest left names it (prune.go).
//
// # Encryption
//
// With CatalogOptions.Recipients, every segment PublishImage uploads is
// one age file (package crypt), and an image uses only encrypted segments
// (the daemon copies what it would take from plaintext ones into the new
// segment). The manifest says so (Encryption: scheme and recipient types,
// no key); extents address the segments' plaintext. A snapshot the
// identities do not open is a KeyError, which stops a restore, while a
// damaged one is corrupt and falls back. See encrypt.go.
//
// # How the daemon uses it
//
//	store, _ := storeurl.Open(ctx, url, ...)            // local or S3
//	store = uploader.WithRetry(store, policy, logger)
//	cat := uploader.NewCatalog(store, uploader.CatalogOptions{Host: host, Version: v, Logger: logger})
//	lease, err := cat.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount " + dir, StateDir: stateDir})
//	                                                    // ErrLeaseHeld: another host writes here
//	m, err := cat.Latest(ctx)                           // ErrNoSnapshots: first boot
//	lease.SetBase(m.ID)                                 // prune on any host keeps it
//	im, err := pool.Open(ctx, m, nil)                   // package image: the lower layer
//	p, err := cat.PublishImage(ctx, uploader.ImageInput{Segment: next, Extents: ext,
//	        Sources: []uploader.Manifest{m}, Parent: m.ID, Expect: m.ID, Files: files, Lease: lease})
//	                                                    // ErrConflict: another host published; stop
//	                                                    // p.Sent: what the upload cost
//	cat.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.DefaultRetention()})
//	<-lease.Lost()                                      // taken over: stop publishing
//	lease.Release(ctx)                                  // at shutdown, after the last publish
//
// Status pages read cat.Latest, cat.Snapshots and cat.ReadLease.
