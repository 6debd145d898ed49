package uploader

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/hermesfs/hermesfs/uploader/crypt"
)

// Encrypted snapshots.
//
// With CatalogOptions.Recipients set, Publish encrypts the archive with
// age (package crypt) into a temporary file beside it and uploads that:
// the stored object is an age file whose plaintext is the squashfs
// archive, so `age -d` recovers it. The manifest records the scheme and
// the recipient stanza types, never a key, and leaves out the file count;
// its size and sha256 are the ciphertext's. A fresh file key per object
// means no byte of a new archive's ciphertext equals the previous one's:
// an encrypted publish never copies ranges from the previous archive (the
// Delta is ignored) and uploads the whole object.
//
// Restore streams the download through the decryption, checking the
// ciphertext's size and sha256 against the manifest and authenticating
// every chunk, and writes the plaintext archive. The local file is
// plaintext: the local disk already holds the tree itself (the upper
// layer), so encrypting it would protect nothing.

// Encryption is how a snapshot's archive object is encrypted.
type Encryption struct {
	Scheme string `json:"scheme"` // "age"
	// RecipientTypes are the age stanza types of its header (X25519,
	// ssh-ed25519, ssh-rsa, mlkem768x25519): which kinds of key open it.
	RecipientTypes []string `json:"recipient_types"`
}

// ErrPlaintext is a plaintext publish refused because LATEST is encrypted
// (a forgotten --encrypt-to); CatalogOptions.AllowPlaintext permits it.
var ErrPlaintext = errors.New("refusing to publish a plaintext snapshot over an encrypted one")

// KeyError is an encrypted snapshot the identities at hand cannot open:
// none given, or none matching. It is not corruption: Restore stops
// instead of falling back to an older snapshot. errors.Is matches
// crypt.ErrNoIdentity or crypt.ErrWrongIdentity.
type KeyError struct {
	ID  string
	Err *crypt.KeyError
}

func (e *KeyError) Error() string { return fmt.Sprintf("snapshot %s is %v", e.ID, e.Err) }
func (e *KeyError) Unwrap() error { return e.Err }

// Identities are the identities the catalog decrypts snapshots with (nil:
// none given).
func (c *Catalog) Identities() *crypt.Identities { return c.opts.Identities }

// sealInput checks a publish against the encryption of LATEST and, with
// recipients, encrypts in.Path and points in at the ciphertext. cleanup
// removes the ciphertext file.
func (c *Catalog) sealInput(ctx context.Context, latest string, in *PublishInput) (*Encryption, func(), error) {
	noop := func() {}
	var prev *Encryption
	prevKnown := false
	if latest != "" {
		if m, err := c.Manifest(ctx, latest); err == nil {
			prev, prevKnown = m.Encryption, true
		} else if ctx.Err() != nil {
			return nil, noop, err
		}
	}
	r := c.opts.Recipients
	if r == nil {
		if prev != nil && !c.opts.AllowPlaintext {
			return nil, noop, fmt.Errorf("%w: LATEST (%s) is encrypted to %s recipients; pass --encrypt-to (or HERMESFS_ENCRYPT_TO), or --allow-plaintext to publish unencrypted on purpose",
				ErrPlaintext, latest, strings.Join(prev.RecipientTypes, ", "))
		}
		if prev != nil {
			c.log.Warn("publishing a plaintext snapshot over an encrypted LATEST (allowed by --allow-plaintext)", "latest", latest)
		}
		return nil, noop, nil
	}
	if prevKnown && prev == nil {
		c.log.Info("first encrypted snapshot in this store: the older ones stay plaintext until pruned", "latest", latest, "recipient_types", strings.Join(r.Types(), ","))
	}
	start := time.Now()
	dir, base := filepath.Split(in.Path)
	tmp, err := os.CreateTemp(dir, "."+base+".tmp-age-*")
	if err != nil {
		return nil, noop, err
	}
	cleanup := func() { tmp.Close(); os.Remove(tmp.Name()) }
	src, err := os.Open(in.Path)
	if err != nil {
		cleanup()
		return nil, noop, err
	}
	defer src.Close()
	if st, err := src.Stat(); err != nil {
		cleanup()
		return nil, noop, err
	} else if in.SHA256 != "" && st.Size() != in.Size {
		cleanup()
		return nil, noop, fmt.Errorf("%s has %d bytes, the packer reported %d", in.Path, st.Size(), in.Size)
	}
	h := sha256.New()
	ah := newAsyncWriter(h)
	cw := &countWriter{w: io.MultiWriter(tmp, ah)}
	err = crypt.Seal(cw, &ctxReader{ctx: ctx, r: src}, r)
	ah.Close()
	if err != nil {
		cleanup()
		return nil, noop, err
	}
	if err := tmp.Close(); err != nil {
		cleanup()
		return nil, noop, err
	}
	c.log.Debug("encrypted the archive", "recipients", r.Len(), "size", cw.n, "took", time.Since(start).Round(time.Millisecond))
	in.Path, in.SHA256, in.Size, in.Files = tmp.Name(), hex.EncodeToString(h.Sum(nil)), cw.n, 0
	return &Encryption{Scheme: crypt.Scheme, RecipientTypes: r.Types()}, cleanup, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// srcReader remembers the error of the download it reads, so that a
// network failure seen through the decryption is not taken for tampering.
type srcReader struct {
	r   io.Reader
	err error
}

func (s *srcReader) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		s.err = err
	}
	return n, err
}

