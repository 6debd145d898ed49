package main

import (
	"context"
	"flag"
	"fmt"
	"time"

	"github.com/hermesfs/hermesfs/uploader/crypt"
)

func init() {
	register(&command{
		name:    "keygen",
		summary: "create an age key for encrypted snapshots",
		usage:   "FILE",
		help: `Creates an age X25519 key in FILE (which must not exist), readable by its
owner only, in the format age-keygen writes, and prints its public key: the
recipient to give to 'mount --encrypt-to'. The file is the identity for
'mount', 'restore', 'verify' and 'unpack' (--identity FILE), and for the age
CLI (age -d -i FILE). Keep a copy somewhere other than the machine and the
store: without it, encrypted snapshots cannot be read by anyone.

Examples:
  hermesfs keygen ~/.config/hermesfs/key.txt
  hermesfs mount --encrypt-to age1... --identity ~/.config/hermesfs/key.txt ~/.hermes

Exit status: 0 created, 1 failed (FILE exists, or cannot be written), 2 bad
command line.`,
		run: runKeygen,
	})
}

func runKeygen(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) != 1 {
		return usageError("keygen needs one FILE to write the key to")
	}
	pub, err := crypt.WriteNewKey(args[0], time.Now().UTC().Format(time.RFC3339))
	if err != nil {
		return err
	}
	fmt.Fprintf(e.stderr, "wrote the private key to %s; public key (recipient):\n", args[0])
	fmt.Fprintln(e.stdout, pub)
	return nil
}
