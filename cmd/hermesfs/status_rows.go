package main

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/fs/memguard"
)

// memoryReporter is the overlay's view of the memory hook for status.
type memoryReporter interface {
	MemoryLimits() map[string]int
	MemoryConfigProblems() []string
}

func (m *mountAdapter) MemoryLimits() map[string]int {
	out := map[string]int{}
	for k, v := range m.guard.Limits(context.Background()) {
		out[string(k)] = v
	}
	return out
}

func (m *mountAdapter) MemoryConfigProblems() []string { return m.guard.ConfigProblems() }

// memoryStatus fills in the memory hook's limits and config problems.
func (d *daemon) memoryStatus(r *statusReport) {
	if mr, ok := d.ov.(memoryReporter); ok {
		r.MemoryLimits = mr.MemoryLimits()
		r.MemoryConfigProblems = mr.MemoryConfigProblems()
	}
}

// warnMemoryConfig says at startup, as an error, that config.yaml sets a
// memory limit hermesfs cannot read: the limit in force is then the flag or
// the default, and Hermes may be using another one.
func warnMemoryConfig(log *slog.Logger, g *memguard.Guard) {
	problems := g.ConfigProblems()
	if len(problems) == 0 {
		return
	}
	lim := g.Limits(context.Background())
	log.Error("config.yaml sets a memory limit hermesfs cannot read: enforcing the flag or default limit instead, which may not be the one Hermes uses (fix config.yaml; `hermesfs status` shows this until then)",
		"problems", strings.Join(problems, "; "), "memory_limit", lim[memguard.KindMemory], "user_limit", lim[memguard.KindUser])
}

func printMemoryStatus(row func(k, f string, a ...any), r statusReport) {
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
		row("memory config", "WARNING: %s (the limit in force is the flag or default, not what config.yaml means)", p)
	}
}

// changedLine is status' "changed" figure, named for what it counts: every
// file or directory created, written, renamed or deleted since the last
// snapshot (one created and deleted again counts too), not the number of
// entries that differ from it.
func changedLine(r statusReport) string {
	if r.DirtyFiles == 0 {
		return "nothing since the last snapshot"
	}
	return fmt.Sprintf("%d files or directories touched (created, written, renamed or deleted), %s written, since the last snapshot", r.DirtyFiles, humanBytes(r.DirtyBytes))
}

// lastSnapshotLine is status' "last snapshot" row: one line, its figures
// after the id when this daemon took it.
func lastSnapshotLine(l *snapshotRecord) string {
	s := fmt.Sprintf("%s at %s", l.ID, l.Time.Local().Format(time.DateTime))
	if l.Duration > 0 {
		s += fmt.Sprintf(" (%s archive, %s uploaded, took %s)", humanBytes(l.Size), humanBytes(l.BytesUploaded), l.Duration.Round(time.Millisecond))
	}
	return s
}

// recoveredNote ends the ready line when the mount shows local changes a
// crash or a failed upload left over its base snapshot.
func recoveredNote(pending bool) string {
	if !pending {
		return ""
	}
	return " local=recovered (unpublished changes over that snapshot; publishing them now)"
}
