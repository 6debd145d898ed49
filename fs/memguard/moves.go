package memguard

import (
	"context"
	"fmt"
	"syscall"
)

// Reasons of the audit events of renames and deletes.
const (
	// ReasonMoveAway refuses a rename that would take a guarded file, or
	// the directory holding guarded files, away from its guarded path.
	ReasonMoveAway = "move-away"
	// ReasonRenamed records a guarded file renamed onto another guarded
	// path (its new content there is judged by Check, recorded apart).
	ReasonRenamed = "renamed"
	// ReasonDeleted records a guarded file deleted.
	ReasonDeleted = "deleted"
)

// Moving rules on a rename, before it happens, of from to to, where from
// is a guarded file or (dir) a directory that guarded files may sit below.
// Such a rename is refused with EPERM, and recorded, unless it takes a
// guarded file onto another guarded path: memory moved out of the guarded
// paths would escape the limits, and a home without memories/ starts Hermes
// with no memory at all. Copies are fine (a copy is a new file), and so is
// deleting a guarded file on purpose. nil lets the rename go on, recording
// nothing yet (see Moved). An error wrapping EIO refuses it too: the
// refusal could not be recorded.
func (g *Guard) Moving(ctx context.Context, from, to string, dir bool, pid uint32) error {
	if !dir && g.Guarded(from) && g.Guarded(to) {
		return nil
	}
	what := "a guarded memory file"
	if dir {
		what = "a directory holding guarded memory files"
	}
	detail := fmt.Sprintf("renaming %s to %s would take %s out of the guarded paths; copy it instead", from, to, what)
	ev := Event{File: from, Verdict: VerdictRejected, Reason: ReasonMoveAway, Detail: detail}
	if err := g.record(&ev, pid); err != nil {
		return err
	}
	g.log.Warn("memory rename refused", "file", from, "to", to, "reason", ReasonMoveAway,
		"pid", ev.PID, "process", ev.Process, "errno", syscall.EPERM.Error())
	return &RejectError{File: from, Reason: ReasonMoveAway, Detail: detail, Errno: syscall.EPERM}
}

// Moved records that guarded file from was renamed onto guarded path to.
func (g *Guard) Moved(ctx context.Context, from, to string, pid uint32) {
	ev := Event{File: from, Verdict: VerdictAccepted, Reason: ReasonRenamed, Detail: "renamed to " + to}
	if err := g.record(&ev, pid); err == nil {
		g.log.Info("memory file renamed", "file", from, "to", to, "pid", ev.PID, "process", ev.Process)
	}
}

// Removed records that guarded file rel was deleted.
func (g *Guard) Removed(ctx context.Context, rel string, pid uint32) {
	ev := Event{File: rel, Verdict: VerdictAccepted, Reason: ReasonDeleted, Detail: "deleted"}
	if err := g.record(&ev, pid); err == nil {
		g.log.Info("memory file deleted", "file", rel, "pid", ev.PID, "process", ev.Process)
	}
}

// record stamps ev with the time, the limit of its file and the process,
// and appends it to the audit log.
func (g *Guard) record(ev *Event, pid uint32) error {
	if kind, ok := g.files[ev.File]; ok {
		ev.Limit = g.limit(kind)
	}
	ev.PID, ev.Process = process(g.proc, pid)
	ev.Time = g.now().UTC()
	if err := g.audit.append(ev); err != nil {
		g.log.Error("memory rename or delete not recorded", "file", ev.File, "reason", ev.Reason, "pid", pid, "err", err)
		return fmt.Errorf("memguard: %s %s: %w: %w", ev.Reason, ev.File, err, syscall.EIO)
	}
	return nil
}
