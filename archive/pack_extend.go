package archive

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"math"
	"path"
	"syscall"
	"time"
)

// Extending packs (PackOptions.Extend): the image is Base's image grown at
// the end of each region. See "Extending" in doc.go.
//
//	[sb][opts][ Base's data, same offsets ][ new data and fragment blocks ]
//	[ Base's inode table, verbatim ][ new inode blocks ]
//	[ Base's directory table, verbatim ][ new directory blocks ]
//	[ fragment table: Base's full blocks, then the rest re-encoded ][ index ]
//	[ export table: Base's blocks, changed ones re-encoded, new ones ][ index ]
//	[ id table ][ index ][ padding ][ trailer: Base's pages and groups reused ]

// A ChangeFS is a tree that is PackOptions.Base's tree with changes it
// knows of. Pack uses it with PackOptions.Extend to visit only what
// changed.
type ChangeFS interface {
	// BaseInode reports which inode of Base the entry at name stands for.
	// unchanged: the entry, and for a directory everything below it, is
	// that inode of Base exactly (Pack reuses it without listing, reading
	// or stat-ing below it). Otherwise ok reports the inode of Base the
	// entry was before it changed (Pack keeps its number); ok is false for
	// entries Base never had. name is a path as io/fs gives it ("." for
	// the root).
	BaseInode(name string) (ino Inode, unchanged, ok bool)
}

// extendFallback is why an extending pack gave up before writing
// anything: Pack packs afresh instead.
type extendFallback struct{ reason string }

func (e *extendFallback) Error() string { return "cannot extend the base: " + e.reason }

// extendable returns why this pack cannot extend its base, or "".
func (p *packer) extendable() string {
	b := p.opts.Base
	if !p.opts.Segment {
		return "Extend needs Segment"
	}
	if b == nil {
		return "no base"
	}
	if _, ok := p.src.(ChangeFS); !ok {
		return "the source does not implement ChangeFS"
	}
	switch {
	case b.tr2 == nil:
		return "the base has no version 2 trailer"
	case b.bs != p.bs:
		return fmt.Sprintf("the base's block size is %d, this pack's %d", b.bs, p.bs)
	case b.Compression() != p.opts.Compression:
		return fmt.Sprintf("the base is compressed with %s, this pack with %s", b.Compression(), p.opts.Compression)
	case b.exportIdx == nil:
		return "the base has no export table"
	case b.sb.XattrTable != noTable:
		return "the base has extended attributes"
	case b.sb.Flags != p.flags():
		return fmt.Sprintf("the base's superblock flags are %#x, this pack's %#x", b.sb.Flags, p.flags())
	case b.tr2.root.nextInode <= b.sb.Inodes:
		return "the base's trailer root names no next inode number"
	}
	opts := p.codec.options()
	if opts != nil {
		hb, err := b.readChecked(superblockSize, 2+uint64(len(opts)), kindCompOpts)
		if err != nil || !bytes.Equal(hb[2:], opts) {
			return "the base was written with other compressor options"
		}
	}
	return ""
}

// flags are the superblock flags this pack writes.
func (p *packer) flags() uint16 {
	f := uint16(flagNoXattrs | flagDuplicates | flagExportable)
	if p.codec.options() != nil {
		f |= flagCompOpts
	}
	if _, ok := p.codec.(noneCodec); ok {
		f |= flagUncompInodes | flagUncompData | flagUncompFrags | flagUncompIDs
	}
	return f
}

// extender is the state of one extending pack's walk of the change.
type extender struct {
	p    *packer
	base *Reader
	cfs  ChangeFS
	lfs  iofs.ReadLinkFS

	links     map[linkKey]*node
	owners    []*node // every inode owner seen, in walk order
	parent    map[*node]*node
	listed    []*node       // the directories listed, in walk order
	baseNames map[Inode]int // names of each base inode in the base listings read

	kept map[Inode]*node // base inodes whose numbers this image keeps
	dead map[Inode]*inode
	next uint32

	// Garbage: bytes of the image that nothing uses any more, found by
	// this pack, and the base files whose blocks may be among them.
	freed uint64
	// copied: offsets of Base's data and fragment blocks the new image
	// copies (dataWriter.store).
	copied map[uint64]bool
	// copiedSums: content sums of the data blocks it copies from any
	// archive.
	copiedSums map[sum]bool
	oldFiles   []*inode
	live       int64 // inode numbers in use, change from the base's
}

