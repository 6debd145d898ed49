package main

import (
	"context"
	"errors"
	"flag"
)

func init() {
	register(&command{
		name:    "pack",
		summary: "pack a directory tree into a squashfs archive",
		usage:   "[flags] DIR FILE",
		run: func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
			return errors.New("not implemented yet")
		},
	})
}
