package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "mount",
		summary: "mount the home directory and keep it snapshotted to the store",
		usage:   "[flags] MOUNTPOINT",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
