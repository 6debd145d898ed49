// Command retentioncost computes what a retention policy keeps in the
// store: a snapshot published every -interval for -days (a mount whose
// tree changes between every two snapshots: the most snapshots there can
// be), pruned after every publish with the policy, as the mount does. Each
// snapshot is a whole archive object of -size bytes growing by -growth a
// day, plus a manifest; the delta publish makes the store copy bytes, not
// share them, so every kept archive costs its full size.
// scripts/retention-cost.sh measures -size and -growth on a generated home.
package main

import (
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

func main() {
	days := flag.Int("days", 30, "days of snapshots")
	interval := flag.Duration("interval", 15*time.Minute, "time between snapshots")
	size := flag.Int64("size", 0, "archive size of the first snapshot, bytes")
	growth := flag.Int64("growth", 0, "archive growth per day, bytes")
	garbage := flag.Float64("garbage", 0, "share of garbage an archive carries on top of its data (0 to 0.25, the packer's limit)")
	manifest := flag.Int64("manifest", 600, "manifest size, bytes")
	flag.Parse()
	if *size <= 0 {
		fmt.Fprintln(os.Stderr, "retentioncost: -size is required")
		os.Exit(2)
	}
	policy := uploader.DefaultRetention()
	start := time.Date(2026, 10, 1, 0, 7, 0, 0, time.UTC)
	n := int(time.Duration(*days) * 24 * time.Hour / *interval)
	var kept []time.Time // newest first
	for i := range n {
		t := start.Add(time.Duration(i) * *interval)
		kept = append([]time.Time{t}, kept...)
		reasons := policy.Keep(kept)
		next := kept[:0:0]
		for j, r := range reasons {
			if r != nil || j == 0 {
				next = append(next, kept[j])
			}
		}
		kept = next
	}
	var bytes int64
	for _, t := range kept {
		age := t.Sub(start).Hours() / 24
		a := float64(*size) + age*float64(*growth)
		bytes += int64(a*(1+*garbage)) + *manifest
	}
	fmt.Printf("policy %s, %d days at %s: %d snapshots published, %d kept: %d objects (archive + manifest each, plus LATEST and the lease), %.2f GiB\n",
		policy, *days, *interval, n, len(kept), 2*len(kept)+2, float64(bytes)/(1<<30))
}
