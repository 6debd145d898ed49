package s3_test

import (
	"bytes"
	"crypto/rand"
	"errors"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/s3"
)

const mib = 1 << 20

// composed is a source object in the store and a local file that shares
// most of its bytes, with the ranges that say where.
type composed struct {
	src    uploader.ComposeSource
	local  []byte
	path   string
	ranges []uploader.ComposeRange
}

func rnd(n int) []byte {
	b := make([]byte, n)
	rand.Read(b)
	return b
}

// newComposed puts a 26 MiB source and builds the next version: a new
// header, two long copied runs around new bytes, a copied run too short to
// be a part of its own, and a new tail.
func newComposed(t *testing.T, s uploader.Store) *composed {
	t.Helper()
	srcb := rnd(26 * mib)
	info, err := s.Put(t.Context(), "snapshots/old.sqfs", bytes.NewReader(srcb), int64(len(srcb)), uploader.PutOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c := &composed{src: uploader.ComposeSource{Key: "snapshots/old.sqfs", ETag: info.ETag, Size: info.Size}}
	add := func(b []byte) { c.local = append(c.local, b...) }
	copied := func(off, n int) {
		c.ranges = append(c.ranges, uploader.ComposeRange{Offset: int64(len(c.local)), SourceOffset: int64(off), Length: int64(n)})
		add(srcb[off : off+n])
	}
	add(rnd(96))
	copied(96, 11*mib)
	add(rnd(2*mib + 5))
	copied(13*mib, 9*mib+77)
	add(rnd(1000))
	copied(23*mib, 2*mib) // too short: sent
	add(rnd(300_000))
	c.path = filepath.Join(t.TempDir(), "new.sqfs")
	if err := os.WriteFile(c.path, c.local, 0o600); err != nil {
		t.Fatal(err)
	}
	return c
}

func (c *composed) put(t *testing.T, s uploader.Composer, key string) (uploader.ComposeResult, error) {
	t.Helper()
	f, err := os.Open(c.path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	return s.PutComposed(t.Context(), key, f, int64(len(c.local)), c.src, c.ranges, uploader.PutOptions{})
}

func getAll(t *testing.T, s uploader.Store, key string) []byte {
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

// A composed object downloads byte for byte as the local file, and only
// what could not be copied was sent.
func TestPutComposed(t *testing.T) {
	srv := startServer(t)
	for _, name := range []string{"plain", "retry"} {
		t.Run(name, func(t *testing.T) {
			raw := srv.store(t, srv.config())
			var s uploader.Store = raw
			if name == "retry" {
				s = uploader.WithRetry(raw, uploader.RetryPolicy{}, nil)
			}
			c := newComposed(t, s)
			res, err := c.put(t, s.(uploader.Composer), "snapshots/new.sqfs")
			if err != nil {
				t.Fatal(err)
			}
			size := int64(len(c.local))
			// Sent: the first part (5 MiB: the new header widened with
			// copyable bytes), the middle gap widened to 5 MiB, and the
			// rest after the last long run.
			if res.Size != size || res.Sent+res.Copied != size || res.Copied < 12*mib || res.Sent > 13*mib {
				t.Errorf("result %+v for a %d-byte object", res, size)
			}
			if got := getAll(t, s, "snapshots/new.sqfs"); !bytes.Equal(got, c.local) {
				t.Fatal("composed object differs from the local file")
			}
			if st, err := s.Stat(t.Context(), "snapshots/new.sqfs"); err != nil || st.ETag != res.ETag {
				t.Errorf("stat %+v, %v; put said ETag %s", st, err, res.ETag)
			}
			if n := incompleteUploadsOf(t, raw); n != 0 {
				t.Errorf("%d incomplete multipart uploads left", n)
			}
		})
	}
}

// Too little to copy: a plain put.
func TestPutComposedPlain(t *testing.T) {
	srv := startServer(t)
	s := srv.store(t, srv.config())
	c := newComposed(t, s)
	c.ranges = c.ranges[2:] // only the short one
	res, err := c.put(t, s, "snapshots/new.sqfs")
	if err != nil || res.Copied != 0 || res.Sent != int64(len(c.local)) {
		t.Fatalf("%+v, %v", res, err)
	}
	if !bytes.Equal(getAll(t, s, "snapshots/new.sqfs"), c.local) {
		t.Fatal("object differs from the local file")
	}
}

// A source that changed or went away since its ETag was read, or whose
// copied bytes are not what the caller said, fails the put cleanly:
// nothing stored, no upload left behind, an error the catalog recognises.
func TestPutComposedRefused(t *testing.T) {
	srv := startServer(t)
	for _, c := range []struct {
		name    string
		breakIt func(t *testing.T, s *s3.Store, c *composed)
		want    error
	}{
		{"changed", func(t *testing.T, s *s3.Store, c *composed) {
			b := rnd(int(c.src.Size))
			if _, err := s.Put(t.Context(), c.src.Key, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
				t.Fatal(err)
			}
		}, uploader.ErrPrecondition},
		{"missing", func(t *testing.T, s *s3.Store, c *composed) {
			if err := s.Delete(t.Context(), c.src.Key); err != nil {
				t.Fatal(err)
			}
		}, iofs.ErrNotExist},
		{"mismatch", func(t *testing.T, s *s3.Store, c *composed) {
			// The local file differs inside a range it says is copied.
			r := c.ranges[1]
			c.local[r.Offset+r.Length-12345] ^= 1
			os.WriteFile(c.path, c.local, 0o600)
		}, uploader.ErrComposeMismatch},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := srv.store(t, srv.config())
			cc := newComposed(t, s)
			c.breakIt(t, s, cc)
			_, err := cc.put(t, uploader.WithRetry(s, uploader.RetryPolicy{}, nil), "snapshots/new.sqfs")
			if !errors.Is(err, c.want) {
				t.Fatalf("got %v, want %v", err, c.want)
			}
			if _, err := s.Stat(t.Context(), "snapshots/new.sqfs"); !errors.Is(err, iofs.ErrNotExist) {
				t.Errorf("a refused put left an object: %v", err)
			}
			if n := incompleteUploadsOf(t, s); n != 0 {
				t.Errorf("%d incomplete multipart uploads left", n)
			}
		})
	}
}

// Failures of every kind on the copy requests are retried and the object
// still comes out byte for byte.
func TestPutComposedFaults(t *testing.T) {
	f := newFaulty(t)
	through := f.cat.Store()
	c := newComposed(t, f.raw)
	// The first attempt of every copy fails, each in another way.
	faults := []faultproxy.Fault{faultproxy.ErrorAfter, faultproxy.ResetAfter, faultproxy.Error500, faultproxy.Reset, faultproxy.SlowDown}
	n := 0
	f.proxy.SetRule(func(r faultproxy.Request) faultproxy.Fault {
		if r.Op != "UploadPartCopy" {
			return faultproxy.Pass
		}
		n++
		if n%2 == 1 {
			return faults[(n/2)%len(faults)]
		}
		return faultproxy.Pass
	})
	res, err := c.put(t, through.(uploader.Composer), "snapshots/new.sqfs")
	f.proxy.SetRule(nil)
	if err != nil {
		t.Fatal(err)
	}
	if res.Copied == 0 {
		t.Fatalf("nothing copied: %+v", res)
	}
	ops, _ := f.proxy.Counts()
	if ops["UploadPartCopy"] < 4 {
		t.Errorf("requests %v: the copies were not retried", ops)
	}
	if !bytes.Equal(getAll(t, f.raw, "snapshots/new.sqfs"), c.local) {
		t.Fatal("object differs from the local file")
	}
	if n := incompleteUploadsOf(t, f.raw); n != 0 {
		t.Errorf("%d incomplete multipart uploads left", n)
	}
}

// A server whose copied parts come back with ETags that are not MD5s
// (SSE-KMS, SSE-C) cannot have its copies checked: the composed put fails
// with errors.ErrUnsupported, leaves no upload behind, and the store
// composes no more (no copy is even tried again).
func TestPutComposedOpaqueETags(t *testing.T) {
	f := newFaulty(t)
	through := f.cat.Store()
	c := newComposed(t, f.raw)
	f.proxy.SetRule(func(r faultproxy.Request) faultproxy.Fault {
		if r.Op == "UploadPartCopy" {
			return faultproxy.OpaqueETag
		}
		return faultproxy.Pass
	})
	defer f.proxy.SetRule(nil)
	if _, err := c.put(t, through.(uploader.Composer), "snapshots/new.sqfs"); !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("composed put with unverifiable copies: %v, want errors.ErrUnsupported", err)
	}
	if _, err := f.raw.Stat(t.Context(), "snapshots/new.sqfs"); !errors.Is(err, iofs.ErrNotExist) {
		t.Errorf("object stored anyway: %v", err)
	}
	if n := incompleteUploadsOf(t, f.raw); n != 0 {
		t.Errorf("%d incomplete multipart uploads left", n)
	}
	ops, _ := f.proxy.Counts()
	copies := ops["UploadPartCopy"]
	if copies == 0 {
		t.Fatal("no copy was tried")
	}
	if _, err := c.put(t, through.(uploader.Composer), "snapshots/new2.sqfs"); !errors.Is(err, errors.ErrUnsupported) {
		t.Fatalf("second composed put: %v, want errors.ErrUnsupported", err)
	}
	if ops, _ = f.proxy.Counts(); ops["UploadPartCopy"] != copies {
		t.Errorf("copies tried again after the server's ETags proved unverifiable (%d -> %d)", copies, ops["UploadPartCopy"])
	}
	if through.(uploader.Composer).CanCompose() {
		t.Error("the store still says it can compose")
	}
}
