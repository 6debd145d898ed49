package daemon

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

// Before a daemon is ready its control socket does not answer, and a boot
// can take long: a first seed packs and uploads a whole home. Meanwhile
// the daemon says what it does in two places: a log line every
// bootReportEvery on stderr (whatever stderr is: a terminal, journald, a
// container log, so a slow boot never looks hung), and the file boot.json
// in the state dir, which `hermesfs status` reads while nothing answers on
// the socket. boot.json goes when the boot ends, ready or not; one left by
// a killed daemon names a pid that is gone and is ignored.

// bootReportEvery is how often a long boot step logs its progress.
const bootReportEvery = 5 * time.Second

// bootFileEvery bounds how often boot.json is rewritten.
const bootFileEvery = time.Second

const bootFile = "boot.json"

// BootStatus is boot.json: what a daemon that is not ready yet does.
type BootStatus struct {
	PID     int       `json:"pid"`
	Started time.Time `json:"started"`
	// Doing is one line for people: "seeding the store from the existing
	// directory: packed 120 of 5000 files (1.2 MiB of 409.6 MiB)".
	Doing   string    `json:"doing"`
	Updated time.Time `json:"updated"`
}

// setBootStatus records what the boot does now, for status.
func (d *daemon) setBootStatus(doing string) {
	if d.sd == nil {
		return
	}
	b, err := json.Marshal(BootStatus{PID: os.Getpid(), Started: d.started, Doing: doing, Updated: time.Now()})
	if err != nil {
		return
	}
	// No fsync: it describes a process, and is worthless after a crash.
	tmp := d.sd.file("." + bootFile + ".tmp")
	if os.WriteFile(tmp, b, 0o600) == nil {
		os.Rename(tmp, d.sd.file(bootFile))
	}
}

// clearBootStatus removes boot.json: the boot is over.
func (d *daemon) clearBootStatus() {
	if d.sd != nil {
		os.Remove(d.sd.file(bootFile))
		os.Remove(d.sd.file("." + bootFile + ".tmp"))
	}
}

// ReadBootStatus returns what the booting daemon of the state dir does,
// if one is booting there.
func ReadBootStatus(stateDir string) (BootStatus, bool) {
	var bs BootStatus
	b, err := os.ReadFile(filepath.Join(stateDir, bootFile))
	if err != nil || json.Unmarshal(b, &bs) != nil || !ProcessAlive(bs.PID) {
		return BootStatus{}, false
	}
	return bs, true
}

// BootingReport is status' report of a daemon that is not ready yet.
func BootingReport(mountpoint, stateDir string) (StatusReport, bool) {
	bs, ok := ReadBootStatus(stateDir)
	if !ok {
		return StatusReport{}, false
	}
	return StatusReport{Mountpoint: mountpoint, StateDir: stateDir, Running: true, PID: bs.PID,
		Started: bs.Started, Boot: bs.Doing, Lease: "none yet"}, true
}

// seedProgress reports a seed's pack and upload: a log line every
// bootReportEvery, boot.json at most every bootFileEvery. The pack calls
// it on one goroutine, the upload maybe on several.
type seedProgress struct {
	d                 *daemon
	mu                sync.Mutex
	lastLog, lastFile time.Time
}

func newSeedProgress(d *daemon) *seedProgress {
	now := time.Now()
	return &seedProgress{d: d, lastLog: now, lastFile: now.Add(-bootFileEvery)}
}

const seedDoing = "seeding the store from the existing directory"

// started says the seed began (at once: a log line and boot.json).
func (s *seedProgress) started() {
	s.d.log.Info(seedDoing+": the store is empty and the mountpoint directory is not; packing it as the first snapshot before mounting over it", "dir", s.d.cfg.Mountpoint)
	s.d.setBootStatus(seedDoing + ": packing")
}

func (s *seedProgress) packed(p archive.PackProgress) {
	s.report(fmt.Sprintf("packed %d of %d files (%s of %s)", p.Files, p.TotalFiles, HumanBytes(p.Bytes), HumanBytes(p.TotalBytes)),
		"files", p.Files, "of_files", p.TotalFiles, "bytes", p.Bytes, "of_bytes", p.TotalBytes)
}

// packDone says the pack is over and the upload begins.
func (s *seedProgress) packDone(ps packStats) {
	what := fmt.Sprintf("packed %d files (%s of content) into %s; uploading it", ps.Files, HumanBytes(ps.BytesPacked), HumanBytes(ps.Segment))
	s.mu.Lock()
	s.d.log.Info(seedDoing+": "+what, "files", ps.Files, "bytes_packed", ps.BytesPacked, "segment", ps.Segment)
	s.lastLog = time.Now()
	s.d.setBootStatus(seedDoing + ": " + what)
	s.mu.Unlock()
	if seedPacked != nil {
		seedPacked()
	}
}

// seedPacked, in tests, is called once a seed is packed, before its
// upload: a test holds the boot there.
var seedPacked func()

func (s *seedProgress) uploaded(sent, total int64) {
	s.report(fmt.Sprintf("uploaded %s of %s", HumanBytes(sent), HumanBytes(total)), "uploaded", sent, "of_bytes", total)
}

func (s *seedProgress) report(what string, attrs ...any) {
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if now.Sub(s.lastLog) >= bootReportEvery {
		s.lastLog = now
		s.d.log.Info(seedDoing+": "+what, attrs...)
	}
	if now.Sub(s.lastFile) >= bootFileEvery {
		s.lastFile = now
		s.d.setBootStatus(seedDoing + ": " + what)
	}
}
