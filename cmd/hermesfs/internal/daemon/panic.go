package daemon

import (
	"errors"
	"fmt"
	iofs "io/fs"
	"runtime/debug"
	"sync/atomic"
)

// A panic in a snapshot (a bug in the overlay's view, the packer, the
// store client) must not take the daemon down: the mount is still
// serving, and the upper layer may hold the only copy of hours of work. A
// crash there also repeats at every start, as the recovery publish runs
// the same snapshot again. So every snapshot runs under contain, and the
// packer turns panics on its own goroutines into errors
// (archive.PanicError): the panic fails that snapshot like a failed
// upload, with its stack in the log, and everything local is kept.

// panicError is a panic contain recovered.
type panicError struct {
	value any
	stack []byte
}

func (p *panicError) Error() string {
	return fmt.Sprintf("panic: %v", p.value)
}

// PanicStack returns the panicking goroutine's stack.
func (p *panicError) PanicStack() []byte { return p.stack }

// contain runs f, turning a panic on this goroutine into a *panicError.
func contain(f func() error) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = &panicError{value: v, stack: debug.Stack()}
		}
	}()
	return f()
}

// panicStack returns the stack of the panic err comes from (recovered by
// contain or by the packer), or nil if it comes from none.
func panicStack(err error) []byte {
	var p interface{ PanicStack() []byte }
	if errors.As(err, &p) {
		return p.PanicStack()
	}
	return nil
}

// viewHook lets tests put faults into the frozen view the packer reads,
// where a bug of the overlay's would be: on whatever goroutine the packer
// calls it from. Nil fields do nothing.
type viewHook struct {
	// readDir runs before each ReadDir of the view.
	readDir func(name string)
	// open may stand in for each file opened from the view.
	open func(name string, f iofs.File) iofs.File
}

// testViewHook is set by tests only.
var testViewHook atomic.Pointer[viewHook]