// scanExtend walks the change into the node tree: every directory the
// source does not say is unchanged is listed, each entry Lstat'ed; an
// unchanged entry is checked against the base and kept as it is.
func (e *extender) scan(ctx context.Context) error {
	p := e.p
	fi, err := e.lfs.Lstat(".")
	if err != nil {
		return fmt.Errorf("lstat root: %w", err)
	}
	if !fi.IsDir() {
		return errors.New("root is not a directory")
	}
	root := &node{path: "."}
	if err := p.fill(root, fi); err != nil {
		return err
	}
	p.root = root
	x, unch, ok := e.cfs.BaseInode(".")
	if !ok || x != e.base.root {
		return &extendFallback{"the source's root does not stand for the base's root"}
	}
	root.claim, root.unchanged = x, unch
	e.owners = append(e.owners, root)
	if unch {
		return nil
	}
	return e.visit(ctx, root, x)
}

func (e *extender) visit(ctx context.Context, d *node, x Inode) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	p := e.p
	if x != 0 {
		if bx, err := e.base.lookupBare(x); err == nil && basicType(bx.typ) == typeDir {
			bl, err := e.base.listing(bx)
			if err != nil {
				return err
			}
			d.baseList = bl
			for _, be := range bl.ents {
				e.baseNames[be.Ino]++
			}
		} else if err != nil && !errors.Is(err, iofs.ErrNotExist) {
			return err
		}
	}
	e.listed = append(e.listed, d)
	ents, err := iofs.ReadDir(p.src, d.path)
	if err != nil {
		return fmt.Errorf("read dir %s: %w", d.path, err)
	}
	for i, de := range ents {
		name := de.Name()
		if !validName(name) {
			return fmt.Errorf("%s: invalid entry name %q", d.path, name)
		}
		if i > 0 && ents[i-1].Name() >= name {
			return fmt.Errorf("%s: directory listing not sorted or has duplicates at %q", d.path, name)
		}
		cpath := path.Join(d.path, name)
		fi, err := e.lfs.Lstat(cpath)
		if err != nil {
			return fmt.Errorf("lstat %s: %w", cpath, err)
		}
		c := &node{name: name, path: cpath}
		if err := p.fill(c, fi); err != nil {
			return fmt.Errorf("%s: %w", cpath, err)
		}
		bx, unch, ok := e.cfs.BaseInode(cpath)
		if ok {
			c.claim, c.unchanged = bx, unch
		}
		e.parent[c] = d
		if c.mode.IsDir() {
			d.subdirs++
		} else if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink > 1 {
			k := linkKey{uint64(st.Dev), st.Ino}
			if o := e.links[k]; o != nil {
				if o.mode.Type() != c.mode.Type() {
					return fmt.Errorf("%s: hard link to %s changed type", cpath, o.path)
				}
				c.owner = o
				o.nlink++
				// One inode: changed if any of its names says so.
				if o.claim != c.claim {
					o.unchanged = false
				}
				o.unchanged = o.unchanged && c.unchanged
			} else {
				e.links[k] = c
			}
		}
		if c.mode.Type() == iofs.ModeSymlink {
			t, err := e.lfs.ReadLink(cpath)
			if err != nil {
				return fmt.Errorf("readlink %s: %w", cpath, err)
			}
			if len(t) == 0 || len(t) > maxSymlinkLen {
				return fmt.Errorf("%s: symlink target of %d bytes", cpath, len(t))
			}
			c.target = t
			c.size = int64(len(t))
		}
		d.children = append(d.children, c)
		if c.owner == nil {
			e.owners = append(e.owners, c)
		}
		if c.mode.IsDir() && !(ok && unch) {
			if !ok {
				bx = 0
			}
			if err := e.visit(ctx, c, bx); err != nil {
				return err
			}
		}
	}
	return nil
}

