package crypt

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/pem"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"golang.org/x/crypto/ssh"
)

// newKey writes a fresh age key into dir and returns its path and
// recipient.
func newKey(t *testing.T, dir, name string) (string, string) {
	t.Helper()
	p := filepath.Join(dir, name)
	pub, err := WriteNewKey(p, "test")
	if err != nil {
		t.Fatal(err)
	}
	return p, pub
}

func seal(t *testing.T, plain []byte, r *Recipients) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := Seal(&buf, bytes.NewReader(plain), r); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func TestCryptRoundTripReaderAt(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key, pub := newKey(t, dir, "key.txt")
	r, err := ParseRecipients([]string{pub})
	if err != nil {
		t.Fatal(err)
	}
	if got := r.Types(); !slices.Equal(got, []string{"X25519"}) {
		t.Fatalf("types %v", got)
	}
	ids, err := LoadIdentities([]string{key})
	if err != nil {
		t.Fatal(err)
	}
	plain := make([]byte, 300<<10+123)
	rand.Read(plain)
	ct := seal(t, plain, r)
	if !IsEncrypted(ct) || bytes.Contains(ct, plain[:64]) {
		t.Fatal("not an age file")
	}
	ra, n, err := Open(bytes.NewReader(ct), int64(len(ct)), ids)
	if err != nil {
		t.Fatal(err)
	}
	if n != int64(len(plain)) {
		t.Fatalf("size %d, want %d", n, len(plain))
	}
	// Ranges inside a chunk, across chunks, and at the end.
	for _, rg := range [][2]int{{0, 10}, {65530, 20}, {131072, 65536}, {len(plain) - 7, 7}} {
		got := make([]byte, rg[1])
		if _, err := ra.ReadAt(got, int64(rg[0])); err != nil && err != io.EOF {
			t.Fatal(err)
		}
		if !bytes.Equal(got, plain[rg[0]:rg[0]+rg[1]]) {
			t.Fatalf("range %v differs", rg)
		}
	}
	sr, err := NewReader(bytes.NewReader(ct), ids)
	if err != nil {
		t.Fatal(err)
	}
	all, err := io.ReadAll(sr)
	if err != nil || !bytes.Equal(all, plain) {
		t.Fatalf("stream decrypt: %v", err)
	}
	types, err := HeaderTypes(bytes.NewReader(ct))
	if err != nil || !slices.Equal(types, []string{"X25519"}) {
		t.Fatalf("header types %v %v", types, err)
	}
}

func TestCryptWrongAndMissingIdentity(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	_, pub := newKey(t, dir, "a.txt")
	other, _ := newKey(t, dir, "b.txt")
	r, _ := ParseRecipients([]string{pub})
	ct := seal(t, []byte("secret"), r)
	ids, _ := LoadIdentities([]string{other})
	_, _, err := Open(bytes.NewReader(ct), int64(len(ct)), ids)
	ke, ok := errors.AsType[*KeyError](err)
	if !ok || !errors.Is(err, ErrWrongIdentity) || !slices.Equal(ke.Types, []string{"X25519"}) {
		t.Fatalf("wrong identity: %v", err)
	}
	_, _, err = Open(bytes.NewReader(ct), int64(len(ct)), nil)
	if !errors.Is(err, ErrNoIdentity) || !strings.Contains(err.Error(), "X25519") {
		t.Fatalf("no identity: %v", err)
	}
	key, _ := os.ReadFile(other)
	if strings.Contains(err.Error(), string(key[len(key)-20:])) {
		t.Fatal("error carries key material")
	}
}

