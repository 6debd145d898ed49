package fs

import (
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestFreezeListsNothing: a freeze takes no listing and no status but the
// root's, whatever the upper layer holds; the view reads the rest when
// asked, and directories changed after the freeze keep their listings for
// it: one whose whiteouts hide lower entries and that is then removed, one
// renamed over, one that moves, and one that only gains entries.
func TestFreezeListsNothing(t *testing.T) {
	lower, _ := packLower(t, sampleTree)
	e := mountEnv(t, lower, Options{})
	for i := 0; i < 200; i++ {
		os.MkdirAll(e.path(fmt.Sprintf("many/d%d", i%10)), 0o755)
		e.write(fmt.Sprintf("many/d%d/f%d", i%10, i), "x")
	}
	must(t, os.Remove(e.path("a/b/two.txt")))                  // a/b: a whiteout, merged-empty
	must(t, os.Remove(e.path("skills/web/sub/deep.txt")))      // sub: a whiteout
	must(t, os.Mkdir(e.path("victim"), 0o755))                 // an empty upper dir
	must(t, os.Remove(e.path("skills/web/SKILL.md")))          // web: a whiteout
	must(t, os.Rename(e.path("skills/web"), e.path("webdir"))) // web: a redirect
	e.remount()
	want := stateOfDir(t, e.mnt)

	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	v.capMu.RLock()
	if len(v.dirs) != 0 || len(v.inodes) != 1 {
		t.Errorf("the freeze took %d listings and %d statuses, want 0 and the root's", len(v.dirs), len(v.inodes))
	}
	v.capMu.RUnlock()
	must(t, os.Remove(e.path("a/b")))                            // whiteouts go with it
	must(t, os.Mkdir(e.path("a/b"), 0o755))                      // opaque now
	e.write("a/b/two.txt", "a new two")                          // where the lower one was
	must(t, unix.Rename(e.path("webdir/sub"), e.path("victim"))) // over an empty dir (os.Rename refuses)
	must(t, os.Rename(e.path("many"), e.path("many2")))          // untouched below
	e.write("many2/d3/new", "new")                               // d3 gains an entry after its parent moved
	must(t, os.Remove(e.path("many2/d4/f4")))

	diffStates(t, "view", stateOfFS(t, v), want)
}

// TestFreezeBornCostsNothing: inodes the overlay creates after a freeze
// are not pinned when they go; files that existed at the freeze are.
func TestFreezeBornCostsNothing(t *testing.T) {
	e := mountEnv(t, nil, Options{})
	e.write("state.json", "v0")
	v, err := e.m.Freeze(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	for i := 1; i <= 20; i++ {
		must(t, atomicWrite(e.path("state.json"), []byte(fmt.Sprintf("v%d", i))))
	}
	e.write("scratch", "x")
	must(t, os.Remove(e.path("scratch")))
	v.mu.Lock()
	pinned := v.pinFds
	v.mu.Unlock()
	if pinned != 1 {
		t.Errorf("%d files pinned, want only the one that existed at the freeze", pinned)
	}
	if b, err := v.Open("state.json"); err != nil {
		t.Fatal(err)
	} else {
		buf := make([]byte, 10)
		k, _ := b.Read(buf)
		b.Close()
		if string(buf[:k]) != "v0" {
			t.Errorf("view reads %q", buf[:k])
		}
	}
}

// TestFreezeExactUnderChurn freezes while writers create, rewrite, append
// to, delete and rename files and directories, and checks every view
// against the tree as it was at its freeze (recorded with the writers
// paused), while the writers go on during the check: names, types, modes,
// sizes, contents and mtimes.
func TestFreezeExactUnderChurn(t *testing.T) {
	lower, _ := packLower(t, func(dir string) {
		for d := 0; d < 3; d++ {
			os.MkdirAll(filepath.Join(dir, fmt.Sprintf("d%d/sub", d)), 0o755)
			for f := 0; f < 4; f++ {
				os.WriteFile(filepath.Join(dir, fmt.Sprintf("d%d/f%d", d, f)), []byte(fmt.Sprintf("lower %d %d", d, f)), 0o644)
			}
		}
	})
	e := mountEnv(t, lower, Options{})
	var pause sync.RWMutex
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := 0; w < 3; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 11))
			for i := 1; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				pause.RLock()
				d := fmt.Sprintf("d%d", r.IntN(3))
				p := e.path(fmt.Sprintf("%s/f%d", d, r.IntN(6)))
				switch r.IntN(9) {
				case 0, 1:
					atomicWrite(p, []byte(fmt.Sprintf("w%d-%d", w, i)))
				case 2:
					if f, err := os.OpenFile(p, os.O_WRONLY|os.O_APPEND, 0); err == nil {
						f.Write([]byte("+"))
						f.Close()
					}
				case 3:
					os.Remove(p)
				case 4:
					os.Rename(p, e.path(fmt.Sprintf("d%d/sub/f%d", r.IntN(3), r.IntN(6))))
				case 5:
					os.Chmod(p, os.FileMode(0o600+r.IntN(64)))
				case 6:
					q := e.path(fmt.Sprintf("%s/sub/n%d", d, r.IntN(4)))
					if os.Mkdir(q, 0o755) != nil {
						os.RemoveAll(q)
					}
				case 7:
					a, b := e.path(fmt.Sprintf("d%d/sub", r.IntN(3))), e.path(fmt.Sprintf("d%d/sub", r.IntN(3)))
					unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE)
				case 8:
					a := e.path(fmt.Sprintf("d%d", r.IntN(3)))
					if os.Rename(a, e.path("moving")) == nil {
						os.Rename(e.path("moving"), a)
					}
				}
				pause.RUnlock()
			}
		}()
	}
	deadline := time.Now().Add(3 * time.Second)
	views := 0
	stopWriters := sync.OnceFunc(func() {
		close(stop)
		wg.Wait()
	})
	defer stopWriters() // before the mount goes, whatever fails
	for time.Now().Before(deadline) {
		pause.Lock()
		want := stateOfDir(t, e.mnt)
		v, err := e.m.Freeze(t.Context())
		pause.Unlock()
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond) // let the writers move on
		got := stateOfFS(t, v)
		v.Close()
		diffStates(t, fmt.Sprintf("view %d", views), got, want)
		if t.Failed() {
			break
		}
		views++
	}
	stopWriters()
	t.Logf("%d views checked", views)
}
