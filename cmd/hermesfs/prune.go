package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "prune",
		summary: "delete old snapshots from the store, keeping the newest N",
		usage:   "[flags]",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
