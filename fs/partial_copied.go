package fs

import (
	"bytes"
	"fmt"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"
)

// A copied map against its copied file.
//
// A copy of a running daemon's state dir reads the upper file and its map
// at different moments (rsync copies the file, then the map in its
// subdirectory; cp and tar go in directory order). Blocks the background
// copy brought in between the two are present in the copied map but holes
// (zeros, or written zeros: rsync -a and tar fill holes) in the copied
// file; a write made in between may be in one and not the other. So a map
// that was copied (its self record differs) is never taken at its word:
// every block it calls present is read from the copy and from the lower
// layer, before the mount serves anything, and judged by what the map
// records of changes, which are appended before the change is made:
//
//   - a 16 KiB range the map calls unchanged was not changed before the
//     map was read, so its bytes then were the lower file's: where the
//     copy holds anything else (holes, or a write made after the map was
//     read), the lower bytes are written back into it. That is the file as
//     it was when the map was read, never a byte the user changed before;
//   - a range the map calls changed holds the user's bytes as the copy
//     read them, unless the copy read it before its block came in: then
//     the copy holds zeros where the lower file does not, and the user's
//     bytes may be nowhere. A 512-byte sector of zeros over lower bytes
//     that are not all zeros is the mark of that; it is also what a user's
//     own zeros look like. When the copy gives reason to doubt it (the
//     check above found the file and the map apart, or the map's session
//     was still open: the daemon ran or was killed while it was copied),
//     the mount is refused, naming the file: neither the zeros nor the
//     lower bytes can be vouched for, and guessing either could put
//     wrong bytes into the next snapshot. A map copied after its daemon
//     stopped cleanly, whose unchanged ranges all match, is trusted: the
//     file and the map were both complete then.
//
// The change records count only if they are complete: a session opened
// in an earlier boot and never closed may have lost records in a machine
// crash, and a map that tracks no changes says nothing; then every range
// counts as changed, and any such sector in a present block refuses the
// mount. Each check reads every present block once, at the first mount
// of the copy (the map is then made again for the file, and is no longer
// a copy).

// copySector is the granularity at which a copied file's zeros are
// told from the lower file's bytes: copy tools read in multiples of it.
const copySector = 512

// checkCopied checks the copied file of copied map p (found by name, with
// status st) against the map and the lower layer, repairs the ranges the
// map calls unchanged, and returns an error that refuses the mount when a
// range can be neither the lower file's nor vouched for as the user's.
func (s *partialSet) checkCopied(p *partial, st *ustat, readOnly bool) error {
	if p.broken != nil {
		return s.copiedStateErr(p, "was made from a file that is not in this snapshot ("+p.broken.Error()+"), so the copy cannot be checked against it")
	}
	dir, name := splitRel(p.recName)
	dfd, err := s.ov.u.dir(dir)
	if err != nil {
		return fmt.Errorf("fs: partial copy-up: check %s: %w", p.recName, err)
	}
	mode := unix.O_RDWR
	if readOnly {
		mode = unix.O_RDONLY
	}
	fd, err := unix.Openat(dfd, name, mode|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	s.ov.u.put(dfd)
	if err != nil {
		return fmt.Errorf("fs: partial copy-up: check %s: %w", p.recName, err)
	}
	defer unix.Close(fd)

	unchanged := p.copiedUnchanged()
	end := min(p.lowerEnd(), st.size)
	data, low := make([]byte, p.bs), make([]byte, p.bs)
	var repaired, doubtful int64
	firstDoubt := int64(-1)
	for i := int64(0); i*p.bs < end; i++ {
		if p.present[i/64]&(1<<(i%64)) == 0 {
			continue
		}
		lo, hi := i*p.bs, min((i+1)*p.bs, end)
		n := int(hi - lo)
		if k, err := preadFull(fd, data[:n], lo); err != nil {
			return fmt.Errorf("fs: partial copy-up: check %s: %w", p.recName, err)
		} else if k < n {
			clear(data[k:n])
		}
		if k, err := s.ov.readLower(p.lower, low[:n], lo); k < n {
			return fmt.Errorf("fs: partial copy-up: check %s against the snapshot at %d: %w", p.recName, lo+int64(k), err)
		}
		if bytes.Equal(data[:n], low[:n]) {
			continue
		}
		for a := lo; a < hi; {
			b := min((a/changeBlock+1)*changeBlock, hi)
			d, l := data[a-lo:b-lo], low[a-lo:b-lo]
			switch {
			case bytes.Equal(d, l):
			case unchanged(a, b):
				if readOnly {
					return s.copiedStateErr(p, "does not match the copied file at "+strconv.FormatInt(a, 10)+": mount the copy writable once, which puts the snapshot's bytes back where the map says nothing changed")
				}
				if err := pwriteAll(fd, l, a); err != nil {
					return fmt.Errorf("fs: partial copy-up: repair %s: %w", p.recName, err)
				}
				repaired += b - a
			default:
				for x := a; x < b; x = min((x/copySector+1)*copySector, b) {
					y := min((x/copySector+1)*copySector, b)
					if allZero(d[x-a:y-a]) && !allZero(l[x-a:y-a]) {
						doubtful++
						if firstDoubt < 0 {
							firstDoubt = x
						}
					}
				}
			}
			a = b
		}
	}
	if repaired > 0 {
		// The repair is no change of the file: its times stay.
		futimens(fd, []unix.Timespec{st.atime, st.mtime})
		if err := unix.Fdatasync(fd); err != nil {
			return fmt.Errorf("fs: partial copy-up: repair %s: %w", p.recName, err)
		}
		s.ov.log.Warn("partial copy-up: the state dir was copied while the file was being copied in; ranges the copy holds wrongly are the snapshot's again",
			"path", p.recName, "bytes", repaired)
	}
	if doubtful > 0 && (repaired > 0 || !p.loaded.closed) {
		return s.copiedDoubtErr(p, doubtful, firstDoubt)
	}
	return nil
}

// copiedUnchanged says, for copied map p as loaded, whether its records
// vouch that [a, b) was not changed before the map was copied.
func (p *partial) copiedUnchanged() func(a, b int64) bool {
	c, l := &p.changes, &p.loaded
	trusted := c.tracks && (l.closed || l.sessOpen && l.sessThisBoot)
	limit := min(c.cut, p.limit, p.lowerSize)
	return func(a, b int64) bool {
		if !trusted || b > limit {
			return false
		}
		for u := a / changeBlock; u*changeBlock < b; u++ {
			if c.isSet(u) {
				return false
			}
		}
		return true
	}
}

// copiedDoubtErr is the error that stops a mount on a copied file whose
// bytes the copy cannot vouch for.
func (s *partialSet) copiedDoubtErr(p *partial, sectors, first int64) error {
	mp := filepath.Join(s.ov.u.path, partialDirName, p.name)
	return fmt.Errorf("the state dir was copied (cp -a, rsync -a, a restore) while hermesfs was copying %q in from the snapshot, and the copy cannot tell its bytes: "+
		"%d sectors of 512 bytes (the first at byte %d) are zeros in the copy where the snapshot has data, in ranges the file's map says were changed; "+
		"they may be the file's own zeros or blocks the copy read before they were copied in, so it is not mounted rather than guess. "+
		"Copy the state dir again from the original while its daemon is stopped (hermesfs umount), or once `hermesfs status` lists no partial copy-ups; "+
		"or give up that file's changes since the snapshot: remove the file and its map %s", p.recName, sectors, first, mp)
}
