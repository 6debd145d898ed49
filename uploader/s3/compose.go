package s3

import (
	"context"
	"crypto/md5"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"net/url"
	"strings"
	"sync"

	"github.com/aws/aws-sdk-go-v2/aws"
	awss3 "github.com/aws/aws-sdk-go-v2/service/s3"

	"github.com/hermesfs/hermesfs/uploader"
)

// A composed put is a multipart upload whose parts are either copies of a
// range of the source object, made by the server (UploadPartCopy, on the
// condition that the source still has the ETag the caller knows), or bytes
// sent from the local file. Every part but the last must be at least 5 MiB
// (MinPartSize), so copy ranges shorter than that are sent instead, and a
// gap to send that is shorter is widened with bytes of the neighbouring
// copy range: the local file holds every byte, so sending one that could
// have been copied is always correct.
//
// The server answers each copied part with its ETag, which AWS, MinIO,
// versitygw and R2 make the MD5 of the part's bytes: it is compared with
// the MD5 of the same range of the local file, so an object assembled
// from copies is checked end to end, not only trusted.

var _ uploader.Composer = (*Store)(nil)

// maxCopyPart is the largest part UploadPartCopy accepts.
const maxCopyPart = 5 << 30

// composedPart is one part of a composed put: n bytes at off of the new
// object, copied from src of the source when copy is set, else sent.
type composedPart struct {
	off, n    int64
	copy      bool
	src       int64
	unchecked bool                    // a copy not compared with local (ComposeRange.Unchecked)
	from      *uploader.ComposeSource // the range's own source, if it names one
}

// planParts cuts an object of size bytes into parts, copying what ranges
// allow: every part but the last at least minPart bytes, sent parts of
// about partSize, copied parts up to maxCopyPart. A gap to send that is
// shorter than minPart is widened with bytes from the end of the copy
// before it, as far as that copy stays minPart long, then from the start
// of the copy after it; a copy that cannot stay minPart long is sent.
func planParts(size int64, ranges []uploader.ComposeRange, minPart, partSize int64) (parts []composedPart, sent, copied int64) {
	var kept []composedPart // the copies, trimmed
	for _, r := range ranges {
		c := composedPart{off: r.Offset, n: r.Length, copy: true, src: r.SourceOffset, unchecked: r.Unchecked, from: r.Source}
		var prev *composedPart
		end := int64(0)
		if len(kept) > 0 {
			prev = &kept[len(kept)-1]
			end = prev.off + prev.n
		}
		if gap := c.off - end; gap > 0 && gap < minPart {
			need := minPart - gap
			fromPrev := int64(0)
			if prev != nil {
				fromPrev = min(need, prev.n-minPart)
			}
			fromNext := need - fromPrev
			if c.n-fromNext < minPart {
				continue // sent with the gap before the next range
			}
			if prev != nil {
				prev.n -= fromPrev
			}
			c.off, c.src, c.n = c.off+fromNext, c.src+fromNext, c.n-fromNext
		}
		if c.n < minPart {
			continue
		}
		kept = append(kept, c)
	}
	var segs []composedPart
	pos := int64(0)
	for _, c := range kept {
		if gap := c.off - pos; gap > 0 {
			segs = append(segs, composedPart{off: pos, n: gap})
		}
		segs = append(segs, c)
		pos = c.off + c.n
	}
	if tail := size - pos; tail > 0 {
		segs = append(segs, composedPart{off: pos, n: tail}) // the last part may be short
	}
	for _, s := range segs {
		limit := partSize
		if s.copy {
			limit = maxCopyPart
			copied += s.n
		} else {
			sent += s.n
		}
		// k parts of at least limit each (the remainder spread over them),
		// so none falls under minPart.
		k := max(int64(1), s.n/limit)
		if s.copy {
			k = (s.n + limit - 1) / limit
		}
		for i := range k {
			lo, hi := s.n*i/k, s.n*(i+1)/k
			p := composedPart{off: s.off + lo, n: hi - lo, copy: s.copy, unchecked: s.unchecked, from: s.from}
			if s.copy {
				p.src = s.src + lo
			}
			parts = append(parts, p)
		}
	}
	return parts, sent, copied
}

// PutComposed implements uploader.Composer with a multipart upload of
// server-side copies and sent parts. It puts plainly when nothing can be
// copied (no range of at least MinPartSize) or when the parts would
// exceed S3's limit of 10,000.
// CanCompose reports whether PutComposed may copy: not once the server
// answered a part copy with an ETag that is not an MD5.
func (s *Store) CanCompose() bool { return !s.uncheckedCopies.Load() }

