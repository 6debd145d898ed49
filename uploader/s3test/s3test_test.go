package s3test_test

import (
	"net/http"
	"os"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader/s3test"
)

// A server launched from a thread that then ends keeps serving. Go ends
// the thread of a goroutine that returns while locked to it (as the FUSE
// file system's requests to its own mount do), and the kernel sends a
// child's Pdeathsig when the thread that forked it ends, not the process:
// a store-outage test saw its server killed half-way ("connection
// refused").
func TestServerOutlivesTheLaunchingThread(t *testing.T) {
	bin, err := s3test.Binary()
	if err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	type launched struct {
		srv *s3test.Server
		err error
	}
	got := make(chan launched, 1)
	var launch func()
	launch = func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		if syscall.Gettid() == syscall.Getpid() {
			// The main thread never ends (the runtime parks it): hold it
			// and launch from another.
			go launch()
			return
		}
		srv, err := s3test.Launch(bin, t.TempDir(), nil)
		got <- launched{srv, err}
	}
	go launch()
	l := <-got
	if l.err != nil {
		t.Fatal(l.err)
	}
	t.Cleanup(func() { l.srv.Close() })
	// The kill follows the thread's end at once; look for a while (on a
	// loaded machine the thread may end late: then this passes without
	// showing anything, never fails wrongly).
	for range 40 {
		if gone, err := l.srv.Exited(); gone {
			t.Fatalf("versitygw exited once the thread that launched it ended: %v", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	resp, err := http.Get(l.srv.Endpoint + "/")
	if err != nil {
		t.Fatalf("versitygw no longer answers: %v", err)
	}
	resp.Body.Close()
}
