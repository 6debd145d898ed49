package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	iofs "io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
)

// persistedState is state.json: what a restart on this host needs to know to
// lose nothing. It is rewritten atomically after every change that matters.
type persistedState struct {
	Mountpoint string `json:"mountpoint"`
	Store      string `json:"store"` // credentials redacted
	Host       string `json:"host"`
	// Base is the snapshot whose image is the lower layer (its segments
	// in cache/segments). Empty: the lower layer is empty (first boot on
	// an empty store).
	Base string `json:"base,omitempty"`
	// LastPublished is the newest snapshot this host published (it may
	// include upper-layer content: Base stays the lower archive until a
	// clean shutdown rebases onto it).
	LastPublished string    `json:"last_published,omitempty"`
	PublishedAt   time.Time `json:"published_at,omitzero"`
	// LastNumbersOf is the snapshot whose inode numbers LastPublished
	// keeps for the lower layer's objects (Base, when it was packed by
	// extending Base or an image that keeps them, or by compacting one):
	// then the next snapshot may extend LastPublished (daemon_extend.go).
	// Empty: it may not. Set with LastPublished.
	LastNumbersOf string `json:"last_published_numbers_of,omitempty"`
	// CompactedExtents is how many extents LastPublished's lineage had
	// right after its last compaction or fresh layout (0: not known):
	// the compaction policy bounds what snapshots add to it
	// (daemon_compact.go).
	CompactedExtents int `json:"compacted_extents,omitempty"`
	// Unpublished is true while the upper layer may hold changes that no
	// published snapshot contains.
	Unpublished bool `json:"unpublished"`
	// CleanShutdown is true when the last daemon stopped after a final
	// snapshot and unmount; false while one runs or after a crash.
	CleanShutdown bool `json:"clean_shutdown"`
	// UnderneathChecked is when a boot last looked at what the
	// mountpoint directory holds (underneath.go): what changed there
	// after it was written while no mount covered it.
	UnderneathChecked time.Time `json:"underneath_checked,omitzero"`
	Updated           time.Time `json:"updated"`
}

// stateDir is one mountpoint's state directory. The lock keeps it to one
// daemon at a time.
type stateDir struct {
	path string
	lock *os.File
	// created is what openStateDir made (directories top down, then the
	// lock file), for removeCreated.
	created []string
}

func (s *stateDir) file(name string) string { return filepath.Join(s.path, name) }
func (s *stateDir) upper() string           { return s.file("upper") }
func (s *stateDir) cacheDir() string        { return s.file("cache") }
func (s *stateDir) packDir() string         { return s.file("pack") }
func (s *stateDir) socket() string          { return s.file("control.sock") }
func (s *stateDir) auditLog() string        { return s.file("audit.jsonl") }
func (s *stateDir) cached(id string) string {
	return filepath.Join(s.cacheDir(), id+".sqfs")
}

// errStateLocked reports another daemon holding the state dir.
var errStateLocked = errors.New("state directory is in use by another hermesfs daemon")

// openStateDir creates the state dir's layout (0700) and takes its lock,
// noting what it created.
func openStateDir(path string) (_ *stateDir, err error) {
	s := &stateDir{path: path}
	defer func() {
		if err != nil {
			s.removeCreated(false)
		}
	}()
	if s.created, err = mkdirAll(path); err != nil {
		return nil, fmt.Errorf("state dir %s: %w", path, err)
	}
	for _, d := range []string{"cache", filepath.Join("cache", "segments"), "upper", "pack"} {
		made, err := mkdirAll(filepath.Join(path, d))
		if err != nil {
			return nil, fmt.Errorf("state dir %s: %w", path, err)
		}
		s.created = append(s.created, made...)
	}
	lockPath := filepath.Join(path, "lock")
	for attempt := 0; ; attempt++ {
		f, made, err := openLock(lockPath)
		if err != nil {
			return nil, fmt.Errorf("state dir %s: lock: %w", path, err)
		}
		if made {
			s.created = append(s.created, lockPath)
		}
		if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
			pid, _ := io.ReadAll(io.LimitReader(f, 32))
			f.Close()
			if errors.Is(err, syscall.EWOULDBLOCK) {
				return nil, fmt.Errorf("%s: %w (pid %s)", path, errStateLocked, strings.TrimSpace(string(pid)))
			}
			return nil, fmt.Errorf("state dir %s: lock: %w", path, err)
		}
		// A refused boot removes the lock file it made (removeCreated)
		// while holding it: a lock taken on that removed file locks
		// nothing, so take it again on the file now at the path.
		if same, err := sameFile(f, lockPath); err != nil || !same {
			f.Close()
			if made {
				s.created = s.created[:len(s.created)-1]
			}
			if attempt < 5 {
				continue
			}
			return nil, fmt.Errorf("state dir %s: lock: the lock file keeps being replaced", path)
		}
		s.lock = f
		break
	}
	// The pid is informational, for the error above.
	if err := s.lock.Truncate(0); err == nil {
		s.lock.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return s, nil
}

