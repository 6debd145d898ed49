package s3_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/aws/aws-sdk-go-v2/aws"
	awss3 "github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/s3"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storetest"
)

// server is one versitygw for a test, handing out empty prefixes.
type server struct {
	endpoint, bucket, access, secret string
	n                                atomic.Int64
}

func startServer(t *testing.T) *server {
	endpoint, bucket, access, secret := s3test.Start(t)
	return &server{endpoint: endpoint, bucket: bucket, access: access, secret: secret}
}

func (s *server) config() s3.Config {
	return s3.Config{
		Bucket:          s.bucket,
		Prefix:          fmt.Sprintf("t%d/agent", s.n.Add(1)),
		Endpoint:        s.endpoint,
		Region:          "us-east-1",
		PathStyle:       true,
		AccessKeyID:     s.access,
		SecretAccessKey: s.secret,
		PartSize:        s3.MinPartSize,
		Concurrency:     3,
	}
}

func (s *server) store(t *testing.T, c s3.Config) *s3.Store {
	st, err := s3.New(t.Context(), c)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func TestS3Conformance(t *testing.T) {
	srv := startServer(t)
	storetest.Run(t, func(t *testing.T) uploader.Store {
		return srv.store(t, srv.config())
	}, storetest.Options{LargeSize: 12<<20 + 12345}) // three 5 MiB parts, the last one short
}

func TestS3RetryConformance(t *testing.T) {
	srv := startServer(t)
	storetest.Run(t, func(t *testing.T) uploader.Store {
		return uploader.WithRetry(srv.store(t, srv.config()), uploader.RetryPolicy{}, nil)
	}, storetest.Options{LargeSize: 11 << 20})
}

func incompleteUploads(t *testing.T, srv *server) int {
	out, err := s3test.Client(srv.endpoint).ListMultipartUploads(context.Background(), &awss3.ListMultipartUploadsInput{Bucket: aws.String(srv.bucket)})
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range out.Uploads {
		t.Logf("incomplete upload of %s (id %s)", aws.ToString(u.Key), aws.ToString(u.UploadId))
	}
	return len(out.Uploads)
}

type failAfter struct {
	r io.Reader
	n int64
}

func (f *failAfter) Read(p []byte) (int, error) {
	if f.n <= 0 {
		return 0, errors.New("source broke")
	}
	p = p[:min(int64(len(p)), f.n)]
	n, err := f.r.Read(p)
	f.n -= int64(n)
	return n, err
}

// A multipart upload that fails, or loses its condition, is aborted: no
// parts are left behind in the bucket.
func TestS3MultipartAbort(t *testing.T) {
	srv := startServer(t)
	st := srv.store(t, srv.config())
	ctx := t.Context()
	data := bytes.Repeat([]byte("hermes"), 3<<20) // 18 MiB: four parts
	_, err := st.Put(ctx, "a", &failAfter{r: bytes.NewReader(data), n: 12 << 20}, -1, uploader.PutOptions{})
	if err == nil || !strings.Contains(err.Error(), "source broke") {
		t.Fatalf("broken stream: %v", err)
	}
	if _, err := st.Put(ctx, "b", bytes.NewReader(data), int64(len(data)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	_, err = st.Put(ctx, "b", bytes.NewReader(data), int64(len(data)), uploader.PutOptions{IfNoneMatch: true})
	if !errors.Is(err, uploader.ErrPrecondition) {
		t.Fatalf("create-only multipart over an object: %v", err)
	}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := st.Put(cctx, "c", bytes.NewReader(data), int64(len(data)), uploader.PutOptions{}); err == nil {
		t.Fatal("canceled put succeeded")
	}
	if n := incompleteUploads(t, srv); n != 0 {
		t.Errorf("%d incomplete multipart uploads left in the bucket", n)
	}
	// A file longer or shorter than declared is refused before any upload.
	for _, size := range []int64{int64(len(data)) - 1, int64(len(data)) + 1} {
		if _, err := st.Put(ctx, "d", bytes.NewReader(data), size, uploader.PutOptions{}); err == nil || !uploader.IsPermanent(err) {
			t.Errorf("declared size %d for %d bytes: %v", size, len(data), err)
		}
	}
}

// Wrong credentials and a missing bucket are permanent: retrying cannot
// help, and the error names the problem.
func TestS3PermanentErrors(t *testing.T) {
	srv := startServer(t)
	c := srv.config()
	c.SecretAccessKey = "wrong"
	_, err := srv.store(t, c).Stat(t.Context(), "LATEST")
	if !uploader.IsPermanent(err) || strings.Contains(err.Error(), "wrong") {
		t.Errorf("bad secret: %v (permanent %v); want permanent and the secret not shown", err, uploader.IsPermanent(err))
	}
	c = srv.config()
	c.Bucket = "no-such-bucket"
	_, err = srv.store(t, c).Put(t.Context(), "x", strings.NewReader("x"), 1, uploader.PutOptions{})
	if !uploader.IsPermanent(err) || !strings.Contains(err.Error(), "NoSuchBucket") {
		t.Errorf("missing bucket: %v", err)
	}
}
