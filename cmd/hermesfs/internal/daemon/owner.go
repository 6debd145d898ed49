package daemon

import (
	"fmt"
	"os"
	"os/user"
	"strconv"
	"strings"
	"syscall"
)

// owner is the user a root daemon serves with --owner: the mount root is
// theirs and every user of the host may use the mount, the kernel checking
// the modes shown (allow_other + default_permissions).
type owner struct {
	Spec     string // as given, for messages
	Uid, Gid int
}

// ParseOwner reads USER[:GROUP]: names or numeric ids. Without GROUP, the
// user's primary group.
func ParseOwner(spec string) (*owner, error) {
	name, group, hasGroup := strings.Cut(spec, ":")
	if name == "" {
		return nil, fmt.Errorf("%q: want USER[:GROUP]", spec)
	}
	o := &owner{Spec: spec}
	if uid, err := strconv.ParseUint(name, 10, 31); err == nil {
		o.Uid, o.Gid = int(uid), -1
		if u, err := user.LookupId(name); err == nil {
			o.Gid, _ = strconv.Atoi(u.Gid)
		}
	} else {
		u, err := user.Lookup(name)
		if err != nil {
			return nil, fmt.Errorf("%q: %v", spec, err)
		}
		o.Uid, _ = strconv.Atoi(u.Uid)
		o.Gid, _ = strconv.Atoi(u.Gid)
	}
	if hasGroup {
		if group == "" {
			return nil, fmt.Errorf("%q: empty GROUP", spec)
		}
		if gid, err := strconv.ParseUint(group, 10, 31); err == nil {
			o.Gid = int(gid)
		} else {
			g, err := user.LookupGroup(group)
			if err != nil {
				return nil, fmt.Errorf("%q: %v", spec, err)
			}
			o.Gid, _ = strconv.Atoi(g.Gid)
		}
	}
	if o.Gid < 0 {
		return nil, fmt.Errorf("%q: uid %d has no user entry to take a group from: give USER:GROUP", spec, o.Uid)
	}
	return o, nil
}

// giveRoot makes the upper layer's root, which is the mount root, the
// owner's, with the mode of the directory the mount covers (its setgid and
// sticky bits too) when that is a directory: what the user saw before the
// mount is what they see on it. Only the root changes hands: everything
// below keeps the owner the archive or its creator gave it.
func (o *owner) giveRoot(upper, mountpoint string) error {
	if err := os.MkdirAll(upper, 0o700); err != nil {
		return err
	}
	if err := os.Lchown(upper, o.Uid, o.Gid); err != nil {
		return fmt.Errorf("--owner %s: %w", o.Spec, err)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(mountpoint, &st); err != nil || st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return nil
	}
	return syscall.Chmod(upper, st.Mode&07777)
}