// resolve decides, for every inode seen, whether it keeps a base inode's
// number (and whether as it is), which base inodes went away, and numbers
// the rest.
func (e *extender) resolve(ctx context.Context) error {
	base := e.base
	for _, o := range e.owners {
		if o.claim == 0 {
			continue
		}
		if e.kept[o.claim] != nil {
			// Another object of this tree stands for it already.
			if o.unchanged {
				return fmt.Errorf("%s: the source says it is inode %d of the base unchanged, and so is %s (a bug of its ChangeFS)", o.path, o.claim, e.kept[o.claim].path)
			}
			o.claim = 0
			continue
		}
		bx, err := base.lookupInode(o.claim)
		if err != nil && !errors.Is(err, iofs.ErrNotExist) {
			return err
		}
		if err != nil || basicType(bx.typ) != inodeTypeOf(o.mode) {
			if o.unchanged {
				return fmt.Errorf("%s: the source says it is inode %d of the base unchanged, which the base does not have as a %v (a bug of its ChangeFS)", o.path, o.claim, o.mode.Type())
			}
			o.claim = 0
			continue
		}
		o.baseIn = bx
		e.kept[o.claim] = o
		if o.unchanged {
			if err := e.check(o, bx); err != nil {
				return err
			}
		}
	}
	// The base listings of directories that went count too: a name moved
	// out of one is not left behind.
	if err := e.findDead(ctx); err != nil {
		return err
	}
	for _, o := range e.owners {
		if o.baseIn == nil {
			continue
		}
		if o.mode.IsDir() {
			if o != e.p.root && e.baseNames[o.claim] == 0 {
				return fmt.Errorf("%s: the source says it stands for directory inode %d of the base, which the base still has in a directory the source says is unchanged (a bug of its ChangeFS)", o.path, o.claim)
			}
			o.reused = o.unchanged && o != e.p.root
			continue
		}
		v, b, s := uint32(e.baseNames[o.claim]), o.baseIn.nlink, o.nlink
		switch {
		case o.unchanged && s == v:
			o.reused = true
		case v >= b:
			o.unchanged = false
		default:
			return &extendFallback{fmt.Sprintf("%s: a hard link (inode %d) changed while another of its names is in a directory the source says is unchanged", o.path, o.claim)}
		}
	}
	e.number()
	return nil
}

// check fails when an entry the source says is an unchanged base inode is
// not: that is a bug of its ChangeFS, and packing it would make an image
// that differs from the tree.
func (e *extender) check(o *node, bx *inode) error {
	a := bx.attr()
	bad := func(what string, got, want any) error {
		return fmt.Errorf("%s: the source says it is inode %d of the base unchanged, but its %s is %v, the base's %v (a bug of its ChangeFS)", o.path, o.claim, what, got, want)
	}
	secs, _ := mtimeSecs(o.mtime)
	switch {
	case a.Mode != o.mode&(iofs.ModeType|iofs.ModePerm|iofs.ModeSetuid|iofs.ModeSetgid|iofs.ModeSticky):
		return bad("mode", o.mode, a.Mode)
	case a.Uid != o.uid || a.Gid != o.gid:
		return bad("owner", fmt.Sprintf("%d:%d", o.uid, o.gid), fmt.Sprintf("%d:%d", a.Uid, a.Gid))
	case bx.mtime != secs:
		return bad("mtime", secs, bx.mtime)
	case o.mode.IsRegular() && a.Size != o.size:
		return bad("size", o.size, a.Size)
	case o.mode.Type() == iofs.ModeSymlink && bx.target != o.target:
		return bad("target", o.target, bx.target)
	case o.mode&iofs.ModeDevice != 0 && bx.rdev != encodeDev(o.rdev):
		return bad("device", o.rdev, a.Rdev)
	}
	return nil
}

// findDead lists the base inodes this image no longer has: those the base
// listings read name that no entry stands for, with everything below a
// directory that went. A hard-linked file one of whose names went while
// another stays in an unchanged directory makes the pack fall back (its
// link count would be wrong).
func (e *extender) findDead(ctx context.Context) error {
	base := e.base
	var gone []Inode
	var walkDead func(x Inode, depth int) error
	seen := map[Inode]bool{}
	walkDead = func(x Inode, depth int) error {
		if seen[x] || depth > 4096 {
			return nil
		}
		seen[x] = true
		if err := ctx.Err(); err != nil {
			return err
		}
		gone = append(gone, x)
		in, err := base.lookupBare(x)
		if err != nil || basicType(in.typ) != typeDir {
			return err
		}
		bl, err := base.listing(in)
		if err != nil {
			return err
		}
		for _, be := range bl.ents {
			e.baseNames[be.Ino]++
		}
		for _, be := range bl.ents {
			if e.kept[be.Ino] == nil && be.Mode.IsDir() {
				if err := walkDead(be.Ino, depth+1); err != nil {
					return err
				}
			} else if e.kept[be.Ino] == nil && !seen[be.Ino] {
				seen[be.Ino] = true
				gone = append(gone, be.Ino)
			}
		}
		return nil
	}
	for _, d := range e.listed {
		if d.baseList == nil {
			continue
		}
		for _, be := range d.baseList.ents {
			if e.kept[be.Ino] != nil || seen[be.Ino] {
				continue
			}
			if be.Mode.IsDir() {
				if err := walkDead(be.Ino, 0); err != nil {
					return err
				}
			} else {
				seen[be.Ino] = true
				gone = append(gone, be.Ino)
			}
		}
	}
	for _, x := range gone {
		in, err := base.lookupInode(x)
		if errors.Is(err, iofs.ErrNotExist) {
			continue
		}
		if err != nil {
			return err
		}
		if basicType(in.typ) != typeDir && uint32(e.baseNames[x]) < in.nlink {
			return &extendFallback{fmt.Sprintf("a name of hard-linked inode %d went while another stays in a directory the source says is unchanged", x)}
		}
		e.dead[x] = in
	}
	return nil
}

