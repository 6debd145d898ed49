package uploader

import (
	"context"
	"errors"
	"fmt"
	iofs "io/fs"
	"slices"
	"strings"
	"time"
)

// PruneResult lists what Prune did (or, in a dry run, would do).
type PruneResult struct {
	Kept    []string // complete snapshots kept, newest first
	Deleted []string // snapshots whose objects were (would be) deleted
	// Decisions holds every snapshot of the catalog, newest first, with
	// the reasons it stays or goes.
	Decisions []PruneDecision
	// Segments deleted (would be), because no remaining snapshot uses
	// them, and their stored bytes; Stored is the bytes of the segments
	// that stay (every image byte the store keeps, shared or not).
	SegmentsDeleted []string
	FreedBytes      int64
	Segments        int
	StoredBytes     int64
	// GCSkipped says why segments were not collected this time (a
	// manifest that could not be read: what it uses is unknown).
	GCSkipped string
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
// A compaction (a snapshot whose manifest says it compacts another:
// the same tree, laid out anew) takes the place of the snapshot it
// compacts: the policy sees it at that snapshot's time, and not the
// compacted one, which goes unless kept for one of the reasons above.
// So compactions neither take a rule's places nor keep old layouts
// alive beside them.
//
// Then the segments no snapshot left uses are deleted (see collect): a
// segment shared by a snapshot that stays, or by one published while the
// prune ran, stays.
//
// A snapshot's manifest is deleted before anything its image is made of,
// so a manifest never names a missing object, and a crash half way leaves
// only unreferenced objects for the next prune.
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
		if !o.complete() || latest != "" && id > latest {
			continue
		}
		t, _ := IDTime(id) // scan kept valid ids only
		cand, times = append(cand, id), append(times, t)
	}
	cand, times, replaced := c.compactions(ctx, cand, times)
	policy := map[string][]string{}
	for i, r := range opts.Policy.Keep(times) {
		policy[cand[i]] = r
	}

	now := c.opts.Now()
	for _, id := range ids {
		o := byID[id]
		complete := o.complete()
		t, _ := IDTime(id)
		d := PruneDecision{ID: id, Time: t, Incomplete: !complete}
		switch {
		case latest != "" && id > latest:
			d.Keep, d.Reasons = true, []string{"newer than LATEST (a publish in progress or a lost race)"}
		case !complete && o.manifest == nil && now.Sub(o.stored()) < c.opts.OrphanGrace:
			d.Keep, d.Reasons = true, []string{"archive or extents without manifest, younger than " + c.opts.OrphanGrace.String() + " (an upload in progress)"}
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
				if by, ok := replaced[id]; ok {
					d.Reasons = []string{"its compaction " + by + " holds the same tree and takes its place"}
				}
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
			// The manifest first: a snapshot without one is no snapshot.
			// Its image's objects (the extents list here, the archive
			// and segments below) go once nothing else uses them.
			if o.manifest != nil {
				if err := c.store.Delete(ctx, ManifestKey(id)); err != nil {
					return res, fmt.Errorf("prune %s: %w", id, err)
				}
				c.mu.Lock()
				delete(c.manifests, id)
				c.mu.Unlock()
			}
			if o.extents != nil {
				if err := c.store.Delete(ctx, ExtentsKey(id)); err != nil {
					return res, fmt.Errorf("prune %s: %w", id, err)
				}
			}
			c.log.Info("pruned snapshot", "id", id, "complete", complete)
		}
		res.Deleted = append(res.Deleted, id)
	}
	if err := c.collect(ctx, &res, latest, opts.DryRun); err != nil {
		return res, fmt.Errorf("prune: %w", err)
	}
	return res, nil
}

