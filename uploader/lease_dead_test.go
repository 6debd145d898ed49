package uploader_test

import (
	"errors"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

// TestLeaseHolderDead: a live lease written during this boot of this
// machine is taken over at once when HolderDead proves its holder gone;
// it is asked about no other lease (another boot, another machine, an
// older lease that records no boot), and a lease it cannot prove dead is
// refused as before. The holder whose lease was taken finds it lost, not
// lapsed.
func TestLeaseHolderDead(t *testing.T) {
	ctx := t.Context()
	vm1 := uploader.Machine{Hostname: "vm-1", ID: "0123456789abcdef", BootID: "boot-1"}
	proc := &uploader.LeaseProcess{PID: 4242, PIDNamespace: "pid:[4026531836]", Lock: "2049:77"}

	for _, c := range []struct {
		name    string
		holder  uploader.Machine
		verdict bool
		asked   bool
		taken   bool
	}{
		{"this boot, proven gone", vm1, true, true, true},
		{"this boot, not proven", vm1, false, true, false},
		{"an earlier boot of this machine", uploader.Machine{Hostname: "vm-1", ID: vm1.ID, BootID: "boot-0"}, true, false, false},
		{"another machine", uploader.Machine{Hostname: "vm-2", ID: "fedcba9876543210", BootID: "boot-1"}, true, false, false},
		{"an older hermesfs's lease (no boot recorded)", uploader.Machine{Hostname: "vm-1", ID: vm1.ID}, true, false, false},
	} {
		s := newLocal(t)
		holder := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm-1-aaaa", Machine: c.holder})
		hl, err := holder.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount /a", StateDir: "/state-a", Process: proc, Heartbeat: -1})
		if err != nil {
			t.Fatal(err)
		}
		rec, _, err := holder.ReadLease(ctx)
		if err != nil || rec.Process == nil || *rec.Process != *proc || rec.BootID != c.holder.BootID {
			t.Fatalf("%s: lease record %+v, %v: want the process and boot recorded", c.name, rec, err)
		}
		asked := false
		contender := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "vm-1-bbbb", Machine: vm1})
		cl, err := contender.AcquireLease(ctx, uploader.LeaseOptions{Holder: "hermesfs mount /b", Heartbeat: -1,
			HolderDead: func(r uploader.LeaseRecord) (string, bool) {
				asked = true
				if r.Process == nil || r.Process.PID != proc.PID || r.StateDir != "/state-a" {
					t.Errorf("%s: HolderDead got %+v", c.name, r)
				}
				return "its state dir's lock is free", c.verdict
			}})
		if asked != c.asked {
			t.Errorf("%s: HolderDead asked %v, want %v", c.name, asked, c.asked)
		}
		if !c.taken {
			if !errors.Is(err, uploader.ErrLeaseHeld) {
				t.Errorf("%s: %v, want the lease held", c.name, err)
			}
			hl.Release(ctx)
			continue
		}
		if err != nil {
			t.Fatalf("%s: %v, want the lease taken over", c.name, err)
		}
		if err := hl.Renew(ctx); !errors.Is(err, uploader.ErrLeaseLost) || errors.Is(err, uploader.ErrLeaseLapsed) {
			t.Errorf("%s: the old holder's renewal: %v, want lost (taken over), not lapsed", c.name, err)
		}
		cl.Release(ctx)
	}
}
