package uploader

import (
	"errors"
	"fmt"
	iofs "io/fs"
	"os"
	"path/filepath"
)

// OpenLocal returns the store in the existing directory root. Unlike
// NewLocal it creates nothing: commands that only read use it, so a
// mistyped path is reported instead of becoming a new empty store. A
// missing directory satisfies errors.Is(err, io/fs.ErrNotExist).
func OpenLocal(root string) (*Local, error) {
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("local store %s: %w", root, err)
	}
	st, err := os.Stat(abs)
	switch {
	case errors.Is(err, iofs.ErrNotExist):
		return nil, noStoreError(abs)
	case err != nil:
		return nil, fmt.Errorf("local store: %w", err)
	case !st.IsDir():
		return nil, fmt.Errorf("local store %s: not a directory", abs)
	}
	return &Local{root: abs}, nil
}

// noStoreError is a local store directory that does not exist.
type noStoreError string

func (e noStoreError) Error() string {
	return fmt.Sprintf("no store at %s: the directory does not exist (nothing was published there; check --store or HERMESFS_STORE)", string(e))
}

func (e noStoreError) Is(target error) bool { return target == iofs.ErrNotExist }
