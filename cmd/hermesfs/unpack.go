package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "unpack",
		summary: "extract a squashfs archive into a directory",
		usage:   "[flags] FILE DIR",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
