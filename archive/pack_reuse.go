package archive

import (
	"fmt"
	"io"
	iofs "io/fs"
)

// reuseKey identifies content in an earlier archive by where it lives: two
// inodes with the same blocks (deduplicated copies) have the same content.
type reuseKey struct {
	r              *Reader
	frag, fragOff  uint32
	size           int64
	nblocks, first uint64
}

// reuse copies the compressed blocks of a file that an earlier archive
// holds, checking each against that archive's checksums. It reports false
// when the archive does not qualify, and the file is then read as usual.
func (d *dataWriter) reuse(n *node, fd *fileData, src BlockSource) (bool, error) {
	p := d.p
	r, ino, ok := src.ArchiveSource()
	if !ok || r == nil || !r.Checksummed() || r.bs != p.bs || r.Compression() != p.opts.Compression {
		return false, nil
	}
	a, err := r.Stat(ino)
	if err != nil || !a.Mode.IsRegular() || a.Size != n.size {
		return false, nil
	}
	l, err := r.layout(ino)
	if err != nil {
		return false, nil
	}
	key := reuseKey{r: r, size: l.size, frag: noFragment, nblocks: uint64(len(l.offs))}
	if len(l.offs) > 0 {
		key.first = l.offs[0]
	}
	if l.frag >= 0 {
		key.frag, key.fragOff = uint32(l.frag), l.fragOff
	}
	if d.reused == nil {
		d.reused = map[reuseKey]*fileData{}
	}
	if prior := d.reused[key]; prior != nil {
		n.file = prior
		return true, nil
	}
	d.reused[key] = fd

	bs := int64(p.bs)
	if n.size < bs {
		if l.frag >= 0 {
			if ok, err := d.reuseFragment(n, fd, r, l); ok || err != nil {
				return true, err
			}
		}
		// Take the bytes (checked and decompressed by the reader) into the
		// new fragments.
		buf, idx, off, err := d.fragmentSpace(int(n.size))
		if err != nil {
			return true, err
		}
		if _, err := r.readLayout(l, buf, 0); err != nil && err != io.EOF {
			return true, fmt.Errorf("reuse %s: %w", n.path, err)
		}
		fd.frag, fd.fragOff = idx, off
		return true, nil
	}
	nblocks := (n.size + bs - 1) / bs
	fd.words = make([]uint32, 0, nblocks)
	for i, w := range l.words {
		blen := min(bs, n.size-int64(i)*bs)
		if w == 0 {
			if err := d.submit(&job{kind: jobData, hole: int(blen), file: fd}); err != nil {
				return true, err
			}
			continue
		}
		raw, err := r.readAt(l.offs[i], uint64(w&^dataUncompBit), kindData.String())
		if err == nil {
			err = r.check(l.offs[i], raw, kindData.String())
		}
		if err != nil {
			return true, fmt.Errorf("reuse %s: %w", n.path, err)
		}
		j := &job{kind: jobRaw, in: raw, out: raw, file: fd, word: w, crc: crc32c(raw)}
		if err := d.submit(j); err != nil {
			return true, err
		}
		p.res.ReusedBytes += blen
	}
	if l.frag >= 0 {
		// The earlier archive packed this file's tail into a fragment
		// (mksquashfs -always-use-fragments); here it is a short block.
		off := int64(len(l.words)) * bs
		buf := d.in.get()[:n.size-off]
		if _, err := r.readLayout(l, buf, off); err != nil && err != io.EOF {
			d.in.put(buf)
			return true, fmt.Errorf("reuse %s: %w", n.path, err)
		}
		if err := d.submit(&job{kind: jobData, in: buf, file: fd}); err != nil {
			return true, err
		}
	}
	return true, nil
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
	if b.base.tr == nil || len(b.base.tr.mtimeNs) == 0 {
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
		fd.frag, fd.fragOff = idx, l.fragOff
		d.p.res.ReusedBytes += n.size
		return true, nil
	}
	if !d.scanned {
		if err := d.scanFragments(); err != nil {
			return false, err
		}
	}
	used := r.fragmentUse()
	if l.frag >= len(used) || float64(d.liveFrag[key]) < fragmentLive*float64(used[l.frag]) {
		return false, nil
	}
	f := r.frags[l.frag]
	raw, err := r.readAt(f.start, uint64(f.word&^dataUncompBit), kindFragment.String())
	if err == nil {
		err = r.check(f.start, raw, kindFragment.String())
	}
	if err != nil {
		return true, fmt.Errorf("reuse %s: %w", n.path, err)
	}
	idx := d.nfrags
	d.nfrags++
	if d.adopted == nil {
		d.adopted = map[oldFragment]uint32{}
	}
	d.adopted[key] = idx
	j := &job{kind: jobRawFragment, in: raw, out: raw, frag: idx, word: f.word, crc: crc32c(raw)}
	if err := d.submit(j); err != nil {
		return true, err
	}
	fd.frag, fd.fragOff = idx, l.fragOff
	d.p.res.ReusedBytes += n.size
	return true, nil
}

// scanFragments learns, once per pack and only when some file turns out to
// come from an earlier archive, how many bytes of each earlier fragment
// block the files still to be packed use. It opens each small file once.
func (d *dataWriter) scanFragments() error {
	d.scanned = true
	d.liveFrag = map[oldFragment]int64{}
	bs := int64(d.p.bs)
	for _, n := range d.p.order {
		if n.size == 0 || n.size >= bs {
			continue
		}
		if err := d.ctx.Err(); err != nil {
			return err
		}
		f, err := d.p.src.Open(n.path)
		if err != nil {
			continue // reported when the file itself is packed
		}
		if bsrc, ok := f.(BlockSource); ok {
			if r, ino, ok := bsrc.ArchiveSource(); ok && r != nil {
				if l, err := r.layout(ino); err == nil && l.frag >= 0 && l.size == n.size {
					d.liveFrag[oldFragment{r, l.frag}] += n.size
				}
			}
		}
		f.Close()
	}
	return nil
}

// fragmentUse returns, per fragment block, how many of its bytes the
// archive's files use (the end of the last tail in it).
func (r *Reader) fragmentUse() []int64 {
	r.fragUseOnce.Do(func() {
		use := make([]int64, len(r.frags))
		seen := map[Inode]bool{}
		for _, e := range r.entries {
			if !e.Mode.IsRegular() || seen[e.Ino] {
				continue
			}
			seen[e.Ino] = true
			in, err := r.lookupInode(e.Ino)
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
