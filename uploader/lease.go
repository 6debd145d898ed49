package uploader

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"log/slog"
	"os"
	"slices"
	"strings"
	"sync"
	"time"
)

// The writer lease: one host at a time may publish to a prefix. The lease
// is the JSON object LeaseKey, changed only by conditional puts, so two
// hosts can never both believe they took it. A holder renews it every
// Heartbeat; a lease not renewed for TTL is stale and any host may take it
// over (a conditional put against the stale object's ETag). A holder that
// finds the object changed under it, or that could not renew before its
// own expiry, has lost the lease and must stop publishing: Lost() closes
// and Err() says why.
//
// No decision compares two hosts' wall clocks, so a host whose clock is
// minutes off (a cloned VM, no NTP) neither steals a live lease nor keeps
// publishing on a dead one:
//   - the holder counts its lease valid for TTL from the start of its last
//     successful write, on its own monotonic clock (CatalogOptions.Mono);
//   - a contender measures the lease object's age on the store's clock:
//     the store's time when it answered (HTTP Date; the local store's file
//     system clock) minus the object's modification time, both stamped by
//     the store. The lease is stale once that age passes TTL (plus a
//     second for the one-second resolution of HTTP dates). A store that
//     tells no time is watched instead: a lease object this catalog has
//     seen unchanged for TTL on its monotonic clock is stale.
//
// The holder's write starts before the store stamps it, so the holder
// stops believing in its lease before any contender may take it. The
// times inside the lease record (Renewed, Expires) are for people, and
// TTL is their difference (a difference on one clock).

// Lease defaults.
const (
	DefaultLeaseTTL       = 25 * time.Second
	DefaultLeaseHeartbeat = 10 * time.Second
)

var (
	// ErrLeaseHeld is an Acquire refused because another holder's lease is
	// live. See LeaseHeldError.
	ErrLeaseHeld = errors.New("lease held by another holder")
	// ErrLeaseLost is returned once a lease was taken over or expired.
	ErrLeaseLost = errors.New("lease lost")
	// ErrLeaseLapsed is a lost lease that expired because its renewals
	// failed (the store did not answer), not one another holder took:
	// errors.Is(err, ErrLeaseLost) holds for it too.
	ErrLeaseLapsed = errors.New("lease lapsed")
)

// LeaseHeldError names the live holder: which writer, on this machine or
// which other one, with which state dir. Leases written by an older
// hermesfs name only the writer id (Host).
type LeaseHeldError struct {
	Holder   string
	Host     string // the holder's writer id: its hostname and a random suffix
	Hostname string // its machine's hostname; "" in an older lease
	StateDir string // its state dir; "" in an older lease
	// SameMachine is true when the holder runs on this machine (same
	// hostname and machine id): another mount here, not another host.
	SameMachine bool
	Expires     time.Time
}

func (e *LeaseHeldError) Error() string {
	return fmt.Sprintf("the store is in use by %s; lease valid until %s unless renewed)",
		strings.TrimSuffix(describeHolder(e.Holder, e.Host, e.Hostname, e.StateDir, e.SameMachine), ")"),
		e.Expires.UTC().Format(time.RFC3339))
}

func (e *LeaseHeldError) Is(target error) bool { return target == ErrLeaseHeld }

// describeHolder names a lease's holder for people, always ending in ")":
// "hermesfs mount /h on this machine (state dir /s, writer h-1a2b)", or on
// host H (another machine), or for an older lease only its writer id.
func describeHolder(holder, host, hostname, stateDir string, same bool) string {
	sd := stateDir
	if sd == "" {
		sd = "unknown"
	}
	switch {
	case hostname == "":
		return fmt.Sprintf("%s on host %s (a writer id; this lease was written by an older hermesfs, which does not record its machine or state dir)", holder, host)
	case same:
		return fmt.Sprintf("%s on this machine (state dir %s, writer %s)", holder, sd, host)
	}
	return fmt.Sprintf("%s on host %s (another machine; state dir %s there, writer %s)", holder, hostname, sd, host)
}

// describe names r's holder as seen from the catalog's machine.
func (c *Catalog) describe(r LeaseRecord) string {
	return describeHolder(r.Holder, r.Host, r.Hostname, r.StateDir, c.opts.Machine.holds(r))
}

