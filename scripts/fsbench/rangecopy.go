package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/fs"
)

// rangeCopy is the copy-up group: the first 4 KiB write into 1 GiB and
// 4 GiB lower files with copy-up by range against a forced whole-file
// copy-up and native disk; the freeze stall with a partial 1 GiB file; a
// fresh session's first SQLite commit into the home's state.db in the
// lower layer, then 3,000 autocommit inserts; random 4 KiB writes while
// the background copy runs and after it finished. It packs its own lower
// layer (the big files and state.db) and mounts it twice: by range (the
// default) and whole-file (CopyUpByRangeMin -1).
func (b *bench) rangeCopy() error {
	dir := filepath.Join(b.work, "range")
	src := filepath.Join(dir, "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	for name, mib := range map[string]int64{"big1.bin": 1024, "big4.bin": 4096, "big1w.bin": 1024} {
		if err := writePatterned(filepath.Join(src, name), mib<<20); err != nil {
			return err
		}
	}
	if err := copyFile(filepath.Join(b.home, "state.db"), filepath.Join(src, "state.db")); err != nil {
		return err
	}
	img := filepath.Join(dir, "lower.sqfs")
	f, err := os.Create(img)
	if err != nil {
		return err
	}
	t0 := time.Now()
	_, err = archive.PackDir(context.Background(), f, src, archive.PackOptions{})
	f.Close()
	if err != nil {
		return err
	}
	fmt.Printf("# copy-up group: packed 6 GiB of big files + state.db in %s\n", time.Since(t0).Round(time.Millisecond))
	lf, err := os.Open(img)
	if err != nil {
		return err
	}
	defer lf.Close()
	st, _ := lf.Stat()
	mount := func(name string, min int64) (*fs.Mounted, string, error) {
		r, err := archive.Open(lf, st.Size(), archive.ReaderOptions{Name: img})
		if err != nil {
			return nil, "", err
		}
		mnt := filepath.Join(dir, "mnt-"+name)
		os.MkdirAll(mnt, 0o755)
		log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
		m, err := fs.Mount(context.Background(), mnt, fs.Options{Upper: filepath.Join(dir, "upper-"+name), Lower: r, Logger: log, CopyUpByRangeMin: min, PassthroughWriteMax: b.ptwMax})
		return m, mnt, err
	}
	unmount := func(m *fs.Mounted) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		m.Unmount(ctx)
	}
	firstWrite := func(p string) (time.Duration, error) {
		if err := dropCaches(); err != nil {
			return 0, err
		}
		t := time.Now()
		err := touchWrite(p)
		return time.Since(t), err
	}
	line := func(name string, native, overlay time.Duration, goal string) {
		fmt.Printf("%-44s %12s %12s %7.0f  %s\n", name, dur(native), dur(overlay), float64(overlay)/float64(native), goal)
	}

	// Whole-file copy-up first, then its upper goes (disk space).
	mw, mntW, err := mount("whole", -1)
	if err != nil {
		return err
	}
	whole := map[string]time.Duration{}
	for _, name := range []string{"big1.bin", "big4.bin"} {
		if whole[name], err = firstWrite(filepath.Join(mntW, name)); err != nil {
			unmount(mw)
			return err
		}
	}
	wholeDB := filepath.Join(mntW, "state.db")
	dropCaches()
	wholeCommit, err := timeSQL(wholeDB, freshCommitSQL)
	unmount(mw)
	os.RemoveAll(filepath.Join(dir, "upper-whole"))
	if err != nil {
		return err
	}

	m, mnt, err := mount("range", 0)
	if err != nil {
		return err
	}
	defer unmount(m)
	for _, c := range []struct{ name, label string }{{"big1.bin", "1 GiB"}, {"big4.bin", "4 GiB"}} {
		native, err := firstWrite(filepath.Join(src, c.name))
		if err != nil {
			return err
		}
		ranged, err := firstWrite(filepath.Join(mnt, c.name))
		if err != nil {
			return err
		}
		line("first 4 KiB write, "+c.label+" lower, by range", native, ranged, "<= 10ms (cold)")
		line("first 4 KiB write, "+c.label+" lower, whole file", native, whole[c.name], "info: forced whole-file copy-up")
		if c.name == "big1.bin" {
			// The freeze while that file is partial.
			t := time.Now()
			v, err := m.Freeze(context.Background())
			if err != nil {
				return err
			}
			total := time.Since(t)
			v.Close()
			fmt.Printf("%-44s %12s %12s %7s  %s\n", "freeze with a partial 1 GiB file", "-", dur(v.Stall()), "-", "< 100ms (stall; whole Freeze "+dur(total)+")")
		}
	}
	// A fresh session: the database is in the lower layer.
	nativeDB := filepath.Join(dir, "native-state.db")
	if err := copyFile(filepath.Join(src, "state.db"), nativeDB); err != nil {
		return err
	}
	dropCaches()
	nc, err := timeSQL(nativeDB, freshCommitSQL)
	if err != nil {
		return err
	}
	dropCaches()
	oc, err := timeSQL(filepath.Join(mnt, "state.db"), freshCommitSQL)
	if err != nil {
		return err
	}
	line("fresh session: first SQLite commit, by range", nc, oc, "<= 50ms (cold, incl. sqlite3 start)")
	line("fresh session: first SQLite commit, whole", nc, wholeCommit, "info: forced whole-file copy-up")
	ins := func(db string) (time.Duration, error) { return timeSQL(db, autocommitSQL(3000)) }
	ni, err := ins(nativeDB)
	if err != nil {
		return err
	}
	oi, err := ins(filepath.Join(mnt, "state.db"))
	if err != nil {
		return err
	}
	report("3000 SQLite inserts into state.db (partial)", "<= 1.3", ni, oi)

	// Random writes into a partial 1 GiB file while it completes, then
	// after.
	if _, err := firstWrite(filepath.Join(mnt, "big1w.bin")); err != nil {
		return err
	}
	for _, phase := range []string{"during completion", "after completion"} {
		if phase == "after completion" {
			t := time.Now()
			for len(m.PartialCopyUps()) > 0 {
				time.Sleep(50 * time.Millisecond)
			}
			fmt.Printf("# background copies finished %s after the writes\n", time.Since(t).Round(time.Millisecond))
		}
		partial := len(m.PartialCopyUps())
		for _, c := range []struct {
			n    int
			sync bool
		}{{20000, false}, {2000, true}} {
			tn := time.Now()
			if err := randomWrites(filepath.Join(src, "big1w.bin"), c.n, c.sync); err != nil {
				return err
			}
			dn := time.Since(tn)
			to := time.Now()
			if err := randomWrites(filepath.Join(mnt, "big1w.bin"), c.n, c.sync); err != nil {
				return err
			}
			name := fmt.Sprintf("%dk random 4K writes, %s", c.n/1000, phase)
			if c.sync {
				name = fmt.Sprintf("%dk 4K writes+fdatasync, %s", c.n/1000, phase)
			}
			report(name, "info", dn, time.Since(to))
		}
		if phase == "during completion" {
			fmt.Printf("# partial files when the writes started: %d; now: %d\n", partial, len(m.PartialCopyUps()))
		}
	}
	return nil
}

const freshCommitSQL = "PRAGMA journal_mode=WAL;\nINSERT INTO messages(session_id, role, content, timestamp) VALUES('fresh', 'user', 'hello', 1);\n"

func autocommitSQL(n int) string {
	var sb strings.Builder
	sb.WriteString("PRAGMA journal_mode=WAL;\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&sb, "INSERT INTO messages(session_id, role, content, timestamp) VALUES('s%d', 'user', hex(randomblob(200)), %d);\n", i%50, i)
	}
	return sb.String()
}

// timeSQL runs script with the sqlite3 shell on db and times it.
func timeSQL(db, script string) (time.Duration, error) {
	cmd := exec.Command("sqlite3", db)
	cmd.Stdin = strings.NewReader(script)
	cmd.Dir = "/"
	t := time.Now()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("sqlite3 %s: %v: %s", db, err, out)
	}
	return time.Since(t), nil
}
