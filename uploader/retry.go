package uploader

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"time"
)

// RetryPolicy is capped exponential backoff with jitter. The zero value is
// DefaultRetryPolicy.
type RetryPolicy struct {
	// MaxRetries is how many times a failed request is retried: 0 means the
	// default (3), a negative value means never; values above 5 are
	// clamped to 5, so an outage fails a request within about a minute
	// instead of hiding behind endless retries.
	MaxRetries int
	// Base is the delay before the first retry (default 200ms); each retry
	// doubles it, up to Cap (default 30s).
	Base, Cap time.Duration
	// Jitter spreads each delay by ±Jitter of itself (default 0.25), so
	// hosts that failed together do not retry together.
	Jitter float64

	// Sleep waits d or until ctx ends; nil means a timer. Tests inject one.
	Sleep func(ctx context.Context, d time.Duration) error
	// Rand returns a number in [0, 1); nil means math/rand/v2.
	Rand func() float64
}

// Defaults and limits of RetryPolicy.
const (
	DefaultMaxRetries = 3
	MaxMaxRetries     = 5
	DefaultRetryBase  = 200 * time.Millisecond
	DefaultRetryCap   = 30 * time.Second
	DefaultJitter     = 0.25
)

// DefaultRetryPolicy returns the policy used when none is configured.
func DefaultRetryPolicy() RetryPolicy { return RetryPolicy{}.withDefaults() }

func (p RetryPolicy) withDefaults() RetryPolicy {
	switch {
	case p.MaxRetries == 0:
		p.MaxRetries = DefaultMaxRetries
	case p.MaxRetries < 0:
		p.MaxRetries = 0
	case p.MaxRetries > MaxMaxRetries:
		p.MaxRetries = MaxMaxRetries
	}
	if p.Base <= 0 {
		p.Base = DefaultRetryBase
	}
	if p.Cap <= 0 {
		p.Cap = DefaultRetryCap
	}
	if p.Cap < p.Base {
		p.Cap = p.Base
	}
	if p.Jitter <= 0 || p.Jitter >= 1 {
		p.Jitter = DefaultJitter
	}
	if p.Sleep == nil {
		p.Sleep = sleepCtx
	}
	if p.Rand == nil {
		p.Rand = rand.Float64
	}
	return p
}

