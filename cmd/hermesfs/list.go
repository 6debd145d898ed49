package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "list",
		summary: "list the snapshots in the store",
		usage:   "[flags]",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
