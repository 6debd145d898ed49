package fs

import (
	"context"
	"errors"
	"syscall"

	fusefs "github.com/hanwen/go-fuse/v2/fs"
	"golang.org/x/sys/unix"
)

// GuardMover is optionally implemented by a Guard that rules on renames of
// guarded paths and records them and deletes (Check judges the content a
// rename brings onto a guarded name; this is about where guarded files go).
//
// Moving is called before a rename takes from to to when from is a guarded
// file, or a directory a guarded file may sit below (dir; every directory
// when the Guard is no GuardedBelower). nil lets the rename go on; an
// error wrapping EPERM refuses it with EPERM, any other with EIO. Moved is
// called after a guarded file was renamed onto a guarded path, Removed
// after a guarded file was deleted; both only record.
type GuardMover interface {
	Moving(ctx context.Context, from, to string, dir bool, pid uint32) error
	Moved(ctx context.Context, from, to string, pid uint32)
	Removed(ctx context.Context, rel string, pid uint32)
}

// guardMover is the Guard as a GuardMover, or nil.
func (ov *overlay) guardMover() GuardMover {
	gm, _ := ov.guard.(GuardMover)
	return gm
}

// guardsBelow reports whether a guarded file may sit below directory rel.
func (ov *overlay) guardsBelow(rel string) bool {
	if gb, ok := ov.guard.(GuardedBelower); ok {
		return gb.GuardedBelow(rel)
	}
	return true
}

// moveAway asks the GuardMover about s leaving path from for to. It
// returns whether s is a guarded file (for Moved after the rename).
func (ov *overlay) moveAway(ctx context.Context, s *node, from, to string) (guardedFile bool, errno syscall.Errno) {
	gm := ov.guardMover()
	if gm == nil {
		return false, 0
	}
	dir := s.isDir()
	switch {
	case dir && !ov.guardsBelow(from):
		return false, 0
	case !dir && !ov.guard.Guarded(from):
		return false, 0
	}
	if err := gm.Moving(context.WithoutCancel(ctx), from, to, dir, callerPid(ctx)); err != nil {
		if errors.Is(err, syscall.EPERM) {
			return false, syscall.EPERM
		}
		return false, syscall.EIO
	}
	return !dir, 0
}

// renameGuarded is rename with guarded paths kept in place: a GuardMover
// refuses (and records) a rename that would take guarded files away, and
// records one that takes a guarded file onto another guarded path.
func (n *node) renameGuarded(ctx context.Context, name string, newParent fusefs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	ov := n.ov
	np, ok := newParent.(*node)
	if ov.guardMover() == nil || !ok || ov.opts.ReadOnly {
		return n.rename(ctx, name, newParent, newName, flags)
	}
	var from, to string
	var src, dst *node
	if srel, ok := n.rel(); ok {
		from = joinRel(srel, name)
	}
	if drel, ok := np.rel(); ok {
		to = joinRel(drel, newName)
	}
	if ch := n.GetChild(name); ch != nil {
		src, _ = ch.Operations().(*node)
	}
	if ch := np.GetChild(newName); ch != nil {
		dst, _ = ch.Operations().(*node)
	}
	var srcGuarded, dstGuarded bool
	if src != nil && from != "" && to != "" && src != dst {
		var errno syscall.Errno
		if srcGuarded, errno = ov.moveAway(ctx, src, from, to); errno != 0 {
			return errno
		}
		if flags&unix.RENAME_EXCHANGE != 0 && dst != nil {
			if dstGuarded, errno = ov.moveAway(ctx, dst, to, from); errno != 0 {
				return errno
			}
		}
	}
	errno := n.rename(ctx, name, newParent, newName, flags)
	if errno == 0 {
		if srcGuarded {
			ov.guardMover().Moved(context.WithoutCancel(ctx), from, to, callerPid(ctx))
		}
		if dstGuarded {
			ov.guardMover().Moved(context.WithoutCancel(ctx), to, from, callerPid(ctx))
		}
	}
	return errno
}