// Delay is the wait before retry number n (0 for the first retry), given a
// random number r in [0, 1): Base·2ⁿ, spread by ±Jitter, at most Cap.
func (p RetryPolicy) Delay(n int, r float64) time.Duration {
	p = p.withDefaults()
	d := p.Base
	for i := 0; i < n && d < p.Cap; i++ {
		d *= 2
	}
	d = min(d, p.Cap)
	d = time.Duration(float64(d) * (1 + p.Jitter*(2*r-1)))
	return min(d, p.Cap)
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// Retry is a Store that retries the requests of the Store it wraps under a
// RetryPolicy. Errors for which IsPermanent is true are returned at once.
//
// A Put is retried only if its reader is an io.Seeker: each retry seeks
// back to the position the reader had when Put was called. Stores whose
// Put makes several requests retry each of them through RetryRequest. A Put with any
// other reader is tried once (pass an *os.File or a *bytes.Reader to get
// retries). A Get's reader resumes a broken read with a new ranged Get from
// where it stopped, and fails if the object changed (another ETag) in
// between. A List that fails part way is restarted and skips the keys it
// already delivered.
type Retry struct {
	Store
	policy RetryPolicy
	log    *slog.Logger
	obs    RetryObserver // nil unless the wrapped store is one
}

// RetryObserver is implemented by a wrapped Store (Observed) that wants to
// know of each retry: ObserveRetry is called with the operation ("put",
// "get", "upload part", ...) before each retry's wait.
type RetryObserver interface {
	ObserveRetry(op string)
}

var _ Store = (*Retry)(nil)

// WithRetry wraps s. logger receives one warning per retried failure.
func WithRetry(s Store, p RetryPolicy, logger *slog.Logger) *Retry {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	obs, _ := s.(RetryObserver)
	return &Retry{Store: s, policy: p.withDefaults(), log: logger, obs: obs}
}

// Unwrap returns the wrapped store.
func (r *Retry) Unwrap() Store { return r.Store }

// do runs op until it succeeds, fails permanently or runs out of retries.
func (r *Retry) do(ctx context.Context, what, key string, op func() error) error {
	for n := 0; ; n++ {
		err := op()
		if err == nil || IsPermanent(err) || ctx.Err() != nil {
			return err
		}
		if n >= r.policy.MaxRetries {
			return fmt.Errorf("%w (gave up after %d attempts)", err, n+1)
		}
		d := r.policy.Delay(n, r.policy.Rand())
		if r.obs != nil {
			r.obs.ObserveRetry(what)
		}
		r.log.Warn("store request failed; retrying", "op", what, "key", key, "retry", n+1, "of", r.policy.MaxRetries, "delay", d, "err", err)
		if err := r.policy.Sleep(ctx, d); err != nil {
			return err
		}
	}
}

type retryKey struct{}

// RetryRequest runs one request of a Store operation that makes several
// (the parts of a multipart upload) under the policy of the WithRetry
// decorator the operation was called through, if any; else once. Retrying
// each request on its own keeps one broken part from restarting a
// gigabyte upload. op must rewind whatever body it sends. An error after
// the retries are spent comes back marked permanent, so the decorator
// does not retry the whole operation on top.
func RetryRequest(ctx context.Context, what, key string, op func(attempt int) error) error {
	r, _ := ctx.Value(retryKey{}).(*Retry)
	if r == nil {
		return op(0)
	}
	attempt := 0
	err := r.do(ctx, what, key, func() error {
		err := op(attempt)
		attempt++
		return err
	})
	return Permanent(err)
}

// Put implements Store.
func (r *Retry) Put(ctx context.Context, key string, body io.Reader, size int64, opts PutOptions) (ObjectInfo, error) {
	seeker, ok := body.(io.Seeker)
	if !ok {
		return r.Store.Put(ctx, key, body, size, opts)
	}
	start, err := seeker.Seek(0, io.SeekCurrent)
	if err != nil {
		return r.Store.Put(ctx, key, body, size, opts)
	}
	ctx = context.WithValue(ctx, retryKey{}, r)
	var info ObjectInfo
	first := true
	err = r.do(ctx, "put", key, func() error {
		if !first {
			if _, err := seeker.Seek(start, io.SeekStart); err != nil {
				return Permanent(fmt.Errorf("put %s: rewind body: %w", key, err))
			}
		}
		first = false
		var err error
		info, err = r.Store.Put(ctx, key, body, size, opts)
		return err
	})
	return info, err
}

// Get implements Store.
func (r *Retry) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, ObjectInfo, error) {
	var (
		body io.ReadCloser
		info ObjectInfo
	)
	err := r.do(ctx, "get", key, func() error {
		var err error
		body, info, err = r.Store.Get(ctx, key, off, length)
		return err
	})
	if err != nil {
		return nil, ObjectInfo{}, err
	}
	want := info.Size - off
	if length >= 0 && length < want {
		want = length
	}
	return &resumingBody{r: r, ctx: ctx, key: key, etag: info.ETag, off: off, left: want, body: body}, info, nil
}

// resumingBody reads a Get's bytes, reopening the range after a transient
// failure.
type resumingBody struct {
	r    *Retry
	ctx  context.Context
	key  string
	etag string
	off  int64 // of the next byte to read
	left int64 // bytes still expected
	body io.ReadCloser
	fail int // consecutive failures without progress
}

