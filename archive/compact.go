package archive

import (
	"context"
	"encoding/binary"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sort"
)

// CompactOptions configures Compact.
type CompactOptions struct {
	// Workers is the number of goroutines compressing blocks (metadata
	// and repacked fragment tails; data blocks are copied). Default
	// runtime.GOMAXPROCS(0).
	Workers int
	Logger  *slog.Logger
}

// Compact writes base's tree afresh into dst, as a pack with
// PackOptions.Segment on base: the same content, owners, modes and mtimes,
// and the same inode numbers (those no object uses stay unused: st_ino
// stays stable). Data blocks are copied by reference (PackResult.Runs name
// base's bytes), in the order they stand in base, so the runs are long; a
// fragment block is kept when at least 3/4 of it is still used, else its
// live tails are repacked; metadata and the trailer are written densely.
// The image carries base's lineage on, with generation 0 and no garbage:
// what it leaves out is the garbage extending packs left in base (dead
// inodes, listings and blocks). It is written with base's compression,
// compressor options and block size, so later packs can extend it.
//
// dst must be an *os.File (see PackOptions.Segment). Compact reads all of
// base's metadata (not its data blocks but for fragment tails it
// repacks): it is meant for the background, not for a stop's snapshot.
func Compact(ctx context.Context, dst *os.File, base *Reader, opts CompactOptions) (PackResult, error) {
	level, err := base.level()
	if err != nil {
		return PackResult{}, fmt.Errorf("archive: compact: %w", err)
	}
	po := PackOptions{Compression: base.Compression(), Level: level, BlockSize: base.bs, Workers: opts.Workers,
		Logger: opts.Logger, Base: base, Segment: true}
	p, err := newPacker(base.FS(), po)
	if err != nil {
		return PackResult{}, fmt.Errorf("archive: compact: %w", err)
	}
	k := &keepNumbers{base: base, next: base.sb.Inodes + 1,
		claim: func(n *node) Inode {
			if n.srcIno == 0 || n.srcIno > math.MaxUint32 {
				return 0
			}
			return Inode(n.srcIno)
		}}
	if base.tr2 != nil {
		k.lineage = base.tr2.root.lineage
		k.next = max(k.next, base.tr2.root.nextInode)
	}
	p.keep, p.compact = k, true
	return p.packTo(ctx, dst)
}

// level is the compressor level base was written with, as far as its
// compressor options tell (what Pack needs to write the same options).
func (r *Reader) level() (int, error) {
	if r.sb.Flags&flagCompOpts == 0 {
		return 0, nil
	}
	m, err := r.metaBlock(superblockSize, kindCompOpts, r.sb.InodeTable)
	if err != nil {
		return 0, err
	}
	b := m.b
	switch r.Compression() {
	case Zstd, Gzip:
		if len(b) >= 4 {
			return int(binary.LittleEndian.Uint32(b)), nil
		}
	case LZ4:
		if len(b) >= 8 && binary.LittleEndian.Uint32(b[4:])&1 != 0 {
			return 9, nil
		}
		return 0, nil
	}
	return 0, nil
}

// sortByBase orders the files to pack by where their blocks stand in the
// archive they come from (Compact), so that the copies make long runs.
func (p *packer) sortByBase() {
	key := func(n *node) uint64 {
		r, ino := p.effectiveSource(n)
		if r == nil {
			return math.MaxUint64
		}
		l, err := r.layout(ino)
		if err != nil || len(l.offs) == 0 {
			return math.MaxUint64
		}
		return l.offs[0]
	}
	keys := make(map[*node]uint64, len(p.order))
	for _, n := range p.order {
		keys[n] = key(n)
	}
	sort.SliceStable(p.order, func(i, j int) bool { return keys[p.order[i]] < keys[p.order[j]] })
}
