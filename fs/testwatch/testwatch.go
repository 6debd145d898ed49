// Package testwatch fails a hung test early, and says what it hung on.
//
// A test that waits for something that never comes (a daemon that never
// says ready, a mount that never answers, a command that never exits)
// otherwise runs until the package's -timeout, minutes later, and that
// panic names the tests still running but not what they wait for. Here
// every test that calls Wait (the helpers that wait call it for it) has a
// deadline, Limit by default (HERMESFS_TEST_DEADLINE overrides it; Extend
// sets one per test): past it, the process prints the test's name, how
// long it ran, what it was waiting for and since when, and every
// goroutine's stack, runs the OnExpire hooks (which kill what the tests
// started) and exits 2. The deadline is generous, it only catches a hang;
// it never replaces a test's own bounded waits.
//
// It imports only the standard library, so any package's tests may use it.
package testwatch

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"
)

// Limit is the default deadline of a test.
const Limit = 10 * time.Minute

type watch struct {
	name   string
	start  time.Time
	timer  *time.Timer
	what   string // what the test waits for now ("" if nothing)
	since  time.Time
	waited []string // the last few things it waited for
}

var (
	mu      sync.Mutex
	watches = map[testing.TB]*watch{}
	hooks   []func()
	fired   bool
)

// defaultLimit is Limit, or $HERMESFS_TEST_DEADLINE.
func defaultLimit() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("HERMESFS_TEST_DEADLINE")); err == nil && d > 0 {
		return d
	}
	return Limit
}

// get returns t's watch, arming it the first time.
func get(t testing.TB) *watch {
	mu.Lock()
	defer mu.Unlock()
	if w := watches[t]; w != nil {
		return w
	}
	w := &watch{name: t.Name(), start: time.Now()}
	w.timer = time.AfterFunc(defaultLimit(), func() { expire(w) })
	watches[t] = w
	t.Cleanup(func() {
		w.timer.Stop()
		mu.Lock()
		delete(watches, t)
		mu.Unlock()
	})
	return w
}

// Start arms t's deadline (Wait and Extend do too): a helper every test
// of a package calls (the one that mounts) starts it, so that a test hung
// where no helper waits still fails at its deadline.
func Start(t testing.TB) { get(t) }

// Extend gives t the deadline limit from its start (a test known to run
// long: the torture tests).
func Extend(t testing.TB, limit time.Duration) {
	w := get(t)
	mu.Lock()
	defer mu.Unlock()
	if d := defaultLimit(); d > limit {
		limit = d // HERMESFS_TEST_DEADLINE only ever lengthens
	}
	w.timer.Reset(time.Until(w.start.Add(limit)))
}

// Wait notes that t now waits for what; call the function it returns
// once the wait is over.
func Wait(t testing.TB, what string) (done func()) {
	w := get(t)
	mu.Lock()
	w.what, w.since = what, time.Now()
	mu.Unlock()
	return func() {
		mu.Lock()
		if w.what == what {
			w.waited = append(w.waited, what)
			if len(w.waited) > 5 {
				w.waited = w.waited[1:]
			}
			w.what = ""
		}
		mu.Unlock()
	}
}

// OnExpire adds a function run when a deadline passes, before the
// process exits: what tests started outside the process (daemons,
// mounts) goes with it.
func OnExpire(f func()) {
	mu.Lock()
	hooks = append(hooks, f)
	mu.Unlock()
}

func expire(w *watch) {
	mu.Lock()
	if fired {
		mu.Unlock()
		return
	}
	fired = true
	msg := fmt.Sprintf("\ntestwatch: %s is still running after %s: a hang, failing the package now.\n", w.name, time.Since(w.start).Round(100*time.Millisecond))
	if w.what != "" {
		msg += fmt.Sprintf("testwatch: it has been waiting for %s for %s.\n", w.what, time.Since(w.since).Round(100*time.Millisecond))
	} else {
		msg += "testwatch: it is not in a wait its helpers know of.\n"
	}
	if len(w.waited) > 0 {
		msg += fmt.Sprintf("testwatch: before that it waited for: %q\n", w.waited)
	}
	for _, o := range watches {
		if o != w {
			msg += fmt.Sprintf("testwatch: also running: %s (%s), waiting for %q\n", o.name, time.Since(o.start).Round(100*time.Millisecond), o.what)
		}
	}
	hs := hooks
	mu.Unlock()
	buf := make([]byte, 8<<20)
	buf = buf[:runtime.Stack(buf, true)]
	fmt.Fprintf(os.Stderr, "%s\ngoroutines:\n%s\n%s", msg, buf, msg)
	for _, h := range hs {
		h()
	}
	os.Exit(2)
}
