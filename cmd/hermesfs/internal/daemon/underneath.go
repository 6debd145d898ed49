package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/hermesfs/hermesfs/fs"
)

// Files written into the mountpoint directory while no mount covers it (a
// writer that outlived the stop, an agent started before the mount) are
// taken into the upper layer before the mount covers them (fs.Adopt), so
// they are in the home and in the next snapshot, never hidden.
//
// What the directory held when it was last accounted for is known by time:
// persistedState.UnderneathChecked is when the last boot looked at it (the
// first one packed it into the first snapshot, or took it in); an entry
// whose ctime is later was written since. A state dir from before that
// field counts from its own birth. A state dir this boot made (a new host)
// counts everything, unless this boot seeded the store from the directory:
// what a new host's directory holds is not in the store.

// underneathMark is the instant a look at the mountpoint directory
// starts, on the clock ctime is read from: the ctime of a file made (and
// removed) in the state dir. A file written before it has an earlier
// ctime; one written in the same tick is looked at again next time, which
// finds it the same (a file's own time read here could be a tick ahead of
// the ctimes written just before, which would then never be looked at).
func (d *daemon) underneathMark() time.Time {
	f, err := os.CreateTemp(d.sd.path, ".underneath-mark-*")
	if err != nil {
		return time.Now().Add(-time.Second)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return time.Now().Add(-time.Second)
	}
	return time.Unix(st.Ctim.Sec, st.Ctim.Nsec)
}

// underneathShown bounds the files a warning names.
const underneathShown = 10

// adoptUnderneath takes into upper (over lower, nil for none) what the
// mountpoint directory gained since it was last accounted for. guarded
// names the memory files, never written by adoption (what would go there
// goes beside them). It records what it took for status and makes the
// mount publish it; an error stops the boot with the files untouched.
func (d *daemon) adoptUnderneath(ctx context.Context, upper string, lower fs.Lower, guarded func(string) bool) error {
	if d.cfg.ReadOnly {
		// A read-only mount keeps nothing: the next writable mount
		// takes them in.
		return nil
	}
	if d.refuseWrites {
		// The home shown while the writer lease is awaited takes
		// nothing in: once the lease is ours the base is decided again,
		// and what is taken in must go over that one. The directory,
		// opened before the mount covers it, tells then whether the
		// mount must be made again to take something in
		// (underneathWaits).
		if d.underneath == nil {
			f, err := os.Open(d.cfg.Mountpoint)
			if err != nil {
				return fmt.Errorf("the mountpoint directory %s: %w", d.cfg.Mountpoint, err)
			}
			d.underneath = f
		}
		return nil
	}
	since := d.underneathSince()
	start := d.underneathMark()
	got, err := fs.Adopt(ctx, d.cfg.Mountpoint, upper, lower, fs.AdoptOptions{
		Since:  since,
		Stamp:  start.UTC().Format("20060102-150405"),
		Beside: guarded,
	})
	if len(got) > 0 {
		d.adopted = got
		d.pending = true
		d.warnAdopted(got, since.IsZero())
	}
	if err != nil {
		return fmt.Errorf("the mountpoint directory %s holds files written while no mount covered it, and they could not all be taken into the home "+
			"(%d were); nothing is mounted, and the directory is as it was: %w", d.cfg.Mountpoint, len(got), err)
	}
	d.st.UnderneathChecked = start
	return nil
}

// underneathSince is when the mountpoint directory was last accounted
// for: what changed there at it or after is taken in (zero: everything).
func (d *daemon) underneathSince() time.Time {
	since := d.st.UnderneathChecked
	if since.IsZero() && !slices.Contains(d.sd.created, d.sd.upper()) {
		// A state dir from before the record: the directory was
		// accounted for when the state dir was made.
		since = birthTime(d.sd.path)
	}
	return since
}

// underneathWaits reports whether the mountpoint directory, covered by the
// home shown while the writer lease was awaited, holds anything this boot
// must take in; the boot then makes the mount again (adoption writes into
// the upper layer, which only an unmounted overlay may have written
// behind its back). It may say yes of a file the home holds the same; a
// directory it cannot read counts as yes, and the mount made again looks
// at it as every boot does.
func (d *daemon) underneathWaits(ctx context.Context) bool {
	if d.underneath == nil {
		return false
	}
	f := d.underneath
	d.underneath = nil
	defer f.Close()
	changed, err := fs.ChangedUnderneath(ctx, fmt.Sprintf("/proc/self/fd/%d", f.Fd()), d.underneathSince())
	if err != nil {
		d.log.Warn("cannot look at the mountpoint directory underneath the home shown while waiting; mounting again to take in what it holds", "err", err)
		return true
	}
	return changed
}

// warnAdopted logs one warning naming what was taken in (a bounded list
// and the count).
func (d *daemon) warnAdopted(got []fs.Adopted, newHost bool) {
	var names []string
	var bytes int64
	beside := 0
	for i, a := range got {
		bytes += a.Size
		if a.From != "" {
			beside++
		}
		if i < underneathShown {
			names = append(names, adoptedLine(a))
		}
	}
	msg := "files were written into the mountpoint directory while no mount covered it; they are now in the home as changes over the snapshot " +
		"(and in the next snapshot), left as they were underneath"
	if beside > 0 {
		msg += "; where the home holds something else at a name, the file is beside it as NAME.underneath-TIME"
	}
	if newHost {
		msg += "; this is the first mount here: if the store belongs to another home, stop now and pass --store"
	}
	d.log.Warn(msg, "count", len(got), "beside", beside, "bytes", bytes, "files", strings.Join(names, ", "))
}

// adoptedLine is how an adopted entry is named in logs and status.
func adoptedLine(a fs.Adopted) string {
	if a.From != "" {
		return a.From + " -> " + a.Path
	}
	return a.Path
}

// birthTime is when path was made, or zero if the file system does not
// say (then everything in the directory counts as new).
func birthTime(path string) time.Time {
	var x unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, filepath.Clean(path), unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BTIME, &x); err != nil || x.Mask&unix.STATX_BTIME == 0 {
		return time.Time{}
	}
	return time.Unix(x.Btime.Sec, int64(x.Btime.Nsec))
}
