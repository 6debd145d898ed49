package uploader

import (
	"context"
	"errors"
	iofs "io/fs"
)

// permanentError marks an error that retrying the same request cannot fix.
type permanentError struct{ err error }

func (e *permanentError) Error() string { return e.err.Error() }
func (e *permanentError) Unwrap() error { return e.err }

// Permanent marks err as not worth retrying (access denied, a missing
// bucket, a malformed request). It returns nil for nil.
func Permanent(err error) error {
	if err == nil || IsPermanent(err) {
		return err
	}
	return &permanentError{err: err}
}

// IsPermanent reports whether retrying the operation that returned err
// cannot succeed: err was marked with Permanent, or it is a failed
// condition, a missing key, an invalid range or key, a composed put the
// store got wrong or does not support, or a canceled or expired context.
func IsPermanent(err error) bool {
	var pe *permanentError
	switch {
	case err == nil:
		return false
	case errors.As(err, &pe),
		errors.Is(err, ErrPrecondition),
		errors.Is(err, iofs.ErrNotExist),
		errors.Is(err, ErrInvalidRange),
		errors.Is(err, ErrInvalidKey),
		errors.Is(err, ErrComposeMismatch),
		errors.Is(err, errors.ErrUnsupported),
		errors.Is(err, context.Canceled),
		errors.Is(err, context.DeadlineExceeded):
		return true
	}
	return false
}

// explained is an error with one plain sentence that says what it means
// to a user, for messages to lead with (Explain); it prints as the error
// it wraps, the detail.
type explained struct {
	plain string
	err   error
}

func (e *explained) Error() string   { return e.err.Error() }
func (e *explained) Unwrap() error   { return e.err }
func (e *explained) Explain() string { return e.plain }

// Explained attaches plain, one sentence a user can act on ("the bucket
// does not exist"), to err. nil for nil.
func Explained(plain string, err error) error {
	if err == nil {
		return nil
	}
	return &explained{plain: plain, err: err}
}

// Explain returns the plain sentence Explained attached to an error in
// err's chain, or "".
func Explain(err error) string {
	var e interface{ Explain() string }
	if errors.As(err, &e) {
		return e.Explain()
	}
	return ""
}
