// Package crypt encrypts snapshot archives for the store with age
// (https://age-encryption.org/v1), so that the store holds only ciphertext
// and a user can still recover a snapshot with nothing but the age CLI:
//
//	age -d -i key.txt SNAPSHOT.sqfs > snap.sqfs && unsquashfs snap.sqfs
//
// The stored object is exactly an age file whose plaintext is the squashfs
// archive. age encrypts every file under a fresh random file key, wrapped
// once per recipient in a header "stanza"; the payload is a sequence of
// 64 KiB chunks, each sealed with ChaCha20-Poly1305, the last one marked,
// so that truncation, reordering and any flipped byte are detected before
// a byte of plaintext is used. Open exposes that as an io.ReaderAt: reading
// a range fetches and authenticates only the chunks that cover it, which is
// what lets a lazy reader over the ciphertext serve random reads.
//
// Recipients are public: age X25519 keys (age1…), post-quantum hybrid keys
// (age1pq1…), and SSH ed25519 and RSA public keys. Identities are secret
// and read only from files, never from the command line or the
// environment, and a key file that group or others may read is refused,
// as ssh refuses such keys. No error or log line of this package carries
// key material: parse errors name the file and line, not the text.
package crypt

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"

	"filippo.io/age"
	"filippo.io/age/agessh"
	"golang.org/x/crypto/ssh"
)

// Scheme names this encryption in manifests.
const Scheme = "age"

// Magic is how every age file begins.
const Magic = "age-encryption.org/v1\n"

// IsEncrypted reports whether b, the first bytes of a file, is an age
// file's beginning.
func IsEncrypted(b []byte) bool { return bytes.HasPrefix(b, []byte(Magic)) }

var (
	// ErrNoIdentity: a snapshot is encrypted and no identity was given.
	ErrNoIdentity = errors.New("no identity given to decrypt it (--identity FILE or HERMESFS_IDENTITY)")
	// ErrWrongIdentity: none of the identities given opens the file.
	ErrWrongIdentity = errors.New("none of the identities given matches its recipients")
	// ErrUnknownRecipientType: the header holds a recipient stanza of a
	// type the file was not encrypted to (as its manifest records).
	ErrUnknownRecipientType = errors.New("header names a recipient type it was not encrypted to")
	// ErrHeader: the age header is malformed or its MAC does not match.
	ErrHeader = errors.New("age header is malformed or fails its MAC")
	// ErrAuth: a payload chunk fails authentication (a flipped byte, a
	// truncated or reordered object, or another file's bytes).
	ErrAuth = errors.New("ciphertext fails authentication")
)

// KeyError says a snapshot cannot be decrypted with the identities at
// hand, and which kinds of recipient it was encrypted to.
type KeyError struct {
	// Types are the recipient stanza types of the file (X25519,
	// ssh-ed25519, ssh-rsa, mlkem768x25519, …): they say which kind of
	// key opens it, never which key.
	Types []string
	Err   error // ErrNoIdentity or ErrWrongIdentity
}

func (e *KeyError) Error() string {
	return fmt.Sprintf("encrypted to %s recipients; %v", typeList(e.Types), e.Err)
}
func (e *KeyError) Unwrap() error { return e.Err }

func typeList(t []string) string {
	if len(t) == 0 {
		return "unknown"
	}
	return strings.Join(t, ", ")
}

// Recipients are the public keys new snapshots are encrypted to.
type Recipients struct {
	list  []age.Recipient
	types []string
}

// ParseRecipients parses recipient arguments: an age public key (age1…),
// an SSH public key line (ssh-ed25519 …, ssh-rsa …), or @FILE, a file of
// such lines (age's recipients-file format: blank lines and lines starting
// with # are skipped). At least one recipient is required.
func ParseRecipients(args []string) (*Recipients, error) {
	r := &Recipients{}
	for _, a := range args {
		a = strings.TrimSpace(a)
		if a == "" {
			continue
		}
		if name, ok := strings.CutPrefix(a, "@"); ok {
			if err := r.addFile(name); err != nil {
				return nil, err
			}
			continue
		}
		rec, err := parseRecipient(a)
		if err != nil {
			return nil, fmt.Errorf("recipient %s: %w", shorten(a), err)
		}
		r.list = append(r.list, rec)
	}
	if len(r.list) == 0 {
		return nil, errors.New("no recipient given")
	}
	types, err := stanzaTypes(r.list)
	if err != nil {
		return nil, err
	}
	r.types = types
	return r, nil
}

