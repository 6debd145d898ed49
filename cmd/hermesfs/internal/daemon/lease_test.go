package daemon

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// The mount's lease names the snapshot its lower layer is (the image it
// reads lazily from the store), also after it published newer ones, and a
// prune from another host keeps that snapshot whatever the policy says.
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
	publish := func(expect string) uploader.Published {
		t.Helper()
		p := filepath.Join(t.TempDir(), "seg")
		os.WriteFile(p, []byte("segment bytes of "+expect), 0o600) // the catalog never parses it
		var src []uploader.Manifest
		if expect != "" {
			m, err := a.Manifest(ctx, expect)
			if err != nil {
				t.Fatal(err)
			}
			src = append(src, m)
		}
		r, err := a.PublishImage(ctx, uploader.ImageInput{Segment: p, Extents: []uploader.Extent{{Length: int64(len("segment bytes of " + expect))}},
			Sources: src, Parent: expect, Expect: expect})
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	base := publish("")
	a.lease.SetBase(base.ID) // what boot does for the mount's base
	newer := publish(base.ID)
	if err := a.lease.Renew(ctx); err != nil {
		t.Fatal(err)
	}
	other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm2"})
	if rec, _, err := other.ReadLease(ctx); err != nil || rec.Base != base.ID {
		t.Fatalf("lease %+v, %v; want base %s after publishing %s", rec, err, base.ID, newer.ID)
	}
	res, err := other.PruneWith(ctx, uploader.PruneOptions{Policy: uploader.RetentionPolicy{Last: 1}})
	if err != nil || !slices.Equal(res.Kept, []string{newer.ID, base.ID}) {
		t.Errorf("prune kept %q, %v; want LATEST and the lease's base", res.Kept, err)
	}
}

// runRefused runs Run for mountpoint mp over the local store dir with state
// dir state, expecting it to refuse before the mount is ready, and returns
// its logs and error. mod, if set, changes the config and options first.
func runRefused(t *testing.T, store, mp, state string, mod func(*Config, *Options)) (string, error) {
	t.Helper()
	cfg := Config{
		Mountpoint: mp, StateDir: state, Retention: uploader.DefaultRetention(),
		StopTimeout: time.Minute, MemoryLimit: 2200, UserLimit: 1375, Lazy: true, ReadTimeout: 30 * time.Second,
	}
	runDir := filepath.Join(filepath.Dir(mp), "run")
	getenv := func(k string) string {
		if k == "HERMESFS_RUNTIME_DIR" {
			return runDir
		}
		return ""
	}
	out := &readyWriter{ready: make(chan struct{})}
	logs := &lockedBuffer{}
	opts := Options{
		Stdout: out, Getenv: getenv, Version: "test",
		Logger: slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelDebug})),
		Store: func(*slog.Logger) (string, storeurl.Options, error) {
			return "file://" + store, storeurl.Options{Getenv: getenv, UID: os.Getuid()}, nil
		},
	}
	if mod != nil {
		mod(&cfg, &opts)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- Run(ctx, cfg, opts) }()
	select {
	case err := <-done:
		return logs.String(), err
	case <-out.ready:
		cancel()
		<-done
		if fs.IsMountpoint(mp) {
			syscall.Unmount(mp, syscall.MNT_DETACH)
		}
		t.Fatalf("the mount went ahead; logs:\n%s", logs)
	case <-time.After(2 * time.Minute):
		t.Fatalf("Run neither refused nor got ready in 2 minutes; logs:\n%s", logs)
	}
	return "", nil
}

// TestRunLeaseHeldOnThisMachine: a second mount of the same store on this
// machine is refused naming the other mount's state dir and how to stop
// it, not as "another host" (each mount has its own writer id).
func TestRunLeaseHeldOnThisMachine(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mpA, mpB := filepath.Join(root, "store"), filepath.Join(root, "home-a"), filepath.Join(root, "home-b")
	for _, d := range []string{store, mpA, mpB} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	stateA := filepath.Join(root, "state-a")
	a := startDaemon(t, store, mpA, stateA, filepath.Join(root, "run"))

	logs, err := runRefused(t, store, mpB, filepath.Join(root, "state-b"), nil)
	if ExitCode(err) != ExitConflict {
		t.Fatalf("Run: %v (exit %d), want exit %d; logs:\n%s", err, ExitCode(err), ExitConflict, logs)
	}
	for _, want := range []string{
		"hermesfs mount " + mpA + " on this machine (state dir " + stateA,
		"stop that mount first ('hermesfs umount " + mpA + "')",
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q lacks %q", err, want)
		}
	}
	if err := a.stop(t); err != nil {
		t.Fatalf("first daemon: %v", err)
	}
}