// collect deletes the segments no snapshot uses any more: after the
// snapshots are pruned, the store is listed again (so that a snapshot
// published meanwhile counts) and every manifest left is read; a segment
// (or a whole archive) that none names goes, then its digests, unless it
// may be a publish in progress's (see inFlight), which uploads its segment
// before its manifest (not those of a snapshot this prune removed: that
// one was complete). Leftovers of crashed publishes (digests or an
// extents list whose segment or manifest is gone) go the same way. If a manifest cannot be read for another reason than damage (the
// store failing, a format this hermesfs does not know), nothing is
// collected: what it uses is unknown. With dryRun the snapshots res.Deleted names count as
// gone, and nothing is deleted.
//
// A publish in progress never needs a segment this deletes: it uses the
// segments of its base (LATEST, or the writer lease's base, both kept by
// PruneWith) and its own new one.
func (c *Catalog) collect(ctx context.Context, res *PruneResult, latest string, dryRun bool) error {
	gone := map[string]bool{} // snapshots this prune removed
	for _, id := range res.Deleted {
		gone[id] = true
	}
	byID, err := c.scan(ctx)
	if err != nil {
		return err
	}
	used := map[string]bool{}
	for id, o := range byID {
		if o.manifest == nil || dryRun && gone[id] {
			continue
		}
		m, err := c.manifestCached(ctx, id)
		if errors.Is(err, iofs.ErrNotExist) {
			continue // pruned by another host meanwhile
		}
		if errors.Is(err, ErrCorrupt) {
			// A damaged manifest makes no snapshot: nothing can be read
			// by it, so nothing need be kept for it.
			c.log.Warn("prune: a damaged manifest keeps no segment", "id", id, "err", err)
			continue
		}
		if err != nil {
			res.GCSkipped = fmt.Sprintf("manifest of %s unreadable: %v", id, err)
			c.log.Warn("prune: segments not collected: a manifest could not be read", "id", id, "err", err)
			return nil
		}
		if m.Segmented() {
			for _, r := range m.Segments {
				used[r.Key] = true
			}
			if m.Standalone {
				used[m.Archive] = true
			}
		} else {
			used[m.Archive] = true
		}
	}
	type object struct {
		info ObjectInfo
		sums *ObjectInfo
	}
	segs := map[string]*object{}
	var sums []ObjectInfo
	list := func(o ObjectInfo) error {
		switch {
		case IsSegmentKey(o.Key):
			if segs[o.Key] == nil {
				segs[o.Key] = &object{}
			}
			segs[o.Key].info = o
		case strings.HasSuffix(o.Key, SumsExt) && IsSegmentKey(strings.TrimSuffix(o.Key, SumsExt)):
			sums = append(sums, o)
		}
		return nil
	}
	if err := c.store.List(ctx, SegmentsPrefix, list); err != nil {
		return fmt.Errorf("list segments: %w", err)
	}
	if err := c.store.List(ctx, SnapshotsPrefix, list); err != nil {
		return fmt.Errorf("list snapshots: %w", err)
	}
	for _, s := range sums {
		k := strings.TrimSuffix(s.Key, SumsExt)
		if segs[k] == nil {
			segs[k] = &object{}
		}
		segs[k].sums = &s
	}
	now := c.opts.Now()
	keys := make([]string, 0, len(segs))
	for k := range segs {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		o := segs[k]
		young := !gone[segmentID(k)] && c.inFlight(segmentID(k), latest, now, o.info, o.sums)
		if used[k] || young {
			if o.info.Key != "" {
				res.Segments++
				res.StoredBytes += o.info.Size
			}
			continue
		}
		if dryRun {
			if o.info.Key != "" {
				res.SegmentsDeleted = append(res.SegmentsDeleted, k)
				res.FreedBytes += o.info.Size
			}
			continue
		}
		if o.info.Key != "" {
			if err := c.store.Delete(ctx, k); err != nil {
				return fmt.Errorf("delete segment %s: %w", k, err)
			}
			res.SegmentsDeleted = append(res.SegmentsDeleted, k)
			res.FreedBytes += o.info.Size
			c.log.Info("deleted a segment no snapshot uses", "key", k, "size", o.info.Size)
		}
		if o.sums != nil {
			if err := c.store.Delete(ctx, o.sums.Key); err != nil {
				return fmt.Errorf("delete digests %s: %w", o.sums.Key, err)
			}
		}
	}
	// Extents lists left by a publish that crashed before its manifest.
	for id, o := range byID {
		if o.extents != nil && o.manifest == nil && !dryRun && (gone[id] || !c.inFlight(id, latest, now, *o.extents, nil)) {
			if err := c.store.Delete(ctx, ExtentsKey(id)); err != nil {
				return fmt.Errorf("delete extents %s: %w", id, err)
			}
		}
	}
	return nil
}

