package daemon

import (
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
)

// The mount's lease names the snapshot it is based on once it published
// one, and a prune from another host keeps that snapshot whatever the
// policy says.
func TestMountLeaseNamesBase(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	s, err := uploader.NewLocal(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	a := newCatalogAdapter(s, uploader.CatalogOptions{Host: "vm1"}, nil)
	l, err := a.Lease(ctx, "hermesfs mount /h")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	p := filepath.Join(t.TempDir(), "a.sqfs")
	os.WriteFile(p, []byte("archive bytes"), 0o600)
	r, err := a.Publish(ctx, p, publishMeta{Files: 1}, "")
	if err != nil {
		t.Fatal(err)
	}
	if err := a.lease.Renew(ctx); err != nil {
		t.Fatal(err)
	}
	other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm2"})
	if rec, _, err := other.ReadLease(ctx); err != nil || rec.Base != r.ID {
		t.Fatalf("lease %+v, %v; want base %s", rec, err, r.ID)
	}
	// Another host moves LATEST on (as after a takeover): the base is no
	// longer LATEST, and a keep-last-1 prune still keeps it.
	m := publishDir(t, other, t.TempDir())
	res, err := other.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
	if err != nil || !slices.Equal(res.Kept, []string{m.ID, r.ID}) {
		t.Errorf("prune kept %q, %v; want the newest and the lease's base", res.Kept, err)
	}
}

// publishDir packs dir and publishes it to cat over its LATEST.
func publishDir(t *testing.T, cat *uploader.Catalog, dir string) uploader.Manifest {
	t.Helper()
	p := filepath.Join(t.TempDir(), "a.sqfs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	res, err := archive.PackDir(t.Context(), f, dir, archive.PackOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	latest, err := cat.LatestID(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	m, err := cat.Publish(t.Context(), uploader.PublishInput{
		Path: p, SHA256: hex.EncodeToString(res.SHA256[:]), Size: res.Size,
		Parent: latest, Expect: latest, Files: res.Files,
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}