// number gives every inode its number: a kept base inode its own; a new
// one the number of a base inode that went from the same directory under
// the same name and type (an atomic write-and-rename keeps st_ino), else
// a number no image of the lineage used.
func (e *extender) number() {
	p := e.p
	taken := map[Inode]bool{}
	for _, o := range e.owners {
		if o.baseIn != nil {
			o.ino = uint32(o.claim)
			if o.reused {
				o.ref = o.baseIn.ref
			}
			continue
		}
		if d := e.parent[o]; d != nil && d.baseList != nil {
			if i := sortedFind(d.baseList.ents, o.name); i >= 0 {
				be := d.baseList.ents[i]
				if in := e.dead[be.Ino]; in != nil && !taken[be.Ino] && basicType(in.typ) == inodeTypeOf(o.mode) {
					taken[be.Ino] = true
					o.ino = uint32(be.Ino)
					e.live++
					continue
				}
			}
		}
		o.ino = e.next
		e.next++
		e.live++
	}
	for x := range taken {
		e.oldFiles = append(e.oldFiles, e.dead[x])
		e.freed += e.recordBytes(e.dead[x])
		delete(e.dead, x)
	}
	for _, in := range e.dead {
		e.live--
		e.freed += e.recordBytes(in)
		switch basicType(in.typ) {
		case typeFile:
			e.oldFiles = append(e.oldFiles, in)
		case typeDir:
			e.freed += e.listingBytes(in)
		}
	}
	// A directory kept as it is under another parent (moved) gets a new
	// inode record naming its parent; its listing stays.
	for _, o := range e.owners {
		if o.reused && o.mode.IsDir() && o.baseIn.parent != e.parent[o].ino {
			o.reused, o.relist = false, true
		}
	}
	if p.root.unchanged {
		p.root.relist = true
	}
	for _, o := range e.owners {
		if o.baseIn == nil || o.reused {
			continue
		}
		// Re-encoded: its old record is garbage, and a listed
		// directory's old listing; a file's old blocks maybe.
		e.freed += e.recordBytes(o.baseIn)
		switch {
		case o.mode.IsDir() && !o.relist:
			e.freed += e.listingBytes(o.baseIn)
		case o.mode.IsRegular():
			e.oldFiles = append(e.oldFiles, o.baseIn)
		}
	}
	p.inodes = e.next - 1
}

// recordBytes estimates the stored bytes of a base inode's record.
func (e *extender) recordBytes(in *inode) uint64 {
	n := uint64(minInodeSize)
	switch in.typ {
	case typeDir:
		n = 32
	case typeLDir:
		n = 40 + uint64(in.idxCnt)*32
	case typeFile, typeLFile:
		n = 32
		if in.typ == typeLFile {
			n = 56
		}
		blocks := in.size / uint64(e.base.bs)
		if in.frag == noFragment && in.size%uint64(e.base.bs) != 0 {
			blocks++
		}
		n += 4 * blocks
	case typeSymlink, typeLSymlink:
		n = 24 + in.size
	case typeBlockDev, typeCharDev, typeLBlock, typeLChar:
		n = 24
	}
	return e.ratio(kindInodeTable, e.base.sb.InodeTable+refBlock(in.ref), e.base.sb.DirTable, n)
}

// listingBytes estimates the stored bytes of a base directory's listing.
func (e *extender) listingBytes(in *inode) uint64 {
	if in.size <= 3 {
		return 0
	}
	return e.ratio(kindDirTable, e.base.sb.DirTable+uint64(in.dirBlk), e.base.dirEnd, in.size-3)
}

// ratio scales n decoded bytes of the metadata block at off to stored
// bytes (by that block's ratio; n when it cannot tell).
func (e *extender) ratio(kind extentKind, off, end, n uint64) uint64 {
	m, err := e.base.metaBlock(off, kind, end)
	if err != nil || len(m.b) == 0 {
		return n
	}
	return n * m.n / uint64(len(m.b))
}

