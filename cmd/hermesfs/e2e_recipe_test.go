package main

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// readmeRecipe is the shell recipe the README gives to put a snapshot's
// image together on a local store with standard tools (the code block
// after the marker), with its store line pointing at storeDir.
func readmeRecipe(t *testing.T, storeDir string) string {
	t.Helper()
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "<!-- recipe:local -->\n```sh\n")
	if !ok {
		t.Fatal("README.md has no recipe:local block")
	}
	block, _, ok := strings.Cut(rest, "```")
	if !ok {
		t.Fatal("README.md: the recipe block does not end")
	}
	lines := strings.Split(block, "\n")
	if !strings.HasPrefix(lines[0], "store=") {
		t.Fatalf("the recipe does not start by naming the store: %q", lines[0])
	}
	lines[0] = "store=" + storeDir
	return strings.Join(lines, "\n")
}

// The README's recipe, run as written with dd, age and unsquashfs only,
// gives back the snapshot's tree: for a plaintext and an encrypted store,
// of an image whose extents span the segments of several snapshots.
func TestE2EReadmeRecipe(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse", "unsquashfs", "age", "dd")
	for _, encrypted := range []bool{false, true} {
		t.Run(map[bool]string{false: "plaintext", true: "encrypted"}[encrypted], func(t *testing.T) {
			storeDir := e2eDir(t, "store")
			store := "file://" + storeDir
			h := newHost(t, store)
			work := e2eDir(t, "work")
			if encrypted {
				key, pub := newTestKey(t)
				h = encryptedHost(t, store, key, pub)
				b, err := os.ReadFile(key)
				if err != nil {
					t.Fatal(err)
				}
				// The recipe names key.txt in the directory it runs in.
				if err := os.WriteFile(filepath.Join(work, "key.txt"), b, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			mp := e2eDir(t, "home")
			lazyHome(t, mp)
			d := h.mount(mp, "--interval", "0")
			for i := range 3 {
				writeFile(t, filepath.Join(mp, "sessions", fmt.Sprintf("new-%d.json", i)), strings.Repeat(fmt.Sprintf("turn %d\n", i), 2000), 0o644)
				if code, out, errOut := h.run("snapshot", mp); code != 0 {
					t.Fatalf("snapshot: %d %s%s", code, out, errOut)
				}
			}
			want := snapshotTree(t, mp)
			d.stopOK(t)
			id := localLatest(t, storeDir)
			if segs := strings.Count(mustRead(t, filepath.Join(storeDir, "snapshots", id+".json")), `"sums_sha256"`); segs < 2 {
				t.Fatalf("the image uses %d segments; the recipe should be tried on several", segs)
			}
			cmd := exec.Command("sh", "-e", "-c", readmeRecipe(t, storeDir))
			cmd.Dir = work
			if out, err := cmd.CombinedOutput(); err != nil {
				t.Fatalf("the README's recipe: %v\n%s", err, out)
			}
			if diff := diffTrees(want, snapshotTree(t, filepath.Join(work, "home"))); diff != "" {
				t.Errorf("the recipe's tree differs from the snapshot:\n%s", diff)
			}
		})
	}
}
