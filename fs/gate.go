package fs

import (
	"context"
	"sync"
	"sync/atomic"
	"syscall"
)

// errSealed is what a mutation of a sealed mount fails with.
const errSealed = syscall.EROFS

// gate separates mutations from freezes. Every operation that changes the
// upper layer holds it shared for its duration (enter/leave); freeze takes it
// exclusively: new mutations wait, the ones in flight drain, and the caller
// captures a quiescent upper layer. The shared side is one atomic add when
// no freeze is pending, so writes pay next to nothing for it. A sealed gate
// (the stop's last freeze) stays closed: every mutation that has not
// entered fails from then on.
type gate struct {
	// state counts mutations in flight; frozenBit is set while a freeze is
	// pending or held, and for good once sealed.
	state  atomic.Int64
	sealed atomic.Bool

	mu      sync.Mutex
	thawed  chan struct{} // closed when the current freeze ends
	drained chan struct{} // closed when the last mutation leaves a frozen gate
}

const frozenBit = int64(1) << 62

// enter admits one mutation, waiting out a freeze; false if the gate is
// sealed (the mutation must fail, with EROFS).
func (g *gate) enter() bool {
	for {
		if s := g.state.Add(1); s&frozenBit == 0 {
			return true
		}
		// A freeze is pending: undo, then wait for the thaw.
		g.leave()
		if g.sealed.Load() {
			return false
		}
		g.mu.Lock()
		ch := g.thawed
		g.mu.Unlock()
		if ch != nil {
			<-ch
		}
	}
}

// leave ends one mutation.
func (g *gate) leave() {
	if s := g.state.Add(-1); s == frozenBit {
		g.mu.Lock()
		if g.drained != nil {
			close(g.drained)
			g.drained = nil
		}
		g.mu.Unlock()
	}
}

// freeze blocks new mutations and waits for those in flight to finish. On
// success the caller must call thaw. It fails only when ctx ends first, and
// then leaves the gate open (unless sealed meanwhile).
func (g *gate) freeze(ctx context.Context) error {
	g.mu.Lock()
	for g.thawed != nil {
		// Another freeze holds the gate; wait for it to end.
		ch := g.thawed
		g.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
		g.mu.Lock()
	}
	if g.sealed.Load() {
		return g.drainSealed(ctx)
	}
	g.thawed = make(chan struct{})
	drained := make(chan struct{})
	g.drained = drained
	if g.state.Add(frozenBit) == frozenBit {
		close(drained)
		g.drained = nil
	}
	g.mu.Unlock()

	select {
	case <-drained:
		return nil
	case <-ctx.Done():
		g.thaw()
		return ctx.Err()
	}
}

// drainSealed is freeze on a sealed gate, called with g.mu held: nothing
// enters any more; it waits for the mutations still in flight.
func (g *gate) drainSealed(ctx context.Context) error {
	if g.state.Load() == frozenBit {
		g.mu.Unlock()
		return nil
	}
	if g.drained == nil {
		g.drained = make(chan struct{})
	}
	ch := g.drained
	g.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// thaw reopens the gate after a successful freeze; a sealed gate stays
// closed.
func (g *gate) thaw() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.thawed != nil {
		close(g.thawed)
		g.thawed = nil
	}
	if g.sealed.Load() {
		return
	}
	g.state.Add(-frozenBit)
	g.drained = nil
}

// seal closes the gate for good: mutations in flight finish, every later
// one fails. Held by a freeze, the gate stays closed at its thaw.
func (g *gate) seal() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.sealed.Swap(true) {
		return
	}
	if g.thawed == nil {
		g.state.Add(frozenBit)
	}
}
