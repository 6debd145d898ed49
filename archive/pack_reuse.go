package archive

import (
	"fmt"
	"io"
	iofs "io/fs"
)

// fileSource is where a file's content already lives: inode ino of the
// archive r, as the file's BlockSource said.
type fileSource struct {
	r   *Reader
	ino Inode
}

// source asks the file at n.path whether it is an earlier archive's
// content (see sourceOf), once.
func (p *packer) source(n *node) {
	if n.checked {
		return
	}
	f, err := p.src.Open(n.path)
	if err != nil {
		return // reported when the file itself is packed
	}
	defer f.Close()
	p.sourceOf(n, f)
}

// sourceOf asks f, opened from n.path, whether it is an earlier archive's
// content, and keeps the answer when that archive qualifies: checksummed,
// written with the new archive's compression and block size, and holding
// an inode of the file's size.
func (p *packer) sourceOf(n *node, f iofs.File) {
	n.checked = true
	bsrc, ok := f.(BlockSource)
	if !ok {
		return
	}
	r, ino, ok := bsrc.ArchiveSource()
	if !ok || r == nil || !r.Checksummed() || r.bs != p.bs || r.Compression() != p.opts.Compression {
		return
	}
	a, err := r.Stat(ino)
	if err != nil || !a.Mode.IsRegular() || a.Size != n.size {
		return
	}
	if _, err := r.layout(ino); err != nil {
		return // its block list does not decode: pack it afresh
	}
	n.src = &fileSource{r: r, ino: ino}
}

// reuseKey identifies content in an earlier archive by where it lives: two
// inodes with the same blocks (deduplicated copies) have the same content.
type reuseKey struct {
	r              *Reader
	frag, fragOff  uint32
	size           int64
	nblocks, first uint64
}

// reuse copies the compressed blocks of inode ino of the earlier archive r,
// which holds n's content, checking each against r's checksums.
func (d *dataWriter) reuse(n *node, fd *fileData, r *Reader, ino Inode) error {
	p := d.p
	l, err := r.layout(ino)
	if err != nil {
		return fmt.Errorf("reuse %s: %w", n.path, err)
	}
	key := reuseKey{r: r, size: l.size, frag: noFragment, nblocks: uint64(len(l.offs))}
	if len(l.offs) > 0 {
		key.first = l.offs[0]
	}
	if l.frag >= 0 {
		key.frag, key.fragOff = uint32(l.frag), l.fragOff
	}
	if prior := d.reused[key]; prior != nil {
		// Stored once in r (a duplicate there): once here too, and not
		// read either.
		n.file = prior
		p.res.ReusedBytes += prior.reusedBytes
		return nil
	}
	d.reused[key] = fd
	fromBase := p.base != nil && r == p.base.r
	s := r.fileSumOf(ino)
	if s.known() {
		fd.sum, fd.sumSet = s, true
		d.remember(fd, s)
	}

	bs := int64(p.bs)
	if n.size < bs {
		// (An extending pack does not weigh the fragment blocks of other
		// archives: that would walk the whole archive.)
		if l.frag >= 0 && p.extend == nil {
			if ok, err := d.reuseFragment(n, fd, r, l); ok || err != nil {
				return err
			}
		}
		// Take the bytes (checked and decompressed by the reader) into the
		// new fragments.
		buf, idx, off, err := d.fragmentSpace(fd, int(n.size))
		if err != nil {
			return err
		}
		if _, err := r.readLayout(l, buf, 0); err != nil && err != io.EOF {
			return fmt.Errorf("reuse %s: %w", n.path, err)
		}
		fd.frag, fd.fragOff = idx, off
		return nil
	}
	nblocks := (n.size + bs - 1) / bs
	fd.words = make([]uint32, 0, nblocks)
	fd.chunks = make([]sum, 0, nblocks)
	// Holes and tails are not read from the tree either.
	fd.reusedBytes = n.size
	p.res.ReusedBytes += n.size
	for i, w := range l.words {
		blen := min(bs, n.size-int64(i)*bs)
		if w == 0 {
			if err := d.submit(&job{kind: jobData, hole: int(blen), file: fd}); err != nil {
				return err
			}
			continue
		}
		j, err := d.copyJob(r, l.offs[i], w, int(blen), fd)
		if err != nil {
			return fmt.Errorf("reuse %s: %w", n.path, err)
		}
		if fromBase && j.copyFrom == nil {
			j.baseOff = int64(l.offs[i])
		}
		if err := d.submit(j); err != nil {
			return err
		}
	}
	if l.frag >= 0 {
		// The earlier archive packed this file's tail into a fragment
		// (mksquashfs -always-use-fragments); here it is a short block.
		off := int64(len(l.words)) * bs
		buf := d.in.get()[:n.size-off]
		if _, err := r.readLayout(l, buf, off); err != nil && err != io.EOF {
			d.in.put(buf)
			return fmt.Errorf("reuse %s: %w", n.path, err)
		}
		if err := d.submit(&job{kind: jobData, in: buf, file: fd}); err != nil {
			return err
		}
	}
	return nil
}

