package uploader_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// TestLeaseHeldSaysWhichMachine: every mount has its own writer id (a
// hostname plus a random suffix), so a refusal that names only that id
// reads like another host even when the holder is another mount on this
// machine. The lease records the holder's machine and state dir, and the
// refusal says "this machine (state dir X)" or "host H (another machine)".
func TestLeaseHeldSaysWhichMachine(t *testing.T) {
	ctx := t.Context()
	s := newLocal(t)
	vm1 := uploader.Machine{Hostname: "vm-1", ID: "0123456789abcdef"}
	holder := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm-1-1af6faa3", Machine: vm1})
	l, err := holder.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount /home/a/.hermes", StateDir: "/srv/state-a", Heartbeat: -1})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release(ctx)
	if rec, _, err := holder.ReadLease(ctx); err != nil || rec.Hostname != "vm-1" || rec.MachineID != vm1.ID || rec.StateDir != "/srv/state-a" {
		t.Fatalf("lease record %+v, %v: want the machine and state dir recorded", rec, err)
	}

	for _, c := range []struct {
		name    string
		machine uploader.Machine
		same    bool
		want    []string
	}{
		{"another mount on this machine", vm1, true,
			[]string{"hermesfs mount /home/a/.hermes on this machine (state dir /srv/state-a, writer vm-1-1af6faa3"}},
		{"another machine", uploader.Machine{Hostname: "vm-2", ID: "fedcba9876543210"}, false,
			[]string{"hermesfs mount /home/a/.hermes on host vm-1 (another machine; state dir /srv/state-a there"}},
		// A cloned VM keeps the hostname; its machine id tells it apart.
		{"same hostname, another machine id", uploader.Machine{Hostname: "vm-1", ID: "fedcba9876543210"}, false,
			[]string{"on host vm-1 (another machine"}},
	} {
		other := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm-x-9f8e7d6c", Machine: c.machine})
		_, err := other.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount /home/b/.hermes", Heartbeat: -1})
		held, ok := errors.AsType[*uploader.LeaseHeldError](err)
		if !ok || !errors.Is(err, uploader.ErrLeaseHeld) {
			t.Fatalf("%s: %v, want the lease held", c.name, err)
		}
		if held.SameMachine != c.same || held.StateDir != "/srv/state-a" || held.Hostname != "vm-1" {
			t.Errorf("%s: %+v", c.name, held)
		}
		msg := err.Error()
		for _, w := range c.want {
			if !strings.Contains(msg, w) {
				t.Errorf("%s: %q lacks %q", c.name, msg, w)
			}
		}
		if c.same == strings.Contains(msg, "host vm-1") || !strings.Contains(msg, "lease valid until") {
			t.Errorf("%s: %q", c.name, msg)
		}
	}
}

// TestLeaseOldRecordReadable: a lease an older hermesfs wrote (no hostname,
// machine id or state dir) is still read, refuses as before naming its
// writer id, and is taken over once released.
func TestLeaseOldRecordReadable(t *testing.T) {
	ctx := t.Context()
	s := newLocal(t)
	now := time.Now().UTC()
	old := fmt.Sprintf(`{"holder": "hermesfs mount /home/a/.hermes", "host": "vm-1af6faa3", "token": "0011223344556677",
	  "generation": 3, "acquired": %q, "renewed": %q, "expires": %q, "write": "8899aabbccddeeff"}`,
		now.Format(time.RFC3339Nano), now.Format(time.RFC3339Nano), now.Add(uploader.DefaultLeaseTTL).Format(time.RFC3339Nano))
	if _, err := s.Put(ctx, uploader.LeaseKey, bytes.NewReader([]byte(old)), int64(len(old)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	c := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm-1-9f8e7d6c"})
	rec, _, err := c.ReadLease(ctx)
	if err != nil || rec.Holder != "hermesfs mount /home/a/.hermes" || rec.Host != "vm-1af6faa3" || rec.Generation != 3 {
		t.Fatalf("old lease read as %+v, %v", rec, err)
	}
	_, err = c.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount /home/b/.hermes", Heartbeat: -1})
	held, ok := errors.AsType[*uploader.LeaseHeldError](err)
	if !ok || held.SameMachine || held.Host != "vm-1af6faa3" || !strings.Contains(err.Error(), "on host vm-1af6faa3") || strings.Contains(err.Error(), "this machine") {
		t.Fatalf("old live lease: %v", err)
	}
	// Released by its (old) holder: taken at once, now with the machine.
	var r map[string]any
	json.Unmarshal([]byte(old), &r)
	r["released"], r["expires"] = true, now.Format(time.RFC3339Nano)
	b, _ := json.Marshal(r)
	if _, err := s.Put(ctx, uploader.LeaseKey, bytes.NewReader(b), int64(len(b)), uploader.PutOptions{}); err != nil {
		t.Fatal(err)
	}
	l, err := c.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount /home/b/.hermes", StateDir: "/srv/b", Heartbeat: -1})
	if err != nil {
		t.Fatalf("released old lease: %v", err)
	}
	defer l.Release(ctx)
	if got := l.Record(); got.Generation != 4 || got.Hostname == "" || got.StateDir != "/srv/b" {
		t.Errorf("new record %+v", got)
	}
}
