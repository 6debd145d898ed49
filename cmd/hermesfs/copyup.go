package main

import (
	"flag"
	"fmt"
	"strings"

	"github.com/hermesfs/hermesfs/fs"
)

// Copy-up by range: the mount flag, its variable, and what status shows.

func init() {
	envFlags["HERMESFS_COPY_UP_BY_RANGE_MIN"] = "copy-up-by-range-min"
}

func (c *mountConfig) addCopyUpFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.CopyUpByRangeMin, "copy-up-by-range-min", c.CopyUpByRangeMin, "smallest archived file whose first write copies only the blocks it touches, the rest following in the background, e.g. 4M; off copies every file whole before its first write (env HERMESFS_COPY_UP_BY_RANGE_MIN)")
}

func (c *mountConfig) validateCopyUp() error {
	switch v := strings.ToLower(strings.TrimSpace(c.CopyUpByRangeMin)); v {
	case "off", "0", "false", "no":
		c.copyUpMin = -1
	default:
		n, err := parseSize(v)
		if err != nil {
			return usageError("--copy-up-by-range-min: %v (or off)", err)
		}
		c.copyUpMin = n
	}
	return nil
}

// partialCopyUps lists the mount's partial files, if it can say.
func partialCopyUps(ov overlay) []fs.PartialCopyUp {
	if p, ok := ov.(interface{ PartialCopyUps() []fs.PartialCopyUp }); ok {
		return p.PartialCopyUps()
	}
	return nil
}

// partialCopyUpsOf reports m's partial copy-ups to the metrics: how many,
// and the bytes copied into them so far.
func partialCopyUpsOf(m *fs.Mounted) func() (partialCopyUpStats, bool) {
	return func() (partialCopyUpStats, bool) {
		var s partialCopyUpStats
		for _, p := range m.PartialCopyUps() {
			s.InProgress++
			s.Bytes += p.Present
		}
		return s, true
	}
}

func printPartials(row func(k, f string, a ...any), ps []fs.PartialCopyUp) {
	for _, p := range ps {
		name := p.Path
		if name == "" {
			name = fmt.Sprintf("upper inode %d", p.UpperIno)
		}
		pct := 100.0
		if p.Size > 0 {
			pct = 100 * float64(p.Present) / float64(p.Size)
		}
		state := "copying in the background"
		switch {
		case p.LowerGone:
			state = "STALLED: the archived file it came from is not in the base snapshot"
		case !p.Running:
			state = "resumes when the file is next used"
		}
		row("partial copy-up", "%s: %s of %s (%.0f%%), %s", name, humanBytes(p.Present), humanBytes(p.Size), pct, state)
	}
}
