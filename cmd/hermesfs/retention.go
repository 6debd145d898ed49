package main

import (
	"flag"
	"fmt"
	"strconv"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// Retention flags are shared by mount (applied after every publish) and
// prune. Given none, the default policy applies; given any, the policy is
// exactly the rules given (as in restic), so `--keep-daily 7` alone keeps
// seven days and nothing hourly.

// retentionCounts are the counted rules: flag name, environment variable.
var retentionCounts = []struct{ flag, env, help string }{
	{"keep-last", "HERMESFS_KEEP_LAST", "keep the newest N snapshots"},
	{"keep-hourly", "HERMESFS_KEEP_HOURLY", "keep the newest snapshot of each of the last N hours that have one"},
	{"keep-daily", "HERMESFS_KEEP_DAILY", "keep the newest snapshot of each of the last N days that have one"},
	{"keep-weekly", "HERMESFS_KEEP_WEEKLY", "keep the newest snapshot of each of the last N ISO weeks that have one"},
	{"keep-monthly", "HERMESFS_KEEP_MONTHLY", "keep the newest snapshot of each of the last N months that have one"},
	{"keep-yearly", "HERMESFS_KEEP_YEARLY", "keep the newest snapshot of each of the last N years that have one"},
}

func init() {
	for _, r := range retentionCounts {
		envFlags[r.env] = r.flag
	}
	envFlags["HERMESFS_KEEP_WITHIN"] = "keep-within"
}

// addRetentionFlags declares the retention flags; keep receives --keep
// (nil: a variable of its own). Like the --keep-* flags, --keep shows no
// default of its own: given none of them, the default policy applies
// (retentionPolicy), not a --keep of 10.
func addRetentionFlags(fs *flag.FlagSet, keep *int) {
	if keep == nil {
		keep = new(int)
	}
	d := uploader.DefaultRetention()
	fs.IntVar(keep, "keep", 0, fmt.Sprintf("the same as --keep-last (env HERMESFS_KEEP; default %d when no --keep-* flag is given)", d.Last))
	defaults := map[string]int{"keep-last": d.Last, "keep-hourly": d.Hourly, "keep-daily": d.Daily, "keep-weekly": d.Weekly, "keep-monthly": d.Monthly, "keep-yearly": d.Yearly}
	for _, r := range retentionCounts {
		fs.Int(r.flag, 0, fmt.Sprintf("%s; -1: all (env %s; default %d when no --keep-* flag is given)", r.help, r.env, defaults[r.flag]))
	}
	fs.String("keep-within", "", "keep every snapshot younger than this, relative to the newest one, e.g. 36h, 7d, 2w, 1y6m (m = month) (env HERMESFS_KEEP_WITHIN)")
}

// retentionPolicy reads the retention flags of fs (set on the command
// line or by applyEnv). nil fs: the default policy.
func retentionPolicy(fs *flag.FlagSet) (uploader.RetentionPolicy, error) {
	p := uploader.RetentionPolicy{Location: time.Local}
	if fs == nil {
		d := uploader.DefaultRetention()
		d.Location = time.Local
		return d, nil
	}
	given := map[string]string{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = f.Value.String() })
	counts := map[string]*int{
		"keep-last": &p.Last, "keep-hourly": &p.Hourly, "keep-daily": &p.Daily,
		"keep-weekly": &p.Weekly, "keep-monthly": &p.Monthly, "keep-yearly": &p.Yearly,
	}
	gave := false
	for _, name := range []string{"keep", "keep-last", "keep-hourly", "keep-daily", "keep-weekly", "keep-monthly", "keep-yearly"} {
		v, ok := given[name]
		if !ok {
			continue
		}
		gave = true
		n, err := strconv.Atoi(v)
		if err != nil || n < -1 {
			return p, usageError("--%s %s: want a count, or -1 for all", name, v)
		}
		if name == "keep" {
			if l, ok := given["keep-last"]; ok && l != v {
				return p, usageError("--keep %s and --keep-last %s disagree (--keep is --keep-last)", v, l)
			}
			if n < 1 {
				return p, usageError("--keep %d: keep at least 1 snapshot", n)
			}
			name = "keep-last"
		}
		*counts[name] = n
	}
	if v, ok := given["keep-within"]; ok && v != "" {
		gave = true
		d, err := uploader.ParseRetentionDuration(v)
		if err != nil {
			return p, usageError("--keep-within: %v", err)
		}
		p.Within = d
	}
	if !gave {
		d := uploader.DefaultRetention()
		d.Location = time.Local
		return d, nil
	}
	if p.IsZero() {
		return p, usageError("the --keep-* flags given keep nothing; give at least one positive count or --keep-within")
	}
	return p, nil
}
