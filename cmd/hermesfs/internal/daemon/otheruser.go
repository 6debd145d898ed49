package daemon

import (
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/fs"
)

// A daemon that runs as root with --owner serves the agent's user, whose
// `hermesfs status` finds neither the mount in its own registry nor the
// daemon's state dir and control socket, which are root's (0700): it must
// still learn that the mount is alive, and how to see the rest. What it
// can read without privileges says that much: /proc/self/mountinfo names
// the hermesfs mount and the uid that made it (user_id=), and the
// daemon's command line in /proc (world-readable) names its mountpoint.

// OtherUserDaemon is a live hermesfs mount made by a daemon of another
// user.
type OtherUserDaemon struct {
	Mountpoint string
	UID        int
	User       string // the uid's name, or the uid
	PID        int    // 0 when /proc does not tell
}

// OtherUserMounts returns the live hermesfs mounts (below prefix, or
// exactly at it when exact) that a daemon of a user other than the caller
// serves and the caller can reach. A mount that does not answer within a
// second is left out.
func OtherUserMounts(prefix string, exact bool) []OtherUserDaemon {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	me := os.Getuid()
	top := map[string]OtherUserDaemon{} // a later line is a mount on top
	var order []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := fs.UnescapeMountinfo(f[4])
		if exact && mp != prefix || !exact && !within(mp, prefix) {
			continue
		}
		if _, seen := top[mp]; !seen {
			order = append(order, mp)
		}
		top[mp] = OtherUserDaemon{UID: -1}
		for i := 5; i+3 < len(f); i++ {
			if f[i] != "-" {
				continue
			}
			if f[i+1] != "fuse."+fs.FsName && fs.UnescapeMountinfo(f[i+2]) != fs.FsName {
				break
			}
			for _, o := range strings.Split(f[i+3], ",") {
				if v, ok := strings.CutPrefix(o, "user_id="); ok {
					if uid, err := strconv.Atoi(v); err == nil {
						top[mp] = OtherUserDaemon{Mountpoint: mp, UID: uid}
					}
				}
			}
			break
		}
	}
	var out []OtherUserDaemon
	for _, mp := range order {
		o := top[mp]
		if o.UID < 0 || o.UID == me || ProbeFUSE(mp, time.Second) != FUSELive {
			continue
		}
		if _, err := os.Stat(mp); err != nil {
			continue // not this user's to reach (a directory it may not enter)
		}
		o.User = strconv.Itoa(o.UID)
		if u, err := user.LookupId(o.User); err == nil {
			o.User = u.Username
		}
		o.PID = mountDaemonPID(mp, o.UID)
		out = append(out, o)
	}
	return out
}

func within(path, dir string) bool {
	rel, err := filepath.Rel(dir, path)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// mountDaemonPID finds, in /proc, the one `hermesfs mount` of uid whose
// command line names mp (absolute); 0 if none or several.
func mountDaemonPID(mp string, uid int) int {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	found := 0
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st syscall.Stat_t
		if syscall.Stat("/proc/"+e.Name(), &st) != nil || int(st.Uid) != uid {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(b), "\x00"), "\x00")
		if len(args) < 3 || !strings.HasPrefix(filepath.Base(args[0]), "hermesfs") {
			continue
		}
		isMount, names := false, false
		for _, a := range args[1:] {
			if a == "mount" {
				isMount = true
			}
			if filepath.IsAbs(a) && filepath.Clean(a) == mp {
				names = true
			}
		}
		if isMount && names {
			if found != 0 {
				return 0
			}
			found = pid
		}
	}
	return found
}
