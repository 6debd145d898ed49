package daemon

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

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
	latest, err := other.LatestID(ctx)
	if err != nil {
		t.Fatal(err)
	}
	next := filepath.Join(t.TempDir(), "next.sqfs")
	os.WriteFile(next, []byte("another host's snapshot"), 0o600) // the catalog never parses it
	m, err := other.Publish(ctx, uploader.PublishInput{Path: next, Parent: latest, Expect: latest})
	if err != nil {
		t.Fatal(err)
	}
	res, err := other.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
	if err != nil || !slices.Equal(res.Kept, []string{m.ID, r.ID}) {
		t.Errorf("prune kept %q, %v; want the newest and the lease's base", res.Kept, err)
	}
}
