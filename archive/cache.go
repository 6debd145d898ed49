package archive

import (
	"container/list"
	"sync"
)

// lru is a cache bounded in bytes (each value's cost is given when it is
// stored), least recently used first out. Concurrent misses on one key
// load it once. A value costing more than the whole bound is returned but
// not kept.
type lru[K comparable, V any] struct {
	mu       sync.Mutex
	max, cur int64
	order    list.List // of *lruEntry[K, V], most recent first
	m        map[K]*list.Element
	inflight map[K]*lruLoad[V]
}

type lruEntry[K comparable, V any] struct {
	key  K
	v    V
	cost int64
}

type lruLoad[V any] struct {
	done chan struct{}
	v    V
	err  error
}

func newLRU[K comparable, V any](max int64) *lru[K, V] {
	return &lru[K, V]{max: max, m: map[K]*list.Element{}, inflight: map[K]*lruLoad[V]{}}
}

// get returns the value of key, loading it with load on a miss; load
// returns the value and what keeping it costs.
func (c *lru[K, V]) get(key K, load func() (V, int64, error)) (V, error) {
	c.mu.Lock()
	if e, ok := c.m[key]; ok {
		c.order.MoveToFront(e)
		v := e.Value.(*lruEntry[K, V]).v
		c.mu.Unlock()
		return v, nil
	}
	if l, ok := c.inflight[key]; ok {
		c.mu.Unlock()
		<-l.done
		return l.v, l.err
	}
	l := &lruLoad[V]{done: make(chan struct{})}
	c.inflight[key] = l
	c.mu.Unlock()

	var cost int64
	func() {
		// A panic in load must not leave waiters blocked forever.
		defer func() {
			if v := recover(); v != nil {
				c.mu.Lock()
				delete(c.inflight, key)
				c.mu.Unlock()
				close(l.done)
				panic(v)
			}
		}()
		l.v, cost, l.err = load()
	}()

	c.mu.Lock()
	delete(c.inflight, key)
	if l.err == nil && cost <= c.max {
		c.m[key] = c.order.PushFront(&lruEntry[K, V]{key: key, v: l.v, cost: cost})
		c.cur += cost
		for c.cur > c.max {
			e := c.order.Back()
			ce := e.Value.(*lruEntry[K, V])
			c.order.Remove(e)
			delete(c.m, ce.key)
			c.cur -= ce.cost
		}
	}
	c.mu.Unlock()
	close(l.done)
	return l.v, l.err
}

// peek returns the value of key if it is cached, without loading it.
func (c *lru[K, V]) peek(key K) (V, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if e, ok := c.m[key]; ok {
		c.order.MoveToFront(e)
		return e.Value.(*lruEntry[K, V]).v, true
	}
	var zero V
	return zero, false
}

// blockCache keeps decompressed data and fragment blocks.
type blockCache = lru[cacheKey, []byte]

// cacheKey names a block by offset and size word: a hostile image could
// describe one offset two ways.
type cacheKey struct {
	off  uint64
	word uint32
}

func newBlockCache(max int64) *blockCache { return newLRU[cacheKey, []byte](max) }