func (r *Recipients) addFile(name string) error {
	b, err := os.ReadFile(name)
	if err != nil {
		return fmt.Errorf("recipients file: %w", err)
	}
	n := 0
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(nil, 1<<20)
	for line := 1; sc.Scan(); line++ {
		s := strings.TrimSpace(sc.Text())
		if s == "" || strings.HasPrefix(s, "#") {
			continue
		}
		rec, err := parseRecipient(s)
		if err != nil {
			// The line is not quoted: a private key pasted by mistake
			// must not end up in a log.
			return fmt.Errorf("recipients file %s line %d: %w", name, line, err)
		}
		r.list = append(r.list, rec)
		n++
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("recipients file %s: %w", name, err)
	}
	if n == 0 {
		return fmt.Errorf("recipients file %s: no recipient in it", name)
	}
	return nil
}

// parseRecipient reads one recipient. Its errors say what a recipient
// looks like; the library's own words come last, as the cause.
func parseRecipient(s string) (age.Recipient, error) {
	switch {
	case strings.HasPrefix(s, "age1pq1"):
		r, err := age.ParseHybridRecipient(s)
		if err != nil {
			return nil, fmt.Errorf("not a valid post-quantum age public key (age1pq1… as 'age-keygen -pq' prints it, copied whole) (cause: %w)", err)
		}
		return r, nil
	case strings.HasPrefix(s, "age1"):
		r, err := age.ParseX25519Recipient(s)
		if err != nil {
			return nil, fmt.Errorf("not a valid age public key: one is \"age1\" and 58 more lower-case letters and digits, as 'hermesfs keygen FILE' or 'age-keygen' print it; copy it whole (cause: %w)", err)
		}
		return r, nil
	case strings.HasPrefix(s, "ssh-ed25519 "), strings.HasPrefix(s, "ssh-rsa "):
		pk, _, _, _, err := ssh.ParseAuthorizedKey([]byte(s))
		if err != nil {
			return nil, fmt.Errorf("not a valid SSH public key: give the whole line of the .pub file, \"ssh-ed25519 AAAA… comment\" (cause: %w)", err)
		}
		if pk.Type() == "ssh-rsa" {
			return agessh.NewRSARecipient(pk)
		}
		return agessh.NewEd25519Recipient(pk)
	case strings.HasPrefix(s, "AGE-SECRET-KEY-"), strings.HasPrefix(s, "-----BEGIN"):
		return nil, errors.New("this is a private key, not a recipient: give the public key (age-keygen -y KEYFILE prints it)")
	}
	return nil, errors.New("not a recipient: give an age public key (age1…, printed by 'hermesfs keygen FILE' or 'age-keygen'), an ssh-ed25519 or ssh-rsa public key line (a .pub file's), or @FILE with one of those a line")
}

// shorten keeps a recipient argument recognisable in a message without
// repeating all of it.
func shorten(s string) string {
	if strings.HasPrefix(s, "AGE-SECRET-KEY-") || strings.HasPrefix(s, "-----BEGIN") {
		return "(private key, not shown)"
	}
	if len(s) > 24 {
		return s[:20] + "…"
	}
	return s
}

// stanzaTypes wraps a throwaway file key to learn the stanza type each
// recipient writes: the names a header shows and a manifest records.
func stanzaTypes(list []age.Recipient) ([]string, error) {
	var types []string
	key := make([]byte, 16)
	for _, r := range list {
		ss, err := r.Wrap(key)
		if err != nil {
			return nil, fmt.Errorf("recipient: %w", err)
		}
		for _, s := range ss {
			if !slices.Contains(types, s.Type) {
				types = append(types, s.Type)
			}
		}
	}
	slices.Sort(types)
	return types, nil
}

// Types returns the stanza types the recipients write, sorted.
func (r *Recipients) Types() []string { return slices.Clone(r.types) }

// Len is the number of recipients.
func (r *Recipients) Len() int { return len(r.list) }

// Identities are the private keys snapshots are decrypted with.
type Identities struct {
	list  []age.Identity
	files []string
}

// LoadIdentities reads identity files: age identity files (lines of
// AGE-SECRET-KEY-1…, as age-keygen writes them) or unencrypted OpenSSH
// ed25519 or RSA private keys. A file readable or writable by group or
// others is refused.
func LoadIdentities(paths []string) (*Identities, error) {
	ids := &Identities{}
	for _, p := range paths {
		if p == "" {
			continue
		}
		if err := CheckKeyFile(p); err != nil {
			return nil, err
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("identity file: %w", err)
		}
		got, err := parseIdentities(b)
		if err != nil {
			return nil, fmt.Errorf("identity file %s: %w", p, err)
		}
		ids.list = append(ids.list, got...)
		ids.files = append(ids.files, p)
	}
	if len(ids.list) == 0 {
		return nil, errors.New("no identity file given")
	}
	return ids, nil
}

