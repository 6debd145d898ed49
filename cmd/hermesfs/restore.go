package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "restore",
		summary: "download, verify and extract a snapshot into a directory",
		usage:   "[flags] DIR",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
