package daemon

import "fmt"

// Exit codes, carried by the errors Run (and the helpers the CLI shares
// with it) return. Scripts rely on these numbers; never renumber them.
const (
	ExitOK       = 0 // success
	ExitFailure  = 1 // the operation failed; the message says why
	ExitUsage    = 2 // bad command line
	ExitCorrupt  = 3 // an archive or snapshot failed verification
	ExitConflict = 4 // another host published or holds the store (lease, LATEST)
	ExitUnsynced = 5 // stopped, but the final snapshot did not reach the store; local state kept
	ExitCrypt    = 6 // an encrypted snapshot could not be opened (no or wrong --identity), or plaintext over encrypted refused
	ExitNotFound = 7 // the snapshot named (restore, export, verify) is not in the store
)

const (
	exitOK       = ExitOK
	exitFailure  = ExitFailure
	exitUsage    = ExitUsage
	exitCorrupt  = ExitCorrupt
	exitConflict = ExitConflict
	exitUnsynced = ExitUnsynced
	exitCrypt    = ExitCrypt
)

// ExitError carries an exit code other than ExitFailure through an error
// chain; ExitCode finds it.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string { return e.Err.Error() }
func (e *ExitError) Unwrap() error { return e.Err }

// WithCode marks err to exit with code.
func WithCode(code int, err error) error {
	if err == nil {
		return nil
	}
	return &ExitError{Code: code, Err: err}
}

// UsageError reports a bad command line (or configuration): ExitUsage.
func UsageError(format string, a ...any) error {
	return &ExitError{Code: ExitUsage, Err: fmt.Errorf(format, a...)}
}

// ExitCode returns the exit code err carries (ExitFailure if none).
func ExitCode(err error) int { return exitCodeOf(err) }

type exitError = ExitError

func withCode(code int, err error) error { return WithCode(code, err) }

func usageError(format string, a ...any) error { return UsageError(format, a...) }