// Machine identifies the machine a catalog runs on, so that whoever finds
// the writer lease held can tell another mount on this machine from
// another machine.
type Machine struct {
	// Hostname is os.Hostname.
	Hostname string
	// ID is a digest of the machine id (/etc/machine-id, else
	// /var/lib/dbus/machine-id), "" where there is none: hostnames repeat
	// across cloned VMs and containers. The id itself never leaves the
	// machine (systemd asks that it be kept private).
	ID string
	// BootID is a digest of the kernel's boot id, new at every boot (and
	// different on every clone of a VM): a lease with this machine's
	// BootID was written during this very boot of it. "" where the
	// kernel gives none.
	BootID string
}

// SameBoot reports whether lease r was written on machine m during its
// current boot: only then can m tell whether r's holder still runs (see
// LeaseOptions.HolderDead).
func (m Machine) SameBoot(r LeaseRecord) bool {
	return m.holds(r) && m.BootID != "" && r.BootID == m.BootID
}

// holds reports whether lease r was written on machine m.
func (m Machine) holds(r LeaseRecord) bool {
	return m.Hostname != "" && r.Hostname == m.Hostname && r.MachineID == m.ID
}

// LocalMachine is the machine this process runs on.
var LocalMachine = sync.OnceValue(func() Machine {
	m := Machine{}
	m.Hostname, _ = os.Hostname()
	for _, p := range []string{"/etc/machine-id", "/var/lib/dbus/machine-id"} {
		b, err := os.ReadFile(p)
		if id := strings.TrimSpace(string(b)); err == nil && id != "" {
			sum := sha256.Sum256([]byte("hermesfs writer lease machine\n" + id))
			m.ID = hex.EncodeToString(sum[:16])
			break
		}
	}
	if b, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		if id := strings.TrimSpace(string(b)); id != "" {
			sum := sha256.Sum256([]byte("hermesfs writer lease boot\n" + id))
			m.BootID = hex.EncodeToString(sum[:16])
		}
	}
	return m
})

// LeaseRecord is the content of the lease object.
type LeaseRecord struct {
	Holder string `json:"holder"`
	// Host is the holder's writer id (CatalogOptions.Host).
	Host string `json:"host"`
	// Hostname, MachineID (Machine.ID) and StateDir say where the holder
	// runs; absent from leases an older hermesfs wrote.
	Hostname  string `json:"hostname,omitempty"`
	MachineID string `json:"machine_id,omitempty"`
	StateDir  string `json:"state_dir,omitempty"`
	// BootID (Machine.BootID) and Process say which process of which
	// boot of that machine holds the lease, so that a contender on the
	// same machine can prove it gone; absent from older leases.
	BootID     string        `json:"boot_id,omitempty"`
	Process    *LeaseProcess `json:"process,omitempty"`
	Token      string        `json:"token"` // random, one per acquisition
	Generation int64         `json:"generation"`
	Acquired   time.Time     `json:"acquired"`
	Renewed    time.Time     `json:"renewed"`
	Expires    time.Time     `json:"expires"`
	Released   bool          `json:"released,omitempty"`
	// Base is the snapshot the holder's mount is based on: its tree came
	// from it and its next snapshot is packed on it. Prune keeps it.
	Base string `json:"base,omitempty"`
	// Write is random per write: after an ambiguous failure (the request
	// may have landed) the writer re-reads and recognises its own write.
	Write string `json:"write"`
}

// LeaseProcess names the process holding a lease on its machine
// (LeaseRecord.Process). The catalog records it and never reads it: what
// it proves is the holder's to decide (LeaseOptions.HolderDead).
type LeaseProcess struct {
	// PID is the holder's process id, in the pid namespace PIDNamespace
	// names (as readlink /proc/self/ns/pid gives it).
	PID          int    `json:"pid,omitempty"`
	PIDNamespace string `json:"pid_ns,omitempty"`
	// Lock names the file the holder keeps locked while it runs (its
	// state dir's lock) as "DEV:INODE", so that a contender can tell
	// that file from another at the same path in another mount
	// namespace.
	Lock string `json:"lock,omitempty"`
}

// ttl is the holder's TTL: the span of its own record, on its own clock.
func (r LeaseRecord) ttl() time.Duration {
	if d := r.Expires.Sub(r.Renewed); d > 0 {
		return d
	}
	return DefaultLeaseTTL
}

// httpDateResolution is the granularity of HTTP dates (Date,
// Last-Modified): an age measured from them may be short by up to this.
const httpDateResolution = time.Second

