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
package uploader
