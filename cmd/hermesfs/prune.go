package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
)

func init() {
	register(&command{
		name:    "prune",
		summary: "delete old snapshots from the store by a retention policy",
		usage:   "[flags]",
		help: `Deletes the snapshots the retention policy does not keep. Each rule keeps
the newest snapshot of each of its last N time buckets that hold one (hours,
days, ISO weeks, months, years, in local time), --keep-last the newest N and
--keep-within everything younger than the duration (measured from the newest
snapshot); a snapshot any rule keeps stays. With no --keep-* flag the default
policy applies: ` + uploader.DefaultRetention().String() + `.
Given any, the policy is exactly the rules given. --keep N is --keep-last N.

Whatever the policy, prune never deletes the snapshot LATEST names or anything
newer (another host may be publishing), nor the snapshot the writer lease says
its mount is based on. It removes each snapshot's manifest before its archive,
so an interrupted prune never leaves a manifest without its archive. An archive
without a manifest (a crashed upload) is deleted once it is an hour old.
'mount' applies the same flags after every snapshot it publishes.

--dry-run prints what would be kept and removed and why, deleting nothing.

Examples:
  hermesfs prune --dry-run
  hermesfs prune --keep-hourly 48 --keep-daily 30 --keep-monthly 12
  hermesfs prune --keep-within 7d --dry-run --json
  HERMESFS_STORE=s3://my-bucket/alice hermesfs prune --keep 30

` + storeHelp,
		flags: func(fs *flag.FlagSet) {
			addStoreFlags(fs)
			addRetentionFlags(fs, nil)
			fs.Bool("dry-run", false, "print what would be kept and removed, and why; delete nothing")
			fs.Bool("json", false, "print every snapshot's decision as a JSON array")
			fs.Bool("verbose", false, "print every snapshot's decision (the default with --dry-run)")
		},
		run: runPrune,
	})
}

func runPrune(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) > 0 {
		return usageError("prune takes no arguments")
	}
	if err := applyEnv(fs, e.getenv); err != nil {
		return err
	}
	policy, err := retentionPolicy(fs)
	if err != nil {
		return err
	}
	dry := fs.Lookup("dry-run").Value.String() == "true"
	asJSON := fs.Lookup("json").Value.String() == "true"
	verbose := dry || fs.Lookup("verbose").Value.String() == "true"
	cat, loc, err := openCatalog(ctx, e, fs)
	if err != nil {
		return err
	}
	res, err := cat.PruneWith(ctx, uploader.PruneOptions{Policy: policy, DryRun: dry, Protect: localMountBases(ctx, e, loc.String())})
	if asJSON {
		if res.Decisions == nil {
			res.Decisions = []uploader.PruneDecision{}
		}
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		if jerr := enc.Encode(res.Decisions); jerr != nil && err == nil {
			err = jerr
		}
	} else {
		printPrune(e, res, policy, dry, verbose)
	}
	if err != nil {
		return fmt.Errorf("prune %s: %w", loc, err)
	}
	return nil
}

// localMountBases names the snapshots the mounts running on this host
// over the store at url are based on (read-only mounts hold no lease that
// would name theirs).
func localMountBases(ctx context.Context, e *env, url string) map[string]string {
	entries, err := daemon.ListRegistry(daemon.RuntimeDir(os.Getuid(), e.getenv))
	if err != nil {
		return nil
	}
	bases := map[string]string{}
	for _, en := range entries {
		resp, err := daemon.ControlCall(ctx, en.Socket, daemon.ControlRequest{Op: "status"})
		if err != nil || resp.Status == nil || resp.Status.Store != url || resp.Status.Base == "" {
			continue
		}
		bases[resp.Status.Base] = "base of the mount at " + resp.Status.Mountpoint + " on this host"
	}
	return bases
}

// printPrune writes the decisions as a table (every snapshot when
// verbose, else the deletions) and a summary line.
func printPrune(e *env, res uploader.PruneResult, policy uploader.RetentionPolicy, dry, verbose bool) {
	removed, keep := "deleted", "keep"
	if dry {
		removed = "remove"
	}
	for _, d := range res.Decisions {
		if !verbose && d.Keep {
			continue
		}
		action := removed
		if d.Keep {
			action = keep
		}
		fmt.Fprintf(e.stdout, "%-7s %s  %s  %s\n", action, d.ID, d.Time.Local().Format("2006-01-02 15:04"), strings.Join(d.Reasons, ", "))
	}
	verb := "deleted"
	if dry {
		verb = "would delete"
	}
	fmt.Fprintf(e.stdout, "policy %s: kept %d snapshots, %s %d\n", policy, len(res.Kept), verb, len(res.Deleted))
	if verbose {
		for _, k := range res.SegmentsDeleted {
			fmt.Fprintf(e.stdout, "%-7s %s  (no snapshot left uses it)\n", removed, k)
		}
	}
	switch {
	case res.GCSkipped != "":
		fmt.Fprintf(e.stdout, "segments not collected: %s\n", res.GCSkipped)
	case len(res.SegmentsDeleted) > 0 || verbose:
		fmt.Fprintf(e.stdout, "segments: %s %d (%s), %d stay (%s stored)\n", verb, len(res.SegmentsDeleted),
			daemon.HumanBytes(res.FreedBytes), res.Segments, daemon.HumanBytes(res.StoredBytes))
	}
}
