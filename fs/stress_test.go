package fs

import (
	"bytes"
	"fmt"
	iofs "io/fs"
	"math/rand/v2"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestFreezeUnderChurn takes views while writers replace, append to, delete
// and rename files and directories concurrently. Every file of every view
// must open and hold one whole version written for its name: nothing
// captured may vanish or show bytes written after the freeze.
func TestFreezeUnderChurn(t *testing.T) {
	lower, _ := packLower(t, func(dir string) {
		for d := 0; d < 4; d++ {
			os.MkdirAll(filepath.Join(dir, fmt.Sprintf("d%d", d)), 0o755)
			for f := 0; f < 5; f++ {
				os.WriteFile(filepath.Join(dir, fmt.Sprintf("d%d/f%d", d, f)), version(fmt.Sprintf("f%d", f), 0), 0o644)
			}
		}
	})
	e := mountEnv(t, lower, Options{})
	stop := make(chan struct{})
	var wg sync.WaitGroup
	// The writers stop however the test ends (a failed freeze too), or
	// they would churn through the rest of the package's tests.
	var stopOnce sync.Once
	halt := func() { stopOnce.Do(func() { close(stop) }); wg.Wait() }
	defer halt()
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 9))
			for i := 1; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				d := fmt.Sprintf("d%d", r.IntN(4))
				name := fmt.Sprintf("f%d", r.IntN(8))
				p := e.path(d + "/" + name)
				switch r.IntN(6) {
				case 0, 1:
					atomicWrite(p, version(name, i))
				case 2:
					// Rewrite in place, whole version in one write.
					if f, err := os.OpenFile(p, os.O_WRONLY, 0); err == nil {
						f.WriteAt(version(name, i), 0)
						f.Close()
					}
				case 3:
					os.Remove(p)
				case 4:
					os.Rename(p, e.path(fmt.Sprintf("d%d/%s", r.IntN(4), name)))
				case 5:
					// Swap two directories' names through a third.
					a, b := fmt.Sprintf("d%d", r.IntN(4)), fmt.Sprintf("d%d", r.IntN(4))
					tmp := e.path(fmt.Sprintf("tmp%d", w))
					if os.Rename(e.path(a), tmp) == nil {
						os.Rename(e.path(b), e.path(a))
						os.Rename(tmp, e.path(b))
						os.Rename(tmp, e.path(a)) // if b was a
					}
				}
			}
		}()
	}
	deadline := time.Now().Add(3 * time.Second)
	views := 0
	for time.Now().Before(deadline) {
		v, err := e.m.Freeze(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(20 * time.Millisecond) // let the writers move on
		err = iofs.WalkDir(v, ".", func(p string, d iofs.DirEntry, err error) error {
			if err != nil || !d.Type().IsRegular() {
				return err
			}
			b, err := iofs.ReadFile(v, p)
			if err != nil {
				return err
			}
			name := path.Base(p)
			if strings.HasPrefix(name, ".tmp_") {
				// A temp file of atomicWrite: created empty, then
				// written whole in one write(2).
				if len(b) == 0 {
					return nil
				}
				name = string(b[:bytes.IndexByte(b, ':')])
			}
			if !validVersion(name, b) {
				return fmt.Errorf("%s: %.40q", p, b)
			}
			return nil
		})
		v.Close()
		if err != nil {
			t.Fatalf("view %d: %v", views, err)
		}
		views++
	}
	halt()
	t.Logf("%d views checked", views)
}

// version is content number i of a file called name: self-describing, 20 KiB
// (more than one saved block).
func version(name string, i int) []byte {
	head := fmt.Sprintf("%s:%d:", name, i)
	return []byte(head + strings.Repeat("v", 20<<10-len(head)))
}

func validVersion(name string, b []byte) bool {
	if len(b) != 20<<10 || !bytes.HasPrefix(b, []byte(name+":")) {
		return false
	}
	rest := b[len(name)+1:]
	i := bytes.IndexByte(rest, ':')
	return i > 0 && bytes.Count(rest[i+1:], []byte("v")) == len(rest)-i-1
}