func (s *Store) PutComposed(ctx context.Context, key string, local io.ReaderAt, size int64, src uploader.ComposeSource, ranges []uploader.ComposeRange, opts uploader.PutOptions) (uploader.ComposeResult, error) {
	if err := uploader.CheckComposeArgs(key, size, src, ranges, opts); err != nil {
		return uploader.ComposeResult{}, fmt.Errorf("s3: put %s: %w", key, err)
	}
	if !s.CanCompose() {
		return uploader.ComposeResult{}, fmt.Errorf("s3: put %s: this server's copied parts cannot be checked: %w", key, errors.ErrUnsupported)
	}
	parts, sent, copied := planParts(size, ranges, MinPartSize, s.partSizeFor(size))
	if copied == 0 || len(parts) > maxParts {
		info, err := s.Put(ctx, key, io.NewSectionReader(local, 0, size), size, opts)
		return uploader.ComposeResult{ObjectInfo: info, Sent: size}, err
	}
	// The local file must hold exactly size bytes, as for Put.
	var b [1]byte
	if _, err := local.ReadAt(b[:], size-1); err != nil {
		return uploader.ComposeResult{}, fmt.Errorf("s3: put %s: %w", key, uploader.Permanent(fmt.Errorf("source shorter than %d bytes: %w", size, err)))
	}
	if n, _ := local.ReadAt(b[:], size); n > 0 {
		return uploader.ComposeResult{}, fmt.Errorf("s3: put %s: %w", key, uploader.Permanent(fmt.Errorf("source longer than %d bytes", size)))
	}
	next := func(i int) (part, error) {
		if i >= len(parts) {
			return part{}, io.EOF
		}
		p := parts[i]
		if !p.copy {
			return s.bodies(key, func(int) (io.ReadSeeker, int64, func(), error) {
				return io.NewSectionReader(local, p.off, p.n), p.n, func() {}, nil
			})(i)
		}
		from := src
		if p.from != nil {
			from = *p.from
		}
		return s.copyPart(key, local, from, p), nil
	}
	info, err := s.multipartChecked(ctx, key, next, opts, func() error { return nil })
	if err != nil {
		err = s.wrap("put composed", key, err)
		if opts.IfMatch != "" && errors.Is(err, iofs.ErrNotExist) {
			err = fmt.Errorf("%w (%w)", err, uploader.ErrPrecondition)
		}
		return uploader.ComposeResult{}, err
	}
	return uploader.ComposeResult{ObjectInfo: info, Sent: sent, Copied: copied}, nil
}

// copyPart is a part the server copies from src, checked against the MD5
// of the local bytes it stands for.
func (s *Store) copyPart(key string, local io.ReaderAt, src uploader.ComposeSource, p composedPart) part {
	var (
		once    sync.Once
		sum     string
		sumErr  error
		srcPath = copySource(s.bucket, s.prefix+src.Key)
	)
	localMD5 := func(ctx context.Context) (string, error) {
		once.Do(func() {
			h := md5.New()
			if _, err := io.Copy(h, uploader.ContextReader(ctx, io.NewSectionReader(local, p.off, p.n))); err != nil {
				sumErr = uploader.Permanent(fmt.Errorf("read %d bytes at %d: %w", p.n, p.off, err))
				return
			}
			sum = hex.EncodeToString(h.Sum(nil))
		})
		return sum, sumErr
	}
	return part{n: p.n, done: func() {}, send: func(ctx context.Context, uploadID *string, num int32) (*string, error) {
		if p.unchecked {
			return s.serverCopy(ctx, key, uploadID, num, srcPath, src, p)
		}
		// Hash the local bytes while the server copies (the hash stops
		// when ctx ends).
		// A copy that cannot be checked stops it early (stopHash); any
		// other failure lets it finish, for the retry to use.
		hctx, stopHash := context.WithCancel(ctx)
		defer stopHash()
		hashed := make(chan struct{})
		go func() { localMD5(hctx); close(hashed) }()
		defer func() { <-hashed }()
		etag, err := s.serverCopy(ctx, key, uploadID, num, srcPath, src, p)
		if err != nil {
			return nil, err
		}
		got := strings.Trim(*etag, `"`)
		if !isMD5(got) {
			// Nothing to check the copy against: never trust it, and
			// stop composing with this server.
			stopHash()
			if !s.uncheckedCopies.Swap(true) {
				s.log.Warn("composing snapshots from earlier ones is off for this store: it answers part copies with ETags that are not MD5s, so copies cannot be checked; archives are uploaded whole", "etag", got)
			}
			return nil, uploader.Permanent(fmt.Errorf("part %d copied from %s: ETag %q is not an MD5, the copy cannot be checked: %w",
				num, src.Key, got, errors.ErrUnsupported))
		}
		want, err := localMD5(ctx)
		if err != nil {
			return nil, err
		}
		if got != want {
			return nil, uploader.Permanent(fmt.Errorf("part %d, bytes %d-%d copied from %s at %d: MD5 %s, local %s: %w",
				num, p.off, p.off+p.n-1, src.Key, p.src, got, want, uploader.ErrComposeMismatch))
		}
		return etag, nil
	}}
}

func isMD5(etag string) bool {
	if len(etag) != 32 {
		return false
	}
	_, err := hex.DecodeString(etag)
	return err == nil
}

// copySource is the x-amz-copy-source value for key in bucket: URL-encoded,
// slashes kept.
func copySource(bucket, key string) string {
	segs := strings.Split(key, "/")
	for i, s := range segs {
		segs[i] = url.PathEscape(s)
	}
	return url.PathEscape(bucket) + "/" + strings.Join(segs, "/")
}

// serverCopy has the server copy part num from the source as the caller
// knows it (its ETag) and returns the part's ETag, unchecked: what a range
// of bytes local does not hold at hand (uploader.ComposeRange.Unchecked)
// is taken as; the checked path compares it with the local bytes' MD5.
func (s *Store) serverCopy(ctx context.Context, key string, uploadID *string, num int32, srcPath string, src uploader.ComposeSource, p composedPart) (*string, error) {
	out, err := s.client.UploadPartCopy(ctx, &awss3.UploadPartCopyInput{
		Bucket:            aws.String(s.bucket),
		Key:               s.full(key),
		UploadId:          uploadID,
		PartNumber:        aws.Int32(num),
		CopySource:        aws.String(srcPath),
		CopySourceRange:   aws.String(fmt.Sprintf("bytes=%d-%d", p.src, p.src+p.n-1)),
		CopySourceIfMatch: aws.String(`"` + src.ETag + `"`),
	})
	if err != nil {
		return nil, err
	}
	if out.CopyPartResult == nil || out.CopyPartResult.ETag == nil {
		return nil, errors.New("no ETag for the copied part")
	}
	return out.CopyPartResult.ETag, nil
}
