package uploader

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"slices"
)

// RestoreOptions tunes Restore.
type RestoreOptions struct {
	// ID is the snapshot to restore; "" means the newest good one.
	ID string
	// Verify, if set, checks the downloaded archive further (every block,
	// say) after its size and sha256 matched; an error marks the snapshot
	// corrupt, with the same fallback as a hash mismatch. f is the
	// temporary file, complete; read it with ReadAt.
	Verify func(ctx context.Context, f *os.File, m Manifest) error
	// Progress, if set, is called as bytes arrive (from the calling
	// goroutine), with the archive's total size.
	Progress func(done, total int64)
	// Image opens the image of a format 4 snapshot (package image, over a
	// cache directory): required to restore one. Its reads are checked
	// chunk by chunk against the segments' digests; a read that finds
	// damage fails with an error satisfying errors.Is(err, ErrCorrupt).
	Image func(ctx context.Context, m Manifest) (ImageReader, error)
}

// ImageReader is a snapshot image being read (package image's Image).
type ImageReader interface {
	io.ReaderAt
	Size() int64
	Close() error
}

// RestoreResult says what Restore fetched.
type RestoreResult struct {
	Manifest Manifest
	// Skipped holds a *CorruptError for each newer snapshot that failed
	// verification and was passed over, newest first. Non-empty means the
	// restored tree is older than the newest published one: tell the user.
	Skipped []error
	// NoLatest is set when LATEST was missing and the newest manifest was
	// used instead.
	NoLatest bool
	// SHA256 (hex) is the file written: the manifest's for a plaintext
	// snapshot, the decrypted archive's for an encrypted one.
	SHA256 string
}

// Restore downloads a snapshot's archive to the file dst (written to a
// temporary file beside it and renamed into place only once verified),
// checking its size and sha256 against the manifest while it streams.
//
// With no ID it starts from the snapshot LATEST names, or, if there is no
// LATEST, from the newest manifest. A corrupt snapshot (hash mismatch,
// missing or unreadable manifest or archive, Verify failure) is logged as
// an error and skipped for the next older one; the skipped ones are in the
// result. With an ID, that snapshot or an error. An error that is not
// corruption (the network, the disk) stops the restore: falling back then
// would silently hand out older data. A store without snapshots returns
// ErrNoSnapshots.
func (c *Catalog) Restore(ctx context.Context, dst string, o RestoreOptions) (RestoreResult, error) {
	var res RestoreResult
	if o.ID != "" {
		m, sum, err := c.fetch(ctx, o.ID, dst, o)
		res.Manifest, res.SHA256 = m, sum
		return res, err
	}
	latest, _, err := c.readLatest(ctx)
	if err != nil {
		return res, fmt.Errorf("restore: %w", err)
	}
	byID, err := c.scan(ctx)
	if err != nil {
		return res, fmt.Errorf("restore: %w", err)
	}
	var candidates []string
	if latest != "" {
		candidates = append(candidates, latest)
	}
	for _, id := range sortedIDs(byID) {
		if byID[id].manifest == nil {
			continue // no manifest: never published
		}
		if latest == "" || id < latest {
			candidates = append(candidates, id)
		}
	}
	if latest == "" && len(candidates) > 0 {
		res.NoLatest = true
		c.log.Warn("the store has no LATEST; restoring the newest snapshot with a manifest", "id", candidates[0])
	}
	if len(candidates) == 0 {
		return res, ErrNoSnapshots
	}
	for _, id := range candidates {
		m, sum, err := c.fetch(ctx, id, dst, o)
		if err == nil {
			res.Manifest, res.SHA256 = m, sum
			if len(res.Skipped) > 0 {
				c.log.Error("restored an OLDER snapshot because newer ones are corrupt", "id", id, "skipped", len(res.Skipped), "newest_corrupt", res.Skipped[0])
			}
			return res, nil
		}
		if !errors.Is(err, ErrCorrupt) {
			return res, fmt.Errorf("restore %s: %w", id, err)
		}
		c.log.Error("snapshot failed verification; trying the previous one", "id", id, "err", err)
		res.Skipped = append(res.Skipped, err)
	}
	return res, fmt.Errorf("restore: every snapshot failed verification: %w", errors.Join(res.Skipped...))
}

