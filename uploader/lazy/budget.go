package lazy

import (
	"container/list"
	"sync"

	"golang.org/x/sys/unix"
)

// Budget bounds the bytes that the readers sharing it keep in their cache
// files, together: a browse tree opens a reader per segment of every
// snapshot entered, and their caches must stay within one --cache-size.
// When a chunk written puts them over, the least recently used chunks (of
// any reader of the budget) are evicted: marked absent and punched out of
// their reader's sparse cache file, so a later read fetches them again,
// checked against their digests like any miss. A chunk being read from
// the cache file, or being written to it, is never evicted under that read
// or write; while such chunks are in use the bytes may exceed the bound
// for a moment.
//
// A reader with a budget keeps what it holds in memory only: it starts
// from an empty cache file (an earlier partial file at its path is
// discarded), writes no present log, never fills (Fill does nothing) and
// removes its cache file on Close. A cache whose chunks come and go is
// temporary; a log would need to record absence too, and a restart would
// have to charge the chunks it lists to a budget that does not know them.
//
// A Budget's methods may be called concurrently.
type Budget struct {
	max int64

	mu      sync.Mutex
	lru     list.List // of *held, most recently used first
	used    int64
	evicted int64
}

// held is a chunk of a reader that may be in its cache file: written, or
// being written.
type held struct {
	r  *Reader
	i  int
	n  int64
	el *list.Element // nil once evicted
}

// NewBudget returns a budget of max bytes; a budget smaller than a chunk
// keeps nothing past the read that fetched it.
func NewBudget(max int64) *Budget {
	return &Budget{max: max}
}

// BudgetStats describe a budget.
type BudgetStats struct {
	Max  int64 `json:"max_bytes"`
	Used int64 `json:"used_bytes"` // in its readers' cache files now
	// Evicted counts the chunks evicted to stay within Max.
	Evicted int64 `json:"evicted_chunks"`
}

// Stats returns the budget's figures.
func (b *Budget) Stats() BudgetStats {
	b.mu.Lock()
	defer b.mu.Unlock()
	return BudgetStats{Max: b.max, Used: b.used, Evicted: b.evicted}
}

// addLocked charges chunk i of r (about to be written) to the budget, or
// marks it used if it is charged already. r.mu is held.
func (b *Budget) addLocked(r *Reader, i int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if h := r.held[i]; h != nil {
		b.lru.MoveToFront(h.el)
		return
	}
	h := &held{r: r, i: i, n: r.chunkLen(i)}
	h.el = b.lru.PushFront(h)
	r.held[i] = h
	b.used += h.n
}

// touchLocked marks chunk i of r used. r.mu is held.
func (b *Budget) touchLocked(r *Reader, i int) {
	h := r.held[i]
	if h == nil {
		return
	}
	b.mu.Lock()
	b.lru.MoveToFront(h.el)
	b.mu.Unlock()
}

// dropLocked takes chunk h off the budget. b.mu and h.r.mu are held.
func (b *Budget) dropLocked(h *held) {
	if h.el == nil {
		return
	}
	b.lru.Remove(h.el)
	h.el = nil
	h.r.held[h.i] = nil
	b.used -= h.n
}

// reclaim evicts least recently used chunks until the budget holds at
// most max bytes, passing over chunks in use (they count as used now). It
// is called with no reader's lock held: it takes each victim's.
func (b *Budget) reclaim() {
	for tries := 0; ; tries++ {
		b.mu.Lock()
		if b.used <= b.max || b.lru.Len() == 0 || tries > 2*b.lru.Len() {
			b.mu.Unlock()
			return
		}
		h := b.lru.Back().Value.(*held)
		b.mu.Unlock()
		h.r.evict(h)
	}
}

// evict punches chunk h out of r's cache file and marks it absent, unless
// it is in use (then it counts as just used) or gone already.
func (r *Reader) evict(h *held) {
	r.mu.Lock()
	defer r.mu.Unlock()
	b := r.o.Budget
	b.mu.Lock()
	if h.el == nil {
		b.mu.Unlock()
		return
	}
	if r.pins[h.i] > 0 {
		b.lru.MoveToFront(h.el)
		b.mu.Unlock()
		return
	}
	b.dropLocked(h)
	b.evicted++
	b.mu.Unlock()
	i := h.i
	if r.present[i] {
		r.present[i], r.checked[i] = false, false
		r.have--
		r.stats.PresentBytes -= h.n
	}
	r.stats.Evicted++
	// Under r.mu: no write of this chunk can be in flight (a write pins
	// it), and none starts before it is absent. The whole chunk size,
	// also for a short last chunk: its file system block past the end
	// goes too.
	if err := unix.Fallocate(int(r.f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(i)*r.o.ChunkSize, r.o.ChunkSize); err != nil && !r.punchFailed {
		r.punchFailed = true
		r.log.Warn("cannot punch evicted chunks out of the cache file; it keeps their disk space", "path", r.f.Name(), "err", err)
	}
}

// pinLocked keeps chunk i in the cache file (a read or write of it is in
// progress) until unpin, and marks it used. r.mu is held.
func (r *Reader) pinLocked(i int) {
	if r.o.Budget == nil {
		return
	}
	r.pins[i]++
	r.o.Budget.touchLocked(r, i)
}

func (r *Reader) unpin(i int) {
	if r.o.Budget == nil {
		return
	}
	r.mu.Lock()
	r.pins[i]--
	r.mu.Unlock()
}

// releaseBudgetLocked takes every chunk of r off its budget (Close). r.mu is
// held.
func (r *Reader) releaseBudgetLocked() {
	b := r.o.Budget
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, h := range r.held {
		if h != nil {
			b.dropLocked(h)
		}
	}
}
