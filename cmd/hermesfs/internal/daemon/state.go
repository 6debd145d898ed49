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
	// Base is the snapshot whose archive is the lower layer (cache/<id>.sqfs).
	// Empty: the lower layer is empty (first boot on an empty store).
	Base       string `json:"base,omitempty"`
	BaseSHA256 string `json:"base_sha256,omitempty"`
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
	CleanShutdown bool      `json:"clean_shutdown"`
	Updated       time.Time `json:"updated"`
}

// stateDir is one mountpoint's state directory. The lock keeps it to one
// daemon at a time.
type stateDir struct {
	path string
	lock *os.File
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

// openStateDir creates the state dir's layout (0700) and takes its lock.
func openStateDir(path string) (*stateDir, error) {
	if err := os.MkdirAll(path, 0o700); err != nil {
		return nil, fmt.Errorf("state dir %s: %w", path, err)
	}
	for _, d := range []string{"cache", "upper", "pack"} {
		if err := os.MkdirAll(filepath.Join(path, d), 0o700); err != nil {
			return nil, fmt.Errorf("state dir %s: %w", path, err)
		}
	}
	f, err := os.OpenFile(filepath.Join(path, "lock"), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("state dir %s: lock: %w", path, err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		pid, _ := io.ReadAll(io.LimitReader(f, 32))
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%s: %w (pid %s)", path, errStateLocked, strings.TrimSpace(string(pid)))
		}
		return nil, fmt.Errorf("state dir %s: lock: %w", path, err)
	}
	// The pid is informational, for the error above.
	if err := f.Truncate(0); err == nil {
		f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	}
	return &stateDir{path: path, lock: f}, nil
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