// stateHolderWait bounds how long a boot waits for a killed daemon that
// still holds the state dir to finish exiting.
var stateHolderWait = 15 * time.Second

// lockStateDir is openStateDir, except that a state dir held by a daemon
// that was killed but has not finished exiting (a zombie: one of its
// threads waits in the kernel, on a FUSE request nobody will answer) is
// taken over: the FUSE mounts below the state dir (the one at the
// mountpoint went before, clearMountpoint) are aborted, which ends that
// wait, and the lock is waited for, at most stateHolderWait.
func (d *daemon) lockStateDir(path string) (*stateDir, error) {
	sd, err := openStateDir(path)
	if err == nil {
		d.clearStateMounts(path)
	}
	if !errors.Is(err, errStateLocked) {
		return sd, err
	}
	pid := lockHolder(path)
	if !processDying(pid) {
		return nil, err
	}
	d.log.Warn("the state dir is held by a hermesfs daemon that was killed and has not finished exiting (a thread of it waits on a FUSE mount); aborting the mounts it may wait on, and waiting for it",
		"pid", pid, "state_dir", path, "waiting_up_to", stateHolderWait.String())
	for _, mp := range fs.MountsBelow(path) {
		if fstype, _ := MountedFS(mp); strings.HasPrefix(fstype, "fuse") {
			if aerr := fs.AbortConnection(mp, d.log); aerr != nil {
				d.log.Warn("cannot abort a FUSE mount in the state dir", "mountpoint", mp, "err", aerr)
			} else {
				d.log.Warn("aborted a FUSE mount the killed daemon left in the state dir", "mountpoint", mp)
			}
		}
	}
	deadline := time.Now().Add(stateHolderWait)
	for {
		sd, err = openStateDir(path)
		if !errors.Is(err, errStateLocked) {
			if err == nil {
				d.log.Info("took over the state dir of the killed daemon", "pid", pid)
				d.clearStateMounts(path)
			}
			return sd, err
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%w; it is a killed daemon that cannot finish exiting (State: Z; see /proc/%d/task/*/stack for what its threads wait on; aborting that FUSE connection frees it)", err, pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// clearStateMounts aborts and detaches the FUSE mounts below a state dir
// whose lock this daemon has just taken: only a daemon holding that lock
// mounts there (the passthrough write check), so they are a killed
// daemon's, dead or hung, and a hung one would hang the removal of the
// directory it is in.
func (d *daemon) clearStateMounts(path string) {
	for _, mp := range fs.MountsBelow(path) {
		if fstype, _ := MountedFS(mp); !strings.HasPrefix(fstype, "fuse") {
			continue
		}
		if err := fs.AbortConnection(mp, d.log); err != nil {
			d.log.Warn("cannot abort a FUSE mount a killed daemon left in the state dir", "mountpoint", mp, "err", err)
		} else {
			d.log.Warn("aborted a FUSE mount a killed daemon left in the state dir", "mountpoint", mp)
		}
	}
}

// lockHolder is the pid the lock file of state dir path names (0 if
// none).
func lockHolder(path string) int {
	b, err := os.ReadFile(filepath.Join(path, "lock"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// processDying reports whether process pid has exited but not all of its
// threads have (its main thread is a zombie: it can never run again, and
// what it holds goes once its last thread ends).
func processDying(pid int) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	// "pid (comm) S ...": the state follows the last ')'.
	i := strings.LastIndexByte(string(b), ')')
	return i >= 0 && i+2 < len(b) && b[i+2] == 'Z'
}

// mkdirAll is os.MkdirAll(path, 0o700) that returns the directories it
// created, top down.
func mkdirAll(path string) ([]string, error) {
	var missing []string
	for p := filepath.Clean(path); ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil {
			break
		} else if !errors.Is(err, iofs.ErrNotExist) {
			return nil, err
		}
		missing = append(missing, p)
		if filepath.Dir(p) == p {
			break
		}
	}
	var made []string
	for i := len(missing) - 1; i >= 0; i-- {
		if err := os.Mkdir(missing[i], 0o700); err != nil && !errors.Is(err, iofs.ErrExist) {
			return made, err
		} else if err == nil {
			made = append(made, missing[i])
		}
	}
	// What exists at path may be something other than a directory.
	if fi, err := os.Stat(path); err != nil {
		return made, err
	} else if !fi.IsDir() {
		return made, fmt.Errorf("%s: not a directory", path)
	}
	return made, nil
}

// openLock opens the lock file, creating it if needed; made says it did.
func openLock(path string) (f *os.File, made bool, err error) {
	f, err = os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err == nil {
		return f, true, nil
	}
	if !errors.Is(err, iofs.ErrExist) {
		return nil, false, err
	}
	f, err = os.OpenFile(path, os.O_RDWR, 0o600)
	return f, false, err
}

// sameFile reports whether f is the file now at path.
func sameFile(f *os.File, path string) (bool, error) {
	a, err := f.Stat()
	if err != nil {
		return false, err
	}
	b, err := os.Stat(path)
	if errors.Is(err, iofs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return os.SameFile(a, b), nil
}

// removeCreated takes away what openStateDir created, newest first, for a
// boot that does not go ahead: the lock file, then each directory it made
// that is still empty. With whole (the boot published nothing), a state
// dir it made goes whole, with what the boot wrote there since
// (state.json, a download, the bookkeeping of a mount shown read-only
// while the lease was awaited), unless its upper layer holds changes.
// Nothing that existed before is removed. Call it before close, with the
// lock held.
func (s *stateDir) removeCreated(whole bool) {
	if whole {
		changed, err := fs.UpperHasChanges(s.upper())
		whole = err == nil && !changed
	}
	for i := len(s.created) - 1; i >= 0; i-- {
		if s.created[i] == s.path && whole {
			os.RemoveAll(s.path)
			continue
		}
		if s.created[i] == s.segmentsDir() {
			// Made by this boot: what it holds (a manifest's segment
			// digests, fetched before the mount was refused) is only a
			// cache.
			os.RemoveAll(s.created[i])
			continue
		}
		os.Remove(s.created[i]) // a directory only if empty
	}
	s.created = nil
}

// close releases the lock.
func (s *stateDir) close() error {
	if s.lock == nil {
		return nil
	}
	err := s.lock.Close()
	s.lock = nil
	return err
}

// load reads state.json; a missing file is a zero state.
func (s *stateDir) load() (persistedState, error) {
	return ReadState(s.path)
}

func ReadState(dir string) (persistedState, error) {
	var st persistedState
	b, err := os.ReadFile(filepath.Join(dir, "state.json"))
	if errors.Is(err, iofs.ErrNotExist) {
		return st, nil
	}
	if err != nil {
		return st, fmt.Errorf("state: read %s: %w", dir, err)
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return st, fmt.Errorf("state: parse %s/state.json: %w", dir, err)
	}
	return st, nil
}

// save writes state.json atomically.
func (s *stateDir) save(st persistedState) error {
	st.Updated = time.Now().UTC()
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return uploader.WriteFileAtomic(s.file("state.json"), append(b, '\n'), 0o600)
}

// DirEmpty reports whether dir has no entries; a missing dir is empty.
func DirEmpty(dir string) (bool, error) {
	f, err := os.Open(dir)
	if errors.Is(err, iofs.ErrNotExist) {
		return true, nil
	}
	if err != nil {
		return false, err
	}
	defer f.Close()
	names, err := f.Readdirnames(1)
	if errors.Is(err, io.EOF) {
		return true, nil
	}
	return len(names) == 0, err
}

// setAside renames dir to dir.<what>-<time> so nothing is ever deleted that
// may hold the only copy of a user's data. It returns the new name.
func setAside(dir, what string) (string, error) {
	to := fmt.Sprintf("%s.%s-%s", dir, what, time.Now().UTC().Format("20060102T150405.000Z"))
	if err := os.Rename(dir, to); err != nil {
		return "", fmt.Errorf("set %s aside: %w", dir, err)
	}
	if err := uploader.SyncDir(filepath.Dir(dir)); err != nil {
		return "", err
	}
	return to, nil
}
