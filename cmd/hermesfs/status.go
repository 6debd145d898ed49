package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "status",
		summary: "show a mount's state: base snapshot, dirty data, last snapshot, errors",
		usage:   "[flags] [MOUNTPOINT]",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
