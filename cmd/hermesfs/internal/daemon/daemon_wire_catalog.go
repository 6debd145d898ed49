package daemon

import (
	"context"
	"errors"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// catalogAdapter is an *uploader.Catalog as the daemon's catalog.
type catalogAdapter struct {
	c      *uploader.Catalog
	closer func() error
	lease  *uploader.Lease
	ids    *crypt.Identities // decrypt encrypted snapshots read lazily
	// stateDir is recorded in the lease, so that a mount refused by it
	// can say which state dir (on which machine) holds it; process, so
	// that a mount on this machine can prove this one gone (holderGone,
	// which judges the leases found held). ttl is the lease's (0: the
	// default).
	stateDir   string
	process    *uploader.LeaseProcess
	holderDead func(uploader.LeaseRecord) (string, bool)
	ttl        time.Duration
}

var _ catalog = (*catalogAdapter)(nil)

// newCatalogAdapter wraps s in the default retry policy and opens its
// catalog with o (host, logger, version, encryption).
func newCatalogAdapter(s uploader.Store, o uploader.CatalogOptions, closer func() error) *catalogAdapter {
	c := uploader.NewCatalog(uploader.WithRetry(s, uploader.DefaultRetryPolicy(), o.Logger), o)
	return &catalogAdapter{c: c, closer: closer, ids: o.Identities}
}

func (a *catalogAdapter) Latest(ctx context.Context) (snapshotInfo, error) {
	id, err := a.c.LatestID(ctx)
	if err != nil {
		return snapshotInfo{}, err
	}
	if id == "" {
		// No LATEST: a store whose LATEST was lost still has snapshots.
		snaps, err := a.c.Snapshots(ctx)
		if err != nil {
			return snapshotInfo{}, err
		}
		for _, s := range snaps {
			if !s.Incomplete && s.Err == nil {
				return infoOf(s.Manifest, ""), nil
			}
		}
		return snapshotInfo{}, nil
	}
	info := snapshotInfo{ID: id, Pointer: id}
	if m, err := a.c.Manifest(ctx, id); err == nil {
		info = infoOf(m, id)
	}
	return info, nil
}

// infoOf is what the daemon needs of manifest m (LATEST naming pointer).
func infoOf(m uploader.Manifest, pointer string) snapshotInfo {
	return snapshotInfo{ID: m.ID, Size: m.Size, SHA256: m.SHA256, Host: m.Host, Parent: m.Parent, NewBytes: m.NewBytes, Pointer: pointer, Compacts: m.Compacts}
}

func (a *catalogAdapter) Manifest(ctx context.Context, id string) (uploader.Manifest, error) {
	return a.c.Manifest(ctx, id)
}

func (a *catalogAdapter) Older(ctx context.Context, id string) ([]string, error) {
	refs, err := a.c.Complete(ctx)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, r := range refs {
		if r.ID < id {
			out = append(out, r.ID)
		}
	}
	return out, nil
}

func (a *catalogAdapter) Store() uploader.Store { return a.c.Store() }

func (a *catalogAdapter) Identities() *crypt.Identities { return a.c.Identities() }

func (a *catalogAdapter) Fetch(ctx context.Context, id, dst string) (snapshotInfo, error) {
	res, err := a.c.Restore(ctx, dst, uploader.RestoreOptions{ID: id})
	if err != nil {
		if errors.Is(err, uploader.ErrCorrupt) {
			return snapshotInfo{}, withCode(exitCorrupt, err)
		}
		return snapshotInfo{}, CryptError(err)
	}
	return snapshotInfo{ID: res.Manifest.ID, Size: res.Manifest.Size, SHA256: res.SHA256}, nil
}

func (a *catalogAdapter) PublishImage(ctx context.Context, in uploader.ImageInput) (uploader.Published, error) {
	in.Lease = a.lease
	p, err := a.c.PublishImage(ctx, in)
	if err != nil {
		var ce *uploader.ConflictError
		if errors.As(err, &ce) {
			return uploader.Published{}, mark(err, errConflict)
		}
		if errors.Is(err, uploader.ErrLeaseLost) {
			return uploader.Published{}, mark(err, errLeaseLost)
		}
		return uploader.Published{}, CryptError(err)
	}
	// The lease keeps naming the mount's base (the lower layer, read
	// lazily from its segments): prune keeps it, and LATEST, this.
	return p, nil
}

func (a *catalogAdapter) Has(ctx context.Context, id string) (bool, error) {
	_, err := a.c.Manifest(ctx, id)
	var ce *uploader.CorruptError
	if errors.As(err, &ce) {
		return false, nil // missing or unreadable: not a copy to rely on
	}
	return err == nil, err
}

func (a *catalogAdapter) Prune(ctx context.Context, policy uploader.RetentionPolicy) error {
	_, err := a.c.PruneWith(ctx, uploader.PruneOptions{Policy: policy})
	return err
}

func (a *catalogAdapter) Lease(ctx context.Context, holder string) (lease, error) {
	l, err := a.c.AcquireLease(ctx, uploader.LeaseOptions{Holder: holder, StateDir: a.stateDir, Process: a.process,
		HolderDead: a.holderDead, TTL: a.ttl})
	if err != nil {
		if errors.Is(err, uploader.ErrLeaseHeld) {
			return nil, mark(err, errLeaseHeld)
		}
		return nil, err
	}
	a.lease = l
	return l, nil
}

func (a *catalogAdapter) Close() error {
	if a.closer != nil {
		return a.closer()
	}
	return nil
}

func (realParts) openCatalog(ctx context.Context, d *daemon) (catalog, error) {
	log := d.base.With("component", "uploader")
	raw, o, err := d.e.Store(log)
	if err != nil {
		return nil, err
	}
	s, _, err := storeurl.Open(ctx, raw, o)
	if err != nil {
		return nil, err
	}
	s = d.met.wrapStore(s)
	// The per-state-dir host id names this writer in snapshot ids,
	// manifests and the lease, so a restart recognises its own work.
	co := uploader.CatalogOptions{Host: d.host, Logger: log, Version: d.e.Version}
	if err := d.e.Encryption(&co); err != nil {
		return nil, err
	}
	if co.Recipients != nil && !d.cfg.ReadOnly {
		d.encryption = &encryptionInfo{Scheme: crypt.Scheme, RecipientTypes: co.Recipients.Types()}
		log.Info("new snapshots are encrypted with age", "recipients", co.Recipients.Len(), "recipient_types", strings.Join(co.Recipients.Types(), ","))
	}
	a := newCatalogAdapter(s, co, nil)
	a.stateDir, a.process, a.holderDead, a.ttl = d.sd.path, d.leaseProcess(), holderGone, d.cfg.LeaseTTL
	if !d.cfg.ReadOnly {
		if err := checkEncryptedLatest(ctx, a.c, co); err != nil {
			return nil, err
		}
	}
	return a, nil
}

func (realParts) storeURL(d *daemon) string {
	raw, o, err := d.e.Store(nil)
	if err != nil {
		return redactURL(raw)
	}
	loc, err := storeurl.Parse(raw, o)
	if err != nil {
		return redactURL(raw)
	}
	return loc.String()
}
