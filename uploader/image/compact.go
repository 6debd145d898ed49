package image

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
)

// CompactPolicy says when a snapshot's image is rewritten afresh by
// archive.Compact (in the background, never in a stop's snapshot).
//
// A snapshot that extends the one before (archive.PackOptions.Extend)
// costs only its change, but the image keeps what the change replaced
// (dead inodes, listings and data blocks: the garbage its trailer
// estimates) and it grows more extents (each snapshot adds a few: its new
// data, inode and directory blocks, tables and trailer), which every
// snapshot's extents list and manifest carry, and a reader of the image
// reads across. Compaction brings both back to what the tree needs. It
// writes the image's metadata afresh (most of a compaction's upload, in
// proportion to the file count) and copies data out of segments the new
// image would use little of (LayOut), so its cost is weighed against the
// bytes every snapshot carries: the bounds below are what the 30-day
// retention run of BENCHMARKS.md ("Retention") measured best.
type CompactPolicy struct {
	// GarbageShare: compact once the image's garbage estimate
	// (archive.Reader.GarbageBytes) passes this share of its size.
	GarbageShare float64
	// Extents: compact once the image has this many more extents (its
	// extents list's lines) than right after its lineage's last
	// compaction (or fresh layout): what the snapshots since added. An
	// image's data may lie in many segments after any compaction, so the
	// bound is on what extending adds, which every later snapshot's
	// extents list carries until a compaction.
	Extents int
	// Generation: compact once this many packs extended the image since
	// its lineage's last fresh or compacted one.
	Generation int
}

// DefaultCompactPolicy is the daemon's policy.
func DefaultCompactPolicy() CompactPolicy {
	return CompactPolicy{GarbageShare: 0.25, Extents: 1000, Generation: 1000}
}

// Due says why an image of size bytes with garbage of them dead, laid out
// in extents extents (baseExtents right after its last compaction or
// fresh layout; 0 if not known), generation packs after its last
// compaction, should be compacted now; "" if it should not.
func (p CompactPolicy) Due(size, garbage int64, extents, baseExtents, generation int) string {
	switch {
	case generation == 0:
		return "" // fresh or compacted already
	case p.GarbageShare > 0 && size > 0 && float64(garbage) > p.GarbageShare*float64(size):
		return fmt.Sprintf("garbage %d of %d bytes (over %.0f%%)", garbage, size, 100*p.GarbageShare)
	case p.Extents > 0 && extents-baseExtents > p.Extents:
		return fmt.Sprintf("%d extents, %d added since the last compaction (over %d)", extents, extents-baseExtents, p.Extents)
	case p.Generation > 0 && generation > p.Generation:
		return fmt.Sprintf("generation %d (over %d)", generation, p.Generation)
	}
	return ""
}

// ParseCompactPolicy reads a policy: "off" (never compact), or bounds
// "garbage=25%,extents=300,snapshots=1000", any of them (the others keep
// their defaults; 0 turns one off).
func ParseCompactPolicy(s string) (CompactPolicy, error) {
	s = strings.TrimSpace(s)
	if s == "off" || s == "never" {
		return CompactPolicy{}, nil
	}
	p := DefaultCompactPolicy()
	if s == "" || s == "default" {
		return p, nil
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, ok := strings.Cut(strings.TrimSpace(kv), "=")
		if !ok {
			return p, fmt.Errorf("%q: want NAME=VALUE (garbage=25%%, extents=300, snapshots=1000) or off", kv)
		}
		switch k {
		case "garbage":
			n, err := strconv.ParseFloat(strings.TrimSuffix(v, "%"), 64)
			if err != nil || n < 0 || n > 100 {
				return p, fmt.Errorf("garbage=%s: want a share of the image from 0%% to 100%%", v)
			}
			p.GarbageShare = n / 100
		case "extents", "snapshots":
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return p, fmt.Errorf("%s=%s: want a count, 0 for no bound", k, v)
			}
			if k == "extents" {
				p.Extents = n
			} else {
				p.Generation = n
			}
		default:
			return p, fmt.Errorf("%q: unknown bound (garbage, extents, snapshots)", k)
		}
	}
	return p, nil
}

// String says the bounds, for status and logs.
func (p CompactPolicy) String() string {
	if p == (CompactPolicy{}) {
		return "off"
	}
	return fmt.Sprintf("garbage over %.0f%% of the image, over %d extents added, or over %d snapshots since the last compaction", 100*p.GarbageShare, p.Extents, p.Generation)
}

// CompactRewrite is LayOut's MostlyDead for a compaction: it copies what
// the compacted image uses of a segment it uses less than half of. An
// extended image refers to its base's regions whole, dead bytes included,
// so the snapshots between compactions never find a segment mostly dead;
// the compaction, which refers only to what the tree uses, is where the
// store's garbage is collected: a segment a long-lived file keeps a
// sliver of (a session file appended to hour after hour) would otherwise
// stay whole for as long as the file lives.
const CompactRewrite = 0.5

// Compaction is an image compacted by Compact: the pack's result, and
// the image as extents of out (the extents with an empty key) and of the
// segments of the image compacted.
type Compaction struct {
	archive.PackResult
	Extents []uploader.Extent
	// Rewritten: bytes LayOut copied into out from segments the new image
	// would use little of (or of the other encryption).
	Rewritten int64
}

// Compact writes im's tree afresh into the new file out (archive.Compact
// of r, im's archive: the same tree and inode numbers, data copied by
// reference) and lays it out as extents (LayOut) over im's segments; out
// then holds the new segment. encrypting: the new segment is to be
// encrypted. The daemon's background compaction and the retention
// simulator both call it. On an error out may be left partly written.
func Compact(ctx context.Context, out string, r *archive.Reader, im *Image, encrypting bool, workers int) (Compaction, error) {
	var c Compaction
	f, err := os.OpenFile(out, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return c, err
	}
	c.PackResult, err = archive.Compact(ctx, f, r, archive.CompactOptions{Workers: workers})
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return c, fmt.Errorf("compact: %w", err)
	}
	c.Extents, c.Rewritten, err = layOut(ctx, c.Runs, out, map[*archive.Reader]*Image{r: im}, encrypting, CompactRewrite)
	if err != nil {
		return c, fmt.Errorf("lay the compacted image out: %w", err)
	}
	return c, nil
}
