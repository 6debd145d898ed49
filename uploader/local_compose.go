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
// objects, the store's own files, the rest from local. Copying gains
// nothing on a local disk otherwise, so without such a range it puts
// local plainly.
func (l *Local) PutComposed(ctx context.Context, key string, local io.ReaderAt, size int64, src ComposeSource, ranges []ComposeRange, opts PutOptions) (ComposeResult, error) {
	if err := CheckComposeArgs(key, size, src, ranges, opts); err != nil {
		return ComposeResult{}, fmt.Errorf("local: put %s: %w", key, err)
	}
	var readers []io.Reader
	var pos, copied int64
	open := map[string]*os.File{}
	defer func() {
		for _, f := range open {
			f.Close()
		}
	}()
	source := func(s ComposeSource) (*os.File, error) {
		if f := open[s.Key]; f != nil {
			return f, nil
		}
		f, err := os.Open(l.path(s.Key))
		if err != nil {
			return nil, fmt.Errorf("source %s: %w", s.Key, Permanent(notExist(err)))
		}
		open[s.Key] = f
		st, err := f.Stat()
		if err != nil {
			return nil, err
		}
		if st.Size() != s.Size || s.ETag != "" && fdETag(f, st) != s.ETag {
			return nil, fmt.Errorf("source %s changed: %w", s.Key, Permanent(ErrPrecondition))
		}
		return f, nil
	}
	for _, r := range ranges {
		if !r.Unchecked {
			continue
		}
		sf, err := source(r.SourceOf(src))
		if err != nil {
			return ComposeResult{}, fmt.Errorf("local: put %s: %w", key, err)
		}
		if r.Offset > pos {
			readers = append(readers, io.NewSectionReader(local, pos, r.Offset-pos))
		}
		readers = append(readers, io.NewSectionReader(sf, r.SourceOffset, r.Length))
		pos, copied = r.Offset+r.Length, copied+r.Length
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
