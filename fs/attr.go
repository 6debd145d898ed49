package fs

import (
	iofs "io/fs"

	"github.com/hanwen/go-fuse/v2/fuse"

	"github.com/hermesfs/hermesfs/archive"
)

// FillArchiveAttr fills a with the attributes of an archive entry as the
// overlay shows an entry of its lower layer (fs/browse shows every
// snapshot's entries the same way).
func FillArchiveAttr(a *fuse.Attr, la *archive.Attr) { fillLowerAttr(a, la) }

// UnixMode converts an io/fs mode to st_mode bits.
func UnixMode(m iofs.FileMode) uint32 { return fileModeToUnix(m) }
