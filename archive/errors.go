package archive

import (
	"errors"
	"fmt"
	"runtime/debug"
)

// ErrCorrupt is matched (errors.Is) by every error that reports damage in
// an archive: a checksum mismatch, a block that does not decompress, a
// table that points outside the image, a structure that makes no sense.
// Such errors are *CorruptError values naming the archive and the byte
// offset of the first bad block.
var ErrCorrupt = errors.New("archive corrupt")

// CorruptError describes damage found in an archive.
type CorruptError struct {
	Name   string // the archive, as given in ReaderOptions.Name
	Offset int64  // byte offset of the bad block or structure in the file
	What   string // what lives there: "data block", "inode table block", ...
	Err    error  // what is wrong with it
}

func (e *CorruptError) Error() string {
	name := e.Name
	if name == "" {
		name = "(unnamed)"
	}
	return fmt.Sprintf("archive %s: corrupt %s at offset %d: %v", name, e.What, e.Offset, e.Err)
}

func (e *CorruptError) Is(target error) bool { return target == ErrCorrupt }
func (e *CorruptError) Unwrap() error        { return e.Err }

var errChecksum = errors.New("checksum mismatch")

// PanicError is a panic in one of the goroutines Pack starts to read and
// compress file data (the source FS's Open and Read included), returned
// as Pack's error: a bug in a file system being packed, or in the packer,
// fails that pack instead of the process. A panic on the goroutine that
// called Pack is left to the caller.
type PanicError struct {
	Value any    // what was passed to panic
	Stack []byte // the panicking goroutine's stack
}

func (e *PanicError) Error() string { return fmt.Sprintf("panic: %v", e.Value) }

// PanicStack returns the stack of the panic, for the log.
func (e *PanicError) PanicStack() []byte { return e.Stack }

// recovered, deferred, turns a panic of its goroutine into a *PanicError
// in *err.
func recovered(err *error) {
	if v := recover(); v != nil {
		*err = &PanicError{Value: v, Stack: debug.Stack()}
	}
}

// errSelfCheck is what Pack reports when a block it is about to write does
// not hold the content it computed the block's sum from (worker.check): a
// bug of the packer, not damage of its input. The archive must not be used.
var errSelfCheck = errors.New("content does not match the sum the packer computed for it (a packer bug, please report it: the archive must not be used)")
