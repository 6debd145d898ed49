package daemon

import (
	"context"
	"os"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/lazy"
)

// What the other hermesfs commands share with the daemon: the control
// socket's client, the registry of running mounts, the state dir as status
// reads it, and the helpers that give errors their exit codes. The daemon
// itself uses the unexported names.

// StatusReport is what `hermesfs status` shows; the daemon fills it.
type StatusReport = statusReport

// SnapshotRecord is the last snapshot a daemon published.
type SnapshotRecord = snapshotRecord

// ControlRequest and ControlResponse are one exchange on the control
// socket (control.go).
type (
	ControlRequest  = controlRequest
	ControlResponse = controlResponse
)

// RegistryEntry is one running mount in the runtime dir.
type RegistryEntry = registryEntry

// PersistedState is a state dir's state.json.
type PersistedState = persistedState

// Owner is the user a root daemon serves (Config.Owner).
type Owner = owner

// ErrNoDaemon reports that nothing answers on a control socket.
var ErrNoDaemon = errNoDaemon

// ControlCall sends req to the control socket at path and returns the
// response; a socket nobody listens on gives ErrNoDaemon.
func ControlCall(ctx context.Context, path string, req ControlRequest) (ControlResponse, error) {
	return controlCall(ctx, path, req)
}

// LocateDaemon finds the control socket and state dir of the daemon
// serving mountpoint (stateDir: as given, or "" for the default).
func LocateDaemon(getenv func(string) string, mountpoint, stateDir string) (RegistryEntry, error) {
	return locateDaemon(&env{Options{Getenv: getenv}}, mountpoint, stateDir)
}

// ListRegistry lists the mounts registered in the runtime dir dir.
func ListRegistry(dir string) ([]RegistryEntry, error) { return listRegistry(dir) }

// ReadState reads the state.json of the state dir dir without locking it.
func ReadState(dir string) (PersistedState, error) { return readState(dir) }

// UpperHasChanges reports whether an upper layer holds changes.
func UpperHasChanges(dir string) (bool, error) { return upperHasChanges(dir) }

// ParseOwner reads USER[:GROUP]: names or numeric ids.
func ParseOwner(spec string) (*Owner, error) { return parseOwner(spec) }

// LazyLine describes the fill of a base read lazily, for status.
func LazyLine(l *lazy.Stats) string { return lazyLine(l) }

// LazyCryptError gives the error of opening an encrypted snapshot lazily
// its exit code.
func LazyCryptError(m uploader.Manifest, err error) error { return lazyCryptError(m, err) }

// OpenArchive opens the archive file at path, or the lazy reader of a base
// a running daemon is still fetching there. A corrupt archive carries
// ExitCorrupt.
func OpenArchive(path string, opts archive.ReaderOptions) (*archive.Reader, *os.File, error) {
	return openArchive(path, opts)
}

// ArchiveError gives archive damage its exit code.
func ArchiveError(err error) error { return archiveError(err) }

// CryptError gives encryption errors their exit code.
func CryptError(err error) error { return cryptError(err) }

// OrNone is s, or "none (empty)" for "".
func OrNone(s string) string { return orNone(s) }

// HumanBytes formats n bytes in binary units.
func HumanBytes(n int64) string { return humanBytes(n) }

// The answers of ProbeFUSE.
const (
	FUSELive = fuseLive // it answered
	FUSEDead = fuseDead // ENOTCONN or ECONNABORTED: its daemon is gone
	FUSEHung = fuseHung // no answer within the wait
)

// ProbeFUSE asks the mount at mp for statfs and says whether it answered
// (FUSELive), failed as a FUSE mount whose daemon is gone (FUSEDead) or did
// not answer within wait (FUSEHung).
func ProbeFUSE(mp string, wait time.Duration) int { return probeFUSE(mp, wait) }

// ProcessAlive reports whether the process pid exists.
func ProcessAlive(pid int) bool { return processAlive(pid) }

// DirEmpty reports whether dir has no entries.
func DirEmpty(dir string) (bool, error) { return dirEmpty(dir) }
