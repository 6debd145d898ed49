package archive

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// The layouts an extending pack writes, checked on their own against the
// readers we promise (see "Extending" in doc.go): a metadata block left
// short in the middle of the inode and directory tables, with the blocks
// after it starting afresh (a large directory with an index among them);
// and inode numbers with holes, sb.Inodes past the highest number in use,
// the export entries of the holes zero. unsquashfs 4.5.1 (listing and
// extraction), go-diskfs and the kernel (lookups through the directory
// index, st_ino) read both.
func TestFormatProbes(t *testing.T) {
	unsquashfs := needTool(t, "unsquashfs")
	src := filepath.Join(t.TempDir(), "tree")
	for i := range 100 {
		writeFile(t, filepath.Join(src, "a", fmt.Sprintf("f%03d", i)), text(100+i, i), 0o644)
	}
	const big = 800
	bigName := func(i int) string { return fmt.Sprintf("session-%05d-%s.json", i, strings.Repeat("x", i%100)) }
	for i := range big {
		writeFile(t, filepath.Join(src, "b-cut", bigName(i)), []byte(bigName(i)), 0o644)
	}
	for i := range 100 {
		writeFile(t, filepath.Join(src, "c", fmt.Sprintf("g%03d", i)), text(100+i, i+7), 0o644)
	}
	os.Symlink("a/f001", filepath.Join(src, "link"))
	os.Link(filepath.Join(src, "a", "f002"), filepath.Join(src, "c", "hard"))
	want := scanTree(t, src)
	for name, pr := range map[string]*formatProbe{
		"short": {cutBefore: "b-cut"},
		"holes": {inoGap: 3, inoExtra: 5000},
	} {
		t.Run(name, func(t *testing.T) {
			p, _ := packToFile(t, src, PackOptions{probe: pr})
			r := openFile(t, p)
			compareTrees(t, want, scanArchive(t, r), compareOpts{})
			if err := r.Verify(t.Context()); err != nil {
				t.Fatal(err)
			}
			if pr.cutBefore != "" {
				short := 0
				for _, lens := range [][]int{tableBlocks(t, r, kindInodeTable, r.sb.InodeTable, r.sb.DirTable), tableBlocks(t, r, kindDirTable, r.sb.DirTable, r.dirEnd)} {
					for _, n := range lens[:len(lens)-1] {
						if n != metaBlockSize {
							short++
						}
					}
				}
				if short != 2 {
					t.Fatalf("%d short metadata blocks before the last of their table, want 2", short)
				}
			}
			run(t, unsquashfs, "-l", "-no-progress", p)
			dir := filepath.Join(t.TempDir(), "x")
			run(t, unsquashfs, "-no-progress", "-d", dir, p)
			compareTrees(t, want, scanTree(t, dir), compareOpts{})
			checkGoDiskfs(t, p, want)
			mnt := kernelMount(t, p)
			compareTrees(t, want, scanTree(t, mnt), compareOpts{})
			for i := 0; i < big; i += 7 {
				data, err := os.ReadFile(filepath.Join(mnt, "b-cut", bigName(i)))
				if err != nil || string(data) != bigName(i) {
					t.Fatalf("kernel lookup %s: %q %v", bigName(i), data, err)
				}
			}
			for _, name := range []string{"a/f002", "c/hard", "c/g050", "b-cut"} {
				a, err := r.resolve("t", name, false)
				if err != nil {
					t.Fatal(err)
				}
				fi, err := os.Lstat(filepath.Join(mnt, name))
				if err != nil {
					t.Fatal(err)
				}
				if ino := fi.Sys().(*syscall.Stat_t).Ino; ino != uint64(a.Ino) {
					t.Errorf("%s: kernel st_ino %d, archive inode %d", name, ino, a.Ino)
				}
			}
		})
	}
}
