package uploader

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"time"
)

// PruneResult lists what Prune did (or, in a dry run, would do).
type PruneResult struct {
	Kept    []string // complete snapshots kept, newest first
	Deleted []string // snapshots whose objects were (would be) deleted
	// Decisions holds every snapshot of the catalog, newest first, with
	// the reasons it stays or goes.
	Decisions []PruneDecision
}

// PruneDecision is what a prune does with one snapshot and why.
type PruneDecision struct {
	ID   string    `json:"id"`
	Time time.Time `json:"time"`
	Keep bool      `json:"keep"`
	// Reasons: for a kept snapshot, every rule or protection that keeps
	// it ("LATEST", "daily 3", "base of the writer lease", ...); for a
	// removed one, why it goes.
	Reasons    []string `json:"reasons"`
	Incomplete bool     `json:"incomplete,omitempty"`
}

// PruneOptions configures PruneWith.
type PruneOptions struct {
	Policy RetentionPolicy
	// DryRun decides without deleting anything.
	DryRun bool
	// Protect names more snapshots never to delete, each with the reason
	// shown (e.g. the base of a mount known to the caller).
	Protect map[string]string
}

// Prune keeps the newest keep complete snapshots up to and including
// LATEST: PruneWith with RetentionPolicy{Last: keep}.
func (c *Catalog) Prune(ctx context.Context, keep int) (PruneResult, error) {
	if keep < 1 {
		return PruneResult{}, fmt.Errorf("prune: keep %d: must keep at least 1 snapshot", keep)
	}
	return c.PruneWith(ctx, PruneOptions{Policy: RetentionPolicy{Last: keep}})
}

// PruneWith deletes the snapshots the policy does not keep. The policy is
// applied to the complete snapshots up to and including the one LATEST
// names, by the times in their ids. Whatever the policy says, it never
// deletes:
//   - what LATEST names, or anything newer (a publish in progress, or a
//     loser of a race that may still be wanted);
//   - the snapshot the writer lease says its holder's mount is based on
//     (its tree, and the archive its next snapshot is packed on and copies
//     its shared prefix from), unless the lease was released;
//   - what opts.Protect names;
//   - an archive without a manifest younger than OrphanGrace (an upload in
//     progress).
//
// Nothing else needs keeping for the snapshots that stay: every archive in
// the store is a whole object. A delta publish has the store copy byte
// ranges of the previous archive into the new object (S3 UploadPartCopy
// makes an independent copy; the local store writes every archive in
// full), so deleting the source later takes nothing from the copy. Only a
// publish still to come reads its source, and that source is its
// holder's base (kept above); were it gone, the publish would upload
// whole.
//
// A snapshot's manifest is deleted before its archive, so a manifest
// never points at a missing archive, and a crash half way leaves only an
// orphan archive for the next prune.
func (c *Catalog) PruneWith(ctx context.Context, opts PruneOptions) (PruneResult, error) {
	var res PruneResult
	if opts.Policy.IsZero() {
		return res, errors.New("prune: the retention policy keeps nothing; give at least one rule")
	}
	latest, _, err := c.readLatest(ctx)
	if err != nil {
		return res, fmt.Errorf("prune: %w", err)
	}
	protect := map[string]string{}
	for id, why := range opts.Protect {
		protect[id] = why
	}
	lease, _, err := c.ReadLease(ctx)
	switch {
	case errors.Is(err, iofs.ErrNotExist):
	case err != nil:
		return res, fmt.Errorf("prune: %w", err)
	case !lease.Released && lease.Base != "":
		protect[lease.Base] = fmt.Sprintf("base of the writer lease's mount (%s on %s)", lease.Holder, lease.Host)
	}
	byID, err := c.scan(ctx)
	if err != nil {
		return res, fmt.Errorf("prune: %w", err)
	}
	ids := sortedIDs(byID)

	// The policy sees the complete snapshots up to LATEST, newest first.
	var cand []string
	var times []time.Time
	for _, id := range ids {
		o := byID[id]
		if o.archive == nil || o.manifest == nil || latest != "" && id > latest {
			continue
		}
		t, _ := IDTime(id) // scan kept valid ids only
		cand, times = append(cand, id), append(times, t)
	}
	policy := map[string][]string{}
	for i, r := range opts.Policy.Keep(times) {
		policy[cand[i]] = r
	}

	now := c.opts.Now()
	for _, id := range ids {
		o := byID[id]
		complete := o.archive != nil && o.manifest != nil
		t, _ := IDTime(id)
		d := PruneDecision{ID: id, Time: t, Incomplete: !complete}
		switch {
		case latest != "" && id > latest:
			d.Keep, d.Reasons = true, []string{"newer than LATEST (a publish in progress or a lost race)"}
		case !complete && o.manifest == nil && now.Sub(o.archive.ModTime) < c.opts.OrphanGrace:
			d.Keep, d.Reasons = true, []string{"archive without manifest, younger than " + c.opts.OrphanGrace.String() + " (an upload in progress)"}
		default:
			if id == latest {
				d.Reasons = append(d.Reasons, "LATEST")
			}
			if why, ok := protect[id]; ok {
				d.Reasons = append(d.Reasons, why)
			}
			d.Reasons = append(d.Reasons, policy[id]...)
			d.Keep = len(d.Reasons) > 0
			if !d.Keep {
				d.Reasons = []string{"no rule keeps it"}
				if !complete {
					d.Reasons = []string{"incomplete (archive or manifest missing)"}
				}
			}
		}
		res.Decisions = append(res.Decisions, d)
		if d.Keep {
			if complete {
				res.Kept = append(res.Kept, id)
			}
			continue
		}
		if !opts.DryRun {
			if o.manifest != nil {
				if err := c.store.Delete(ctx, ManifestKey(id)); err != nil {
					return res, fmt.Errorf("prune %s: %w", id, err)
				}
			}
			if o.archive != nil {
				if err := c.store.Delete(ctx, ArchiveKey(id)); err != nil {
					return res, fmt.Errorf("prune %s: %w", id, err)
				}
			}
			c.log.Info("pruned snapshot", "id", id, "complete", complete)
		}
		res.Deleted = append(res.Deleted, id)
	}
	return res, nil
}
