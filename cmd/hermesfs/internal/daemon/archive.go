package daemon

import (
	"errors"
	"os"

	"github.com/hermesfs/hermesfs/archive"
)

// ArchiveError gives archive damage its exit status.
func ArchiveError(err error) error {
	if errors.Is(err, archive.ErrCorrupt) {
		return withCode(exitCorrupt, err)
	}
	return err
}

// OpenArchive opens the archive file at path (opts.Name defaults to path).
// The caller closes the file once done with the reader; a corrupt archive
// carries the exit code exitCorrupt.
func OpenArchive(path string, opts archive.ReaderOptions) (*archive.Reader, *os.File, error) {
	f, err := os.Open(path)
	if lr, ok := lazyLookup(path); ok && errors.Is(err, os.ErrNotExist) {
		// A base still being fetched: read through its lazy reader.
		if opts.Name == "" {
			opts.Name = path
		}
		r, err := archive.Open(lr, lr.Size(), opts)
		if err != nil {
			return nil, nil, ArchiveError(err)
		}
		return r, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if opts.Name == "" {
		opts.Name = path
	}
	r, err := archive.Open(f, fi.Size(), opts)
	if err != nil {
		f.Close()
		return nil, nil, ArchiveError(err)
	}
	return r, f, nil
}
