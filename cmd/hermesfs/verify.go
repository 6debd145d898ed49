package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "verify",
		summary: "check every block of an archive (a file or a snapshot id)",
		usage:   "[flags] FILE|ID",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
