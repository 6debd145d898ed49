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
			s.removeCreated()
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
// that is still empty. Nothing that existed before, and nothing the boot
// wrote since (a download, state.json), is removed. Call it before close,
// with the lock held.
func (s *stateDir) removeCreated() {
	for i := len(s.created) - 1; i >= 0; i-- {
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
