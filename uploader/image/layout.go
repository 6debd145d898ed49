package image

import (
	"context"
	"fmt"
	"os"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
)

// MostlyDead is the share of a segment's bytes an image must use for the
// image to keep using it; below it, the image takes a copy of what it uses
// into its own segment (see LayOut).
const MostlyDead = 0.25

// LayOut turns a segment pack's runs into the image's extents: new bytes
// are ranges of the new segment (Key ""), copies are ranges of the
// segments of the image they were copied from (sources, by the archive
// reader the packer copied from).
//
// What the image would take from a segment of which it uses less than a
// quarter (mostly dead: the blocks of files changed or deleted since), or
// from a segment of the other kind than this snapshot's encryption, is
// copied into the new segment instead (appended to the file out): the old
// segment then goes once the snapshots that still need it are pruned, so
// garbage in the store stays bounded, and an encrypted snapshot never
// points at plaintext. The second result is the bytes so copied.
func LayOut(ctx context.Context, runs []archive.Run, out string, sources map[*archive.Reader]*Image, encrypting bool) ([]uploader.Extent, int64, error) {
	return layOut(ctx, runs, out, sources, encrypting, MostlyDead)
}

// layOut is LayOut copying from segments the image uses less than
// rewrite of.
func layOut(ctx context.Context, runs []archive.Run, out string, sources map[*archive.Reader]*Image, encrypting bool, rewrite float64) ([]uploader.Extent, int64, error) {
	type piece struct {
		x   uploader.Extent
		src *Image
		off int64 // in the source image
	}
	var pieces []piece
	live := map[string]int64{}
	var segLen int64
	for _, r := range runs {
		if r.Source == nil {
			pieces = append(pieces, piece{x: uploader.Extent{Offset: r.Offset, Length: r.Length}})
			segLen = max(segLen, r.Offset+r.Length)
			continue
		}
		src := sources[r.Source]
		if src == nil {
			return nil, 0, fmt.Errorf("internal error: the pack copied %d bytes from an archive that is none of the source images", r.Length)
		}
		at := r.Offset
		for _, x := range src.Extents().Slice(r.Offset, r.Length) {
			pieces = append(pieces, piece{x: x, src: src, off: at})
			live[x.Key] += x.Length
			at += x.Length
		}
	}
	size, enc := map[string]int64{}, map[string]bool{}
	for _, o := range sources {
		m := o.Manifest()
		if m.Segmented() {
			for _, s := range m.Segments {
				size[s.Key], enc[s.Key] = s.Size, m.Encryption != nil
			}
		} else {
			size[m.Archive], enc[m.Archive] = m.Size, m.Encryption != nil
		}
	}
	copyOut := func(key string) bool {
		return enc[key] != encrypting || float64(live[key]) < rewrite*float64(size[key])
	}
	var (
		f       *os.File
		copied  int64
		buf     []byte
		extents []uploader.Extent
	)
	for _, p := range pieces {
		if p.src == nil || !copyOut(p.x.Key) {
			extents = append(extents, p.x)
			continue
		}
		if f == nil {
			var err error
			if f, err = os.OpenFile(out, os.O_WRONLY|os.O_APPEND, 0); err != nil {
				return nil, 0, err
			}
			defer f.Close()
			buf = make([]byte, 4<<20)
		}
		for done := int64(0); done < p.x.Length; {
			if err := ctx.Err(); err != nil {
				return nil, 0, err
			}
			n := min(int64(len(buf)), p.x.Length-done)
			if _, err := p.src.ReadAt(buf[:n], p.off+done); err != nil {
				return nil, 0, fmt.Errorf("copy %d bytes of segment %s into the new one: %w", n, p.x.Key, err)
			}
			if _, err := f.Write(buf[:n]); err != nil {
				return nil, 0, err
			}
			done += n
		}
		extents = append(extents, uploader.Extent{Offset: segLen + copied, Length: p.x.Length})
		copied += p.x.Length
	}
	if f != nil {
		if err := f.Sync(); err != nil {
			return nil, 0, err
		}
	}
	return extents, copied, nil
}
