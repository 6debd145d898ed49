package daemon

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// Lazy boot of an encrypted snapshot.
//
// The store object is an age file; its chunk digests in the manifest are
// the ciphertext's. The lazy reader fetches and verifies ciphertext chunks
// into cache/<id>.sqfs.age.partial (its present log beside it), and the
// mount and the packer read the plaintext through age's decrypting
// ReaderAt over it, which authenticates every 64 KiB age chunk before a
// byte of it is used. Boot fetches the header (the first chunk) and the
// final chunk (which authenticates the size) first, then the chunks that
// hold the squashfs metadata tail, located from the plaintext superblock.
//
// Once the fill is complete and the whole object's sha256 matched, the
// lazy reader renames it to cache/<id>.sqfs.age; it is then decrypted into
// cache/<id>.sqfs (a temporary file renamed into place), state.json records
// that file's sha256 as the base's, and the ciphertext file goes: the
// cache ends up exactly as a full download leaves it, so the cache checks,
// the packer, verify and the next boot see a plaintext archive as always.
// A crash before that step leaves the complete ciphertext, which the next
// boot checks against the manifest and decrypts again.

// isKeyError reports an encrypted snapshot the identities at hand cannot
// open: a boot stops there (exit 6) rather than download it.
func isKeyError(err error) bool {
	_, ok := errors.AsType[*uploader.KeyError](err)
	return ok
}

// plainReader is the plaintext of an encrypted archive: decrypted from
// the lazy reader, and once the complete archive was decrypted into the
// cache, read from that file (the same bytes, without the decryption).
type plainReader struct {
	dec  io.ReaderAt
	n    int64
	file atomic.Pointer[os.File]
}

func (p *plainReader) Size() int64 { return p.n }

func (p *plainReader) ReadAt(b []byte, off int64) (int, error) {
	if f := p.file.Load(); f != nil {
		return f.ReadAt(b, off)
	}
	return p.dec.ReadAt(b, off)
}

// useFile makes reads go to the plaintext file at path.
func (p *plainReader) useFile(path string) {
	f, err := os.Open(path)
	if err != nil {
		return // the decryption keeps serving
	}
	if fi, err := f.Stat(); err != nil || fi.Size() != p.n || !p.file.CompareAndSwap(nil, f) {
		f.Close()
	}
}

// Close closes the plaintext file, if reads went there.
func (p *plainReader) Close() error {
	if f := p.file.Swap(nil); f != nil {
		return f.Close()
	}
	return nil
}

