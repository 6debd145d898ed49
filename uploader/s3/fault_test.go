package s3_test

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awss3 "github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/s3"
)

// faulty is a catalog whose requests cross a fault proxy, next to a direct
// view of the same prefix to check what really is in the bucket.
type faulty struct {
	proxy  *faultproxy.Proxy
	cat    *uploader.Catalog
	direct *uploader.Catalog
	raw    *s3.Store
}

func newFaulty(t *testing.T) *faulty {
	srv := startServer(t)
	p, err := faultproxy.Start(srv.endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	c := srv.config()
	direct := srv.store(t, c)
	c.Endpoint = p.URL
	through := srv.store(t, c)
	policy := uploader.RetryPolicy{MaxRetries: 5, Base: time.Millisecond, Cap: 20 * time.Millisecond}
	return &faulty{
		proxy:  p,
		cat:    uploader.NewCatalog(uploader.WithRetry(through, policy, nil), uploader.CatalogOptions{Host: "faulty"}),
		direct: uploader.NewCatalog(direct, uploader.CatalogOptions{Host: "checker"}),
		raw:    direct,
	}
}

func randomArchive(t *testing.T, n int) (string, string) {
	b := make([]byte, n)
	rand.Read(b)
	p := filepath.Join(t.TempDir(), "a.sqfs")
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(b)
	return p, hex.EncodeToString(sum[:])
}

// checkLatest restores what LATEST names straight from the server and
// checks it is complete and intact.
func (f *faulty) checkLatest(t *testing.T, wantID, wantSum string) {
	t.Helper()
	dst := filepath.Join(t.TempDir(), "check")
	res, err := f.direct.Restore(t.Context(), dst, uploader.RestoreOptions{})
	if err != nil || len(res.Skipped) > 0 {
		t.Fatalf("LATEST does not name an intact snapshot: %v (skipped %v)", err, res.Skipped)
	}
	if res.Manifest.ID != wantID || res.Manifest.SHA256 != wantSum {
		t.Fatalf("LATEST names %s (sha256 %s), want %s (%s)", res.Manifest.ID, res.Manifest.SHA256, wantID, wantSum)
	}
}

// Every third request fails in one of the six ways: publishes of small and
// multipart-sized archives, and restores, still complete and verify.
func TestFaultsPublishAndRestore(t *testing.T) {
	f := newFaulty(t)
	ctx := t.Context()
	f.proxy.SetRule(faultproxy.Every(3, faultproxy.Error500, faultproxy.SlowDown, faultproxy.Reset,
		faultproxy.ErrorAfter, faultproxy.ResetAfter, faultproxy.Truncate))
	base := ""
	for i, size := range []int{100_000, 12<<20 + 77, 3_000, 6 << 20, 50_000, 40_000} {
		p, sum := randomArchive(t, size)
		m, err := f.cat.Publish(ctx, uploader.PublishInput{Path: p, Parent: base, Expect: base})
		if err != nil {
			t.Fatalf("publish %d (%d bytes) through faults: %v", i, size, err)
		}
		f.checkLatest(t, m.ID, sum)
		dst := filepath.Join(t.TempDir(), "r")
		res, err := f.cat.Restore(ctx, dst, uploader.RestoreOptions{})
		if err != nil || res.Manifest.ID != m.ID {
			t.Fatalf("restore %d through faults: %+v, %v", i, res, err)
		}
		base = m.ID
	}
	_, faults := f.proxy.Counts()
	for _, k := range []faultproxy.Fault{faultproxy.Error500, faultproxy.SlowDown, faultproxy.Reset, faultproxy.ErrorAfter, faultproxy.ResetAfter, faultproxy.Truncate} {
		if faults[k] == 0 {
			t.Errorf("fault %v never injected: the schedule does not exercise it", k)
		}
	}
	if n := incompleteUploadsOf(t, f.raw); n != 0 {
		t.Errorf("%d incomplete multipart uploads left", n)
	}
}

func incompleteUploadsOf(t *testing.T, s *s3.Store) int {
	out, err := s.Client().ListMultipartUploads(t.Context(), &awss3.ListMultipartUploadsInput{Bucket: aws.String(s.Bucket())})
	if err != nil {
		t.Fatal(err)
	}
	return len(out.Uploads)
}

// When the store keeps failing, a publish fails with an error that says
// why, and LATEST stays on the previous complete snapshot.
func TestFaultsOutage(t *testing.T) {
	f := newFaulty(t)
	ctx := t.Context()
	p, sum := randomArchive(t, 20_000)
	m, err := f.cat.Publish(ctx, uploader.PublishInput{Path: p})
	if err != nil {
		t.Fatal(err)
	}
	for _, fault := range []faultproxy.Fault{faultproxy.SlowDown, faultproxy.Reset, faultproxy.ResetAfter} {
		// The manifest or LATEST write never gets through; what comes
		// before it does.
		for _, op := range []string{"PutObject", "UploadPart"} {
			f.proxy.SetRule(func(r faultproxy.Request) faultproxy.Fault {
				if r.Op == op || r.Op == "CompleteMultipartUpload" && op == "UploadPart" {
					return fault
				}
				return faultproxy.Pass
			})
			size := 1000
			if op == "UploadPart" {
				size = 11 << 20
			}
			p2, _ := randomArchive(t, size)
			f.proxy.ResetCounts()
			_, err := f.cat.Publish(ctx, uploader.PublishInput{Path: p2, Parent: m.ID, Expect: m.ID})
			if ops, _ := f.proxy.Counts(); fault == faultproxy.SlowDown && op == "PutObject" && ops["PutObject"] != 6 {
				// One try and five retries: the SDK must not retry on its own.
				t.Errorf("SlowDown on every PutObject: %d attempts, want 6", ops["PutObject"])
			}
			if err == nil {
				t.Fatalf("%v on every %s: publish succeeded", fault, op)
			}
			if !strings.Contains(err.Error(), "gave up after 6 attempts") {
				t.Errorf("%v on every %s: error does not say what happened: %v", fault, op, err)
			}
			f.proxy.SetRule(nil)
			f.checkLatest(t, m.ID, sum)
		}
	}
}

// A bit flipped in the newest archive in the bucket is caught while
// downloading through a faulty network, and the previous snapshot
// restored; truncated and reset downloads are resumed, not mistaken for
// corruption.
func TestFaultsBitFlipFallback(t *testing.T) {
	f := newFaulty(t)
	ctx := t.Context()
	var ms []uploader.Manifest
	var sums []string
	base := ""
	for range 3 {
		p, sum := randomArchive(t, 6<<20)
		m, err := f.cat.Publish(ctx, uploader.PublishInput{Path: p, Parent: base, Expect: base})
		if err != nil {
			t.Fatal(err)
		}
		ms, sums, base = append(ms, m), append(sums, sum), m.ID
	}
	key := uploader.ArchiveKey(ms[2].ID)
	rc, _, err := f.raw.Get(ctx, key, 0, -1)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	buf.ReadFrom(rc)
	rc.Close()
	b := buf.Bytes()
	b[len(b)/3] ^= 1
	if _, err := f.raw.Put(ctx, key, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	f.proxy.SetRule(faultproxy.Every(2, faultproxy.Truncate, faultproxy.Reset, faultproxy.SlowDown))
	dst := filepath.Join(t.TempDir(), "r")
	res, err := f.cat.Restore(ctx, dst, uploader.RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if res.Manifest.ID != ms[1].ID || len(res.Skipped) != 1 || !errors.Is(res.Skipped[0], uploader.ErrCorrupt) {
		t.Fatalf("restored %s skipping %v; want %s after skipping the flipped %s", res.Manifest.ID, res.Skipped, ms[1].ID, ms[2].ID)
	}
	got, _ := os.ReadFile(dst)
	if s := sha256.Sum256(got); hex.EncodeToString(s[:]) != sums[1] {
		t.Error("restored file is not the previous snapshot")
	}
}

// A small snapshot costs four requests: read LATEST, put the archive, put
// the manifest, move LATEST.
func TestPublishRequestCount(t *testing.T) {
	f := newFaulty(t)
	p, _ := randomArchive(t, 1000)
	f.proxy.ResetCounts()
	if _, err := f.cat.Publish(t.Context(), uploader.PublishInput{Path: p}); err != nil {
		t.Fatal(err)
	}
	ops, _ := f.proxy.Counts()
	if ops["GetObject"] != 1 || ops["PutObject"] != 3 || f.proxy.Total() != 4 {
		t.Errorf("a small publish cost %v (%d requests), want 1 GetObject and 3 PutObject", ops, f.proxy.Total())
	}
}
