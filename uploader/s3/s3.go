// Package s3 is the uploader.Store for Amazon S3 and S3-compatible servers
// (Cloudflare R2, MinIO, versitygw), on aws-sdk-go-v2.
//
// Objects live under a key prefix in one bucket. Big objects go up as
// multipart uploads, a bounded number of parts at a time: from an
// io.ReaderAt (an *os.File) the parts are read in place, so memory stays
// flat; from a plain stream each part is buffered, so memory is at most
// PartSize × Concurrency. A failed multipart upload is aborted, so no
// invisible parts keep costing storage. Conditional puts send If-None-Match
// or If-Match (on PutObject and on CompleteMultipartUpload), which AWS, R2
// and versitygw honour atomically.
//
// The SDK makes one attempt per request and its retry token bucket is off:
// retries belong to uploader.WithRetry, whose backoff neither multiplies
// with the SDK's nor fails fast during a long outage. Request checksums are
// computed only when an operation requires them (R2 rejects some of the
// SDK's default trailing checksums on multipart uploads).
package s3

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	awsmiddleware "github.com/aws/aws-sdk-go-v2/aws/middleware"
	"github.com/aws/aws-sdk-go-v2/aws/ratelimit"
	"github.com/aws/aws-sdk-go-v2/aws/retry"
	awshttp "github.com/aws/aws-sdk-go-v2/aws/transport/http"
	"github.com/aws/aws-sdk-go-v2/config"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awss3 "github.com/aws/aws-sdk-go-v2/service/s3"
	"github.com/aws/aws-sdk-go-v2/service/s3/types"
	"github.com/aws/smithy-go"
	"github.com/aws/smithy-go/logging"
	smithymiddleware "github.com/aws/smithy-go/middleware"
	smithyhttp "github.com/aws/smithy-go/transport/http"

	"github.com/hermesfs/hermesfs/uploader"
)

// Config describes a bucket prefix and how to reach it. Only Bucket is
// required; New fills in the defaults.
type Config struct {
	Bucket string
	// Prefix is prepended to every key ("team/agent1" stores LATEST as
	// "team/agent1/LATEST"). Leading and trailing slashes are ignored.
	Prefix string
	// Endpoint is the server's URL, e.g. https://ACCOUNT.r2.cloudflarestorage.com
	// or http://127.0.0.1:9000; empty means AWS (or AWS_ENDPOINT_URL_S3, which
	// the SDK reads itself).
	Endpoint string
	// Region; empty means the SDK's configuration (AWS_REGION, ~/.aws/config),
	// else us-east-1. R2 wants "auto".
	Region string
	// PathStyle addresses the bucket as ENDPOINT/BUCKET/KEY instead of
	// BUCKET.ENDPOINT/KEY; MinIO and most self-hosted servers need it.
	PathStyle bool
	// AccessKeyID and SecretAccessKey (and SessionToken), if set, are used
	// instead of the standard credential chain (environment, shared files,
	// SSO, instance roles).
	AccessKeyID, SecretAccessKey, SessionToken string

	// PartSize is the size of a multipart upload's parts (default 16 MiB,
	// at least 5 MiB); objects up to this size go up in one request.
	PartSize int64
	// Concurrency is how many parts are in flight at once (default 4).
	Concurrency int
	// HTTPClient, if set, sends the requests (tests route it through a
	// fault-injecting proxy by Endpoint instead).
	HTTPClient *http.Client
	// Logger receives multipart aborts that fail; nil discards.
	Logger *slog.Logger
}

// Defaults and limits for Config.
const (
	DefaultPartSize    = 16 << 20
	MinPartSize        = 5 << 20
	DefaultConcurrency = 4
	maxParts           = 10000
)

