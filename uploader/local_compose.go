package uploader

import (
	"context"
	"fmt"
	"io"
	"os"
)

var _ Composer = (*Local)(nil)

// CanCompose implements Composer.
func (l *Local) CanCompose() bool { return true }

// PutComposed implements Composer for the ranges the caller does not hold
// at hand (ComposeRange.Unchecked): those bytes are read from the source
// object, the store's own file, the rest from local. Copying gains
// nothing on a local disk otherwise, so without such a range it puts
// local plainly.
func (l *Local) PutComposed(ctx context.Context, key string, local io.ReaderAt, size int64, src ComposeSource, ranges []ComposeRange, opts PutOptions) (ComposeResult, error) {
	if err := CheckComposeArgs(key, size, src, ranges, opts); err != nil {
		return ComposeResult{}, fmt.Errorf("local: put %s: %w", key, err)
	}
	var readers []io.Reader
	var pos, copied int64
	sf := (*os.File)(nil)
	defer func() {
		if sf != nil {
			sf.Close()
		}
	}()
	for _, r := range ranges {
		if !r.Unchecked {
			continue
		}
		if sf == nil {
			f, err := os.Open(l.path(src.Key))
			if err != nil {
				return ComposeResult{}, fmt.Errorf("local: put %s: source %s: %w", key, src.Key, Permanent(notExist(err)))
			}
			sf = f
			st, err := f.Stat()
			if err != nil {
				return ComposeResult{}, fmt.Errorf("local: put %s: %w", key, err)
			}
			if st.Size() != src.Size || fdETag(f, st) != src.ETag {
				return ComposeResult{}, fmt.Errorf("local: put %s: source %s changed: %w", key, src.Key, Permanent(ErrPrecondition))
			}
		}
		if r.Offset > pos {
			readers = append(readers, io.NewSectionReader(local, pos, r.Offset-pos))
		}
		readers = append(readers, io.NewSectionReader(sf, r.SourceOffset, r.Length))
		pos, copied = r.Offset+r.Length, copied+r.Length
	}
	if sf == nil {
		readers = nil
	}
	if pos < size {
		readers = append(readers, io.NewSectionReader(local, pos, size-pos))
	}
	info, err := l.put(ctx, key, io.MultiReader(readers...), size, opts)
	if err != nil {
		return ComposeResult{}, fmt.Errorf("local: put %s: %w", key, err)
	}
	return ComposeResult{ObjectInfo: info, Sent: size - copied, Copied: copied}, nil
}
