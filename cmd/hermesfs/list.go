package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
)

func init() {
	register(&command{
		name:    "list",
		summary: "list the snapshots in the store",
		usage:   "[flags]",
		help: `Lists the snapshots in the store, newest first: id, creation time (UTC),
archive size, number of files, the host that made it, and how the archive is
encrypted ("age: X25519" and the like; "-" for plaintext; an encrypted
snapshot's manifest holds no file count). The snapshot LATEST
names (the one 'mount' and 'restore' use) is marked with *. A snapshot whose
archive or manifest is missing (a publish in progress or one that crashed) is
marked incomplete.

Examples:
  hermesfs list
  hermesfs list --store s3://my-bucket/agents/alice --json

` + storeHelp,
		flags: func(fs *flag.FlagSet) {
			addStoreFlags(fs)
			fs.Bool("json", false, "print a JSON array instead of a table")
		},
		run: runList,
	})
}

// listEntry is one snapshot in `list --json`.
type listEntry struct {
	ID         string    `json:"id"`
	Created    time.Time `json:"created"`
	Size       int64     `json:"size"`
	Files      int64     `json:"files"`
	Host       string    `json:"host"`
	Parent     string    `json:"parent,omitempty"`
	SHA256     string    `json:"sha256,omitempty"`
	Latest     bool      `json:"latest"`
	Incomplete bool      `json:"incomplete,omitempty"`
	// Encryption is the scheme and recipient types of an encrypted
	// snapshot; absent for plaintext.
	Encryption *uploader.Encryption `json:"encryption,omitempty"`
	// New is the bytes the snapshot's own segment added to the store (its
	// image's new bytes: what it cost); Segments how many its image uses.
	New      int64  `json:"new_bytes"`
	Segments int    `json:"segments,omitempty"`
	Error    string `json:"error,omitempty"`
}

func runList(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error {
	if len(args) > 0 {
		return usageError("list takes no arguments")
	}
	cat, loc, err := openCatalog(ctx, e, fs)
	if err != nil {
		return err
	}
	snaps, err := cat.Snapshots(ctx)
	if err != nil {
		return fmt.Errorf("list %s: %w", loc, err)
	}
	entries := make([]listEntry, 0, len(snaps))
	for _, s := range snaps {
		le := listEntry{ID: s.ID, Created: s.Created, Size: s.Size, Files: s.Files, Host: s.Host, Parent: s.Parent,
			SHA256: s.SHA256, Latest: s.Latest, Incomplete: s.Incomplete, Encryption: s.Encryption, New: s.NewBytes,
			Segments: len(s.Segments)}
		if !s.Segmented() {
			le.New = s.Size // a whole archive of an older hermesfs
		}
		if le.Created.IsZero() {
			le.Created = s.ModTime.UTC()
		}
		if s.Err != nil {
			le.Error = s.Err.Error()
		}
		entries = append(entries, le)
	}
	if fs.Lookup("json").Value.String() == "true" {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(entries)
	}
	if len(entries) == 0 {
		fmt.Fprintf(e.stdout, "no snapshots in %s\n", loc)
		return nil
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "  ID\tCREATED (UTC)\tSIZE\tNEW\tFILES\tHOST\tENCRYPTION")
	for _, le := range entries {
		mark := " "
		if le.Latest {
			mark = "*"
		}
		note := ""
		switch {
		case le.Error != "":
			note = "  (unreadable manifest: " + le.Error + ")"
		case le.Incomplete:
			note = "  (incomplete)"
		}
		files, enc := strconv.FormatInt(le.Files, 10), "-"
		if le.Encryption != nil {
			files, enc = "-", le.Encryption.Scheme+": "+strings.Join(le.Encryption.RecipientTypes, ",")
		}
		fmt.Fprintf(tw, "%s %s\t%s\t%s\t%s\t%s\t%s\t%s%s\n", mark, le.ID, le.Created.UTC().Format("2006-01-02 15:04:05"),
			daemon.HumanBytes(le.Size), daemon.HumanBytes(le.New), files, le.Host, enc, note)
	}
	return tw.Flush()
}