// copyJob is the job that copies data block w of r at off (blen bytes of
// content) into the new archive: read and checked, or, with
// PackOptions.Segment, only accounted for by its recorded checksum. A
// block whose sum r does not record is read either way, and summed by a
// worker, so the new archive records one.
func (d *dataWriter) copyJob(r *Reader, off uint64, w uint32, blen int, fd *fileData) (*job, error) {
	n := w &^ dataUncompBit
	j := &job{kind: jobRaw, file: fd, word: w, baseOff: -1, sum: r.blockSumAt(off)}
	if d.p.opts.Segment {
		crc, err := r.crcAt(off, n, kindData.String())
		if err != nil {
			return nil, err
		}
		j.crc, j.copyFrom, j.copyOff, j.copyLen = crc, r, off, n
	}
	if j.copyFrom == nil || !j.sum.known() {
		raw, err := r.readAt(off, uint64(n), kindData.String())
		if err == nil {
			err = r.check(off, raw, kindData.String())
		}
		if err != nil {
			return nil, err
		}
		j.in, j.out, j.crc = raw, raw, crc32c(raw)
	}
	if !j.sum.known() {
		j.src, j.wantLen = r, blen
	}
	return j, nil
}

// WithBase returns src with each regular file that base holds unchanged
// offered as a BlockSource, so Pack copies its compressed blocks from base
// instead of recompressing it. "Unchanged" is judged as rsync does by
// default: same path, same size and same mtime (to the nanosecond when
// base records nanoseconds, as archives written by Pack do). Use it only
// when files are not rewritten in place with their size and mtime kept.
//
// src must implement iofs.ReadDirFS and iofs.ReadLinkFS, as Pack requires.
func WithBase(src iofs.FS, base *Reader) iofs.FS {
	return &baseFS{src: src, base: base}
}

type baseFS struct {
	src  iofs.FS
	base *Reader
}

func (b *baseFS) ReadDir(name string) ([]iofs.DirEntry, error) { return iofs.ReadDir(b.src, name) }
func (b *baseFS) Lstat(name string) (iofs.FileInfo, error)     { return iofs.Lstat(b.src, name) }
func (b *baseFS) ReadLink(name string) (string, error)         { return iofs.ReadLink(b.src, name) }

func (b *baseFS) Open(name string) (iofs.File, error) {
	f, err := b.src.Open(name)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil || !fi.Mode().IsRegular() {
		return f, nil
	}
	a, err := b.base.resolve("open", name, false)
	if err != nil || !a.Mode.IsRegular() || a.Size != fi.Size() {
		return f, nil
	}
	mt := fi.ModTime()
	if !b.base.Checksummed() || (b.base.tr != nil && len(b.base.tr.mtimeNs) == 0) {
		mt = mt.Truncate(1e9)
	}
	if !a.Mtime.Equal(mt) {
		return f, nil
	}
	return &baseFile{File: f, r: b.base, ino: a.Ino}, nil
}

type baseFile struct {
	iofs.File
	r   *Reader
	ino Inode
}

func (f *baseFile) ArchiveSource() (*Reader, Inode, bool) { return f.r, f.ino, true }

// unwrap gives the file underneath, so a local file is still read with
// pread and hole detection when its blocks cannot be reused.
func (f *baseFile) unwrap() iofs.File { return f.File }

// oldFragment names a fragment block of an earlier archive.
type oldFragment struct {
	r   *Reader
	idx int
}

// fragmentLive is the share of an earlier fragment block that must still
// be in use for the block to be copied whole; below it, the live files'
// bytes are repacked so stale bytes do not pile up snapshot after snapshot.
const fragmentLive = 0.75