func parseIdentities(b []byte) ([]age.Identity, error) {
	if IsEncrypted(b) || bytes.HasPrefix(b, []byte("-----BEGIN AGE ENCRYPTED FILE-----")) {
		return nil, errors.New("a passphrase-protected identity file is not supported: hermesfs runs unattended; protect the file with its mode and the service's credentials instead")
	}
	if bytes.Contains(b, []byte("-----BEGIN")) {
		id, err := agessh.ParseIdentity(b)
		if err != nil {
			if _, ok := errors.AsType[*ssh.PassphraseMissingError](err); ok {
				return nil, errors.New("passphrase-protected SSH keys are not supported: use an age key (hermesfs keygen) or an unencrypted key")
			}
			// ssh's parse errors describe the format, never the key.
			return nil, fmt.Errorf("SSH private key: %w", err)
		}
		return []age.Identity{id}, nil
	}
	// age.ParseIdentities never quotes the offending line.
	return age.ParseIdentities(bytes.NewReader(b))
}

// CheckKeyFile refuses a private key file that group or others may read
// or write, as ssh does, so that a secret copied with the wrong mode is
// noticed before it is relied on.
func CheckKeyFile(path string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return fmt.Errorf("identity file: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("identity file %s: not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o077 != 0 {
		return fmt.Errorf("identity file %s: permissions %04o are too open: a private key must be readable by its owner only (chmod 600 %s)", path, perm, path)
	}
	return nil
}

// Files names the identity files loaded, for messages.
func (ids *Identities) Files() []string { return slices.Clone(ids.files) }

// Seal encrypts src to the recipients and writes the age file to dst.
func Seal(dst io.Writer, src io.Reader, r *Recipients) error {
	w, err := age.Encrypt(dst, r.list...)
	if err != nil {
		return fmt.Errorf("encrypt: %w", err)
	}
	if _, err := io.Copy(w, src); err != nil {
		return fmt.Errorf("encrypt: %w", err)
	}
	if err := w.Close(); err != nil {
		return fmt.Errorf("encrypt: %w", err)
	}
	return nil
}

// NewReader decrypts the age file read from src as it streams. A read
// error wraps ErrAuth when the payload fails authentication. Errors
// before the first byte: see Open.
func NewReader(src io.Reader, ids *Identities) (io.Reader, error) {
	if ids == nil || len(ids.list) == 0 {
		types, _ := HeaderTypes(src)
		return nil, &KeyError{Types: types, Err: ErrNoIdentity}
	}
	r, err := age.Decrypt(src, ids.list...)
	if err != nil {
		return nil, classify(err)
	}
	return &authReader{r: r}, nil
}

// HeaderMax is how many leading bytes of an age file CheckIdentities
// needs at most: its header (one line per recipient) and payload nonce.
const HeaderMax = 64 << 10

// CheckIdentities reports whether ids open the age file that starts with
// prefix (its first bytes: the header and the payload nonce, up to
// HeaderMax; the payload itself is not needed): nil, a *KeyError
// (ErrNoIdentity, ErrWrongIdentity), or ErrHeader for a header that is
// damaged or cut short.
func CheckIdentities(prefix []byte, ids *Identities) error {
	_, err := NewReader(bytes.NewReader(prefix), ids)
	return err
}

// Open returns a ReaderAt of the plaintext of the age file in src (size
// bytes of ciphertext) and the plaintext's size. Each ReadAt fetches and
// authenticates only the 64 KiB chunks that cover it; Open itself reads
// the header and the final chunk, which authenticates the size. ReadAt
// may be called concurrently; a chunk that fails authentication is an
// error wrapping ErrAuth, never plaintext.
//
// Errors: a *KeyError (ErrNoIdentity, ErrWrongIdentity) when the
// identities do not open it; ErrHeader or ErrAuth when the file is
// damaged.
func Open(src io.ReaderAt, size int64, ids *Identities) (io.ReaderAt, int64, error) {
	if ids == nil || len(ids.list) == 0 {
		types, _ := HeaderTypes(io.NewSectionReader(src, 0, size))
		return nil, 0, &KeyError{Types: types, Err: ErrNoIdentity}
	}
	r, n, err := age.DecryptReaderAt(srcReaderAt{src}, size, ids.list...)
	if err != nil {
		if se, ok := errors.AsType[*srcError](err); ok {
			return nil, 0, se.err
		}
		return nil, 0, classify(err)
	}
	return &authReaderAt{r: r}, n, nil
}

// srcReaderAt marks the errors of the ciphertext's reader, so that a
// failure to read (a store that did not deliver, EIO) is reported as what
// it is and not taken for tampering.
type srcReaderAt struct{ r io.ReaderAt }

func (s srcReaderAt) ReadAt(p []byte, off int64) (int, error) {
	n, err := s.r.ReadAt(p, off)
	if err != nil && err != io.EOF {
		err = &srcError{err}
	}
	return n, err
}

type srcError struct{ err error }

func (e *srcError) Error() string { return e.err.Error() }
func (e *srcError) Unwrap() error { return e.err }

// classify turns age's errors into this package's.
func classify(err error) error {
	if nm, ok := errors.AsType[*age.NoIdentityMatchError](err); ok {
		t := slices.Clone(nm.StanzaTypes)
		slices.Sort(t)
		return &KeyError{Types: slices.Compact(t), Err: ErrWrongIdentity}
	}
	if strings.Contains(err.Error(), "header") {
		return fmt.Errorf("%w: %v", ErrHeader, err)
	}
	return fmt.Errorf("%w: %v", ErrAuth, err)
}

type authReader struct{ r io.Reader }

func (a *authReader) Read(p []byte) (int, error) {
	n, err := a.r.Read(p)
	if err != nil && err != io.EOF {
		err = fmt.Errorf("%w: %v", ErrAuth, err)
	}
	return n, err
}

type authReaderAt struct{ r io.ReaderAt }

func (a *authReaderAt) ReadAt(p []byte, off int64) (int, error) {
	n, err := a.r.ReadAt(p, off)
	if err != nil && err != io.EOF {
		if se, ok := errors.AsType[*srcError](err); ok {
			return n, se.err
		}
		err = fmt.Errorf("%w: %v", ErrAuth, err)
	}
	return n, err
}

// HeaderTypes reads an age header from src and returns the types of its
// recipient stanzas, sorted and without repeats. It reads at most the
// header (up to 64 KiB).
func HeaderTypes(src io.Reader) ([]string, error) {
	br := bufio.NewReader(io.LimitReader(src, 64<<10))
	first, err := br.ReadString('\n')
	if err != nil || first != Magic {
		return nil, fmt.Errorf("%w: not an age file", ErrHeader)
	}
	var types []string
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrHeader, err)
		}
		switch {
		case strings.HasPrefix(line, "---"):
			slices.Sort(types)
			return slices.Compact(types), nil
		case strings.HasPrefix(line, "-> "):
			f := strings.Fields(line[3:])
			if len(f) == 0 {
				return nil, fmt.Errorf("%w: empty stanza", ErrHeader)
			}
			types = append(types, f[0])
		}
	}
}