func (b *resumingBody) Read(p []byte) (int, error) {
	for {
		if b.left <= 0 {
			return 0, io.EOF
		}
		if int64(len(p)) > b.left {
			p = p[:b.left]
		}
		n, err := b.body.Read(p)
		b.off += int64(n)
		b.left -= int64(n)
		if n > 0 {
			b.fail = 0
		}
		switch {
		case err == nil:
			return n, nil
		case err == io.EOF && b.left == 0:
			return n, io.EOF
		case err == io.EOF:
			err = io.ErrUnexpectedEOF // the connection ended early
		}
		if rerr := b.resume(err); rerr != nil {
			return n, rerr
		}
		if n > 0 {
			return n, nil
		}
	}
}

// resume replaces the body after cause broke it.
func (b *resumingBody) resume(cause error) error {
	b.body.Close()
	b.body = EmptyBody()
	if IsPermanent(cause) || b.ctx.Err() != nil {
		return fmt.Errorf("get %s: read at %d: %w", b.key, b.off, cause)
	}
	if b.fail >= b.r.policy.MaxRetries {
		return fmt.Errorf("get %s: read at %d: %w (gave up after %d attempts)", b.key, b.off, cause, b.fail+1)
	}
	d := b.r.policy.Delay(b.fail, b.r.policy.Rand())
	b.fail++
	if b.r.obs != nil {
		b.r.obs.ObserveRetry("get")
	}
	b.r.log.Warn("store read broke; resuming", "key", b.key, "offset", b.off, "retry", b.fail, "delay", d, "err", cause)
	if err := b.r.policy.Sleep(b.ctx, d); err != nil {
		return err
	}
	body, info, err := b.r.Store.Get(b.ctx, b.key, b.off, b.left)
	if err != nil {
		return b.resume(err)
	}
	if info.ETag != b.etag {
		body.Close()
		return Permanent(fmt.Errorf("get %s: object changed while being read (ETag %s, was %s)", b.key, info.ETag, b.etag))
	}
	b.body = body
	return nil
}

func (b *resumingBody) Close() error { return b.body.Close() }

// Stat implements Store.
func (r *Retry) Stat(ctx context.Context, key string) (ObjectInfo, error) {
	var info ObjectInfo
	err := r.do(ctx, "stat", key, func() error {
		var err error
		info, err = r.Store.Stat(ctx, key)
		return err
	})
	return info, err
}

// List implements Store.
func (r *Retry) List(ctx context.Context, prefix string, fn func(ObjectInfo) error) error {
	var last string
	seen := false
	var fnErr error
	err := r.do(ctx, "list", prefix, func() error {
		return r.Store.List(ctx, prefix, func(o ObjectInfo) error {
			if seen && o.Key <= last {
				return nil
			}
			if err := fn(o); err != nil {
				fnErr = err
				return Permanent(err)
			}
			last, seen = o.Key, true
			return nil
		})
	})
	if fnErr != nil && errors.Is(err, fnErr) {
		return fnErr
	}
	return err
}

// Delete implements Store.
func (r *Retry) Delete(ctx context.Context, key string) error {
	return r.do(ctx, "delete", key, func() error { return r.Store.Delete(ctx, key) })
}

var _ Composer = (*Retry)(nil)

// PutComposed implements Composer when the wrapped store does, retrying
// like Put (local is re-read from the start on each attempt); otherwise it
// fails with errors.ErrUnsupported.
// CanCompose reports whether the wrapped store can compose now.
func (r *Retry) CanCompose() bool {
	c, ok := r.Store.(Composer)
	return ok && c.CanCompose()
}

func (r *Retry) PutComposed(ctx context.Context, key string, local io.ReaderAt, size int64, src ComposeSource, ranges []ComposeRange, opts PutOptions) (ComposeResult, error) {
	c, ok := r.Store.(Composer)
	if !ok {
		return ComposeResult{}, fmt.Errorf("put %s: composing from %s: %w", key, src.Key, errors.ErrUnsupported)
	}
	ctx = context.WithValue(ctx, retryKey{}, r)
	var res ComposeResult
	err := r.do(ctx, "put composed", key, func() error {
		var err error
		res, err = c.PutComposed(ctx, key, local, size, src, ranges, opts)
		return err
	})
	return res, err
}
