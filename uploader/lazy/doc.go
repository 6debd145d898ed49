// Package lazy reads a store object on demand: an io.ReaderAt over one
// archive in a store, backed by a sparse local cache file, so that a mount
// can be ready after the archive's metadata arrived and fetch data blocks as
// they are read.
//
// # Chunks and trust
//
// The object is cut into aligned chunks of the manifest's chunk size. A
// chunk is fetched with one ranged Get and checked against its sha256 from
// the manifest before it is written to the cache or handed to any reader;
// bytes that fail the check are never served, and the error names the
// chunk, the key and the cause (a digest mismatch, the object's ETag
// changing, the store failing). A failed fetch is retried with the store
// backoff until Options.ReadTimeout has passed since the read began (or
// until the chunk arrived damaged three times in a row); then that read
// fails with an error that satisfies errors.Is(err, syscall.EIO), logged
// once per chunk until the chunk arrives, and the next read tries again.
// A store that says the object does not exist is not asked again: keys
// are never reused, so a missing object (a segment whose snapshots were
// pruned under the reader) fails the read at once with a
// *uploader.SegmentGoneError (also EIO), and the fill stops.
//
// An object without chunk digests (Options.NoDigests: the archive of a
// format 1 snapshot) is read in chunks of the size given and nothing is
// checked per chunk: the archive reader above checks each block it reads
// against the archive's own checksums, and a complete cache against the
// whole sha256.
//
// # The cache on disk
//
// While incomplete, the cache is Path+".partial" (sparse, the object's
// size) and Path+".present", an append-only log of the chunk indexes whose
// bytes are in the partial file. Records are written only after the data
// they vouch for has been fsynced, and the log is fsynced in turn: a crash
// or power loss can lose chunks (they are fetched again) but never mark
// absent bytes present. Chunks listed by a log from an earlier run are
// checked against their digest the first time they are read, and fetched
// again if they changed on disk. When every chunk is present the whole file's sha256
// is checked against the manifest's, the partial file is renamed to Path
// and the log removed: the cache is then exactly what a full download
// leaves.
//
// # A bounded cache
//
// Readers given one Budget (hermesfs browse: a reader per segment of every
// snapshot entered) keep at most its bytes in their cache files together.
// A chunk is charged before it is written; when the readers hold more, the
// least recently used chunks of any of them are evicted: marked absent
// and punched out of the sparse file (fallocate PUNCH_HOLE), so a later
// read fetches them again, checked like any miss. Reads and writes of a
// chunk in the file pin it, and eviction passes over pinned chunks. Such a
// cache is temporary: no present log (it would have to record absence),
// no fill, and Close removes the file.
//
// # Scheduling
//
// Reads that miss (on demand) fetch a chunk per request from their own
// pool of in-flight requests. The background fill (Fill) has a smaller
// pool, and each of its requests is one ranged Get of a run of absent
// chunks (up to Options.FillSpan): the body is read a chunk at a time into
// a buffer the fill reuses, and each chunk is checked against its digest,
// written and marked present as it arrives, so a fill holds no more than a
// chunk per request in memory and a damaged chunk costs only itself (it is
// fetched again later). The fill fetches the hot set first (see below,
// at most uploader.HotLimit chunks of Options.Hot). After it, for a while
// after a sequential read (see below), the fill follows it: its next
// requests start at the first absent chunk after that read, so a file read
// from start to end gets the fill's requests as its read-ahead, and the
// fill does not hold back for that read's misses. Otherwise on-demand
// misses go first, over the hot set too (it is a guess at what reads will
// want, a waiting read is a fact): the fill issues no new request while
// misses wait, and its requests in flight stop reading their bodies
// between chunks while an on-demand fetch is in the store, so that the
// link's flow control gives the bandwidth to the miss; they go on when it
// is done. A miss on a chunk that a fill request is about to deliver
// waits for it, briefly (then fetches it itself too, and takes whichever
// comes first); a miss on a chunk further on in a fill request, or in a
// paused one, fetches it at once: a miss never queues behind fill
// requests. Concurrent misses on one chunk share one request. A sequential
// read, one that starts exactly where the previous read ended and ends a
// run of such reads that covers a chunk's bytes, also starts fetching the
// next few chunks (read-ahead) from a third, small pool; reads merely
// further on, in the same chunk, or a short run are not sequential (a
// mount's first metadata reads would otherwise send read-ahead and the
// fill ahead of the hot set). When the cache disk fails a write (full,
// say), the fill stops and reads are served from the fetched bytes in
// memory, never from a partly written file.
//
// # Hot set
//
// The reader records the chunk indexes first read after it opened
// (HotRecorder), in first-read order: what a startup reads. The recording
// ends at uploader.HotLimit chunks (a byte bound), at a scan (reads in the
// archive's order that cover scanBytes: tar, grep -r, a backup; the scan's
// own chunks are taken out again), or when the window passes; Fill
// fetches Options.Hot first. HotFiles turns the chunks recorded into the
// file bytes they hold in the archive read, and those into the chunks of
// each new archive holding them, for its manifest.
package lazy