// openLazyEncrypted opens encrypted snapshot m lazily: ciphertext cached at
// path+".age", plaintext served through the decryption.
func (a *catalogAdapter) openLazyEncrypted(ctx context.Context, m uploader.Manifest, path string, o lazyOptions) (*lazyOpen, error) {
	if m.Encryption.Scheme != crypt.Scheme {
		return nil, fmt.Errorf("snapshot %s is encrypted with %q; this hermesfs knows %q", m.ID, m.Encryption.Scheme, crypt.Scheme)
	}
	if a.ids == nil {
		// Nothing to try: no need to fetch a byte.
		return nil, CryptError(&uploader.KeyError{ID: m.ID, Err: &crypt.KeyError{Types: m.Encryption.RecipientTypes, Err: crypt.ErrNoIdentity}})
	}
	agePath := path + ".age"
	if fileExists(agePath) {
		// A fill completed before a crash stopped its decryption: the
		// lazy reader trusts a complete file, so check it first.
		if ok, _ := fileHasSHA256(agePath, m.SHA256); !ok {
			os.Remove(agePath)
		}
	}
	fresh := !fileExists(agePath) && !fileExists(agePath+".partial")
	if o.Ctx == nil {
		o.Ctx = context.Background()
	}
	var once sync.Once
	src := &plainReader{n: -1}
	finish := func(string) {
		once.Do(func() {
			t0 := time.Now()
			sum, err := decryptCache(o.Ctx, agePath, path, a.ids)
			if err != nil {
				if o.Ctx.Err() == nil && o.Logger != nil {
					o.Logger.Error("cannot decrypt the complete archive into the cache; the next start decrypts it", "path", agePath, "err", err)
				}
				return
			}
			if o.Logger != nil {
				o.Logger.Info("decrypted the complete archive into the cache", "path", path, "took", time.Since(t0).Round(time.Millisecond))
			}
			src.useFile(path)
			if o.OnComplete != nil {
				o.OnComplete(sum)
			}
		})
	}
	r, err := lazy.Open(lazy.Options{
		Store: a.c.Store(), Key: m.Archive, Size: m.Size, ChunkSize: m.ChunkSize, Chunks: m.Chunks, SHA256: m.SHA256,
		Path: agePath, ReadTimeout: o.ReadTimeout, Logger: o.Logger, OnComplete: finish,
	})
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*lazyOpen, error) {
		r.Close()
		if fresh {
			// A refused boot leaves the state dir as it found it.
			os.Remove(agePath + ".partial")
			os.Remove(agePath + ".present")
			os.Remove(agePath + ".etag")
		}
		return nil, err
	}
	// What opening the age file reads: the header and the final chunk.
	var wg sync.WaitGroup
	var e1, e2 error
	wg.Go(func() { e1 = r.Prefetch(ctx, 0, min(m.ChunkSize, m.Size)) })
	wg.Go(func() { e2 = r.Prefetch(ctx, m.Size-1, m.Size) })
	wg.Wait()
	if err := errors.Join(e1, e2); err != nil {
		return fail(fmt.Errorf("fetch the archive's header: %w", err))
	}
	plain, n, err := crypt.Open(r, m.Size, a.ids)
	if err != nil {
		return fail(LazyCryptError(m, err))
	}
	ps, err := crypt.PayloadStart(io.NewSectionReader(r, 0, m.Size))
	if err != nil {
		return fail(&uploader.CorruptError{ID: m.ID, Err: err})
	}
	// A plaintext file left by a crash before state.json vouched for it
	// is made again from the verified ciphertext.
	os.Remove(path)
	src.dec, src.n = plain, n
	metaOff := uploader.SquashfsMetaOffset(src, n)
	if metaOff <= 0 {
		metaOff = max(n-1, 0)
	}
	start, _ := crypt.CiphertextRange(ps, m.Size, metaOff, n-metaOff)
	return &lazyOpen{r: r, src: src, m: m, metaStart: start, finish: func() { finish(agePath) }}, nil
}

// LazyCryptError classifies a failure to open snapshot m's age header:
// identities that do not open an intact header are a KeyError (exit 6);
// a header naming a recipient type the manifest does not, or failing its
// MAC or authentication, is corruption.
func LazyCryptError(m uploader.Manifest, err error) error {
	if ke, ok := errors.AsType[*crypt.KeyError](err); ok {
		for _, t := range ke.Types {
			if !slices.Contains(m.Encryption.RecipientTypes, t) {
				return withCode(exitCorrupt, &uploader.CorruptError{ID: m.ID, Err: fmt.Errorf("%w: %s (manifest: %s)", crypt.ErrUnknownRecipientType, t, strings.Join(m.Encryption.RecipientTypes, ", "))})
			}
		}
		return CryptError(&uploader.KeyError{ID: m.ID, Err: ke})
	}
	if errors.Is(err, crypt.ErrAuth) || errors.Is(err, crypt.ErrHeader) {
		return withCode(exitCorrupt, &uploader.CorruptError{ID: m.ID, Err: err})
	}
	return err
}

// decryptCache decrypts the complete, verified age file src into dst (a
// temporary file beside it, fsynced and renamed into place) and returns
// the sha256 of the plaintext.
func decryptCache(ctx context.Context, src, dst string, ids *crypt.Identities) (string, error) {
	f, err := os.Open(src)
	if err != nil {
		return "", err
	}
	defer f.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dst), "."+filepath.Base(dst)+".tmp-*")
	if err != nil {
		return "", err
	}
	keep := false
	defer func() {
		if !keep {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	dr, err := crypt.NewReader(bufio.NewReaderSize(f, 1<<20), ids)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	buf := make([]byte, 1<<20)
	w := io.MultiWriter(tmp, h)
	for {
		if err := ctx.Err(); err != nil {
			return "", err
		}
		n, rerr := io.ReadFull(dr, buf)
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return "", err
			}
		}
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		}
		if rerr != nil {
			return "", rerr
		}
	}
	if err := tmp.Sync(); err != nil {
		return "", err
	}
	if err := tmp.Close(); err != nil {
		return "", err
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return "", err
	}
	keep = true
	if err := uploader.SyncDir(filepath.Dir(dst)); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
