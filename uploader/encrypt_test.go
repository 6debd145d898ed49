package uploader_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
)

// ageKey makes an age key file and returns its recipients and identities.
func ageKey(t *testing.T) (*crypt.Recipients, *crypt.Identities, string) {
	t.Helper()
	p := filepath.Join(t.TempDir(), "key.txt")
	pub, err := crypt.WriteNewKey(p, "test")
	if err != nil {
		t.Fatal(err)
	}
	r, err := crypt.ParseRecipients([]string{pub})
	if err != nil {
		t.Fatal(err)
	}
	ids, err := crypt.LoadIdentities([]string{p})
	if err != nil {
		t.Fatal(err)
	}
	return r, ids, p
}

func cryptCatalog(s uploader.Store, clk *clock, r *crypt.Recipients, ids *crypt.Identities) *uploader.Catalog {
	return uploader.NewCatalog(s, uploader.CatalogOptions{Host: "h", Version: "test", Now: clk.Now, Recipients: r, Identities: ids})
}

func getObject(t *testing.T, s uploader.Store, key string) []byte {
	t.Helper()
	rc, _, err := s.Get(t.Context(), key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func putObject(t *testing.T, s uploader.Store, key string, b []byte) {
	t.Helper()
	if _, err := s.Put(t.Context(), key, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
}

func TestEncryptPublishRestore(t *testing.T) {
	t.Parallel()
	s := newLocal(t)
	ctx := t.Context()
	clk := newClock()
	r, ids, _ := ageKey(t)
	plainCat := catalog(s, "h", clk)
	m0, sum0 := publish(t, plainCat, 50_000)

	var logs bytes.Buffer
	c := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "h", Version: "test", Now: clk.Now, Recipients: r, Identities: ids,
		Logger: slog.New(slog.NewTextHandler(&logs, &slog.HandlerOptions{Level: slog.LevelDebug}))})
	m1, sum1 := publish(t, c, 200_000)
	if !strings.Contains(logs.String(), "first encrypted snapshot") {
		t.Errorf("the first encrypted snapshot after plaintext ones is not logged:\n%s", logs.String())
	}
	if m1.Encryption == nil || m1.Encryption.Scheme != "age" || !slices.Equal(m1.Encryption.RecipientTypes, []string{"X25519"}) {
		t.Fatalf("manifest encryption %+v", m1.Encryption)
	}
	raw := getObject(t, s, uploader.ManifestKey(m1.ID))
	if bytes.Contains(raw, []byte(`"files"`)) || bytes.Contains(raw, []byte("AGE-SECRET")) {
		t.Fatalf("manifest leaks: %s", raw)
	}
	obj := getObject(t, s, m1.Archive)
	if !crypt.IsEncrypted(obj) || int64(len(obj)) != m1.Size || m1.Size <= 200_000 {
		t.Fatalf("stored object is not the age file: %d bytes, manifest %d", len(obj), m1.Size)
	}
	// The object is an age file of the archive, readable with age alone.
	ra, n, err := crypt.Open(bytes.NewReader(obj), int64(len(obj)), ids)
	if err != nil || n != 200_000 {
		t.Fatalf("open object: %v (%d)", err, n)
	}
	if plain, err := io.ReadAll(io.NewSectionReader(ra, 0, n)); err != nil || sha(plain) != sum1 {
		t.Fatalf("decrypted object: %v", err)
	}

	dst := filepath.Join(t.TempDir(), "a.sqfs")
	res, err := c.Restore(ctx, dst, uploader.RestoreOptions{})
	if err != nil || res.Manifest.ID != m1.ID || fileSum(t, dst) != sum1 || res.SHA256 != sum1 {
		t.Fatalf("restore: %+v %v", res, err)
	}
	// The plaintext one before stays readable without a key.
	res, err = plainCat.Restore(ctx, dst, uploader.RestoreOptions{ID: m0.ID})
	if err != nil || fileSum(t, dst) != sum0 || res.SHA256 != sum0 {
		t.Fatalf("restore plaintext: %v", err)
	}

	// Rotation: new recipients from the next snapshot on; the old
	// snapshot still opens with the old key only.
	r2, ids2, _ := ageKey(t)
	c2 := cryptCatalog(s, clk, r2, ids2)
	m2, sum2 := publish(t, c2, 70_000)
	if res, err := c2.Restore(ctx, dst, uploader.RestoreOptions{}); err != nil || res.Manifest.ID != m2.ID || fileSum(t, dst) != sum2 {
		t.Fatalf("restore rotated: %v", err)
	}
	_, err = c2.Restore(ctx, dst, uploader.RestoreOptions{ID: m1.ID})
	if ke, ok := errors.AsType[*uploader.KeyError](err); !ok || ke.ID != m1.ID || !errors.Is(err, crypt.ErrWrongIdentity) || errors.Is(err, uploader.ErrCorrupt) {
		t.Fatalf("old snapshot with the new key: %v", err)
	}
	if _, err := c.Restore(ctx, dst, uploader.RestoreOptions{ID: m1.ID}); err != nil {
		t.Fatalf("old snapshot with the old key: %v", err)
	}
	key, _ := os.ReadFile(ids.Files()[0])
	if i := bytes.Index(key, []byte("AGE-SECRET-KEY-")); i < 0 || bytes.Contains(logs.Bytes(), key[i+15:i+40]) {
		t.Error("the log shows the key")
	}
	both, _ := crypt.LoadIdentities(append(ids.Files(), ids2.Files()...))
	cb := cryptCatalog(s, clk, nil, both)
	for _, m := range []uploader.Manifest{m1, m2} {
		if _, err := cb.Restore(ctx, dst, uploader.RestoreOptions{ID: m.ID}); err != nil {
			t.Fatalf("restore %s with both keys: %v", m.ID, err)
		}
	}
}

func TestEncryptMissingOrWrongIdentityStops(t *testing.T) {
	t.Parallel()
	s := newLocal(t)
	ctx := t.Context()
	clk := newClock()
	r, ids, _ := ageKey(t)
	_, _, otherKey := ageKey(t)
	c := cryptCatalog(s, clk, r, ids)
	publish(t, catalog(s, "h", clk), 10_000) // an older plaintext one
	m, _ := publish(t, c, 10_000)
	dst := filepath.Join(t.TempDir(), "a.sqfs")
	os.WriteFile(dst, []byte("before"), 0o600)

	none := catalog(s, "h", clk)
	_, err := none.Restore(ctx, dst, uploader.RestoreOptions{})
	if !errors.Is(err, crypt.ErrNoIdentity) || errors.Is(err, uploader.ErrCorrupt) || !strings.Contains(err.Error(), m.ID) || !strings.Contains(err.Error(), "X25519") {
		t.Fatalf("no identity: %v", err)
	}
	other, _ := crypt.LoadIdentities([]string{otherKey})
	_, err = cryptCatalog(s, clk, nil, other).Restore(ctx, dst, uploader.RestoreOptions{})
	if !errors.Is(err, crypt.ErrWrongIdentity) || !strings.Contains(err.Error(), m.ID) {
		t.Fatalf("wrong identity: %v", err)
	}
	if b, _ := os.ReadFile(dst); string(b) != "before" {
		t.Fatal("a failed restore replaced the target")
	}
	key, _ := os.ReadFile(otherKey)
	if strings.Contains(err.Error(), strings.TrimSpace(string(key[len(key)-30:]))) {
		t.Fatal("error carries key material")
	}
}

func TestEncryptPlaintextRefused(t *testing.T) {
	t.Parallel()
	s := newLocal(t)
	clk := newClock()
	r, ids, _ := ageKey(t)
	publish(t, cryptCatalog(s, clk, r, ids), 10_000)
	plain := catalog(s, "h", clk)
	latest, _ := plain.LatestID(t.Context())
	p, _ := archiveFile(t, 1000)
	_, err := plain.Publish(t.Context(), uploader.PublishInput{Path: p, Parent: latest, Expect: latest})
	if !errors.Is(err, uploader.ErrPlaintext) || !strings.Contains(err.Error(), "--allow-plaintext") {
		t.Fatalf("plaintext over encrypted: %v", err)
	}
	if now, _ := plain.LatestID(t.Context()); now != latest {
		t.Fatal("LATEST moved")
	}
	allow := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "h", Now: clk.Now, AllowPlaintext: true})
	m, err := allow.Publish(t.Context(), uploader.PublishInput{Path: p, Parent: latest, Expect: latest})
	if err != nil || m.Encryption != nil {
		t.Fatalf("--allow-plaintext: %v", err)
	}
}

