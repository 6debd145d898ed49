package main

import (
	"context"
	"flag"
	"fmt"
)

// verifySnapshot verifies the snapshot with the given id in the store named by
// the command's store flags: the manifest's size and sha256, then every block.
// `hermesfs verify` calls it when its argument is not an existing file.
func verifySnapshot(ctx context.Context, e *env, fs *flag.FlagSet, id string) error {
	return fmt.Errorf("%s: no such file, and verifying snapshots in a store is not implemented yet", id)
}