// fetch downloads and verifies one snapshot into dst.
// The second result is the sha256 of the file written (see
// RestoreResult.SHA256).
func (c *Catalog) fetch(ctx context.Context, id, dst string, o RestoreOptions) (m Manifest, sum string, err error) {
	m, err = c.Manifest(ctx, id)
	if err != nil {
		return Manifest{}, "", err
	}
	if m.Encryption != nil && c.opts.Identities == nil {
		// Nothing could decrypt it: say so before downloading.
		_, err := c.decryptTo(ctx, m, nil, nil, nil)
		return m, "", err
	}
	if m.Segmented() {
		sum, err := c.fetchImage(ctx, m, dst, o)
		return m, sum, err
	}
	rc, info, err := c.store.Get(ctx, m.Archive, 0, -1)
	if errors.Is(err, iofs.ErrNotExist) {
		return m, "", &CorruptError{ID: id, Err: fmt.Errorf("archive %s missing", m.Archive)}
	}
	if err != nil {
		return m, "", fmt.Errorf("download %s: %w", m.Archive, err)
	}
	defer rc.Close()
	if info.Size != m.Size {
		return m, "", &CorruptError{ID: id, Err: fmt.Errorf("archive has %d bytes, manifest says %d", info.Size, m.Size)}
	}
	tmp, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+".tmp-*")
	if err != nil {
		return m, "", fmt.Errorf("restore %s: %w", id, err)
	}
	keep := false
	defer func() {
		if !keep {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	h := sha256.New()
	if m.Encryption != nil {
		var src io.Reader = rc
		if o.Progress != nil {
			src = io.TeeReader(rc, &progressWriter{w: io.Discard, total: m.Size, fn: o.Progress})
		}
		if sum, err = c.decryptTo(ctx, m, src, tmp, h); err != nil {
			return m, "", err
		}
	} else {
		var w io.Writer = io.MultiWriter(tmp, h)
		var cv *chunkVerifier
		if m.SHA256 == "" {
			// No whole-archive sha256 (see Manifest.SHA256): every chunk
			// is checked instead.
			cv = newChunkVerifier(m)
			w = io.MultiWriter(tmp, h, cv)
		}
		if o.Progress != nil {
			w = &progressWriter{w: w, total: m.Size, fn: o.Progress}
		}
		n, err := io.CopyBuffer(w, &ctxReader{ctx: ctx, r: rc}, make([]byte, copyBufSize))
		if err != nil {
			return m, "", fmt.Errorf("download %s: %w", m.Archive, err)
		}
		if n != m.Size {
			return m, "", &CorruptError{ID: id, Err: fmt.Errorf("archive has %d bytes, manifest says %d", n, m.Size)}
		}
		sum = hex.EncodeToString(h.Sum(nil))
		if cv != nil {
			if err := cv.Close(); err != nil {
				return m, "", &CorruptError{ID: id, Err: err}
			}
		} else if sum != m.SHA256 {
			return m, "", &CorruptError{ID: id, Err: fmt.Errorf("archive sha256 is %s, manifest says %s", sum, m.SHA256)}
		}
	}
	if o.Verify != nil {
		if err := o.Verify(ctx, tmp, m); err != nil {
			if ctx.Err() != nil {
				return m, "", err
			}
			return m, "", &CorruptError{ID: id, Err: err}
		}
	}
	if err := tmp.Sync(); err != nil {
		return m, "", fmt.Errorf("restore %s: %w", id, err)
	}
	if err := tmp.Close(); err != nil {
		return m, "", fmt.Errorf("restore %s: %w", id, err)
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return m, "", fmt.Errorf("restore %s: %w", id, err)
	}
	keep = true
	if err := SyncDir(filepath.Dir(dst)); err != nil {
		return m, "", fmt.Errorf("restore %s: %w", id, err)
	}
	return m, sum, nil
}

// fetchImage writes the image of format 4 snapshot m to dst, read
// through o.Image; the result is its sha256.
func (c *Catalog) fetchImage(ctx context.Context, m Manifest, dst string, o RestoreOptions) (string, error) {
	if o.Image == nil {
		return "", fmt.Errorf("restore %s: a snapshot stored as extents needs an image reader", m.ID)
	}
	im, err := o.Image(ctx, m)
	if err != nil {
		return "", err
	}
	defer im.Close()
	if im.Size() != m.Size {
		return "", &CorruptError{ID: m.ID, Err: fmt.Errorf("image has %d bytes, manifest says %d", im.Size(), m.Size)}
	}
	return writeVerified(ctx, m, dst, o, func(w io.Writer) error {
		var pw io.Writer = w
		if o.Progress != nil {
			pw = &progressWriter{w: w, total: m.Size, fn: o.Progress}
		}
		_, err := io.CopyBuffer(pw, ContextReader(ctx, io.NewSectionReader(im, 0, m.Size)), make([]byte, 8<<20))
		return err
	})
}

// writeVerified writes dst atomically with what fill writes (hashing it),
// then runs o.Verify on it; the result is the sha256 of what was written.
func writeVerified(ctx context.Context, m Manifest, dst string, o RestoreOptions, fill func(io.Writer) error) (string, error) {
	tmp, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+".tmp-*")
	if err != nil {
		return "", fmt.Errorf("restore %s: %w", m.ID, err)
	}
	keep := false
	defer func() {
		if !keep {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	h := sha256.New()
	if err := fill(io.MultiWriter(tmp, h)); err != nil {
		if errors.Is(err, ErrCorrupt) {
			return "", &CorruptError{ID: m.ID, Err: err}
		}
		return "", fmt.Errorf("restore %s: %w", m.ID, err)
	}
	if o.Verify != nil {
		if err := o.Verify(ctx, tmp, m); err != nil {
			if ctx.Err() != nil {
				return "", err
			}
			return "", &CorruptError{ID: m.ID, Err: err}
		}
	}
	if err := tmp.Sync(); err != nil {
		return "", fmt.Errorf("restore %s: %w", m.ID, err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("restore %s: %w", m.ID, err)
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", fmt.Errorf("restore %s: %w", m.ID, err)
	}
	keep = true
	if err := SyncDir(filepath.Dir(dst)); err != nil {
		return "", fmt.Errorf("restore %s: %w", m.ID, err)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

type progressWriter struct {
	w     io.Writer
	done  int64
	total int64
	fn    func(done, total int64)
}

func (p *progressWriter) Write(b []byte) (int, error) {
	n, err := p.w.Write(b)
	p.done += int64(n)
	p.fn(p.done, p.total)
	return n, err
}

// SkippedIDs returns the ids of the corrupt snapshots a restore skipped.
func (r RestoreResult) SkippedIDs() []string {
	var ids []string
	for _, err := range r.Skipped {
		if ce, ok := errors.AsType[*CorruptError](err); ok {
			ids = append(ids, ce.ID)
		}
	}
	return slices.Clip(ids)
}
