package daemon

import (
	"errors"
	"os"

	"github.com/hermesfs/hermesfs/archive"
)

// archiveError gives archive damage its exit status.
func archiveError(err error) error {
	if errors.Is(err, archive.ErrCorrupt) {
		return withCode(exitCorrupt, err)
	}
	return err
}

// openArchive opens the archive file at path (opts.Name defaults to path).
// The caller closes the file once done with the reader; a corrupt archive
// carries the exit code exitCorrupt.
func openArchive(path string, opts archive.ReaderOptions) (*archive.Reader, *os.File, error) {
	f, err := os.Open(path)
	if lr, ok := lazyLookup(path); ok && errors.Is(err, os.ErrNotExist) {
		// A base still being fetched: read through its lazy reader.
		if opts.Name == "" {
			opts.Name = path
		}
		r, err := archive.Open(lr, lr.Size(), opts)
		if err != nil {
			return nil, nil, archiveError(err)
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
		return nil, nil, archiveError(err)
	}
	return r, f, nil
}