func TestCryptTamper(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key, pub := newKey(t, dir, "k")
	r, _ := ParseRecipients([]string{pub})
	ids, _ := LoadIdentities([]string{key})
	plain := make([]byte, 200<<10)
	ct := seal(t, plain, r)
	readAll := func(b []byte) error {
		ra, n, err := Open(bytes.NewReader(b), int64(len(b)), ids)
		if err != nil {
			return err
		}
		_, err = io.ReadAll(io.NewSectionReader(ra, 0, n))
		return err
	}
	flipped := slices.Clone(ct)
	flipped[len(ct)/2] ^= 1
	if err := readAll(flipped); !errors.Is(err, ErrAuth) {
		t.Fatalf("flipped byte: %v", err)
	}
	if err := readAll(ct[:len(ct)-100]); !errors.Is(err, ErrAuth) {
		t.Fatalf("truncated: %v", err)
	}
	if err := readAll(ct[:65536*2+200]); !errors.Is(err, ErrAuth) {
		t.Fatalf("truncated at a chunk: %v", err)
	}
	mac := slices.Clone(ct)
	i := bytes.Index(mac, []byte("\n--- ")) + 6
	mac[i] ^= 1
	if err := readAll(mac); !errors.Is(err, ErrHeader) {
		t.Fatalf("header MAC: %v", err)
	}
	unknown := bytes.Replace(ct, []byte("-> X25519 "), []byte("-> Y25519 "), 1)
	types, _ := HeaderTypes(bytes.NewReader(unknown))
	if !slices.Equal(types, []string{"Y25519"}) {
		t.Fatalf("types %v", types)
	}
	if err := readAll(unknown); !errors.Is(err, ErrWrongIdentity) {
		t.Fatalf("unknown type: %v", err)
	}
}

func TestCryptRecipientsParsing(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key, pub := newKey(t, dir, "k")
	_, priv, _ := ed25519.GenerateKey(rand.Reader)
	sshPub, _ := ssh.NewPublicKey(priv.Public())
	line := strings.TrimSpace(string(ssh.MarshalAuthorizedKey(sshPub))) + " me@host"
	file := filepath.Join(dir, "recipients")
	os.WriteFile(file, []byte("# team\n\n"+pub+"\n"+line+"\n"), 0o644)
	r, err := ParseRecipients([]string{"@" + file})
	if err != nil {
		t.Fatal(err)
	}
	if r.Len() != 2 || !slices.Equal(r.Types(), []string{"X25519", "ssh-ed25519"}) {
		t.Fatalf("recipients %d %v", r.Len(), r.Types())
	}
	// The SSH private key opens it, when its file is private.
	blk, err := ssh.MarshalPrivateKey(priv, "")
	if err != nil {
		t.Fatal(err)
	}
	sshKey := filepath.Join(dir, "id_ed25519")
	os.WriteFile(sshKey, pem.EncodeToMemory(blk), 0o644)
	if _, err := LoadIdentities([]string{sshKey}); err == nil || !strings.Contains(err.Error(), "too open") {
		t.Fatalf("open key file accepted: %v", err)
	}
	os.Chmod(sshKey, 0o600)
	ids, err := LoadIdentities([]string{sshKey})
	if err != nil {
		t.Fatal(err)
	}
	ct := seal(t, []byte("hello"), r)
	sr, err := NewReader(bytes.NewReader(ct), ids)
	if err != nil {
		t.Fatal(err)
	}
	if b, _ := io.ReadAll(sr); string(b) != "hello" {
		t.Fatalf("got %q", b)
	}
	// A private key where a recipient belongs is refused without being quoted.
	secret, _ := os.ReadFile(key)
	sk := strings.TrimSpace(strings.Split(string(secret), "\n")[2])
	_, err = ParseRecipients([]string{sk})
	if err == nil || strings.Contains(err.Error(), sk[20:]) {
		t.Fatalf("private key as recipient: %v", err)
	}
	bad := filepath.Join(dir, "bad")
	os.WriteFile(bad, []byte(pub+"\n"+sk+"\n"), 0o600)
	_, err = ParseRecipients([]string{"@" + bad})
	if err == nil || !strings.Contains(err.Error(), "line 2") || strings.Contains(err.Error(), sk[20:]) {
		t.Fatalf("private key in recipients file: %v", err)
	}
	// A passphrase-protected identity file is named as such.
	var enc bytes.Buffer
	sr2, _ := NewScryptRecipientForTest("pw")
	if err := Seal(&enc, strings.NewReader(string(secret)), sr2); err != nil {
		t.Fatal(err)
	}
	pp := filepath.Join(dir, "pp")
	os.WriteFile(pp, enc.Bytes(), 0o600)
	if _, err := LoadIdentities([]string{pp}); err == nil || !strings.Contains(err.Error(), "passphrase") {
		t.Fatalf("passphrase-protected identity: %v", err)
	}
	if _, err := ParseRecipients([]string{"nonsense"}); err == nil {
		t.Fatal("nonsense accepted")
	}
	if _, err := ParseRecipients(nil); err == nil {
		t.Fatal("no recipient accepted")
	}
}