// inFlight reports whether objects uploaded for snapshot id (info, and
// sums if not nil) may belong to a publish still in progress, which
// uploads its segment and extents before its manifest: its id is after
// the LATEST this prune read (a publish makes its id after the LATEST it
// read), or they were stored less than OrphanGrace ago (whatever their
// id says: a host whose clock is off, or one that lost the lease and
// will fail its publish, is given the time anyway).
func (c *Catalog) inFlight(id, latest string, now time.Time, info ObjectInfo, sums *ObjectInfo) bool {
	if id != "" && ValidID(id) == nil && (latest == "" || id > latest) {
		return true
	}
	young := func(o ObjectInfo) bool { return o.Key != "" && now.Sub(o.ModTime) < c.opts.OrphanGrace }
	return young(info) || sums != nil && young(*sums)
}

// manifestCached is Manifest, remembering what it read: a published
// manifest never changes, so a prune reads each only once per catalog.
func (c *Catalog) manifestCached(ctx context.Context, id string) (Manifest, error) {
	c.mu.Lock()
	m, ok := c.manifests[id]
	c.mu.Unlock()
	if ok {
		return m, nil
	}
	m, err := c.Manifest(ctx, id)
	if err != nil {
		return m, err
	}
	c.mu.Lock()
	if c.manifests == nil {
		c.manifests = map[string]Manifest{}
	}
	c.manifests[id] = m
	c.mu.Unlock()
	return m, nil
}

// segmentID is the snapshot that uploaded segment key ("" if unknown).
func segmentID(key string) string {
	name := key[strings.LastIndexByte(key, '/')+1:]
	name = strings.TrimSuffix(name, EncryptedExt)
	for _, ext := range []string{SegmentExt, ArchiveExt} {
		if id, ok := strings.CutSuffix(name, ext); ok {
			return id
		}
	}
	return ""
}

// compactions returns the candidates (newest first, with their times)
// with each snapshot a newer candidate compacts left out, and that
// compaction given its time (the time of its tree); replaced maps each
// left out to the compaction that replaces it. A manifest that cannot be
// read counts as no compaction: both stay candidates.
func (c *Catalog) compactions(ctx context.Context, cand []string, times []time.Time) ([]string, []time.Time, map[string]string) {
	replaced := map[string]string{}
	index := map[string]int{}
	for i, id := range cand {
		index[id] = i
	}
	// Oldest first, so that a compaction of a compaction takes the time
	// of the first snapshot of the chain.
	at := slices.Clone(times)
	for i := len(cand) - 1; i >= 0; i-- {
		m, err := c.manifestCached(ctx, cand[i])
		if err != nil || m.Compacts == "" || m.Compacts >= cand[i] {
			continue
		}
		// Only the snapshot just before it (a compaction is published
		// only while what it compacts is LATEST): the times stay in
		// order.
		j, ok := index[m.Compacts]
		if !ok || j != i+1 {
			continue
		}
		if _, gone := replaced[m.Compacts]; gone {
			continue
		}
		replaced[m.Compacts] = cand[i]
		at[i] = at[j]
	}
	if len(replaced) == 0 {
		return cand, times, replaced
	}
	var outC []string
	var outT []time.Time
	for i, id := range cand {
		if _, gone := replaced[id]; gone {
			continue
		}
		outC, outT = append(outC, id), append(outT, at[i])
	}
	return outC, outT, replaced
}
