package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
)

// Encryption flags. --identity is declared by every command that reads
// archive bytes (mount, restore, verify, unpack); --encrypt-to and
// --allow-plaintext by mount, the only writer of snapshots. Each has an
// environment form, used when the flag is not given.

var cryptEnv = map[string]string{
	"identity":        "HERMESFS_IDENTITY",
	"encrypt-to":      "HERMESFS_ENCRYPT_TO",
	"allow-plaintext": "HERMESFS_ALLOW_PLAINTEXT",
}

// listFlag is a repeatable string flag.
type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error { *l = append(*l, s); return nil }

func addIdentityFlag(fs *flag.FlagSet) {
	fs.Var(&listFlag{}, "identity", "age identity file (age-keygen or hermesfs keygen) or unencrypted SSH private key that decrypts encrypted snapshots; repeatable; must not be readable by group or others "+
		"(env HERMESFS_IDENTITY, several separated by ':')")
}

func addEncryptFlags(fs *flag.FlagSet) {
	addEncryptToFlag(fs, "new snapshots")
	fs.Bool("allow-plaintext", false, "publish unencrypted snapshots even when LATEST is encrypted (env HERMESFS_ALLOW_PLAINTEXT)")
}

func addEncryptToFlag(fs *flag.FlagSet, what string) {
	fs.Var(&listFlag{}, "encrypt-to", "encrypt "+what+" with age to this recipient: an age1… public key, an ssh-ed25519/ssh-rsa public key, or @FILE of recipients, one a line; repeatable "+
		"(env HERMESFS_ENCRYPT_TO, several separated by ',')")
}

// cryptSettings returns flag name's values, or its environment variable's.
func cryptSettings(e *env, fs *flag.FlagSet, name string) []string {
	f := fs.Lookup(name)
	if f == nil {
		return nil
	}
	if l, ok := f.Value.(*listFlag); ok && len(*l) > 0 {
		return *l
	}
	v := e.getenv(cryptEnv[name])
	if v == "" {
		return nil
	}
	if name == "identity" {
		return filepath.SplitList(v)
	}
	return strings.Split(v, ",")
}

// cryptOptions fills the catalog options from the encryption flags and
// environment. Errors are usage errors: they never quote a key.
func cryptOptions(e *env, fs *flag.FlagSet, o *uploader.CatalogOptions) error {
	if ids := cryptSettings(e, fs, "identity"); len(ids) > 0 {
		got, err := crypt.LoadIdentities(ids)
		if err != nil {
			return usageError("--identity: %v", err)
		}
		o.Identities = got
	}
	if rs := cryptSettings(e, fs, "encrypt-to"); len(rs) > 0 {
		got, err := crypt.ParseRecipients(rs)
		if err != nil {
			return usageError("--encrypt-to: %v", err)
		}
		o.Recipients = got
	}
	if f := fs.Lookup("allow-plaintext"); f != nil {
		v := f.Value.String()
		set := false
		fs.Visit(func(x *flag.Flag) { set = set || x.Name == "allow-plaintext" })
		if !set {
			v = e.getenv(cryptEnv["allow-plaintext"])
		}
		if v != "" {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return usageError("allow-plaintext %q: want true or false", v)
			}
			o.AllowPlaintext = b
		}
	}
	return nil
}

// openArchiveAt opens the archive file at path, decrypting it through a
// ReaderAt if it is an age file (only the chunks read are decrypted).
func openArchiveAt(e *env, fs *flag.FlagSet, path string) (*archive.Reader, io.Closer, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	head := make([]byte, len(crypt.Magic))
	n, _ := io.ReadFull(f, head)
	if !crypt.IsEncrypted(head[:n]) {
		f.Close()
		return daemon.OpenArchive(path, archive.ReaderOptions{})
	}
	var o uploader.CatalogOptions
	if err := cryptOptions(e, fs, &o); err != nil {
		f.Close()
		return nil, nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	ra, size, err := crypt.Open(f, fi.Size(), o.Identities)
	if err != nil {
		f.Close()
		if _, ok := errors.AsType[*crypt.KeyError](err); ok {
			return nil, nil, withCode(exitCrypt, fmt.Errorf("%s is %w", path, err))
		}
		return nil, nil, withCode(exitCorrupt, fmt.Errorf("%s: %w", path, err))
	}
	r, err := archive.Open(ra, size, archive.ReaderOptions{Name: path})
	if err != nil {
		f.Close()
		return nil, nil, daemon.ArchiveError(err)
	}
	return r, f, nil
}

// filesOrEncrypted describes a snapshot's contents for messages: its file
// count, which an encrypted snapshot's manifest does not hold.
func filesOrEncrypted(m uploader.Manifest) string {
	if m.Encryption != nil {
		return "encrypted (" + strings.Join(m.Encryption.RecipientTypes, ", ") + ")"
	}
	return fmt.Sprintf("%d files", m.Files)
}
