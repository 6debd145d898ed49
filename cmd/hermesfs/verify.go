package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
)

func init() {
	register(&command{
		name:    "verify",
		summary: "check every block of an archive (a file or a snapshot id)",
		usage:   "[flags] FILE|ID",
		help: `Reads a whole archive and checks every block: against its integrity trailer
(a checksum of every data, fragment and metadata block) and by decompressing
it. If the argument is an existing file, that file is checked; otherwise it is
taken as a snapshot id in the store: the snapshot is downloaded, its size and
sha256 checked against its manifest, then every block.

An encrypted snapshot, or a local age file, needs --identity: its ciphertext's
sha256 is checked, and every 64 KiB chunk authenticated as it is decrypted.

Examples:
  hermesfs verify hermes.sqfs
  hermesfs verify 20261122T134501.123Z-box-1a2b3c4d
  hermesfs verify --store s3://my-bucket/alice 20261122T134501.123Z-box-1a2b3c4d

Exit status: 0 intact, 1 could not check (I/O, store unreachable), 2 bad
command line, 3 corrupt (the message names the first bad block and its byte
offset), 6 encrypted and no --identity opens it, 7 neither a file nor a
snapshot the store holds ('hermesfs list' shows its ids).

` + storeHelp,
		flags: func(fs *flag.FlagSet) { addStoreFlags(fs); addIdentityFlag(fs) },
		run:   runVerify,
	})
}

func runVerify(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) != 1 {
		return usageError("verify needs one FILE or snapshot ID")
	}
	st, err := os.Stat(args[0])
	if err != nil || st.IsDir() {
		return verifySnapshot(ctx, e, fs, args[0])
	}
	return verifyFile(ctx, e, fs, args[0])
}

func verifyFile(ctx context.Context, e *env, fs *flag.FlagSet, name string) error {
	start := time.Now()
	r, f, err := openArchiveAt(e, fs, name)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := r.Verify(ctx); err != nil {
		return daemon.CryptError(daemon.ArchiveError(err))
	}
	st, err := os.Stat(name)
	if err != nil {
		return err
	}
	how := "every block matches its checksum and decompresses"
	if !r.Checksummed() {
		how = "no hermesfs checksums (not packed by hermesfs): every block decompresses"
	}
	fmt.Fprintf(e.stdout, "%s: ok: %s, %d inodes, %s compression, %s (%s)\n",
		name, daemon.HumanBytes(st.Size()), r.Inodes(), r.Compression(), how, time.Since(start).Round(time.Millisecond))
	return nil
}
