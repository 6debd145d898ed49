package s3

import (
	"math/rand/v2"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// The parts of a composed put tile the object, every part but the last is
// at least the minimum, and every copied part lies inside a copy range at
// the source offset that range gives.
func TestPlanParts(t *testing.T) {
	const minPart, partSize = 100, 250
	rng := rand.New(rand.NewPCG(3, 4))
	for round := range 2000 {
		size := int64(1 + rng.IntN(5000))
		var ranges []uploader.ComposeRange
		for pos := int64(rng.IntN(300)); pos < size; {
			n := int64(1 + rng.IntN(600))
			if pos+n > size {
				n = size - pos
			}
			ranges = append(ranges, uploader.ComposeRange{Offset: pos, SourceOffset: int64(rng.IntN(10000)), Length: n})
			pos += n + int64(rng.IntN(200))
		}
		parts, sent, copied := planParts(size, ranges, minPart, partSize)
		var pos int64
		for i, p := range parts {
			if p.off != pos || p.n <= 0 {
				t.Fatalf("round %d: part %d %+v does not continue at %d", round, i, p, pos)
			}
			if i < len(parts)-1 && p.n < minPart {
				t.Fatalf("round %d: part %d of %d bytes is not the last", round, i, p.n)
			}
			if !p.copy && p.n >= 2*partSize {
				t.Fatalf("round %d: sent part of %d bytes", round, p.n)
			}
			if p.copy {
				in := false
				for _, r := range ranges {
					if p.off >= r.Offset && p.off+p.n <= r.Offset+r.Length && p.src == r.SourceOffset+(p.off-r.Offset) {
						in = true
					}
				}
				if !in {
					t.Fatalf("round %d: copied part %+v is not inside a copy range %+v", round, p, ranges)
				}
			}
			pos += p.n
		}
		if pos != size || sent+copied != size {
			t.Fatalf("round %d: parts cover %d of %d bytes (sent %d, copied %d)", round, pos, size, sent, copied)
		}
		// A range long enough to keep a part's worth after lending the
		// gap before it what it lacks is copied.
		var want int64
		prev := int64(0)
		for _, r := range ranges {
			if r.Length >= 2*minPart && r.Offset-prev >= minPart {
				want = 1
			}
			prev = r.Offset + r.Length
		}
		if want > 0 && copied == 0 {
			t.Fatalf("round %d: nothing copied from %+v", round, ranges)
		}
	}
}

// A short gap between two copies takes what it lacks from the end of the
// copy before it when the copy after it cannot spare it.
func TestPlanPartsWidensFromBefore(t *testing.T) {
	ranges := []uploader.ComposeRange{{Offset: 0, SourceOffset: 1000, Length: 250}, {Offset: 260, SourceOffset: 2000, Length: 120}}
	parts, sent, copied := planParts(400, ranges, 100, 250)
	want := []composedPart{{off: 0, n: 160, copy: true, src: 1000}, {off: 160, n: 100}, {off: 260, n: 120, copy: true, src: 2000}, {off: 380, n: 20}}
	if len(parts) != len(want) || sent != 120 || copied != 280 {
		t.Fatalf("parts %+v (sent %d, copied %d), want %+v", parts, sent, copied, want)
	}
	for i := range want {
		if parts[i] != want[i] {
			t.Fatalf("parts %+v, want %+v", parts, want)
		}
	}
}
