package main

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/fs"
)

func printMemoryStatus(row func(k, f string, a ...any), r daemon.StatusReport) {
	if len(r.MemoryLimits) > 0 {
		kinds := make([]string, 0, len(r.MemoryLimits))
		for k := range r.MemoryLimits {
			kinds = append(kinds, k)
		}
		sort.Strings(kinds)
		var parts []string
		for _, k := range kinds {
			parts = append(parts, fmt.Sprintf("%s %d", k, r.MemoryLimits[k]))
		}
		row("memory limits", "%s characters", strings.Join(parts, ", "))
	}
	for _, p := range r.MemoryConfigProblems {
		row("memory config", "WARNING: %s", p)
	}
}

// changedLine is status' "changed" figure, named for what it counts: every
// file or directory created, written, renamed or deleted since the last
// snapshot (one created and deleted again counts too), not the number of
// entries that differ from it.
func changedLine(r daemon.StatusReport) string {
	if r.DirtyFiles == 0 {
		return "nothing since the last snapshot"
	}
	return fmt.Sprintf("%d files or directories touched (created, written, renamed or deleted), %s written, since the last snapshot", r.DirtyFiles, daemon.HumanBytes(r.DirtyBytes))
}

// lastSnapshotLine is status' "last snapshot" row: one line, its figures
// after the id when this daemon took it.
func lastSnapshotLine(l *daemon.SnapshotRecord) string {
	s := fmt.Sprintf("%s at %s", l.ID, l.Time.Local().Format(time.DateTime))
	if l.Duration > 0 {
		s += fmt.Sprintf(" (%s archive, %s uploaded, took %s)", daemon.HumanBytes(l.Size), daemon.HumanBytes(l.BytesUploaded), l.Duration.Round(time.Millisecond))
	}
	return s
}

// writeBackLine is status' "write-back" row.
func writeBackLine(r daemon.StatusReport) string {
	if r.WriteBack <= 0 {
		return "off: changes reach the store at the next snapshot (--interval, 'hermesfs snapshot', stop)"
	}
	return fmt.Sprintf("%s: a change reaches the store %s after it is made", r.WriteBack, r.WriteBack)
}

// unpublishedLine is status' "unpublished" row: since when changes are not
// in the store (the recovery point: a host lost now loses them), when the
// daemon knows.
func unpublishedLine(r daemon.StatusReport) string {
	if r.UnpublishedSince.IsZero() {
		return "yes: local changes not yet in any snapshot"
	}
	if r.RecoveryPointWarning != "" {
		return "WARNING: " + r.RecoveryPointWarning
	}
	age := r.UnpublishedAge.Round(time.Second)
	if r.UnpublishedAge < 10*time.Second {
		age = r.UnpublishedAge.Round(100 * time.Millisecond)
	}
	return fmt.Sprintf("yes, for %s: the changes since %s are not in the store yet", age, clockTime(r.UnpublishedSince, time.Now()))
}

// clockTime writes t in local time as status shows it: the time of day
// when t is today, with its date when it is not ("due 08:08:47" a day
// ahead reads as today).
func clockTime(t, now time.Time) string {
	t, now = t.Local(), now.Local()
	if y, m, d := t.Date(); y == now.Year() && m == now.Month() && d == now.Day() {
		return t.Format(time.TimeOnly)
	}
	return t.Format(time.DateTime)
}

// printAdopted names what the mount took in at boot from the mountpoint
// directory (files written there while no mount covered it): a bounded
// list and the count.
func printAdopted(row func(k, f string, a ...any), got []fs.Adopted) {
	if len(got) == 0 {
		return
	}
	const shown = 10
	var names []string
	for i, a := range got {
		if i == shown {
			names = append(names, fmt.Sprintf("and %d more", len(got)-shown))
			break
		}
		if a.From != "" {
			names = append(names, a.From+" (as "+a.Path+")")
		} else {
			names = append(names, a.Path)
		}
	}
	row("taken in at boot", "%d written into the mountpoint directory while no mount covered it: %s", len(got), strings.Join(names, ", "))
}

// printCompaction is status' "compaction" row: running, or what the last
// compaction of the snapshots' image freed.
func printCompaction(row func(k, f string, a ...any), c *daemon.CompactionStatus) {
	if c == nil || !c.Running && c.Last == nil && c.Failed == 0 {
		return
	}
	var parts []string
	if c.Running {
		parts = append(parts, "running now (in the background; a stop does not wait for it)")
	}
	if l := c.Last; l != nil {
		parts = append(parts, fmt.Sprintf("last %s: %s of %s (%s), freed %s of image, extents %d -> %d, %s uploaded, took %s",
			l.Time.Local().Format(time.DateTime), l.ID, l.Of, l.Reason, daemon.HumanBytes(l.Freed), l.Extents[0], l.Extents[1],
			daemon.HumanBytes(l.Uploaded), l.Took.Round(time.Millisecond)))
	}
	if c.Failed > 0 {
		parts = append(parts, fmt.Sprintf("%d failed (see the log)", c.Failed))
	}
	row("compaction", "%s", strings.Join(parts, "; "))
}