// leaseLeft is how much longer the lease read as cur (info: its object)
// binds others, by the store's clock or by how long this catalog has seen
// the object unchanged; 0 if it is stale or released.
func (c *Catalog) leaseLeft(cur LeaseRecord, info ObjectInfo) time.Duration {
	if cur.Released || cur.Expires.IsZero() {
		return 0 // released, or unreadable: anyone may replace it
	}
	ttl := cur.ttl()
	mono := c.opts.Mono()
	c.mu.Lock()
	if c.leaseSeen.etag != info.ETag || info.ETag == "" {
		c.leaseSeen.etag, c.leaseSeen.at = info.ETag, mono
	}
	left := ttl - (mono - c.leaseSeen.at)
	c.mu.Unlock()
	if !info.StoreTime.IsZero() && !info.ModTime.IsZero() {
		age := info.StoreTime.Sub(info.ModTime)
		left = min(left, ttl+httpDateResolution-age)
	}
	return max(left, 0)
}

// LeaseOptions configures AcquireLease.
type LeaseOptions struct {
	// Holder names the writer for humans and for restarts, e.g.
	// "hermesfs mount /home/a/.hermes". A live lease with the same Holder
	// and the catalog's Host is taken over at once: it belonged to an
	// earlier run of the same writer that did not release it (a crash).
	// So Holder must not name the process, and the caller must make sure
	// only one writer per Holder runs on a host (a lock in its state dir).
	Holder string
	// TTL is how long a lease lives without renewal (default 25s).
	TTL time.Duration
	// Heartbeat is the renewal period (default 10s, or TTL*2/5 if that is
	// shorter); negative disables
	// background renewal (call Renew yourself).
	Heartbeat time.Duration
	// Base is the snapshot the holder's mount is based on (see
	// LeaseRecord.Base); SetBase changes it.
	Base string
	// StateDir is the holder's local state dir, recorded in the lease for
	// whoever finds it held.
	StateDir string
	// Process, if set, is recorded in the lease (LeaseRecord.Process).
	Process *LeaseProcess
	// HolderDead, if set, is asked about a live lease of another holder
	// that was written during this boot of this machine
	// (Machine.SameBoot): if it proves that holder's process gone, it
	// returns why ("its state dir's lock is free") and true, and the
	// lease is taken over at once instead of refused until it expires.
	// It must answer true only on proof: a wrong true takes a live
	// holder's lease (which then stops publishing).
	HolderDead func(LeaseRecord) (why string, dead bool)
}

// Lease is a held writer lease.
type Lease struct {
	c    *Catalog
	opts LeaseOptions
	log  *slog.Logger

	mu    sync.Mutex
	rec   LeaseRecord
	etag  string
	valid time.Duration // on Mono: the lease binds until then
	base  string        // the Base of the next write
	// unsure: the Write nonces of renewals that failed without an answer
	// (a timeout): the store may have applied them. A lease found
	// changed that carries one of them is this holder's own write.
	unsure  []string
	err     error // set once lost or released
	lost    chan struct{}
	stop    context.CancelFunc
	stopped chan struct{}
}

// ReadLease returns the current lease record and its ETag, or an error
// satisfying errors.Is(err, io/fs.ErrNotExist) if there is none.
func (c *Catalog) ReadLease(ctx context.Context) (LeaseRecord, string, error) {
	r, info, err := c.readLease(ctx)
	return r, info.ETag, err
}

func (c *Catalog) readLease(ctx context.Context) (LeaseRecord, ObjectInfo, error) {
	rc, info, err := c.store.Get(ctx, LeaseKey, 0, 64<<10)
	if err != nil {
		return LeaseRecord{}, ObjectInfo{}, fmt.Errorf("read lease: %w", err)
	}
	defer rc.Close()
	b, err := io.ReadAll(rc)
	if err != nil {
		return LeaseRecord{}, ObjectInfo{}, fmt.Errorf("read lease: %w", err)
	}
	var r LeaseRecord
	if err := json.Unmarshal(b, &r); err != nil {
		// Unreadable: treat as a stale lease anyone may replace.
		c.log.Warn("lease object is not valid JSON; treating it as stale", "err", err)
		return LeaseRecord{}, info, nil
	}
	return r, info, nil
}