// reuseFragment points a small file at a copy of the fragment block that
// holds it in the earlier archive, copying the block (compressed, checked)
// the first time, if enough of that block is still in use.
func (d *dataWriter) reuseFragment(n *node, fd *fileData, r *Reader, l *fileLayout) (bool, error) {
	key := oldFragment{r, l.frag}
	if idx, ok := d.adopted[key]; ok {
		return true, d.adoptTail(n, fd, r, l, idx)
	}
	if d.p.liveFrag == nil {
		if err := d.p.scanFragments(d.ctx); err != nil {
			return false, err
		}
	}
	used := r.fragmentUse()
	if l.frag >= len(used) || float64(d.p.liveFrag[key]) < fragmentLive*float64(used[l.frag]) {
		return false, nil
	}
	f, err := r.fragAt(uint32(l.frag))
	if err != nil {
		return true, fmt.Errorf("reuse %s: %w", n.path, err)
	}
	flen := f.word &^ dataUncompBit
	var j *job
	if d.p.opts.Segment {
		crc, err := r.crcAt(f.start, flen, kindFragment.String())
		if err != nil {
			return true, fmt.Errorf("reuse %s: %w", n.path, err)
		}
		j = &job{kind: jobRawFragment, word: f.word, crc: crc, baseOff: -1, copyFrom: r, copyOff: f.start, copyLen: flen}
	} else {
		raw, err := r.readAt(f.start, uint64(flen), kindFragment.String())
		if err == nil {
			err = r.check(f.start, raw, kindFragment.String())
		}
		if err != nil {
			return true, fmt.Errorf("reuse %s: %w", n.path, err)
		}
		j = &job{kind: jobRawFragment, in: raw, out: raw, word: f.word, crc: crc32c(raw), baseOff: -1}
		if d.p.base != nil && r == d.p.base.r {
			j.baseOff = int64(f.start)
		}
	}
	idx := d.nfrags
	d.nfrags++
	d.adopted[key] = idx
	j.frag = idx
	if err := d.submit(j); err != nil {
		return true, err
	}
	return true, d.adoptTail(n, fd, r, l, idx)
}

// adoptTail points a small file at its tail in a fragment block taken
// over from r (as fragment idx of the new archive).
func (d *dataWriter) adoptTail(n *node, fd *fileData, r *Reader, l *fileLayout, idx uint32) error {
	fd.frag, fd.fragOff = idx, l.fragOff
	fd.reusedBytes += n.size
	d.p.res.ReusedBytes += n.size
	if fd.sumSet {
		return nil
	}
	// r records no sum for it: learn it from the bytes (the block is
	// decompressed once and cached), so the new archive does.
	buf := make([]byte, n.size)
	if _, err := r.readLayout(l, buf, 0); err != nil && err != io.EOF {
		return fmt.Errorf("reuse %s: %w", n.path, err)
	}
	fd.sum, fd.sumSet = fileSum(n.size, []sum{chunkSum(buf)}), true
	return nil
}

// fragmentUse returns, per fragment block, how many of its bytes the
// archive's files use (the end of the last tail in it).
func (r *Reader) fragmentUse() []int64 {
	r.fragUseOnce.Do(func() {
		use := make([]int64, r.sb.Fragments)
		inos, _ := r.fileInodes()
		for _, ino := range inos {
			in, err := r.lookupInode(ino)
			if err != nil || in.frag == noFragment || int64(in.frag) >= int64(len(use)) {
				continue
			}
			tail := int64(in.size % uint64(r.bs))
			use[in.frag] = max(use[in.frag], int64(in.fragOff)+tail)
		}
		r.fragUse = use
	})
	return r.fragUse
}

// reusePartial packs a file that is an earlier archive's inode with some
// bytes changed (PartialSource): each block no changed byte falls in, and
// that the inode stores as the same whole block, is copied from that
// archive; the others are read from the file and compressed (or, when the
// base holds them, copied from the base). It reports false, having done
// nothing, when the source does not qualify.
func (d *dataWriter) reusePartial(n *node, fd *fileData, ps PartialSource) (bool, error) {
	p := d.p
	r, ino, changed, ok := ps.PartialArchiveSource()
	if !ok || r == nil || changed == nil || !r.Checksummed() || r.bs != p.bs || r.Compression() != p.opts.Compression {
		return false, nil
	}
	l, err := r.layout(ino)
	if err != nil {
		return false, nil // pack it afresh
	}
	bs := int64(p.bs)
	nblocks := (n.size + bs - 1) / bs
	fd.words = make([]uint32, 0, nblocks)
	fd.chunks = make([]sum, 0, nblocks)
	for i := range nblocks {
		off := i * bs
		k := min(bs, n.size-off)
		// The inode's block i holds the same k bytes if it is a stored
		// block (not in a fragment) of the same length.
		same := i < int64(len(l.words)) && min(bs, l.size-off) == k && !changed(off, k)
		if same {
			w := l.words[i]
			if w == 0 {
				if err := d.submit(&job{kind: jobData, hole: int(k), file: fd}); err != nil {
					return true, err
				}
				continue
			}
			j, err := d.copyJob(r, l.offs[i], w, int(k), fd)
			if err != nil {
				return true, fmt.Errorf("reuse %s: %w", n.path, err)
			}
			fd.reusedBytes += k
			p.res.ReusedBytes += k
			if err := d.submit(j); err != nil {
				return true, err
			}
			continue
		}
		buf := d.in.get()[:k]
		if err := readFull(io.NewSectionReader(ps, off, k), buf, n.path); err != nil {
			d.in.put(buf)
			return true, err
		}
		if err := d.submit(&job{kind: jobData, in: buf, file: fd}); err != nil {
			return true, err
		}
	}
	return true, nil
}
