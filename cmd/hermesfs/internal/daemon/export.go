package daemon

// The types the other hermesfs commands share with the daemon, under
// exported names (the daemon's own code uses the unexported ones), and the
// lookup of a running daemon.

// StatusReport is what `hermesfs status` shows; the daemon fills it.
type StatusReport = statusReport

// CompactionStatus is the compaction part of StatusReport.
type CompactionStatus = compactionStatus

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

// LocateDaemon finds the control socket and state dir of the daemon
// serving mountpoint, or of its last mount (stateDir: as given, or "" to
// look it up: registry, HERMESFS_STATE_DIR, default); From says where the
// state dir came from.
func LocateDaemon(getenv func(string) string, mountpoint, stateDir string) (RegistryEntry, error) {
	return locateDaemon(&env{Options{Getenv: getenv}}, mountpoint, stateDir)
}

// LocateDaemons lists every control socket that may answer for the daemon
// serving mountpoint, in the order to try them (see locateDaemons).
func LocateDaemons(getenv func(string) string, mountpoint, stateDir string) ([]RegistryEntry, error) {
	return locateDaemons(&env{Options{Getenv: getenv}}, mountpoint, stateDir)
}

// WaitReport is what a mount that is not writable yet waits for
// (StatusReport.Waiting).
type WaitReport = waitReport
