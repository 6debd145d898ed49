package main

import (
	"flag"
	"fmt"
	"strings"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
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
		c.CopyUpMin = -1
	default:
		n, err := parseSize(v)
		if err != nil {
			return usageError("--copy-up-by-range-min: %v (or off)", err)
		}
		c.CopyUpMin = n
	}
	return nil
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
		row("partial copy-up", "%s: %s of %s (%.0f%%), %s", name, daemon.HumanBytes(p.Present), daemon.HumanBytes(p.Size), pct, state)
	}
}