// WriteNewKey generates an age X25519 identity, writes it to path (which
// must not exist) readable by its owner only, in age-keygen's format, and
// returns its public key (the recipient to encrypt to).
func WriteNewKey(path string, now string) (string, error) {
	id, err := age.GenerateX25519Identity()
	if err != nil {
		return "", err
	}
	pub := id.Recipient().String()
	body := fmt.Sprintf("# created: %s\n# public key: %s\n%s\n", now, pub, id.String())
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return "", fmt.Errorf("key file: %w", err)
	}
	if _, err := f.WriteString(body); err != nil {
		f.Close()
		os.Remove(path)
		return "", fmt.Errorf("key file: %w", err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		os.Remove(path)
		return "", fmt.Errorf("key file: %w", err)
	}
	if err := f.Close(); err != nil {
		os.Remove(path)
		return "", fmt.Errorf("key file: %w", err)
	}
	return pub, nil
}

// Layout of the payload, for readers that map plaintext offsets to ranges
// of the stored object (a lazy reader fetching the chunks a read needs).
const (
	// ChunkSize is the plaintext size of every payload chunk but the last.
	ChunkSize = 64 << 10
	// ChunkOverhead is the authentication tag each chunk adds.
	ChunkOverhead = 16
	nonceSize     = 16
)

// PayloadStart reads an age header from src and returns where the payload
// chunks start in the file: the header's length plus the 16-byte nonce.
func PayloadStart(src io.Reader) (int64, error) {
	br := bufio.NewReader(io.LimitReader(src, 64<<10))
	var n int64
	first := true
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			return 0, fmt.Errorf("%w: %v", ErrHeader, err)
		}
		if first && line != Magic {
			return 0, fmt.Errorf("%w: not an age file", ErrHeader)
		}
		first = false
		n += int64(len(line))
		if strings.HasPrefix(line, "--- ") {
			return n + nonceSize, nil
		}
	}
}

// CiphertextRange returns the byte range [start, end) of the stored object
// that holds plaintext bytes [off, off+n): whole chunks, since a chunk is
// authenticated as a unit. payloadStart is PayloadStart's result and size
// the stored object's size.
func CiphertextRange(payloadStart, size, off, n int64) (start, end int64) {
	const enc = ChunkSize + ChunkOverhead
	first, last := off/ChunkSize, (off+max(n, 1)-1)/ChunkSize
	start = payloadStart + first*enc
	end = min(payloadStart+(last+1)*enc, size)
	return start, end
}