// contentIndex gives the data phase what it may find in the base by
// content, all of it O(change): the old version of each changed file and
// the files that went (an appended log's leading blocks, a file copied or
// renamed over another, a rewrite that kept most blocks). Content
// elsewhere in the base is not looked for (a fresh pack on a base finds it
// through the whole base's index).
func (e *extender) contentIndex() (*contentIndex, error) {
	ix := &contentIndex{byFile: map[sum]Inode{}, byBlock: map[sum]blockLoc{}, sizes: map[int64]bool{}}
	base := e.base
	if !base.hasSums() {
		return ix, nil
	}
	for _, in := range e.oldFiles {
		if in.hasSum && in.sum.known() {
			if _, dup := ix.byFile[in.sum]; !dup {
				ix.byFile[in.sum] = in.ino
			}
			ix.sizes[int64(in.size)] = true
		}
		l, err := base.decodeLayout(in)
		if err != nil {
			return nil, err
		}
		for k, w := range l.words {
			if w == 0 {
				continue
			}
			if s := base.blockSumAt(l.offs[k]); s.known() {
				if _, dup := ix.byBlock[s]; !dup {
					ix.byBlock[s] = blockLoc{off: l.offs[k], word: w}
				}
			}
		}
	}
	return ix, nil
}

// dataGarbage counts the blocks of base files that changed or went and
// that no file of the new image uses in place.
func (e *extender) dataGarbage(b *baseState) {
	done := map[Inode]bool{}
	for _, in := range e.oldFiles {
		if done[in.ino] || b.inPlace[in.ino] != nil {
			continue
		}
		done[in.ino] = true
		l, err := e.base.decodeLayout(in)
		if err != nil {
			continue
		}
		// A block the new image copies (a changed file's unchanged
		// block, found by its sum or its PartialSource) is the same
		// stored bytes at another image offset: not freed where they
		// are kept.
		for i, w := range l.words {
			if e.copied[l.offs[i]] {
				continue
			}
			// Copied from another archive (the lower layer a changed
			// file was read from by range) with the same content: the
			// base's block was most likely a copy of those bytes too.
			if s := e.base.blockSumAt(l.offs[i]); s.known() && e.copiedSums[s] {
				continue
			}
			e.freed += uint64(w &^ dataUncompBit)
		}
		if l.frag >= 0 {
			if f, err := e.base.fragAt(uint32(l.frag)); err != nil || !e.copied[f.start] {
				e.freed += uint64(l.size % int64(e.base.bs))
			}
		}
	}
}