func TestCryptLayout(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key, pub := newKey(t, dir, "k")
	r, _ := ParseRecipients([]string{pub})
	ids, _ := LoadIdentities([]string{key})
	plain := make([]byte, 3*ChunkSize+1000)
	rand.Read(plain)
	ct := seal(t, plain, r)
	ps, err := PayloadStart(bytes.NewReader(ct))
	if err != nil {
		t.Fatal(err)
	}
	if want := int64(len(ct)) - int64(len(plain)) - 4*ChunkOverhead; ps != want {
		t.Fatalf("payload start %d, want %d", ps, want)
	}
	// Decrypting from only the ranges CiphertextRange names gives the
	// plaintext: zero everything else of the object.
	for _, rg := range [][2]int64{{0, 1}, {ChunkSize - 1, 2}, {2*ChunkSize + 5, 1000}, {int64(len(plain)) - 10, 10}} {
		sparse := make([]byte, len(ct))
		copy(sparse[:ps], ct[:ps])
		s, e := CiphertextRange(ps, int64(len(ct)), rg[0], rg[1])
		copy(sparse[s:e], ct[s:e])
		// age's ReaderAt authenticates the final chunk when it opens.
		ls, le := CiphertextRange(ps, int64(len(ct)), int64(len(plain))-1, 1)
		copy(sparse[ls:le], ct[ls:le])
		ra, _, err := Open(bytes.NewReader(sparse), int64(len(sparse)), ids)
		if err != nil {
			t.Fatal(err)
		}
		got := make([]byte, rg[1])
		if _, err := ra.ReadAt(got, rg[0]); err != nil && err != io.EOF {
			t.Fatalf("range %v: %v", rg, err)
		}
		if !bytes.Equal(got, plain[rg[0]:rg[0]+rg[1]]) {
			t.Fatalf("range %v differs", rg)
		}
	}
}

// failingAt fails reads of the bytes from off on, as a store that does not
// deliver them would.
type failingAt struct {
	b   []byte
	off int64
	err error
}

func (f failingAt) ReadAt(p []byte, off int64) (int, error) {
	if off+int64(len(p)) > f.off && off < int64(len(f.b))-ChunkSize {
		return 0, f.err
	}
	return bytes.NewReader(f.b).ReadAt(p, off)
}

// TestCryptSourceErrors: a failure to read the ciphertext is returned as
// itself, not as an authentication failure.
func TestCryptSourceErrors(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	key, pub := newKey(t, dir, "key.txt")
	r, _ := ParseRecipients([]string{pub})
	ids, err := LoadIdentities([]string{key})
	if err != nil {
		t.Fatal(err)
	}
	plain := make([]byte, 400<<10)
	rand.Read(plain)
	ct := seal(t, plain, r)
	cause := errors.New("store unavailable")
	ra, _, err := Open(failingAt{b: ct, off: 200 << 10, err: cause}, int64(len(ct)), ids)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ra.ReadAt(make([]byte, 10), 0); err != nil {
		t.Fatalf("a readable chunk: %v", err)
	}
	_, err = ra.ReadAt(make([]byte, 10), 250<<10)
	if !errors.Is(err, cause) || errors.Is(err, ErrAuth) {
		t.Fatalf("read of an unreadable chunk: %v", err)
	}
	// Open reads the header: failing there is the source's error too.
	if _, _, err := Open(failingAt{b: ct, off: 0, err: cause}, int64(len(ct)), ids); !errors.Is(err, cause) || errors.Is(err, ErrAuth) {
		t.Fatalf("Open over a failing source: %v", err)
	}
}