// AcquireLease takes the writer lease of the prefix, or fails with a
// LeaseHeldError while another holder's lease is live. Unless
// o.Heartbeat is negative, the lease renews itself in the background
// until Release.
func (c *Catalog) AcquireLease(ctx context.Context, o LeaseOptions) (*Lease, error) {
	if o.TTL <= 0 {
		o.TTL = DefaultLeaseTTL
	}
	if o.Heartbeat == 0 {
		// Several renewals within a TTL, so that one failed renewal
		// does not cost the lease.
		o.Heartbeat = min(DefaultLeaseHeartbeat, o.TTL*2/5)
	}
	l := &Lease{c: c, opts: o, log: c.log.With("lease_holder", o.Holder), lost: make(chan struct{}), base: o.Base}
	token := randomHex(8)
	for attempt := 0; ; attempt++ {
		cur, info, err := c.readLease(ctx)
		exists, etag := err == nil, info.ETag
		if err != nil && !errors.Is(err, iofs.ErrNotExist) {
			return nil, err
		}
		now := c.opts.Now()
		sameHolder := cur.Host == c.opts.Host && cur.Holder == o.Holder
		dead := ""
		if exists && !sameHolder {
			if left := c.leaseLeft(cur, info); left > 0 {
				why, ok := "", false
				if o.HolderDead != nil && c.opts.Machine.SameBoot(cur) {
					why, ok = o.HolderDead(cur)
				}
				if !ok {
					return nil, &LeaseHeldError{Holder: cur.Holder, Host: cur.Host, Hostname: cur.Hostname, StateDir: cur.StateDir,
						SameMachine: c.opts.Machine.holds(cur), Expires: now.Add(left)}
				}
				dead = why
			}
		}
		switch {
		case dead != "":
			l.log.Warn("taking over the live lease of a holder that is gone", "holder", c.describe(cur), "proof", dead, "last_renewed", cur.Renewed)
		case exists && etag != "" && !cur.Released && cur.Token != "":
			l.log.Warn("taking over a stale lease", "stale_holder", c.describe(cur), "last_renewed", cur.Renewed)
		}
		rec := LeaseRecord{
			Holder: o.Holder, Host: c.opts.Host, Token: token, Generation: cur.Generation + 1,
			Hostname: c.opts.Machine.Hostname, MachineID: c.opts.Machine.ID, StateDir: o.StateDir,
			BootID: c.opts.Machine.BootID, Process: o.Process,
			Acquired: now.UTC(), Renewed: now.UTC(), Expires: now.Add(o.TTL).UTC(), Write: randomHex(8), Base: o.Base,
		}
		cond := PutOptions{IfNoneMatch: !exists, IfMatch: etag}
		start := c.opts.Mono()
		newTag, err := l.write(ctx, rec, cond)
		if err == nil {
			l.rec, l.etag, l.valid = rec, newTag, start+o.TTL
			break
		}
		if !errors.Is(err, ErrPrecondition) || attempt >= 3 {
			return nil, err
		}
		// Someone else wrote first; look again (they may hold it now).
	}
	l.log.Info("acquired the writer lease", "generation", l.rec.Generation, "ttl", o.TTL)
	if o.Heartbeat > 0 {
		hctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		l.stop, l.stopped = cancel, make(chan struct{})
		go l.heartbeat(hctx)
	}
	return l, nil
}

// write puts rec under cond and returns the new ETag. A failed condition
// is re-checked: if the object holds rec's own write, an earlier attempt
// landed and the write succeeded.
func (l *Lease) write(ctx context.Context, rec LeaseRecord, cond PutOptions) (string, error) {
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return "", err
	}
	info, err := l.c.store.Put(ctx, LeaseKey, bytes.NewReader(b), int64(len(b)), cond)
	if err == nil {
		return info.ETag, nil
	}
	if !errors.Is(err, ErrPrecondition) {
		return "", fmt.Errorf("write lease: %w", err)
	}
	cur, etag, rerr := l.c.ReadLease(ctx)
	if rerr == nil && cur.Write == rec.Write {
		return etag, nil
	}
	return "", fmt.Errorf("write lease: %w", err)
}

func randomHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return fmt.Sprintf("%x", b)
}

func (l *Lease) heartbeat(ctx context.Context) {
	defer close(l.stopped)
	t := time.NewTicker(l.opts.Heartbeat)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-l.lost:
			return
		case <-t.C:
		}
		rctx, cancel := context.WithTimeout(ctx, l.opts.Heartbeat)
		err := l.Renew(rctx)
		cancel()
		if err != nil && ctx.Err() == nil {
			l.log.Warn("lease renewal failed", "err", err)
		}
	}
}

