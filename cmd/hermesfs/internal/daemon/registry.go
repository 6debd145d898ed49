package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// A registry of mounts lives in the runtime dir (see RuntimeDir), one file
// per mountpoint, so that `hermesfs status` with no argument finds every
// running mount, and status, snapshot and umount find the state dir of a
// mount made with a state dir other than the default. An entry stays once
// its daemon is gone: a daemon that stops records that it stopped (PID 0),
// a killed one leaves its pid, which callers check (ProcessAlive) before
// they talk to its socket. Either way the entry still names the state dir
// that holds the mount's local changes, until the runtime dir goes (a
// reboot empties /run).
type registryEntry struct {
	Mountpoint string    `json:"mountpoint"`
	StateDir   string    `json:"state_dir"`
	Socket     string    `json:"socket"`
	PID        int       `json:"pid"`
	Stopped    time.Time `json:"stopped,omitzero"` // when its daemon stopped
	// Store is the daemon's store URL, credentials redacted ("" from
	// daemons before it was recorded).
	Store string `json:"store,omitempty"`
	// From says where locateDaemon found StateDir: "running daemon",
	// "registry" (the last mount of it, its daemon gone), "--state-dir",
	// "HERMESFS_STATE_DIR" or "default".
	From string `json:"-"`
}

// Where locateDaemon found a state dir (registryEntry.From).
const (
	FromRunning  = "running daemon"
	FromRegistry = "registry"
	FromFlag     = "--state-dir"
	FromEnv      = "HERMESFS_STATE_DIR"
	FromDefault  = "default"
)

func registryPath(dir, mountpoint string) string {
	return filepath.Join(dir, escapePath(mountpoint)+".json")
}

func registerMount(dir string, e registryEntry) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("registry %s: %w", dir, err)
	}
	b, err := json.Marshal(e)
	if err != nil {
		return err
	}
	return uploader.WriteFileAtomic(registryPath(dir, e.Mountpoint), b, 0o600)
}

// markStopped records, if the entry is still ours, that its daemon
// stopped: the entry keeps naming the state dir, for status and umount.
func markStopped(dir, mountpoint string, pid int) {
	e, err := lookupRegistry(dir, mountpoint)
	if err == nil && e.PID == pid {
		e.PID, e.Stopped = 0, time.Now().UTC()
		if b, err := json.Marshal(e); err == nil {
			uploader.WriteFileAtomic(registryPath(dir, mountpoint), b, 0o600)
		}
	}
}

func lookupRegistry(dir, mountpoint string) (registryEntry, error) {
	var e registryEntry
	b, err := os.ReadFile(registryPath(dir, mountpoint))
	if err != nil {
		return e, err
	}
	if err := json.Unmarshal(b, &e); err != nil {
		return e, fmt.Errorf("registry entry for %s: %w", mountpoint, err)
	}
	return e, nil
}

// ListRegistry returns the entries whose process is alive, by mountpoint.
func ListRegistry(dir string) ([]registryEntry, error) {
	names, err := filepath.Glob(filepath.Join(dir, "*.json"))
	if err != nil {
		return nil, err
	}
	var out []registryEntry
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			continue
		}
		var e registryEntry
		if json.Unmarshal(b, &e) != nil || !ProcessAlive(e.PID) {
			continue
		}
		out = append(out, e)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Mountpoint < out[j].Mountpoint })
	return out, nil
}

func ProcessAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// locateDaemon finds the control socket and state dir of the daemon for
// mountpoint, or of its last mount: stateDir if given, else a registry
// entry whose daemon runs, else $HERMESFS_STATE_DIR, else the registry
// entry of its last mount (a daemon that stopped or was killed), else the
// default state dir. From says which.
func locateDaemon(e *env, mountpoint, stateDir string) (registryEntry, error) {
	mp, err := ResolveMountpoint(mountpoint)
	if err != nil {
		return registryEntry{}, err
	}
	from := FromFlag
	if stateDir == "" {
		r, rerr := lookupRegistry(RuntimeDir(os.Getuid(), e.Getenv), mp)
		if rerr == nil && ProcessAlive(r.PID) {
			r.From = FromRunning
			return r, nil
		}
		stateDir, from = e.Getenv("HERMESFS_STATE_DIR"), FromEnv
		if stateDir == "" && rerr == nil && r.StateDir != "" {
			stateDir, from = r.StateDir, FromRegistry
		}
	}
	if stateDir == "" {
		if stateDir, err = DefaultStateDir(mp, os.Getuid(), e.Getenv); err != nil {
			return registryEntry{}, err
		}
		from = FromDefault
	}
	if stateDir, err = filepath.Abs(stateDir); err != nil {
		return registryEntry{}, err
	}
	return registryEntry{Mountpoint: mp, StateDir: stateDir, Socket: filepath.Join(stateDir, "control.sock"), From: from}, nil
}

// locateDaemons lists where the daemon serving mountpoint may answer, to
// be tried in order, each socket once: the state dir given, every live
// registry entry for mountpoint (in this runtime dir, and in the one a
// daemon started by a service manager, without XDG_RUNTIME_DIR,
// registers in), HERMESFS_STATE_DIR, the entries of daemons that stopped
// or died (they name the state dir holding the mount's local changes) and
// the default state dir. Whoever
// would detach a mount no daemon answers for must have tried them all.
func locateDaemons(e *env, mountpoint, stateDir string) ([]registryEntry, error) {
	mp, err := ResolveMountpoint(mountpoint)
	if err != nil {
		return nil, err
	}
	var out []registryEntry
	seen := map[string]bool{}
	add := func(r registryEntry) {
		if !seen[r.Socket] {
			seen[r.Socket] = true
			out = append(out, r)
		}
	}
	dir := func(sd string) error {
		abs, err := filepath.Abs(sd)
		if err != nil {
			return err
		}
		add(registryEntry{Mountpoint: mp, StateDir: abs, Socket: filepath.Join(abs, "control.sock")})
		return nil
	}
	if stateDir != "" {
		if err := dir(stateDir); err != nil {
			return nil, err
		}
	}
	uid := os.Getuid()
	noXDG := func(k string) string {
		if k == "XDG_RUNTIME_DIR" || k == "HERMESFS_RUNTIME_DIR" {
			return ""
		}
		return e.Getenv(k)
	}
	var gone []registryEntry // entries of daemons that stopped or died
	for _, rdir := range []string{RuntimeDir(uid, e.Getenv), RuntimeDir(uid, noXDG)} {
		if r, err := lookupRegistry(rdir, mp); err == nil {
			if ProcessAlive(r.PID) {
				add(r)
			} else {
				gone = append(gone, r)
			}
		}
	}
	if sd := e.Getenv("HERMESFS_STATE_DIR"); sd != "" {
		if err := dir(sd); err != nil {
			return nil, err
		}
	}
	// The state dir the mount's last daemon used: where its local
	// changes are, though nothing answers there now.
	for _, r := range gone {
		add(r)
	}
	sd, err := DefaultStateDir(mp, uid, e.Getenv)
	if err != nil {
		if len(out) > 0 {
			return out, nil
		}
		return nil, err
	}
	if err := dir(sd); err != nil {
		return nil, err
	}
	return out, nil
}