// Store is an uploader.Store on one S3 bucket prefix.
type Store struct {
	client *awss3.Client
	bucket string
	prefix string // "" or ending in "/"
	part   int64
	conc   int
	log    *slog.Logger

	// uncheckedCopies is set once the server answered a part copy with
	// an ETag that is not the part's MD5 (SSE-KMS, SSE-C, some
	// S3-compatible servers): PutComposed then refuses, and the catalog
	// uploads archives whole.
	uncheckedCopies atomic.Bool
}

var _ uploader.Store = (*Store)(nil)

// New connects a Store. It does not send any request: a wrong bucket or
// credentials show up on first use, as a permanent error.
func New(ctx context.Context, c Config) (*Store, error) {
	if c.Bucket == "" {
		return nil, errors.New("s3: no bucket")
	}
	if c.PartSize == 0 {
		c.PartSize = DefaultPartSize
	}
	if c.PartSize < MinPartSize {
		return nil, fmt.Errorf("s3: part size %d below the minimum %d", c.PartSize, MinPartSize)
	}
	if c.Concurrency <= 0 {
		c.Concurrency = DefaultConcurrency
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	opts := []func(*config.LoadOptions) error{
		config.WithRetryer(func() aws.Retryer {
			return retry.NewStandard(func(o *retry.StandardOptions) {
				o.MaxAttempts = 1
				o.RateLimiter = ratelimit.None
			})
		}),
		config.WithRequestChecksumCalculation(aws.RequestChecksumCalculationWhenRequired),
		config.WithResponseChecksumValidation(aws.ResponseChecksumValidationWhenRequired),
		// The SDK's own warnings ("Response has no supported checksum",
		// credential lookups) went to stderr unasked, where they only
		// confuse: they go to the store's logger at debug level, and
		// what matters reaches the user in the errors.
		config.WithLogger(sdkLogger{c.Logger}),
	}
	if c.Region != "" {
		opts = append(opts, config.WithRegion(c.Region))
	}
	if c.AccessKeyID != "" {
		opts = append(opts, config.WithCredentialsProvider(
			credentials.NewStaticCredentialsProvider(c.AccessKeyID, c.SecretAccessKey, c.SessionToken)))
	}
	if c.HTTPClient != nil {
		opts = append(opts, config.WithHTTPClient(c.HTTPClient))
	}
	awsCfg, err := config.LoadDefaultConfig(ctx, opts...)
	if err != nil {
		return nil, fmt.Errorf("s3: load AWS configuration: %w", err)
	}
	if awsCfg.Region == "" {
		awsCfg.Region = "us-east-1"
	}
	client := awss3.NewFromConfig(awsCfg, func(o *awss3.Options) {
		o.UsePathStyle = c.PathStyle
		if c.Endpoint != "" {
			o.BaseEndpoint = aws.String(c.Endpoint)
		}
	})
	prefix := strings.Trim(c.Prefix, "/")
	if prefix != "" {
		prefix += "/"
	}
	return &Store{client: client, bucket: c.Bucket, prefix: prefix, part: c.PartSize, conc: c.Concurrency, log: c.Logger}, nil
}

// Bucket is the store's bucket.
func (s *Store) Bucket() string { return s.bucket }

// Client is the SDK client, for operations outside uploader.Store.
func (s *Store) Client() *awss3.Client { return s.client }

func (s *Store) full(key string) *string { return aws.String(s.prefix + key) }

// Put implements uploader.Store.
func (s *Store) Put(ctx context.Context, key string, r io.Reader, size int64, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	if err := uploader.CheckPutArgs(key, opts); err != nil {
		return uploader.ObjectInfo{}, fmt.Errorf("s3: put %s: %w", key, err)
	}
	var (
		info uploader.ObjectInfo
		err  error
	)
	ra, isRA := r.(io.ReaderAt)
	sk, isSeeker := r.(io.Seeker)
	if isRA && isSeeker && size >= 0 {
		info, err = s.putReaderAt(ctx, key, ra, sk, size, opts)
	} else {
		info, err = s.putStream(ctx, key, r, size, opts)
	}
	if err != nil {
		err = s.wrap("put", key, err)
		if opts.IfMatch != "" && errors.Is(err, iofs.ErrNotExist) {
			// S3 answers If-Match on a missing key with 404 NoSuchKey.
			return uploader.ObjectInfo{}, fmt.Errorf("%w (%w)", err, uploader.ErrPrecondition)
		}
		return uploader.ObjectInfo{}, err
	}
	return info, nil
}

// putReaderAt uploads size bytes of ra from the seeker's current position,
// reading parts in place.
func (s *Store) putReaderAt(ctx context.Context, key string, ra io.ReaderAt, sk io.Seeker, size int64, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	base, err := sk.Seek(0, io.SeekCurrent)
	if err != nil {
		return uploader.ObjectInfo{}, err
	}
	// The source must hold exactly size bytes: the last one, and no more.
	var b [1]byte
	if size > 0 {
		if _, err := ra.ReadAt(b[:], base+size-1); err != nil {
			return uploader.ObjectInfo{}, uploader.Permanent(fmt.Errorf("source shorter than %d bytes: %w", size, err))
		}
	}
	if n, _ := ra.ReadAt(b[:], base+size); n > 0 {
		return uploader.ObjectInfo{}, uploader.Permanent(fmt.Errorf("source longer than %d bytes", size))
	}
	partSize := s.partSizeFor(size)
	var info uploader.ObjectInfo
	if size <= partSize {
		info, err = s.putObject(ctx, key, io.NewSectionReader(ra, base, size), size, opts)
	} else {
		next := func(n int) (io.ReadSeeker, int64, func(), error) {
			off := int64(n) * partSize
			if off >= size {
				return nil, 0, nil, io.EOF
			}
			l := min(partSize, size-off)
			return io.NewSectionReader(ra, base+off, l), l, func() {}, nil
		}
		info, err = s.multipart(ctx, key, next, opts)
	}
	if err == nil {
		_, err = sk.Seek(base+size, io.SeekStart)
	}
	return info, err
}

// partSizeFor grows the part size for objects that would need more parts
// than S3 allows.
func (s *Store) partSizeFor(size int64) int64 {
	p := s.part
	for size > 0 && (size+p-1)/p > maxParts {
		p *= 2
	}
	return p
}

// putStream uploads a reader of unknown or untrusted length, buffering one
// part per upload in flight.
func (s *Store) putStream(ctx context.Context, key string, r io.Reader, size int64, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	partSize := s.part
	if size > 0 {
		partSize = s.partSizeFor(size)
	}
	first := make([]byte, partSize)
	n, err := io.ReadFull(r, first)
	if err != nil && err != io.EOF && err != io.ErrUnexpectedEOF {
		return uploader.ObjectInfo{}, fmt.Errorf("read body: %w", err)
	}
	if err != nil { // all of it fits in one request
		if size >= 0 && int64(n) != size {
			return uploader.ObjectInfo{}, uploader.Permanent(fmt.Errorf("body has %d bytes, want %d", n, size))
		}
		return s.putObject(ctx, key, bytes.NewReader(first[:n]), int64(n), opts)
	}
	pool := make(chan []byte, s.conc)
	for range s.conc - 1 {
		pool <- nil // allocated on first use
	}
	var total int64
	eof := false
	next := func(i int) (io.ReadSeeker, int64, func(), error) {
		if eof {
			return nil, 0, nil, io.EOF
		}
		buf := first
		if i > 0 {
			select {
			case buf = <-pool:
			case <-ctx.Done():
				return nil, 0, nil, ctx.Err()
			}
		}
		if buf == nil {
			buf = make([]byte, partSize)
		}
		release := func() { pool <- buf }
		k := n
		if i > 0 {
			var err error
			k, err = io.ReadFull(r, buf)
			switch {
			case err == io.EOF || err == io.ErrUnexpectedEOF:
				eof = true
			case err != nil:
				release()
				return nil, 0, nil, fmt.Errorf("read body: %w", err)
			}
			if k == 0 {
				release()
				return nil, 0, nil, io.EOF
			}
		}
		total += int64(k)
		if size >= 0 && total > size {
			release()
			return nil, 0, nil, uploader.Permanent(fmt.Errorf("body longer than %d bytes", size))
		}
		return bytes.NewReader(buf[:k]), int64(k), release, nil
	}
	info, err := s.multipartChecked(ctx, key, s.bodies(key, next), opts, func() error {
		if size >= 0 && total != size {
			return uploader.Permanent(fmt.Errorf("body has %d bytes, want %d", total, size))
		}
		return nil
	})
	return info, err
}

func (s *Store) putObject(ctx context.Context, key string, body io.ReadSeeker, size int64, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	in := &awss3.PutObjectInput{
		Bucket:        aws.String(s.bucket),
		Key:           s.full(key),
		Body:          body,
		ContentLength: aws.Int64(size),
	}
	setConditions(opts, &in.IfNoneMatch, &in.IfMatch)
	out, err := s.client.PutObject(ctx, in)
	if err != nil {
		return uploader.ObjectInfo{}, err
	}
	return uploader.ObjectInfo{Key: key, Size: size, ETag: etag(out.ETag)}, nil
}

func setConditions(opts uploader.PutOptions, ifNoneMatch, ifMatch **string) {
	if opts.IfNoneMatch {
		*ifNoneMatch = aws.String("*")
	}
	if opts.IfMatch != "" {
		*ifMatch = aws.String(strconv.Quote(opts.IfMatch))
	}
}

// nextPart returns part number i (0-based) as a body, its length and a
// function to call when the body is no longer needed, or io.EOF after the
// last part. It is called from one goroutine, in order.
type nextPart func(i int) (body io.ReadSeeker, n int64, done func(), err error)

// part is one part of a multipart upload: n bytes that send puts in
// place (sent or copied; called again on each attempt, it returns the
// part's ETag), and done, called once the part is no longer needed.
type part struct {
	n    int64
	send func(ctx context.Context, uploadID *string, num int32) (*string, error)
	done func()
}

// nextAnyPart is nextPart for parts of any kind.
type nextAnyPart func(i int) (part, error)

// bodies turns a nextPart into parts that upload their bodies.
func (s *Store) bodies(key string, next nextPart) nextAnyPart {
	return func(i int) (part, error) {
		body, n, done, err := next(i)
		if err != nil {
			return part{}, err
		}
		return part{n: n, done: done, send: func(ctx context.Context, uploadID *string, num int32) (*string, error) {
			if _, err := body.Seek(0, io.SeekStart); err != nil {
				return nil, uploader.Permanent(err)
			}
			out, err := s.client.UploadPart(ctx, &awss3.UploadPartInput{
				Bucket:        aws.String(s.bucket),
				Key:           s.full(key),
				UploadId:      uploadID,
				PartNumber:    aws.Int32(num),
				Body:          body,
				ContentLength: aws.Int64(n),
			})
			if err != nil {
				return nil, err
			}
			return out.ETag, nil
		}}, nil
	}
}

func (s *Store) multipart(ctx context.Context, key string, next nextPart, opts uploader.PutOptions) (uploader.ObjectInfo, error) {
	return s.multipartChecked(ctx, key, s.bodies(key, next), opts, func() error { return nil })
}

// multipartChecked uploads the parts next yields, Concurrency at a time,
// and completes the upload if check (run after the last part was read)
// passes. On any failure the upload is aborted.
func (s *Store) multipartChecked(ctx context.Context, key string, next nextAnyPart, opts uploader.PutOptions, check func() error) (_ uploader.ObjectInfo, err error) {
	var created *awss3.CreateMultipartUploadOutput
	retried := false
	err = uploader.RetryRequest(ctx, "create multipart upload", key, func(attempt int) error {
		var err error
		retried = retried || attempt > 0
		created, err = s.client.CreateMultipartUpload(ctx, &awss3.CreateMultipartUploadInput{
			Bucket: aws.String(s.bucket),
			Key:    s.full(key),
		})
		return s.wrap("create multipart upload", key, err)
	})
	if retried {
		// A create whose answer was lost may still have made an upload
		// on the server, which nobody would ever abort.
		defer s.abortOthers(ctx, key, created)
	}
	if err != nil {
		return uploader.ObjectInfo{}, err
	}
	uploadID := created.UploadId
	defer func() {
		if err != nil {
			s.abort(ctx, key, uploadID)
		}
	}()

	// A failure stops new parts but lets those in flight finish: a request
	// cut off mid-body can land on the server after the abort and leave the
	// upload behind. Only the caller's cancellation cuts them off.
	pctx := ctx
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		partErr error
		parts   []types.CompletedPart
		total   int64
		slots   = make(chan struct{}, s.conc)
		stop    = make(chan struct{})
	)
	fail := func(err error) {
		mu.Lock()
		if partErr == nil {
			partErr = err
			close(stop)
		}
		mu.Unlock()
	}
	for i := 0; ; i++ {
		select {
		case slots <- struct{}{}:
		case <-pctx.Done():
		case <-stop:
		}
		mu.Lock()
		failed := partErr != nil
		mu.Unlock()
		if failed || pctx.Err() != nil {
			break
		}
		pt, err := next(i)
		if err == io.EOF {
			<-slots
			break
		}
		if err != nil {
			<-slots
			fail(err)
			break
		}
		total += pt.n
		num := int32(i + 1)
		wg.Go(func() {
			defer func() { pt.done(); <-slots }()
			var etag *string
			what := fmt.Sprintf("upload part %d", num)
			err := uploader.RetryRequest(pctx, what, key, func(int) error {
				var err error
				etag, err = pt.send(pctx, uploadID, num)
				return s.wrap(what, key, err)
			})
			if err != nil {
				fail(err)
				return
			}
			mu.Lock()
			parts = append(parts, types.CompletedPart{ETag: etag, PartNumber: aws.Int32(num)})
			mu.Unlock()
		})
	}
	wg.Wait()
	if partErr != nil {
		return uploader.ObjectInfo{}, partErr
	}
	if err := ctx.Err(); err != nil {
		return uploader.ObjectInfo{}, err
	}
	if err := check(); err != nil {
		return uploader.ObjectInfo{}, err
	}
	slices.SortFunc(parts, func(a, b types.CompletedPart) int { return int(*a.PartNumber - *b.PartNumber) })
	in := &awss3.CompleteMultipartUploadInput{
		Bucket:          aws.String(s.bucket),
		Key:             s.full(key),
		UploadId:        uploadID,
		MultipartUpload: &types.CompletedMultipartUpload{Parts: parts},
	}
	setConditions(opts, &in.IfNoneMatch, &in.IfMatch)
	var info uploader.ObjectInfo
	err = uploader.RetryRequest(ctx, "complete multipart upload", key, func(attempt int) error {
		out, err := s.client.CompleteMultipartUpload(ctx, in)
		if err == nil {
			info = uploader.ObjectInfo{Key: key, Size: total, ETag: etag(out.ETag)}
			return nil
		}
		if attempt > 0 && apiCode(err) == "NoSuchUpload" {
			// An earlier attempt completed the upload but its answer was
			// lost. The object is ours if it has our size: keys written by
			// multipart (archives) have one writer.
			if st, serr := s.Stat(ctx, key); serr == nil && st.Size == total {
				info = st
				return nil
			}
		}
		return s.wrap("complete multipart upload", key, err)
	})
	if err != nil {
		return uploader.ObjectInfo{}, err
	}
	return info, nil
}

