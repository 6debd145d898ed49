package fs

import (
	"context"
	"sync"
	"sync/atomic"
)

// gate separates mutations from freezes. Every operation that changes the
// upper layer holds it shared for its duration (enter/leave); freeze takes it
// exclusively: new mutations wait, the ones in flight drain, and the caller
// captures a quiescent upper layer. The shared side is one atomic add when
// no freeze is pending, so writes pay next to nothing for it.
type gate struct {
	// state counts mutations in flight; frozenBit is set while a freeze is
	// pending or held.
	state atomic.Int64

	mu      sync.Mutex
	thawed  chan struct{} // closed when the current freeze ends
	drained chan struct{} // closed when the last mutation leaves a frozen gate
}

const frozenBit = int64(1) << 62

// enter admits one mutation, waiting out a freeze.
func (g *gate) enter() {
	for {
		if s := g.state.Add(1); s&frozenBit == 0 {
			return
		}
		// A freeze is pending: undo, then wait for the thaw.
		g.leave()
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
// then leaves the gate open.
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

// thaw reopens the gate after a successful freeze.
func (g *gate) thaw() {
	g.mu.Lock()
	g.state.Add(-frozenBit)
	g.drained = nil
	close(g.thawed)
	g.thawed = nil
	g.mu.Unlock()
}
