package daemon

import (
	"github.com/hermesfs/hermesfs/fs"
)

// partialCopyUps lists the mount's partial files, if it can say.
func partialCopyUps(ov overlay) []fs.PartialCopyUp {
	if p, ok := ov.(interface{ PartialCopyUps() []fs.PartialCopyUp }); ok {
		return p.PartialCopyUps()
	}
	return nil
}

// partialCopyUpsOf reports m's partial copy-ups to the metrics: how many,
// and the bytes copied into them so far.
func partialCopyUpsOf(m *fs.Mounted) func() (partialCopyUpStats, bool) {
	return func() (partialCopyUpStats, bool) {
		var s partialCopyUpStats
		for _, p := range m.PartialCopyUps() {
			s.InProgress++
			s.Bytes += p.Present
		}
		return s, true
	}
}