func apiCode(err error) string {
	var apiErr smithy.APIError
	if errors.As(err, &apiErr) {
		return apiErr.ErrorCode()
	}
	return ""
}

// abort gives up a multipart upload, even when ctx was canceled: the parts
// would otherwise stay in the bucket, invisible and billed.
//
// A part whose request was canceled may still be landing on the server
// while the abort runs, so, as S3's documentation advises, the abort is
// repeated until the upload is really gone.
func (s *Store) abort(ctx context.Context, key string, uploadID *string) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	var err error
	for attempt := range 5 {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
		}
		_, err = s.client.AbortMultipartUpload(actx, &awss3.AbortMultipartUploadInput{
			Bucket:   aws.String(s.bucket),
			Key:      s.full(key),
			UploadId: uploadID,
		})
		if err != nil && apiCode(err) != "NoSuchUpload" {
			if actx.Err() != nil {
				break
			}
			continue // a failed abort (a 500, a reset) is tried again
		}
		_, lerr := s.client.ListParts(actx, &awss3.ListPartsInput{
			Bucket:   aws.String(s.bucket),
			Key:      s.full(key),
			UploadId: uploadID,
		})
		if apiCode(lerr) == "NoSuchUpload" {
			return
		}
	}
	s.log.Warn("could not abort multipart upload; a lifecycle rule for incomplete uploads cleans it up", "key", key, "err", err)
}