// TestEncryptTamper damages the newest encrypted snapshot in four ways;
// each is refused as corrupt and the restore falls back to the one before.
func TestEncryptTamper(t *testing.T) {
	t.Parallel()
	r, ids, _ := ageKey(t)
	flip := func(b []byte) []byte { b[len(b)/2] ^= 1; return b }
	cases := []struct {
		name   string
		damage func(t *testing.T, s uploader.Store, victim, other uploader.Manifest)
		want   string
		is     error
	}{
		{"flipped byte", func(t *testing.T, s uploader.Store, v, _ uploader.Manifest) {
			putObject(t, s, v.Archive, flip(getObject(t, s, v.Archive)))
		}, "sha256", crypt.ErrAuth},
		{"truncated", func(t *testing.T, s uploader.Store, v, _ uploader.Manifest) {
			b := getObject(t, s, v.Archive)
			putObject(t, s, v.Archive, b[:len(b)-1000])
		}, "bytes", nil},
		{"swapped", func(t *testing.T, s uploader.Store, v, o uploader.Manifest) {
			putObject(t, s, v.Archive, getObject(t, s, o.Archive))
		}, "sha256", nil},
		{"unknown recipient type", func(t *testing.T, s uploader.Store, v, _ uploader.Manifest) {
			// Rewrite the manifest's checksum too: only the header
			// tells the object does not belong to it.
			b := bytes.Replace(getObject(t, s, v.Archive), []byte("-> X25519 "), []byte("-> X99999 "), 1)
			putObject(t, s, v.Archive, b)
			var m map[string]any
			json.Unmarshal(getObject(t, s, uploader.ManifestKey(v.ID)), &m)
			m["sha256"] = sha(b)
			mj, _ := json.Marshal(m)
			putObject(t, s, uploader.ManifestKey(v.ID), mj)
		}, "X99999", crypt.ErrUnknownRecipientType},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := newLocal(t)
			c := cryptCatalog(s, newClock(), r, ids)
			prev, prevSum := publish(t, c, 150_000)
			victim, _ := publish(t, c, 150_000)
			tc.damage(t, s, victim, prev)
			dst := filepath.Join(t.TempDir(), "a.sqfs")
			res, err := c.Restore(t.Context(), dst, uploader.RestoreOptions{})
			if err != nil || res.Manifest.ID != prev.ID || fileSum(t, dst) != prevSum {
				t.Fatalf("restore: %+v %v", res, err)
			}
			if len(res.Skipped) != 1 || !errors.Is(res.Skipped[0], uploader.ErrCorrupt) || !strings.Contains(res.Skipped[0].Error(), tc.want) {
				t.Fatalf("skipped %v", res.Skipped)
			}
			if tc.is != nil && !errors.Is(res.Skipped[0], tc.is) {
				t.Fatalf("skipped %v, want %v", res.Skipped[0], tc.is)
			}
		})
	}
}