// packExtend packs the change of the source over Base's image (see the top
// of this file). It returns an *extendFallback, having written nothing,
// when the change cannot be packed so.
func (p *packer) packExtend(ctx context.Context, f packFile) (res PackResult, err error) {
	start := time.Now()
	base := p.opts.Base
	e := &extender{p: p, base: base, cfs: p.src.(ChangeFS), lfs: p.src.(iofs.ReadLinkFS),
		links: map[linkKey]*node{}, parent: map[*node]*node{}, baseNames: map[Inode]int{},
		kept: map[Inode]*node{}, dead: map[Inode]*inode{}, next: base.tr2.root.nextInode, copied: map[uint64]bool{}, copiedSums: map[sum]bool{}}
	p.extend = e
	if err := e.scan(ctx); err != nil {
		return res, err
	}
	if err := e.resolve(ctx); err != nil {
		return res, err
	}
	for _, o := range e.owners {
		if o.mode.IsRegular() && !o.reused {
			p.order = append(p.order, o)
		}
		if o.mtime.After(p.newest) {
			p.newest = o.mtime
		}
	}
	if uint64(e.next) > math.MaxUint32 {
		return res, &extendFallback{"the lineage used every inode number"}
	}
	ix, err := e.contentIndex()
	if err != nil {
		return res, err
	}
	opts := p.codec.options()
	dataStart := uint64(superblockSize)
	if opts != nil {
		dataStart += 2 + uint64(len(opts))
	}
	p.base = &baseState{r: base, ix: ix, live: map[uint64]uint64{}, inPlace: map[Inode]*fileData{},
		fragIndex: map[int]uint32{}, appending: true, start: dataStart, end: base.sb.InodeTable}
	if err := p.plan(ctx); err != nil {
		return res, err
	}
	p.log.Debug("pack: change scanned", "listed_dirs", len(e.listed), "inodes", len(e.owners), "files", len(p.order), "elapsed", time.Since(start))

	var off int64
	if s, ok := f.(io.Seeker); ok {
		if off, err = s.Seek(0, io.SeekCurrent); err != nil {
			return res, err
		}
	}
	out := &output{f: f, bw: bufio.NewWriterSize(f, 1<<20), base: off, segment: true}
	out.skip(superblockSize)
	// The compressor options and Base's data region: Base's bytes.
	out.copyBase(base.sb.InodeTable-superblockSize, base, superblockSize)
	frags, err := p.writeData(ctx, out)
	if err != nil {
		return res, err
	}
	e.dataGarbage(p.base)
	iData := len(out.ext)
	sb, bounds, err := p.writeTablesExtend(out, frags)
	if err != nil {
		return res, err
	}
	bounds[0] = iData

	imageBytes := out.pos
	padded := (imageBytes + padAlign - 1) / padAlign * padAlign
	if pad := padded - imageBytes; pad > 0 {
		out.trailerWrite(make([]byte, pad))
	}
	sbBytes := sb.marshal()
	recs := p.records(out.ext, out.sums)
	head := []blockRec{{length: superblockSize, kind: kindSuperblock, crc: crc32c(sbBytes)}}
	if opts != nil {
		bi, ok, err := base.blockAt(superblockSize)
		if err != nil {
			return res, err
		}
		if !ok {
			return res, base.corruptf(superblockSize, kindCompOpts.String(), "no checksum recorded for a block at this offset")
		}
		head = append(head, blockRec{length: bi.length, kind: bi.kind, crc: bi.crc})
	}
	rs := []trRegion{
		{off: 0, class: 0, spans: []trSpan{{recs: head}}},
		{off: dataStart, class: int(kindData), spans: []trSpan{{base: base, from: dataStart, to: base.sb.InodeTable}, {recs: recs[:bounds[0]]}}},
		{off: sb.InodeTable, class: int(kindInodeTable), spans: []trSpan{{base: base, from: base.sb.InodeTable, to: base.sb.DirTable}, {recs: recs[bounds[0]:bounds[1]]}}},
		{off: sb.DirTable, class: int(kindDirTable), spans: []trSpan{{base: base, from: base.sb.DirTable, to: base.dirEnd}, {recs: recs[bounds[1]:bounds[2]]}}},
	}
	restOff := sb.DirTable + (base.dirEnd - base.sb.DirTable)
	for _, r := range recs[bounds[1]:bounds[2]] {
		restOff += uint64(r.length)
	}
	for _, rg := range regions(recs[bounds[2]:]) {
		rg.off += restOff
		rs = append(rs, rg)
	}
	ri := base.tr2.root
	ri.imageBytes = imageBytes
	ri.sbCRC = crc32c(sbBytes)
	ri.generation++
	ri.nextInode = e.next
	ri.liveInodes = uint32(max(int64(ri.liveInodes)+e.live, 1))
	ri.garbage += e.freed
	if p.opts.noSums {
		ri.flags &^= rootHasSums
	}
	tb := newTrBuilder(out, padded)
	if err := tb.build(rs); err != nil {
		return res, err
	}
	if err := tb.finish(ri, sbBytes); err != nil {
		return res, err
	}
	if out.err != nil {
		return res, out.err
	}
	if err := out.bw.Flush(); err != nil {
		return res, err
	}
	if _, err := f.WriteAt(sbBytes, off); err != nil {
		return res, fmt.Errorf("write superblock: %w", err)
	}
	p.res.Size = int64(tb.pos)
	p.res.Runs, p.res.SegmentSize = out.runs, out.spos
	p.res.Inodes = int64(ri.liveInodes)
	p.res.Base = BaseExtended
	p.res.KeptNumbers = true
	p.res.Lineage, p.res.Generation, p.res.GarbageBytes = ri.lineage, int(ri.generation), int64(ri.garbage)
	p.log.Info("packed archive by extending its base", "bytes", p.res.Size, "segment_bytes", p.res.SegmentSize,
		"listed_dirs", len(e.listed), "written_inodes", len(e.owners), "files", p.res.Files, "data_bytes", p.res.DataBytes,
		"reused_bytes", p.res.ReusedBytes, "matched_bytes", p.res.MatchedBytes, "generation", ri.generation,
		"garbage_bytes", ri.garbage, "trailer_reused", tb.reused, "trailer_new", tb.written, "elapsed", time.Since(start))
	return p.res, nil
}