// abortOthers aborts every multipart upload of key but keep's (nil: all):
// those a create made whose answer never arrived. Keys of archives are
// written by one publisher only, so any other upload of key is ours.
func (s *Store) abortOthers(ctx context.Context, key string, keep *awss3.CreateMultipartUploadOutput) {
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	full := s.full(key)
	var out *awss3.ListMultipartUploadsOutput
	var err error
	for attempt := range 5 {
		if attempt > 0 {
			time.Sleep(time.Duration(attempt) * 50 * time.Millisecond)
		}
		out, err = s.client.ListMultipartUploads(actx, &awss3.ListMultipartUploadsInput{Bucket: aws.String(s.bucket), Prefix: full})
		if err == nil || actx.Err() != nil {
			break
		}
	}
	if err != nil {
		s.log.Warn("could not list multipart uploads to abort those a lost answer left; a lifecycle rule for incomplete uploads cleans them up", "key", key, "err", err)
		return
	}
	for _, u := range out.Uploads {
		if aws.ToString(u.Key) != aws.ToString(full) || (keep != nil && aws.ToString(u.UploadId) == aws.ToString(keep.UploadId)) {
			continue
		}
		s.abort(ctx, key, u.UploadId)
	}
}

// Get implements uploader.Store.
func (s *Store) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	if err := uploader.CheckGetArgs(key, off, length); err != nil {
		return nil, uploader.ObjectInfo{}, fmt.Errorf("s3: get %s: %w", key, err)
	}
	if length == 0 {
		return s.emptyAt(ctx, key, off)
	}
	in := &awss3.GetObjectInput{Bucket: aws.String(s.bucket), Key: s.full(key)}
	switch {
	case length > 0:
		in.Range = aws.String(fmt.Sprintf("bytes=%d-%d", off, off+length-1))
	case off > 0:
		in.Range = aws.String(fmt.Sprintf("bytes=%d-", off))
	}
	out, err := s.client.GetObject(ctx, in)
	if err != nil {
		err = s.wrap("get", key, err)
		if errors.Is(err, uploader.ErrInvalidRange) {
			return s.emptyAt(ctx, key, off) // off at the end is an empty read
		}
		return nil, uploader.ObjectInfo{}, err
	}
	info := uploader.ObjectInfo{Key: key, ETag: etag(out.ETag), ModTime: aws.ToTime(out.LastModified), Size: aws.ToInt64(out.ContentLength),
		StoreTime: serverDate(out.ResultMetadata)}
	if cr := aws.ToString(out.ContentRange); cr != "" {
		if i := strings.LastIndexByte(cr, '/'); i >= 0 {
			if total, err := strconv.ParseInt(cr[i+1:], 10, 64); err == nil {
				info.Size = total
			}
		}
	}
	return out.Body, info, nil
}

