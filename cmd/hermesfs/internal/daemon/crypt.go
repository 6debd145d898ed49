package daemon

import (
	"context"
	"errors"
	"fmt"
	"slices"
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

// LazyCryptError classifies a failure to open snapshot m's age header:
// identities that do not open an intact header are a KeyError (exit 6);
// a header naming a recipient type the manifest does not, or failing its
// MAC or authentication, is corruption.
func LazyCryptError(m uploader.Manifest, err error) error {
	if ke, ok := errors.AsType[*crypt.KeyError](err); ok {
		for _, t := range ke.Types {
			if !slices.Contains(m.Encryption.RecipientTypes, t) {
				return withCode(exitCorrupt, &uploader.CorruptError{ID: m.ID, Err: fmt.Errorf("%w: %s (manifest: %s)", crypt.ErrUnknownRecipientType, t, strings.Join(m.Encryption.RecipientTypes, ", "))})
			}
		}
		return CryptError(&uploader.KeyError{ID: m.ID, Err: ke})
	}
	if errors.Is(err, crypt.ErrAuth) || errors.Is(err, crypt.ErrHeader) {
		return withCode(exitCorrupt, &uploader.CorruptError{ID: m.ID, Err: err})
	}
	return err
}
