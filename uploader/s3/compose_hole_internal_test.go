package s3

import (
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// Parts copied from an Unchecked range keep the mark; nothing else has it.
func TestPlanPartsUnchecked(t *testing.T) {
	const mib = 1 << 20
	ranges := []uploader.ComposeRange{
		{Offset: 96, SourceOffset: 96, Length: 64<<10 - 96},
		{Offset: 64 << 10, SourceOffset: 64 << 10, Length: 20 * mib, Unchecked: true},
		{Offset: 64<<10 + 20*mib, SourceOffset: 64<<10 + 20*mib, Length: 1000},
	}
	parts, _, copied := planParts(21*mib, ranges, 5*mib, 5*mib)
	if copied == 0 {
		t.Fatal("nothing copied")
	}
	for _, p := range parts {
		inHole := p.off >= 64<<10 && p.off+p.n <= 64<<10+20*mib
		if p.unchecked && (!p.copy || !inHole) {
			t.Errorf("part %+v marked unchecked", p)
		}
		if p.copy && inHole && !p.unchecked {
			t.Errorf("part %+v copied from the unchecked range but not marked", p)
		}
	}
}