// emptyAt answers a zero-length read at off.
func (s *Store) emptyAt(ctx context.Context, key string, off int64) (io.ReadCloser, uploader.ObjectInfo, error) {
	info, err := s.Stat(ctx, key)
	if err != nil {
		return nil, uploader.ObjectInfo{}, err
	}
	if off > info.Size {
		return nil, uploader.ObjectInfo{}, uploader.Permanent(fmt.Errorf("s3: get %s: offset %d past size %d: %w", key, off, info.Size, uploader.ErrInvalidRange))
	}
	return uploader.EmptyBody(), info, nil
}

// Stat implements uploader.Store.
func (s *Store) Stat(ctx context.Context, key string) (uploader.ObjectInfo, error) {
	if err := uploader.ValidKey(key); err != nil {
		return uploader.ObjectInfo{}, fmt.Errorf("s3: stat %s: %w", key, uploader.Permanent(err))
	}
	out, err := s.client.HeadObject(ctx, &awss3.HeadObjectInput{Bucket: aws.String(s.bucket), Key: s.full(key)})
	if err != nil {
		return uploader.ObjectInfo{}, s.wrap("stat", key, err)
	}
	return uploader.ObjectInfo{Key: key, Size: aws.ToInt64(out.ContentLength), ETag: etag(out.ETag), ModTime: aws.ToTime(out.LastModified),
		StoreTime: serverDate(out.ResultMetadata)}, nil
}

