package daemon

import (
	"context"
	"errors"
	"strings"

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
	// can say which state dir (on which machine) holds it.
	stateDir string
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
				return snapshotInfo{ID: s.ID, Size: s.Size, SHA256: s.SHA256, Host: s.Host, Parent: s.Parent}, nil
			}
		}
		return snapshotInfo{}, nil
	}
	info := snapshotInfo{ID: id, Pointer: id}
	if m, err := a.c.Manifest(ctx, id); err == nil {
		info.Size, info.SHA256, info.Host, info.Parent = m.Size, m.SHA256, m.Host, m.Parent
	}
	return info, nil
}

func (a *catalogAdapter) Fetch(ctx context.Context, id, dst string) (snapshotInfo, []string, error) {
	// The sha256 of the manifest is checked while the archive downloads;
	// every block is checked again before it is served, and once in the
	// background after ready (daemon.serve), so boot does not wait for a
	// full decompression pass.
	res, err := a.c.Restore(ctx, dst, uploader.RestoreOptions{ID: id})
	if err != nil {
		if errors.Is(err, uploader.ErrCorrupt) {
			return snapshotInfo{}, res.SkippedIDs(), withCode(exitCorrupt, err)
		}
		return snapshotInfo{}, res.SkippedIDs(), CryptError(err)
	}
	m := res.Manifest
	a.setBase(m.ID)
	// The sha256 of the local file (the plaintext when encrypted): what
	// the state dir records and checks its cache against.
	return snapshotInfo{ID: m.ID, Size: m.Size, SHA256: res.SHA256}, res.SkippedIDs(), nil
}

func (a *catalogAdapter) Publish(ctx context.Context, path string, meta publishMeta, expect string) (publishResult, error) {
	in := uploader.PublishInput{
		Path: path, SHA256: meta.SHA256, Size: meta.Size, Parent: meta.Parent, Expect: expect, Files: meta.Files, Lease: a.lease,
		Hot: meta.Hot,
	}
	if meta.Hole.Len() > 0 {
		in.Hole, in.Fill, in.ChunkSize = meta.Hole, meta.Fill, meta.ChunkSize
	}
	if meta.DeltaSource != "" && len(meta.Copies) > 0 {
		in.Delta = &uploader.Delta{Source: meta.DeltaSource}
		for _, c := range meta.Copies {
			in.Delta.Ranges = append(in.Delta.Ranges, uploader.ComposeRange{Offset: c.Offset, SourceOffset: c.BaseOffset, Length: c.Length})
		}
	}
	p, err := a.c.PublishReport(ctx, in)
	if err != nil {
		var ce *uploader.ConflictError
		if errors.As(err, &ce) {
			return publishResult{}, mark(err, errConflict)
		}
		if errors.Is(err, uploader.ErrLeaseLost) {
			return publishResult{}, mark(err, errLeaseLost)
		}
		return publishResult{}, CryptError(err)
	}
	a.setBase(p.ID)
	return publishResult{snapshotInfo: snapshotInfo{ID: p.ID, Size: p.Size, SHA256: p.SHA256}, BytesUploaded: p.Sent, BytesCopied: p.Copied}, nil
}

// setBase tells the writer lease (and through it, prune on any host) which
// snapshot the mount's tree and next archive are based on now.
func (a *catalogAdapter) setBase(id string) {
	if a.lease != nil {
		a.lease.SetBase(id)
	}
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
	l, err := a.c.AcquireLease(ctx, uploader.LeaseOptions{Holder: holder, StateDir: a.stateDir})
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
	a.stateDir = d.sd.path
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