// decryptTo decrypts the encrypted archive of m read from rc into w,
// hashing the ciphertext into h, and returns the plaintext's sha256 and
// the ciphertext bytes read. A damaged object (size, sha256, header,
// authentication) is a CorruptError; identities that do not open an
// intact object a KeyError.
func (c *Catalog) decryptTo(ctx context.Context, m Manifest, rc io.Reader, w io.Writer, h hash.Hash) (string, error) {
	if m.Encryption.Scheme != crypt.Scheme {
		return "", fmt.Errorf("snapshot %s is encrypted with %q; this hermesfs knows %q: upgrade it", m.ID, m.Encryption.Scheme, crypt.Scheme)
	}
	if c.opts.Identities == nil {
		// Nothing to try: no need to download it.
		return "", &KeyError{ID: m.ID, Err: &crypt.KeyError{Types: m.Encryption.RecipientTypes, Err: crypt.ErrNoIdentity}}
	}
	// Both hashes run beside the decryption, on other cores.
	ch := newAsyncWriter(h)
	defer ch.Close()
	cnt := &countWriter{w: ch}
	src := &srcReader{r: io.TeeReader(&ctxReader{ctx: ctx, r: rc}, cnt)}
	ph := sha256.New()
	pw := newAsyncWriter(ph)
	defer pw.Close()
	// age reads a chunk (64 KiB) at a time; the download goes faster in
	// large reads.
	dr, err := crypt.NewReader(bufio.NewReaderSize(src, copyBufSize), c.opts.Identities)
	if err == nil {
		_, err = io.CopyBuffer(io.MultiWriter(w, pw), dr, make([]byte, copyBufSize))
	}
	if err != nil {
		if ctx.Err() != nil {
			return "", ctx.Err()
		}
		if src.err != nil {
			return "", fmt.Errorf("download %s: %w", m.Archive, src.err)
		}
		// Read the rest, so the sha256 tells a damaged object from a
		// key that does not fit.
		io.Copy(io.Discard, src)
		if src.err != nil {
			return "", fmt.Errorf("download %s: %w", m.Archive, src.err)
		}
	} else {
		// age stops at the final chunk; bytes after it are damage.
		io.Copy(io.Discard, src)
		if src.err != nil {
			return "", fmt.Errorf("download %s: %w", m.Archive, src.err)
		}
	}
	ch.Close()
	pw.Close()
	if cnt.n != m.Size {
		return "", &CorruptError{ID: m.ID, Err: errors.Join(fmt.Errorf("archive has %d bytes, manifest says %d", cnt.n, m.Size), err)}
	}
	if got := hex.EncodeToString(h.Sum(nil)); got != m.SHA256 {
		return "", &CorruptError{ID: m.ID, Err: errors.Join(fmt.Errorf("archive sha256 is %s, manifest says %s", got, m.SHA256), err)}
	}
	if ke, ok := errors.AsType[*crypt.KeyError](err); ok {
		for _, t := range ke.Types {
			if !slices.Contains(m.Encryption.RecipientTypes, t) {
				return "", &CorruptError{ID: m.ID, Err: fmt.Errorf("%w: %s (manifest: %s)", crypt.ErrUnknownRecipientType, t, strings.Join(m.Encryption.RecipientTypes, ", "))}
			}
		}
		return "", &KeyError{ID: m.ID, Err: ke}
	}
	if err != nil {
		return "", &CorruptError{ID: m.ID, Err: err}
	}
	return hex.EncodeToString(ph.Sum(nil)), nil
}

// asyncWriter hands what is written to w on a goroutine of its own, so
// that hashing runs beside the decryption. Close waits for w to have
// everything; it may be called more than once.
type asyncWriter struct {
	ch   chan []byte
	done chan struct{}
	once sync.Once
	pool sync.Pool
}

func newAsyncWriter(w io.Writer) *asyncWriter {
	a := &asyncWriter{ch: make(chan []byte, 16), done: make(chan struct{})}
	go func() {
		defer close(a.done)
		for b := range a.ch {
			w.Write(b) // a hash: never fails
			a.pool.Put(&b)
		}
	}()
	return a
}

func (a *asyncWriter) Write(p []byte) (int, error) {
	var b []byte
	if x, ok := a.pool.Get().(*[]byte); ok && cap(*x) >= len(p) {
		b = (*x)[:len(p)]
	} else {
		b = make([]byte, len(p), max(len(p), 128<<10))
	}
	copy(b, p)
	a.ch <- b
	return len(p), nil
}

func (a *asyncWriter) Close() {
	a.once.Do(func() { close(a.ch) })
	<-a.done
}