// copyBase accounts for n image bytes that are base's bytes at off, whose
// trailer records the trailer builder takes from base (PackOptions.Extend).
func (o *output) copyBase(n uint64, src *Reader, off uint64) {
	if o.err != nil || n == 0 {
		return
	}
	o.pos += n
	o.grow(int64(n), src, int64(off))
}

// writeTablesExtend writes the tables of an extending pack: Base's inode
// and directory tables followed by this pack's blocks, and the fragment,
// export and id tables whole. bounds are the indexes in out.ext where the
// new inode blocks end, the new directory blocks end (and [0], set by the
// caller, where the data ended).
func (p *packer) writeTablesExtend(out *output, newFrags []fragEntry) (*superblock, [3]int, error) {
	var bounds [3]int
	e := p.extend
	base := e.base
	bsb := &base.sb
	bc := p.codec.newWorker()
	t := &tables{
		inodes:     &metaWriter{comp: bc, kind: kindInodeTable, prefix: bsb.DirTable - bsb.InodeTable},
		dirs:       &metaWriter{comp: bc, kind: kindDirTable, prefix: base.dirEnd - bsb.DirTable},
		idIndex:    map[uint32]uint16{},
		extend:     true,
		exportMap:  map[uint32]uint64{},
		writtenMap: map[uint32]bool{},
	}
	for i, id := range base.ids {
		if _, dup := t.idIndex[id]; !dup {
			t.idIndex[id] = uint16(i)
		}
	}
	t.ids = append(t.ids, base.ids...)
	write := p.writeDir
	if p.root.relist {
		write = p.writeRelisted
	}
	if err := write(t, p.root, p.inodes+1); err != nil {
		return nil, bounds, err
	}
	p.inodeRecs = t.inodeRecs
	sb := &superblock{
		Inodes:      p.inodes,
		BlockSize:   uint32(p.bs),
		Compression: p.codec.id(),
		Flags:       p.flags(),
		Major:       4,
		RootInode:   p.root.ref,
		XattrTable:  noTable,
		BlockLog:    bsb.BlockLog,
	}
	mt := p.opts.ModTime
	if mt.IsZero() {
		mt = p.newest
	}
	sb.MkfsTime, _ = mtimeSecs(mt)
	sb.MkfsTime = max(sb.MkfsTime, bsb.MkfsTime)

	sb.InodeTable = out.pos
	out.copyBase(bsb.DirTable-bsb.InodeTable, base, bsb.InodeTable)
	if _, err := t.inodes.emit(out); err != nil {
		return nil, bounds, err
	}
	bounds[1] = len(out.ext)
	sb.DirTable = out.pos
	out.copyBase(base.dirEnd-bsb.DirTable, base, bsb.DirTable)
	if _, err := t.dirs.emit(out); err != nil {
		return nil, bounds, err
	}
	bounds[2] = len(out.ext)

	// Fragment table: Base's full blocks as they are, its last block
	// (entries at the same indexes) and the new entries re-encoded.
	sb.Fragments = bsb.Fragments + uint32(len(newFrags))
	sb.FragmentTable = out.pos
	if sb.Fragments > 0 {
		full := bsb.Fragments / fragsPerBlock
		var starts []uint64
		for k := range full {
			at, err := p.copyMeta(out, base, base.fragIdx[k], kindFragTable)
			if err != nil {
				return nil, bounds, err
			}
			starts = append(starts, at)
		}
		ft := &metaWriter{comp: bc, kind: kindFragTable}
		var ent [fragEntrySize]byte
		put := func(f fragEntry) {
			binary.LittleEndian.PutUint64(ent[0:], f.start)
			binary.LittleEndian.PutUint32(ent[8:], f.word)
			binary.LittleEndian.PutUint32(ent[12:], 0)
			ft.write(ent[:])
		}
		for i := full * fragsPerBlock; i < bsb.Fragments; i++ {
			f, err := base.fragAt(i)
			if err != nil {
				return nil, bounds, err
			}
			put(f)
		}
		for _, f := range newFrags {
			put(f)
		}
		at, err := ft.emit(out)
		if err != nil {
			return nil, bounds, err
		}
		for _, s := range ft.starts {
			starts = append(starts, at+s)
		}
		sb.FragmentTable = p.writeIndex(out, starts)
	}

	// Export table: Base's blocks no entry of which changed, as they are;
	// the others re-encoded; the new ones.
	holes := p.root.ref // a hole's entry: a record that names another number
	for x := range e.dead {
		t.exportMap[uint32(x)] = holes
	}
	changed := map[uint32]bool{}
	for ino := range t.exportMap {
		changed[(ino-1)/refsPerBlock] = true
	}
	count := func(inodes, k uint32) uint32 { return min(refsPerBlock, inodes-k*refsPerBlock) }
	nblk := (p.inodes + refsPerBlock - 1) / refsPerBlock
	var starts []uint64
	for k := range nblk {
		if k < uint32(len(base.exportIdx)) && !changed[k] && count(p.inodes, k) == count(bsb.Inodes, k) {
			at, err := p.copyMeta(out, base, base.exportIdx[k], kindExportTable)
			if err != nil {
				return nil, bounds, err
			}
			starts = append(starts, at)
			continue
		}
		refs := make([]byte, 0, 8*count(p.inodes, k))
		if k < uint32(len(base.exportIdx)) {
			m, err := base.metaBlock(base.exportIdx[k], kindExportTable, bsb.ExportTable)
			if err != nil {
				return nil, bounds, err
			}
			refs = append(refs, m.b[:min(len(m.b), 8*int(count(bsb.Inodes, k)))]...)
		}
		for uint32(len(refs)) < 8*count(p.inodes, k) {
			refs = binary.LittleEndian.AppendUint64(refs, holes)
		}
		for i := range count(p.inodes, k) {
			if ref, ok := t.exportMap[k*refsPerBlock+i+1]; ok {
				binary.LittleEndian.PutUint64(refs[8*i:], ref)
			}
		}
		et := &metaWriter{comp: bc, kind: kindExportTable}
		et.write(refs)
		at, err := et.emit(out)
		if err != nil {
			return nil, bounds, err
		}
		starts = append(starts, at)
	}
	sb.ExportTable = p.writeIndex(out, starts)

	it := &metaWriter{comp: bc, kind: kindIDTable}
	for _, id := range t.ids {
		it.write(binary.LittleEndian.AppendUint32(nil, id))
	}
	var err error
	if sb.IDTable, err = it.emitIndexed(out); err != nil {
		return nil, bounds, err
	}
	sb.IDs = uint16(len(t.ids))
	sb.BytesUsed = out.pos
	return sb, bounds, out.err
}

