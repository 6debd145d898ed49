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
