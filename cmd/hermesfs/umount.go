package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "umount",
		summary: "take a final snapshot, then unmount",
		usage:   "[flags] MOUNTPOINT",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
