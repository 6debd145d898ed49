package daemon

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
)

// CryptError gives encryption errors their exit code.
func CryptError(err error) error {
	if _, ok := errors.AsType[*crypt.KeyError](err); ok || errors.Is(err, uploader.ErrPlaintext) {
		return withCode(exitCrypt, err)
	}
	if errors.Is(err, crypt.ErrAuth) || errors.Is(err, crypt.ErrHeader) {
		return withCode(exitCorrupt, err)
	}
	return err
}

// checkEncryptedLatest refuses, before anything is mounted, a writable
// mount that would publish plaintext over an encrypted LATEST (a
// forgotten --encrypt-to), rather than failing at every snapshot.
func checkEncryptedLatest(ctx context.Context, c *uploader.Catalog, o uploader.CatalogOptions) error {
	if o.Recipients != nil || o.AllowPlaintext {
		return nil
	}
	m, err := c.Latest(ctx)
	if err != nil || m.Encryption == nil {
		return nil // no LATEST, or one the boot deals with
	}
	return withCode(exitCrypt, fmt.Errorf("%w: LATEST (%s) is encrypted to %s recipients; pass --encrypt-to (or HERMESFS_ENCRYPT_TO) with the recipients new snapshots should go to, or --allow-plaintext to publish unencrypted on purpose",
		uploader.ErrPlaintext, m.ID, strings.Join(m.Encryption.RecipientTypes, ", ")))
}

// encryptionInfo is how a mount encrypts new snapshots, as status shows
// it: the scheme and the kinds of recipient, never a key.
type encryptionInfo struct {
	Scheme         string   `json:"scheme"`
	RecipientTypes []string `json:"recipient_types"`
}
