package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "snapshot",
		summary: "take a snapshot of a running mount now and print its id",
		usage:   "[flags] MOUNTPOINT",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