// BenchmarkOpenReadAt reads a 64 MiB age file through Open's ReaderAt in
// 128 KiB reads (the archive's block size), against the same reads of the
// plaintext: the cost of decrypting and authenticating as a mount reads.
func BenchmarkOpenReadAt(b *testing.B) {
	dir := b.TempDir()
	key, pub := newKeyB(b, dir)
	r, _ := ParseRecipients([]string{pub})
	ids, err := LoadIdentities([]string{key})
	if err != nil {
		b.Fatal(err)
	}
	plain := make([]byte, 64<<20)
	rand.Read(plain)
	var buf bytes.Buffer
	if err := Seal(&buf, bytes.NewReader(plain), r); err != nil {
		b.Fatal(err)
	}
	ct := buf.Bytes()
	read := func(b *testing.B, ra io.ReaderAt) {
		p := make([]byte, 128<<10)
		b.SetBytes(int64(len(plain)))
		for b.Loop() {
			for off := int64(0); off < int64(len(plain)); off += int64(len(p)) {
				if _, err := ra.ReadAt(p, off); err != nil && err != io.EOF {
					b.Fatal(err)
				}
			}
		}
	}
	b.Run("plaintext", func(b *testing.B) { read(b, bytes.NewReader(plain)) })
	b.Run("age", func(b *testing.B) {
		ra, _, err := Open(bytes.NewReader(ct), int64(len(ct)), ids)
		if err != nil {
			b.Fatal(err)
		}
		read(b, ra)
	})
}

func newKeyB(b *testing.B, dir string) (string, string) {
	p := filepath.Join(dir, "key.txt")
	pub, err := WriteNewKey(p, "test")
	if err != nil {
		b.Fatal(err)
	}
	return p, pub
}

// CheckIdentities needs only an age file's first bytes: its header and
// payload nonce.
func TestCryptCheckIdentities(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	right, pub := newKey(t, dir, "a.txt")
	wrong, _ := newKey(t, dir, "b.txt")
	r, _ := ParseRecipients([]string{pub})
	ct := seal(t, bytes.Repeat([]byte("payload "), 64<<10), r)
	end := bytes.Index(ct, []byte("\n---"))
	if end < 0 {
		t.Fatal("no header end")
	}
	end = bytes.IndexByte(ct[end+1:], '\n') + end + 2 // past the MAC line
	prefix := ct[:end+16]                             // and the nonce
	ids, _ := LoadIdentities([]string{right})
	if err := CheckIdentities(prefix, ids); err != nil {
		t.Errorf("the right identity on the header alone: %v", err)
	}
	if err := CheckIdentities(ct[:min(len(ct), HeaderMax)], ids); err != nil {
		t.Errorf("the right identity on HeaderMax bytes: %v", err)
	}
	bad, _ := LoadIdentities([]string{wrong})
	if err := CheckIdentities(prefix, bad); !errors.Is(err, ErrWrongIdentity) {
		t.Errorf("a wrong identity: %v", err)
	}
	if err := CheckIdentities(prefix, nil); !errors.Is(err, ErrNoIdentity) {
		t.Errorf("no identity: %v", err)
	}
	if err := CheckIdentities(prefix[:end/2], ids); !errors.Is(err, ErrHeader) {
		t.Errorf("a header cut short: %v", err)
	}
}
