package archive

import (
	"path"
	"slices"
	"sort"
)

// Mapping between an archive's bytes and its files' bytes.
//
// A lazily read archive is fetched in fixed-size chunks of its bytes; a
// session records which chunks it read first (the hot set). Those chunk
// indexes mean something only in the archive they were read from: the next
// archive of the same tree puts changed files elsewhere. ChunkFiles turns
// chunks of one archive into the file bytes they hold, and FileChunks turns
// file bytes into the chunks of another archive that hold them.

// Extent is where some of a regular file's data is stored: the stored
// block at archive bytes [At, At+Size) holds file bytes [Off, Off+Len).
// A block is read (and checked, and decompressed) whole, so the extent is
// the whole block, even a fragment block shared with other files' tails.
type Extent struct {
	At, Size int64
	Off, Len int64
}

// FileRange is a byte range of a regular file, named by its io/fs path in
// an archive (see FS).
type FileRange struct {
	Path     string
	Off, Len int64
}

// Extents returns where the data of regular file ino is stored, in file
// order: one extent per data block, then the fragment block holding its
// tail, if any. Sparse blocks (runs of zeros not stored) have none.
func (r *Reader) Extents(ino Inode) ([]Extent, error) {
	l, err := r.layout(ino)
	if err != nil {
		return nil, err
	}
	return r.extents(l, 0, l.size), nil
}

// extents lists l's extents that hold any of file bytes [off, end).
func (r *Reader) extents(l *fileLayout, off, end int64) []Extent {
	end = min(end, l.size)
	if off < 0 {
		off = 0
	}
	if off >= end {
		return nil
	}
	bs := int64(r.bs)
	var out []Extent
	last := (end - 1) / bs
	for i := off / bs; i <= last && i < int64(len(l.words)); i++ {
		if w := l.words[i]; w != 0 {
			out = append(out, Extent{At: int64(l.offs[i]), Size: int64(w &^ dataUncompBit), Off: i * bs, Len: min(bs, l.size-i*bs)})
		}
	}
	if l.frag >= 0 && last >= int64(len(l.words)) {
		f, err := r.fragAt(uint32(l.frag))
		if err != nil {
			return out
		}
		at := int64(len(l.words)) * bs
		out = append(out, Extent{At: int64(f.start), Size: int64(f.word &^ dataUncompBit), Off: at, Len: l.size - at})
	}
	return out
}

// filePaths returns a path for each regular file inode: the first one
// found walking the tree breadth first (a hard-linked file has several).
// Damage ends the walk: the files found so far are returned.
func (r *Reader) filePaths() map[Inode]string {
	paths := map[Inode]string{}
	dirs := map[Inode]string{r.root: "."}
	r.walk(false, func(dir Inode, ents []DirEntry, _ []uint64) error {
		for _, e := range ents {
			p := path.Join(dirs[dir], e.Name)
			switch {
			case e.Mode.IsDir():
				dirs[e.Ino] = p
			case e.Mode.IsRegular():
				if _, ok := paths[e.Ino]; !ok {
					paths[e.Ino] = p
				}
			}
		}
		delete(dirs, dir)
		return nil
	})
	return paths
}

// ChunkFiles returns the file bytes held by the given chunks of r's
// archive (chunk i is archive bytes [i*chunkSize, (i+1)*chunkSize)), in
// the chunks' order: for each chunk, the bytes of every stored block that
// overlaps it, in archive order, each block once. Adjacent ranges of one
// file are merged. Chunks holding only metadata give nothing. Files whose
// layout is damaged are left out.
func ChunkFiles(r *Reader, chunkSize int64, chunks []int64) []FileRange {
	if chunkSize <= 0 || len(chunks) == 0 {
		return nil
	}
	type span struct {
		at, end  int64
		path     string
		off, len int64
		frag     int // fragment block index (its tails are in tails), or -1
	}
	var spans []span
	type tail struct {
		fr FileRange
		at uint32 // where it lies in the fragment block
	}
	tails := map[int][]tail{}
	paths := r.filePaths()
	inos := make([]Inode, 0, len(paths))
	for ino := range paths {
		inos = append(inos, ino)
	}
	slices.Sort(inos)
	fragAt := map[int]bool{}
	for _, ino := range inos {
		in, err := r.lookupInode(ino)
		if err != nil {
			continue
		}
		l, err := r.decodeLayout(in)
		if err != nil {
			continue
		}
		for _, e := range r.extents(l, 0, l.size) {
			if e.Off >= int64(len(l.words))*int64(r.bs) { // the tail, in a fragment
				tails[l.frag] = append(tails[l.frag], tail{FileRange{Path: paths[ino], Off: e.Off, Len: e.Len}, l.fragOff})
				if !fragAt[l.frag] {
					fragAt[l.frag] = true
					spans = append(spans, span{at: e.At, end: e.At + e.Size, frag: l.frag})
				}
				continue
			}
			spans = append(spans, span{at: e.At, end: e.At + e.Size, path: paths[ino], off: e.Off, len: e.Len, frag: -1})
		}
	}
	for _, t := range tails { // in the order they lie in the block
		sort.SliceStable(t, func(a, b int) bool { return t[a].at < t[b].at })
	}
	sort.SliceStable(spans, func(a, b int) bool { return spans[a].at < spans[b].at })

	var out []FileRange
	add := func(fr FileRange) {
		if n := len(out); n > 0 && out[n-1].Path == fr.Path && out[n-1].Off+out[n-1].Len == fr.Off {
			out[n-1].Len += fr.Len
			return
		}
		out = append(out, fr)
	}
	maxSpan := int64(r.bs) // a stored block is at most one block long
	done := make([]bool, len(spans))
	for _, c := range chunks {
		if c < 0 {
			continue
		}
		from, to := c*chunkSize, (c+1)*chunkSize
		i := sort.Search(len(spans), func(i int) bool { return spans[i].at >= from-maxSpan })
		for ; i < len(spans) && spans[i].at < to; i++ {
			s := spans[i]
			if s.end <= from || done[i] {
				continue
			}
			done[i] = true
			if s.frag < 0 {
				add(FileRange{Path: s.path, Off: s.off, Len: s.len})
				continue
			}
			for _, t := range tails[s.frag] {
				add(t.fr)
			}
		}
	}
	return out
}

// FileChunks returns the chunks of r's archive (chunk i is archive bytes
// [i*chunkSize, (i+1)*chunkSize)) holding the given file bytes, in the
// ranges' order, each once, at most max of them (max <= 0: no bound).
// Every stored block holding any of a range's bytes counts whole. Ranges
// of paths that are not regular files in r are skipped, and bytes past a
// file's end.
func FileChunks(r *Reader, chunkSize int64, ranges []FileRange, max int) []int64 {
	if chunkSize <= 0 {
		return nil
	}
	var out []int64
	seen := map[int64]bool{}
	for _, fr := range ranges {
		if fr.Len <= 0 {
			continue
		}
		a, err := r.resolve("map", fr.Path, false)
		if err != nil || !a.Mode.IsRegular() {
			continue
		}
		l, err := r.layout(a.Ino)
		if err != nil {
			continue
		}
		for _, e := range r.extents(l, fr.Off, fr.Off+fr.Len) {
			for c := e.At / chunkSize; c <= (e.At+e.Size-1)/chunkSize; c++ {
				if seen[c] {
					continue
				}
				if max > 0 && len(out) >= max {
					return out
				}
				seen[c] = true
				out = append(out, c)
			}
		}
	}
	return out
}
