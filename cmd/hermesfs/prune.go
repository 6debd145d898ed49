package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"

	"github.com/hermesfs/hermesfs/uploader"
)

func init() {
	register(&command{
		name:    "prune",
		summary: "delete old snapshots from the store, keeping the newest N",
		usage:   "[flags]",
		help: `Deletes old snapshots, keeping the newest N up to and including the one
LATEST names. It never deletes what LATEST names or anything newer (another
host may be publishing), and removes each snapshot's manifest before its
archive, so an interrupted prune never leaves a manifest without its archive.
An archive without a manifest (a crashed upload) is deleted once it is an
hour old. 'mount' applies the same retention after every snapshot.

Examples:
  hermesfs prune --keep 5
  HERMESFS_STORE=s3://my-bucket/alice hermesfs prune --keep 30

` + storeHelp,
		flags: func(fs *flag.FlagSet) {
			addStoreFlags(fs)
			fs.Int("keep", uploader.DefaultKeep, "how many snapshots to keep (env HERMESFS_KEEP)")
		},
		run: runPrune,
	})
}

func runPrune(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) > 0 {
		return usageError("prune takes no arguments")
	}
	keep, _ := strconv.Atoi(fs.Lookup("keep").Value.String())
	set := false
	fs.Visit(func(f *flag.Flag) { set = set || f.Name == "keep" })
	if v := e.getenv("HERMESFS_KEEP"); v != "" && !set {
		k, err := strconv.Atoi(v)
		if err != nil {
			return usageError("HERMESFS_KEEP=%q: not a number", v)
		}
		keep = k
	}
	if keep < 1 {
		return usageError("--keep %d: keep at least 1 snapshot", keep)
	}
	cat, loc, err := openCatalog(ctx, e, fs)
	if err != nil {
		return err
	}
	res, err := cat.Prune(ctx, keep)
	for _, id := range res.Deleted {
		fmt.Fprintf(e.stdout, "deleted %s\n", id)
	}
	if err != nil {
		return fmt.Errorf("prune %s: %w", loc, err)
	}
	fmt.Fprintf(e.stdout, "kept %d snapshots, deleted %d\n", len(res.Kept), len(res.Deleted))
	return nil
}
