package fs

import "sync"

// dirtyTracker answers Mount.Dirty: which objects changed after a
// generation, and how many bytes were written to them. Bytes are counted per
// epoch (the span between two freezes), so the answer is exact for a
// generation at which a view was frozen (what the daemon asks: "since the
// last snapshot"), and for any other generation counts whole epochs that
// overlap it (an overestimate). Only the last maxEpochs epochs are kept;
// older byte counts are forgotten.
type dirtyTracker struct {
	mu     sync.Mutex
	epochs []uint64 // start generation of each epoch; epochs[0] = 0
	first  int      // index of the first kept epoch
	objs   map[uint64]*dirtyRec
}

type dirtyRec struct {
	last  uint64        // generation of the latest change
	bytes map[int]int64 // epoch -> bytes written in it
}

const maxEpochs = 16

// changed records one mutation of the object with st_ino ino (0: an
// unidentified object, which only bumps the generation) that wrote bytes.
func (ov *overlay) changed(ino uint64, bytes int64) {
	gen := ov.gen.Add(1)
	ov.opts.Stats.noteChange()
	if ino == 0 {
		return
	}
	t := &ov.dirty
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.objs == nil {
		t.objs = map[uint64]*dirtyRec{}
		t.epochs = []uint64{0}
	}
	r := t.objs[ino]
	if r == nil {
		r = &dirtyRec{bytes: map[int]int64{}}
		t.objs[ino] = r
	}
	r.last = gen
	r.bytes[len(t.epochs)-1] += bytes
}

// newEpoch starts an epoch at generation gen (a freeze).
func (t *dirtyTracker) newEpoch(gen uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.objs == nil {
		t.objs = map[uint64]*dirtyRec{}
		t.epochs = []uint64{0}
	}
	t.epochs = append(t.epochs, gen)
	if len(t.epochs)-t.first > maxEpochs {
		drop := t.first
		t.first++
		for _, r := range t.objs {
			delete(r.bytes, drop)
		}
	}
}

// dirty returns the objects changed after generation since and the bytes
// written to them.
func (t *dirtyTracker) dirty(since uint64) (files int, bytes int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, r := range t.objs {
		if r.last <= since {
			continue
		}
		files++
		for e, b := range r.bytes {
			// Epoch e spans [epochs[e], epochs[e+1]).
			if e+1 >= len(t.epochs) || t.epochs[e+1] > since {
				bytes += b
			}
		}
	}
	return files, bytes
}
