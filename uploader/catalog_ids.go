package uploader

import (
	"context"
	"time"
)

// SnapshotRef is a complete snapshot as the store's listing shows it,
// without reading its manifest: enough to name it and date it.
type SnapshotRef struct {
	ID      string
	Created time.Time // from the id
	Size    int64     // of the archive; 0 for an image stored as extents (the manifest has it)
	Latest  bool      // LATEST names it
}

// Complete lists the snapshots that have a manifest and an archive or
// extents list,
// newest first, at the cost of one read of LATEST and one listing: no
// manifest or archive is read, however many snapshots there are.
func (c *Catalog) Complete(ctx context.Context) ([]SnapshotRef, error) {
	latest, _, err := c.readLatest(ctx)
	if err != nil {
		return nil, err
	}
	byID, err := c.scan(ctx)
	if err != nil {
		return nil, err
	}
	var out []SnapshotRef
	for _, id := range sortedIDs(byID) {
		o := byID[id]
		if !o.complete() {
			continue
		}
		t, err := IDTime(id)
		if err != nil {
			continue // scan keeps valid ids only
		}
		ref := SnapshotRef{ID: id, Created: t, Latest: id == latest}
		if o.archive != nil {
			ref.Size = o.archive.Size
		}
		out = append(out, ref)
	}
	return out, nil
}