func sha(b []byte) string {
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// TestEncryptPublishImageKeepsHeader: an encrypted image's publish hands
// back its new segment's first bytes, the age header its identities are
// checked against later; a plaintext one hands back none.
func TestEncryptPublishImageKeepsHeader(t *testing.T) {
	ctx := t.Context()
	r, ids, _ := ageKey(t)
	_, wrong, _ := ageKey(t)
	s := newLocal(t)
	p := filepath.Join(t.TempDir(), "seg")
	if err := os.WriteFile(p, bytes.Repeat([]byte("segment "), 50_000), 0o600); err != nil {
		t.Fatal(err)
	}
	res, err := cryptCatalog(s, newClock(), r, ids).PublishImage(ctx, uploader.ImageInput{Segment: p, Extents: []uploader.Extent{{Length: 400_000}}})
	if err != nil {
		t.Fatal(err)
	}
	obj := getObject(t, s, res.Segment)
	if len(res.SegmentHeader) == 0 || len(res.SegmentHeader) > crypt.HeaderMax || !bytes.HasPrefix(obj, res.SegmentHeader) {
		t.Fatalf("SegmentHeader: %d bytes, not the segment's first bytes (%d in the store)", len(res.SegmentHeader), len(obj))
	}
	if err := crypt.CheckIdentities(res.SegmentHeader, ids); err != nil {
		t.Errorf("the identity on the header handed back: %v", err)
	}
	if err := crypt.CheckIdentities(res.SegmentHeader, wrong); !errors.Is(err, crypt.ErrWrongIdentity) {
		t.Errorf("a wrong identity on the header handed back: %v", err)
	}

	plain := uploader.NewCatalog(newLocal(t), uploader.CatalogOptions{Host: "h", Version: "test"})
	res, err = plain.PublishImage(ctx, uploader.ImageInput{Segment: p, Extents: []uploader.Extent{{Length: 400_000}}})
	if err != nil || res.SegmentHeader != nil {
		t.Errorf("plaintext publish: %d header bytes, %v", len(res.SegmentHeader), err)
	}
}