// Renew extends the lease by TTL from now. It fails with ErrLeaseLost once
// the lease was taken over, or when renewals kept failing until it expired.
func (l *Lease) Renew(ctx context.Context) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return l.err
	}
	now, start := l.c.opts.Now(), l.c.opts.Mono()
	rec := l.rec
	rec.Renewed, rec.Expires, rec.Write, rec.Base = now.UTC(), now.Add(l.opts.TTL).UTC(), randomHex(8), l.base
	etag, err := l.write(ctx, rec, PutOptions{IfMatch: l.etag})
	if errors.Is(err, ErrPrecondition) {
		cur, curTag, rerr := l.c.ReadLease(ctx)
		if rerr == nil && l.adopt(cur, curTag) {
			// Written again over this holder's own applied write.
			etag, err = l.write(ctx, rec, PutOptions{IfMatch: l.etag})
		} else {
			return l.markLost(fmt.Errorf("%w: taken over by %s, generation %d", ErrLeaseLost, l.c.describe(cur), cur.Generation))
		}
	}
	switch {
	case err == nil:
		l.rec, l.etag, l.valid, l.unsure = rec, etag, start+l.opts.TTL, nil
		return nil
	case errors.Is(err, ErrPrecondition):
		cur, _, _ := l.c.ReadLease(ctx)
		return l.markLost(fmt.Errorf("%w: taken over by %s, generation %d", ErrLeaseLost, l.c.describe(cur), cur.Generation))
	case l.c.opts.Mono() >= l.valid:
		return l.markLost(fmt.Errorf("%w: %w: not renewed within its TTL of %s: %w", ErrLeaseLost, ErrLeaseLapsed, l.opts.TTL, err))
	}
	// No answer: the store may have applied it.
	l.unsure = append(l.unsure, rec.Write)
	return err
}

// adopt takes cur (ETag tag), the lease as the store now has it, as this
// holder's own if it is one of its renewals that failed without an answer
// but was applied. Its validity stays that of the last renewal known to
// have landed (the applied one began later). l.mu is held.
func (l *Lease) adopt(cur LeaseRecord, tag string) bool {
	if cur.Token != l.rec.Token || cur.Released || !slices.Contains(l.unsure, cur.Write) {
		return false
	}
	l.rec, l.etag, l.unsure = cur, tag, nil
	l.log.Info("a lease renewal that failed without an answer had been applied", "generation", cur.Generation)
	return true
}

// markLost records the loss; l.mu is held.
func (l *Lease) markLost(err error) error {
	if l.err == nil {
		l.err = err
		close(l.lost)
		l.log.Error("lost the writer lease; publishing must stop", "err", err)
	}
	return l.err
}

// Lost is closed when the lease is lost (or released).
func (l *Lease) Lost() <-chan struct{} { return l.lost }

// Err is nil while the lease is held: not lost, not released, and less
// than TTL since its last successful write began, on this host's
// monotonic clock (so a holder cut off from the store stops believing in
// its lease before others may take it).
func (l *Lease) Err() error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return l.err
	}
	if l.c.opts.Mono() >= l.valid {
		return l.markLost(fmt.Errorf("%w: %w: not renewed within its TTL of %s", ErrLeaseLost, ErrLeaseLapsed, l.opts.TTL))
	}
	return nil
}

// SetBase records the snapshot the holder's mount is now based on; the
// next renewal writes it into the lease, where prune finds it.
func (l *Lease) SetBase(id string) {
	l.mu.Lock()
	l.base = id
	l.mu.Unlock()
}

// Record is the lease as last written by this holder.
func (l *Lease) Record() LeaseRecord {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.rec
}

// Release stops the heartbeat and gives the lease up, so the next host need
// not wait for it to expire. Releasing a lost lease does nothing.
func (l *Lease) Release(ctx context.Context) error {
	if l.stop != nil {
		l.stop()
		<-l.stopped
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return nil
	}
	rec := l.rec
	rec.Released, rec.Expires, rec.Write = true, l.c.opts.Now().UTC(), randomHex(8)
	_, err := l.write(ctx, rec, PutOptions{IfMatch: l.etag})
	if errors.Is(err, ErrPrecondition) {
		if cur, curTag, rerr := l.c.ReadLease(ctx); rerr == nil && l.adopt(cur, curTag) {
			_, err = l.write(ctx, rec, PutOptions{IfMatch: l.etag})
		}
	}
	l.err = errors.New("lease released")
	close(l.lost)
	if errors.Is(err, ErrPrecondition) {
		return nil // someone else holds it now: nothing of ours to release
	}
	if err != nil {
		return fmt.Errorf("release lease: %w", err)
	}
	l.log.Info("released the writer lease")
	return nil
}
