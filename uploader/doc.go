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
// copies of ranges of another object in the store, so that the store copies
// them instead of receiving them. A snapshot archive packed on the previous
// one (package archive, "Snapshots that cost what changed") shares almost
// all its bytes with it; composed, it costs the upload of what changed.
// The S3 store implements it as a multipart upload whose parts are either
// UploadPartCopy of a range of the source (conditional on the source's
// ETag, x-amz-copy-source-if-match) or bytes sent from the local file.
// S3 wants every part but the last to be at least 5 MiB: copy ranges
// shorter than that are sent, and a gap to send that is shorter takes
// bytes from the next copy range (always correct: the local file holds
// every byte), so a composed put sends at least the first 5 MiB (the new
// superblock is at offset 0). Each copied part's ETag, the MD5 of its bytes
// on S3 and the servers like it, is checked against the MD5 of the local
// bytes: the object is verified as it is assembled, not trusted. The local
// store does not compose (a local copy costs what a write costs), and
// WithRetry reports errors.ErrUnsupported for stores that do not.
package uploader

// # The catalog
//
// A Catalog keeps snapshots under a store prefix:
//
//	snapshots/<id>.sqfs   the archive: one standard squashfs file per snapshot
//	snapshots/<id>.json   its Manifest: id, created, host, parent, size, sha256,
//	                      compression, file count, hermesfs version
//	LATEST                the id of the newest published snapshot, one line
//	lease                 the writer lease (JSON), see AcquireLease
//
// Ids look like 20261122T134501.123Z-host-1a2b3c4d: bytewise order is
// creation order, the random tail keeps hosts apart, and a new id always
// sorts after the LATEST it builds on even if this host's clock is behind.
//
// Publish uploads the archive, then the manifest, then moves LATEST with a
// conditional put against the LATEST object it read (create-only if there
// was none). Given a Delta (the archive's copy map against an earlier
// snapshot), it composes the archive from that snapshot's archive when the
// store can (Composer) and the source is in the store with the size its
// manifest records; anything going wrong on that path (source pruned or
// replaced, copied bytes not matching, a store that cannot) falls back to
// a plain upload. The manifest's sha256 is always the local archive's, and
// Restore checks it against what it downloads, so a composed archive is
// verified end to end like any other.
//
// A crash at any step of a publish leaves LATEST on a complete snapshot;
// the loser of a race gets a ConflictError naming both snapshots, and its
// upload stays in the store. Restore downloads the archive LATEST names
// into a local file while hashing it, and on a size or sha256 mismatch (or
// a failed caller-supplied Verify) reports a CorruptError naming the
// snapshot and falls back to the newest older snapshot that verifies,
// logging loudly and listing what it skipped. PruneWith applies a tiered
// RetentionPolicy (restic's keep-last/hourly/daily/weekly/monthly/yearly/
// within) and never touches LATEST, anything newer, or the writer lease's
// base; it deletes a manifest before its archive, so no manifest ever
// names a missing archive.
//
// # Encryption
//
// With CatalogOptions.Recipients, Publish stores the age encryption of
// the archive (package crypt) and uploads it whole: a fresh file key per
// object leaves nothing to copy from the previous one. The manifest says
// so (Encryption: scheme and recipient types, no key) and its size and
// sha256 are the ciphertext's. Restore decrypts while it downloads; a
// snapshot the identities do not open is a KeyError, which stops the
// restore, while a damaged one is corrupt and falls back. See encrypt.go.
//
// # How the daemon uses it
//
//	store, _ := storeurl.Open(ctx, url, ...)            // local or S3
//	store = uploader.WithRetry(store, policy, logger)
//	cat := uploader.NewCatalog(store, uploader.CatalogOptions{Host: host, Version: v, Logger: logger})
//	lease, err := cat.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount " + dir, StateDir: stateDir})
//	                                                    // ErrLeaseHeld: another host writes here
//	res, err := cat.Restore(ctx, stateDir+"/base.sqfs", uploader.RestoreOptions{Verify: archiveVerify})
//	                                                    // ErrNoSnapshots: first boot; res.Skipped: warn
//	p, err := cat.PublishReport(ctx, uploader.PublishInput{Path: packed, SHA256: sum, Size: n,
//	        Parent: base, Expect: base, Files: files, Lease: lease,
//	        Delta: &uploader.Delta{Source: base, Ranges: copies}})
//	                                                    // ErrConflict: another host published; stop
//	                                                    // p.Sent, p.Copied: what the upload cost
//	base = p.ID
//	lease.SetBase(base)                                 // prune on any host keeps it
//	cat.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.DefaultRetention()})
//	<-lease.Lost()                                      // taken over: stop publishing
//	lease.Release(ctx)                                  // at shutdown, after the last publish
//
// Status pages read cat.Latest, cat.Snapshots and cat.ReadLease.
