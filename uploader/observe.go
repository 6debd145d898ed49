package uploader

import (
	"context"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"time"
)

// StoreObserver is told about every request a Store makes, for
// monitoring. Its methods are called concurrently and must be quick.
type StoreObserver interface {
	// StoreRequest reports one request: op is "put", "put_composed",
	// "get", "stat", "list" or "delete", outcome one of the Outcome*
	// constants, took its duration (for a get, until the body starts).
	StoreRequest(op, outcome string, took time.Duration)
	// StoreRetry reports that a failed request of op is about to be
	// retried (by the WithRetry decorator over an Observed store).
	StoreRetry(op string)
	// StoreRead reports n bytes read from a get's body.
	StoreRead(n int64)
}

// Outcomes of a store request, as StoreObserver receives them.
const (
	OutcomeOK           = "ok"
	OutcomeNotFound     = "not_found"
	OutcomePrecondition = "precondition"
	OutcomeCanceled     = "canceled"
	OutcomeError        = "error"
)

// Outcome classifies the result of a store request.
func Outcome(err error) string {
	switch {
	case err == nil:
		return OutcomeOK
	case errors.Is(err, iofs.ErrNotExist):
		return OutcomeNotFound
	case errors.Is(err, ErrPrecondition):
		return OutcomePrecondition
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return OutcomeCanceled
	default:
		return OutcomeError
	}
}

// Observed is a Store that reports each request of the Store it wraps to
// a StoreObserver. Put it below WithRetry, so that every attempt is seen
// and WithRetry reports its retries to the same observer (Retry finds it
// through RetryObserver).
type Observed struct {
	Store
	obs StoreObserver
}

var (
	_ Store         = (*Observed)(nil)
	_ Composer      = (*Observed)(nil)
	_ RetryObserver = (*Observed)(nil)
)

// WithObserver wraps s.
func WithObserver(s Store, obs StoreObserver) *Observed { return &Observed{Store: s, obs: obs} }

// Unwrap returns the wrapped store.
func (o *Observed) Unwrap() Store { return o.Store }

// ObserveRetry implements RetryObserver.
func (o *Observed) ObserveRetry(op string) { o.obs.StoreRetry(op) }

func (o *Observed) done(op string, t0 time.Time, err error) {
	o.obs.StoreRequest(op, Outcome(err), time.Since(t0))
}

// Put implements Store.
func (o *Observed) Put(ctx context.Context, key string, r io.Reader, size int64, opts PutOptions) (ObjectInfo, error) {
	t0 := time.Now()
	info, err := o.Store.Put(ctx, key, r, size, opts)
	o.done("put", t0, err)
	return info, err
}

// Get implements Store.
func (o *Observed) Get(ctx context.Context, key string, off, length int64) (io.ReadCloser, ObjectInfo, error) {
	t0 := time.Now()
	rc, info, err := o.Store.Get(ctx, key, off, length)
	o.done("get", t0, err)
	if err != nil {
		return rc, info, err
	}
	return &observedBody{ReadCloser: rc, obs: o.obs}, info, nil
}

type observedBody struct {
	io.ReadCloser
	obs StoreObserver
}

func (b *observedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 {
		b.obs.StoreRead(int64(n))
	}
	return n, err
}

// Stat implements Store.
func (o *Observed) Stat(ctx context.Context, key string) (ObjectInfo, error) {
	t0 := time.Now()
	info, err := o.Store.Stat(ctx, key)
	o.done("stat", t0, err)
	return info, err
}

// List implements Store. An error returned by fn is the caller's, not the
// store's: the listing counts as ok.
func (o *Observed) List(ctx context.Context, prefix string, fn func(ObjectInfo) error) error {
	t0 := time.Now()
	var fnErr error
	err := o.Store.List(ctx, prefix, func(oi ObjectInfo) error {
		if e := fn(oi); e != nil {
			fnErr = e
			return e
		}
		return nil
	})
	if fnErr != nil && errors.Is(err, fnErr) {
		o.done("list", t0, nil)
	} else {
		o.done("list", t0, err)
	}
	return err
}

// Delete implements Store.
func (o *Observed) Delete(ctx context.Context, key string) error {
	t0 := time.Now()
	err := o.Store.Delete(ctx, key)
	o.done("delete", t0, err)
	return err
}

// CanCompose implements Composer when the wrapped store does.
func (o *Observed) CanCompose() bool {
	c, ok := o.Store.(Composer)
	return ok && c.CanCompose()
}

// PutComposed implements Composer when the wrapped store does; otherwise
// it fails with errors.ErrUnsupported (not counted as a request).
func (o *Observed) PutComposed(ctx context.Context, key string, local io.ReaderAt, size int64, src ComposeSource, ranges []ComposeRange, opts PutOptions) (ComposeResult, error) {
	c, ok := o.Store.(Composer)
	if !ok {
		return ComposeResult{}, fmt.Errorf("put %s: composing from %s: %w", key, src.Key, errors.ErrUnsupported)
	}
	t0 := time.Now()
	res, err := c.PutComposed(ctx, key, local, size, src, ranges, opts)
	o.done("put_composed", t0, err)
	return res, err
}