// List implements uploader.Store.
func (s *Store) List(ctx context.Context, prefix string, fn func(uploader.ObjectInfo) error) error {
	p := awss3.NewListObjectsV2Paginator(s.client, &awss3.ListObjectsV2Input{
		Bucket: aws.String(s.bucket),
		Prefix: aws.String(s.prefix + prefix),
	})
	for p.HasMorePages() {
		page, err := p.NextPage(ctx)
		if err != nil {
			return s.wrap("list", prefix, err)
		}
		for _, o := range page.Contents {
			key := strings.TrimPrefix(aws.ToString(o.Key), s.prefix)
			if uploader.ValidKey(key) != nil {
				continue // not ours: "dir/" markers made by other tools
			}
			err := fn(uploader.ObjectInfo{Key: key, Size: aws.ToInt64(o.Size), ETag: etag(o.ETag), ModTime: aws.ToTime(o.LastModified)})
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// Delete implements uploader.Store.
func (s *Store) Delete(ctx context.Context, key string) error {
	if err := uploader.ValidKey(key); err != nil {
		return fmt.Errorf("s3: delete %s: %w", key, uploader.Permanent(err))
	}
	_, err := s.client.DeleteObject(ctx, &awss3.DeleteObjectInput{Bucket: aws.String(s.bucket), Key: s.full(key)})
	if err != nil {
		err = s.wrap("delete", key, err)
		if errors.Is(err, iofs.ErrNotExist) {
			return nil
		}
		return err
	}
	return nil
}

func etag(p *string) string { return strings.Trim(aws.ToString(p), `"`) }

// wrap names the operation and key, and translates S3's answers into the
// Store contract's sentinels and permanence.
func (s *Store) wrap(op, key string, err error) error {
	if err == nil {
		return nil
	}
	if strings.HasPrefix(err.Error(), "s3: ") {
		return err // wrapped already, by a request inside the operation
	}
	var (
		apiErr smithy.APIError
		resp   *awshttp.ResponseError
		code   string
		status int
	)
	if errors.As(err, &apiErr) {
		code = apiErr.ErrorCode()
	}
	if errors.As(err, &resp) {
		status = resp.HTTPStatusCode()
	}
	plain := s.explain(code, status, err)
	err = fmt.Errorf("s3: %s %s: %w", op, key, err)
	if plain != "" {
		err = uploader.Explained(plain, err)
	}
	switch {
	case isCredentialsError(err):
		return uploader.Permanent(err) // no request was sent: nothing to retry
	case code == "NoSuchKey" || (status == 404 && (code == "NotFound" || code == "")):
		return fmt.Errorf("%w (%w)", err, iofs.ErrNotExist)
	case status == 412 || code == "PreconditionFailed":
		return fmt.Errorf("%w (%w)", err, uploader.ErrPrecondition)
	case status == 416 || code == "InvalidRange":
		return fmt.Errorf("%w (%w)", err, uploader.ErrInvalidRange)
	case code == "RequestTimeout" || code == "SlowDown" || code == "RequestTimeTooSkewed" ||
		code == "ConditionalRequestConflict" || code == "OperationAborted":
		return err // transient, even with a 4xx status
	case status >= 400 && status < 500 && status != 408 && status != 429:
		return uploader.Permanent(err) // 403, NoSuchBucket, InvalidArgument...
	}
	return err
}

// sdkLogger is the SDK's logger as the store's slog logger, at debug
// level.
type sdkLogger struct{ l *slog.Logger }

func (s sdkLogger) Logf(c logging.Classification, format string, v ...any) {
	s.l.Debug("aws sdk: "+fmt.Sprintf(format, v...), "class", string(c))
}

// explain says in one sentence what a failed request means to a user,
// when the answer (its code and status) or the error tells: "" when it
// is nothing a sentence helps with (a missing key, a failed condition).
func (s *Store) explain(code string, status int, err error) string {
	where := fmt.Sprintf("bucket %q", s.bucket)
	switch {
	case isCredentialsError(err):
		return "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE (~/.aws/credentials), or run where an instance role provides them"
	case code == "NoSuchBucket":
		return fmt.Sprintf("the %s does not exist (at this endpoint and region): check the bucket in --store", where)
	case code == "SignatureDoesNotMatch":
		return "the store refused the credentials: the secret key does not match the access key (check AWS_SECRET_ACCESS_KEY)"
	case code == "InvalidAccessKeyId" || code == "XAdminUserNotFound":
		return "the store does not know the access key (check AWS_ACCESS_KEY_ID)"
	case code == "ExpiredToken" || code == "InvalidToken":
		return "the store refused the credentials: the session token is expired or invalid (refresh AWS_SESSION_TOKEN, or log in again)"
	case code == "AccessDenied" || status == 403:
		return fmt.Sprintf("access to the %s was denied: the credentials lack permission for its prefix", where)
	case code == "PermanentRedirect" || code == "AuthorizationHeaderMalformed" && strings.Contains(err.Error(), "region"):
		return fmt.Sprintf("the %s is in another region: set --s3-region or AWS_REGION", where)
	case status == 0 && strings.Contains(err.Error(), "request send failed"):
		return "the store does not answer (its server cannot be reached)"
	}
	return ""
}

// isCredentialsError reports a request that was never sent because no
// credentials could be found.
func isCredentialsError(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "get credentials: ") || strings.Contains(msg, "failed to retrieve credentials") ||
		strings.Contains(msg, "failed to refresh cached credentials")
}

// serverDate is the Date header of the response: the server's clock when
// it answered (zero if absent or unreadable).
func serverDate(md smithymiddleware.Metadata) time.Time {
	resp, ok := awsmiddleware.GetRawResponse(md).(*smithyhttp.Response)
	if !ok || resp == nil {
		return time.Time{}
	}
	t, err := http.ParseTime(resp.Header.Get("Date"))
	if err != nil {
		return time.Time{}
	}
	return t
}