// copyMeta accounts for the metadata block of base at off as this image's
// next block (a copy the destination does not receive), and returns
// where it stands.
func (p *packer) copyMeta(out *output, base *Reader, off uint64, kind extentKind) (uint64, error) {
	bi, ok, err := base.blockAt(off)
	if err != nil {
		return 0, err
	}
	if !ok || bi.kind != kind {
		return 0, base.corruptf(off, kind.String(), "no checksum recorded for a block at this offset")
	}
	at := out.pos
	out.copyExtent(bi.length, kind, bi.crc, sum{}, base, off)
	return at, out.err
}

// writeIndex writes an index array of block positions and returns where
// it stands.
func (p *packer) writeIndex(out *output, starts []uint64) uint64 {
	idx := make([]byte, 0, 8*len(starts))
	for _, s := range starts {
		idx = binary.LittleEndian.AppendUint64(idx, s)
	}
	at := out.pos
	out.write(idx, kindIndex, 0)
	return at
}

// writeRelisted writes the inode of directory o, kept as it is in the
// base but for its parent (moved, or the root): the base's record with
// the parent changed, its listing the base's.
func (p *packer) writeRelisted(t *tables, o *node, parent uint32) error {
	base := p.extend.base
	in := o.baseIn
	c, err := base.cursor(kindInodeTable, base.sb.InodeTable, base.sb.DirTable, refBlock(in.ref), refOffset(in.ref))
	if err != nil {
		return err
	}
	n := 32
	if in.typ == typeLDir {
		n = 40
	}
	rec, err := c.read(nil, n)
	if err != nil {
		return err
	}
	for range in.idxCnt {
		if rec, err = c.read(rec, 12); err != nil {
			return err
		}
		nlen := int(binary.LittleEndian.Uint32(rec[len(rec)-4:])) + 1
		if nlen > maxNameLen {
			return base.corruptf(base.sb.InodeTable+refBlock(in.ref), "inode table block", "directory inode %d: index name of %d bytes", in.ino, nlen)
		}
		if rec, err = c.read(rec, nlen); err != nil {
			return err
		}
	}
	binary.LittleEndian.PutUint32(rec[28:], parent)
	p.res.Dirs++
	return p.putInode(t, o, rec)
}
