package daemon

import "context"

// Snapshots that cost the change (archive.PackOptions.Extend).
//
// A snapshot's image is the previous one grown by what changed: the pack
// asks the frozen view which entries are the lower layer's inodes
// unchanged (fs.View.BaseInode, in the lower layer's inode numbers) and
// visits only the rest. That needs a base holding the lower layer's
// unchanged inodes under the lower layer's numbers: the lower image
// itself, or an image this state dir published from views of the same
// lower and upper layers by extending (or compacting, or extending laid
// out afresh: archive.PackResult.KeptNumbers) such an image.
// state.json's last_published_numbers_of says which lower layer's
// numbers LastPublished keeps, so a restart knows too. Any other image
// (another host's snapshot published over with --on-conflict keep-local,
// one packed without a base) is not such a base: the pack then extends
// the lower image, and the one after extends that.

// packOn is what a snapshot packs on: an open image (nil: none), its
// snapshot id, and whether the pack may extend it.
type packOn struct {
	im     *openImage
	id     string
	extend bool
	lower  string // the lower layer's snapshot, whose numbers an extending pack keeps
}

// numbersOf is what state.json records for the image packed on p with
// stats ps: the lower layer whose numbers it keeps, or "".
func (p packOn) numbersOf(ps packStats) string {
	if p.extend && ps.KeptNumbers {
		return p.lower
	}
	return ""
}

// keepsLowerNumbers reports whether snapshot id, published by this state
// dir, holds the lower layer's inode numbers (st locked by the caller).
func keepsLowerNumbers(st *persistedState, id string) bool {
	if id == "" || st.Base == "" {
		return false
	}
	return id == st.Base || id == st.LastPublished && st.LastNumbersOf == st.Base
}

// packBase is the image the next snapshot is packed on: the last one
// this state dir published when it keeps the lower layer's numbers
// (extended), else the lower image (extended: the changes since the
// mount are packed again, once), else the last published one laid out
// afresh (no lower layer to number by). Its blocks are copied from where
// they are in the store, never read.
func (d *daemon) packBase(ctx context.Context) packOn {
	d.mu.Lock()
	last, base := d.st.LastPublished, d.st.Base
	lastKeeps := keepsLowerNumbers(&d.st, last)
	d.mu.Unlock()
	var cands []packOn
	if lastKeeps {
		cands = append(cands, packOn{id: last, extend: true, lower: base})
	}
	if base != "" && !(lastKeeps && last == base) {
		cands = append(cands, packOn{id: base, extend: true, lower: base})
	}
	if last != "" && !lastKeeps {
		cands = append(cands, packOn{id: last})
	}
	for _, c := range cands {
		o, err := d.image(ctx, c.id, nil)
		if err == nil {
			c.im = o
			return c
		}
		d.log.Warn("cannot open the snapshot to pack on; trying the next", "id", c.id, "err", err)
	}
	return packOn{}
}
