package main

// The torture tests' workload and its checker.
//
// The workload is a separate process (this test binary, re-executed with
// $HERMESFS_TORTURE_WORKLOAD set) that changes a mounted home the ways an
// agent does, from three goroutines ("workers"):
//
//	files  small files under files/: write+fsync, temp+fsync+rename+dir fsync,
//	       append+fsync, unlink+dir fsync, rename+dir fsync
//	blob   blob.bin, 512 KiB rewritten in place by pwrite+fsync
//	sql    db/state.db, WAL mode, synchronous=FULL, one sqlite3 process
//	       per transaction (insert, delete, update)
//
// Before an operation a worker appends "B seq worker kind args..." to a
// journal outside the mount and fsyncs it; once the operation (with its
// fsyncs) returned, "A seq". Content is derived from the seed and the
// sequence number, so the journal alone says what every acknowledged
// operation wrote. The workload stops when the mount goes away (any error)
// or on SIGTERM, between operations.
//
// The checker (tortureModel) turns the journal into each worker's history:
// the states it went through, each with the journal lines between which it
// could have been seen. A tree (the live mount after a crash, or a
// published snapshot) is consistent when one cut of the journal explains
// every worker's state at once: state j of a worker is visible at cut k
// when op j had begun (B line <= k) and op j+1 had not been acknowledged
// (A line > k); an op in flight at k may show partially (a prefix of its
// write). The live tree after a crash must be explained by the cut at the
// end of the journal: everything acknowledged is there. A snapshot may be
// explained by any cut: it is a consistent prefix of the workload.

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	iofs "io/fs"
	"maps"
	"math"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"

	"github.com/hermesfs/hermesfs/uploader"
)

const workloadEnv = "HERMESFS_TORTURE_WORKLOAD"

// The workload process: the test binary runs it instead of the tests when
// the variable is set (before TestMain, so no test machinery starts).
func init() {
	if cfg := os.Getenv(workloadEnv); cfg != "" {
		os.Exit(runWorkload(cfg))
	}
}

const (
	tortureFiles    = 24        // files/f00 .. files/f23
	tortureBlobSize = 512 << 10 // blob.bin
	tortureBlobMax  = 64 << 10  // largest pwrite into blob.bin
	tortureFileMax  = 48 << 10  // largest small file
	tortureDB       = "db/state.db"
)

// workloadConfig is what the test hands the workload, as JSON.
type workloadConfig struct {
	Mount   string   `json:"mount"`
	Journal string   `json:"journal"`
	Seed    uint64   `json:"seed"`
	Seq     int64    `json:"seq"` // the first op's sequence number
	Workers []string `json:"workers"`
	// PauseFile, when it exists, makes the workers wait between ops (so a
	// test can hold the workload still without ending it).
	PauseFile string `json:"pause_file,omitempty"`
	// PaceMillis, if positive, is a pause before each op of each worker:
	// a long test keeps its history (and the checker's work per snapshot)
	// small.
	PaceMillis int `json:"pace_millis,omitempty"`
}

// tortureBytes is the content of op seq: n printable bytes (compressible
// like text, so packs stay quick).
func tortureBytes(seed uint64, seq int64, stream uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed^(stream+1)*0x9e3779b97f4a7c15, uint64(seq)))
	const alpha = "abcdefghijklmnopqrstuvwxyz0123456789 .,;\n"
	b := make([]byte, n)
	for i := range b {
		b[i] = alpha[r.IntN(len(alpha))]
	}
	return b
}

// sqlText is a value for the database: letters only, so it needs no quoting
// and sqlite3's list output splits cleanly.
func sqlText(seed uint64, seq int64, stream uint64, n int) string {
	r := rand.New(rand.NewPCG(seed^(stream+7)*0x2545f4914f6cdd1d, uint64(seq)))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + r.IntN(26))
	}
	return string(b)
}

// journal is the workload's log of begun and acknowledged ops.
type journal struct {
	mu  sync.Mutex
	f   *os.File
	seq atomic.Int64
}

func (j *journal) line(s string) error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if _, err := j.f.WriteString(s + "\n"); err != nil {
		return err
	}
	return j.f.Sync()
}

func (j *journal) begin(worker, kind string, args ...any) (int64, error) {
	seq := j.seq.Add(1) - 1
	parts := []string{"B", strconv.FormatInt(seq, 10), worker, kind}
	for _, a := range args {
		parts = append(parts, fmt.Sprint(a))
	}
	return seq, j.line(strings.Join(parts, " "))
}

func (j *journal) ack(seq int64) error { return j.line("A " + strconv.FormatInt(seq, 10)) }

type workload struct {
	cfg     workloadConfig
	j       *journal
	dev     uint64 // the mount's device: a different one means it went away
	stopped atomic.Bool
}

func runWorkload(cfgJSON string) int {
	var cfg workloadConfig
	if err := json.Unmarshal([]byte(cfgJSON), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "workload:", err)
		return 2
	}
	f, err := os.OpenFile(cfg.Journal, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		fmt.Fprintln(os.Stderr, "workload:", err)
		return 2
	}
	w := &workload{cfg: cfg, j: &journal{f: f}}
	w.j.seq.Store(cfg.Seq)
	var st syscall.Stat_t
	if err := syscall.Stat(cfg.Mount, &st); err != nil {
		fmt.Fprintln(os.Stderr, "workload:", err)
		return 2
	}
	w.dev = st.Dev
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGTERM)
	go func() { <-sigs; w.stopped.Store(true) }()

	var wg sync.WaitGroup
	for i, name := range cfg.Workers {
		rng := rand.New(rand.NewPCG(cfg.Seed+uint64(i)*1000003, uint64(cfg.Seq)))
		wg.Go(func() {
			var err error
			switch name {
			case "files":
				err = w.files(rng)
			case "blob":
				err = w.blob(rng)
			case "sql":
				err = w.sql(rng)
			default:
				err = fmt.Errorf("unknown worker %q", name)
			}
			if err != nil {
				fmt.Fprintf(os.Stderr, "workload: %s: %v\n", name, err)
			}
		})
	}
	wg.Wait()
	return 0
}

// goOn reports whether to start another op: not told to stop, and the
// mount is still the one we started on.
func (w *workload) goOn() bool {
	for w.cfg.PauseFile != "" && !w.stopped.Load() {
		if _, err := os.Stat(w.cfg.PauseFile); err != nil {
			break
		}
		sleepMillis(5)
	}
	if w.cfg.PaceMillis > 0 && !w.stopped.Load() {
		sleepMillis(w.cfg.PaceMillis)
	}
	if w.stopped.Load() {
		return false
	}
	var st syscall.Stat_t
	return syscall.Stat(w.cfg.Mount, &st) == nil && st.Dev == w.dev
}

func (w *workload) path(rel string) string { return filepath.Join(w.cfg.Mount, rel) }

// do journals one op around fn.
func (w *workload) do(fn func() error, worker, kind string, args ...any) error {
	seq, err := w.j.begin(worker, kind, args...)
	if err != nil {
		return err
	}
	if err := fn(); err != nil {
		return fmt.Errorf("op %d %s %v: %w", seq, kind, args, err)
	}
	return w.j.ack(seq)
}

func writeSynced(path string, flag int, data []byte) error {
	f, err := os.OpenFile(path, flag, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

func fileSize(r *rand.Rand) int {
	switch p := r.IntN(10); {
	case p < 6:
		return r.IntN(2000)
	case p < 9:
		return 2000 + r.IntN(14000)
	}
	return 16000 + r.IntN(tortureFileMax-16000)
}

func (w *workload) files(r *rand.Rand) error {
	dir := w.path("files")
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, iofs.ErrExist) {
		return err
	}
	for w.goOn() {
		rel := fmt.Sprintf("files/f%02d", r.IntN(tortureFiles))
		p := w.path(rel)
		_, err := os.Lstat(p)
		exists := err == nil
		kinds := []string{"write", "replace"}
		if exists {
			kinds = []string{"write", "replace", "replace", "append", "append", "delete", "rename", "rename"}
		}
		kind := kinds[r.IntN(len(kinds))]
		n := fileSize(r)
		switch kind {
		case "write", "replace", "append":
			// The content is a function of the op's own seq, which begin
			// assigns: write it inside fn.
			var seq int64
			fn := func() error {
				data := tortureBytes(w.cfg.Seed, seq, 0, n)
				switch kind {
				case "write":
					return writeSynced(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, data)
				case "append":
					return writeSynced(p, os.O_WRONLY|os.O_CREATE|os.O_APPEND, data)
				}
				if err := writeSynced(p+".tmp", os.O_WRONLY|os.O_CREATE|os.O_TRUNC, data); err != nil {
					return err
				}
				if err := os.Rename(p+".tmp", p); err != nil {
					return err
				}
				return uploader.SyncDir(dir)
			}
			s, err := w.j.begin("files", kind, rel, n)
			if err != nil {
				return err
			}
			seq = s
			if err := fn(); err != nil {
				return fmt.Errorf("op %d %s %s: %w", seq, kind, rel, err)
			}
			if err := w.j.ack(seq); err != nil {
				return err
			}
		case "delete":
			if err := w.do(func() error {
				if err := os.Remove(p); err != nil {
					return err
				}
				return uploader.SyncDir(dir)
			}, "files", kind, rel); err != nil {
				return err
			}
		case "rename":
			to := fmt.Sprintf("files/f%02d", r.IntN(tortureFiles))
			if to == rel {
				continue
			}
			if err := w.do(func() error {
				if err := os.Rename(p, w.path(to)); err != nil {
					return err
				}
				return uploader.SyncDir(dir)
			}, "files", kind, rel, to); err != nil {
				return err
			}
		}
	}
	return nil
}

func (w *workload) blob(r *rand.Rand) error {
	p := w.path("blob.bin")
	for w.goOn() {
		fi, err := os.Stat(p)
		if err != nil || fi.Size() != tortureBlobSize {
			var seq int64
			seq, err := w.j.begin("blob", "create", tortureBlobSize)
			if err != nil {
				return err
			}
			if err := writeSynced(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, tortureBytes(w.cfg.Seed, seq, 1, tortureBlobSize)); err != nil {
				return fmt.Errorf("op %d create: %w", seq, err)
			}
			if err := w.j.ack(seq); err != nil {
				return err
			}
			continue
		}
		n := 1 + r.IntN(tortureBlobMax)
		if r.IntN(3) == 0 {
			n = 1 + r.IntN(4096)
		}
		off := r.IntN(tortureBlobSize - n + 1)
		if r.IntN(2) == 0 {
			off &^= 4095
		}
		seq, err := w.j.begin("blob", "pwrite", off, n)
		if err != nil {
			return err
		}
		err = func() error {
			f, err := os.OpenFile(p, os.O_WRONLY, 0)
			if err != nil {
				return err
			}
			defer f.Close()
			if _, err := f.WriteAt(tortureBytes(w.cfg.Seed, seq, 1, n), int64(off)); err != nil {
				return err
			}
			return f.Sync()
		}()
		if err != nil {
			return fmt.Errorf("op %d pwrite: %w", seq, err)
		}
		if err := w.j.ack(seq); err != nil {
			return err
		}
	}
	return nil
}

func (w *workload) sqlite(sql string) error {
	cmd := exec.Command("sqlite3", w.path(tortureDB), sql)
	cmd.Dir = "/"
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("sqlite3: %v: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

func (w *workload) sql(r *rand.Rand) error {
	if !w.goOn() {
		return nil
	}
	if err := os.Mkdir(w.path("db"), 0o755); err != nil && !errors.Is(err, iofs.ErrExist) {
		return err
	}
	if err := w.do(func() error {
		return w.sqlite("PRAGMA journal_mode=WAL; CREATE TABLE IF NOT EXISTS t(id INTEGER PRIMARY KEY, v TEXT NOT NULL);")
	}, "sql", "init"); err != nil {
		return err
	}
	for w.goOn() {
		vlen, ulen := 20+r.IntN(1500), 10+r.IntN(200)
		del, upd := r.IntN(40)+1, r.IntN(40)+1
		var seq int64
		seq, err := w.j.begin("sql", "txn", vlen, del, upd, ulen)
		if err != nil {
			return err
		}
		sql := fmt.Sprintf("PRAGMA synchronous=FULL; PRAGMA busy_timeout=10000; BEGIN; INSERT INTO t VALUES(%d,'%s'); DELETE FROM t WHERE id=%d; UPDATE t SET v='%s' WHERE id=%d; COMMIT;",
			seq, sqlText(w.cfg.Seed, seq, 0, vlen), seq-int64(del), sqlText(w.cfg.Seed, seq, 1, ulen), seq-int64(upd))
		if err := w.sqlite(sql); err != nil {
			return fmt.Errorf("op %d txn: %w", seq, err)
		}
		if err := w.j.ack(seq); err != nil {
			return err
		}
	}
	return nil
}

// ---- the checker ----

// tortureOp is one journaled op.
type tortureOp struct {
	seq    int64
	worker string
	kind   string
	args   []string
	begin  int // journal line of its B
	ack    int // journal line of its A (or of the resolution), -1 in flight
}

func (o *tortureOp) arg(i int) string { return o.args[i] }
func (o *tortureOp) num(i int) int {
	n, err := strconv.Atoi(o.args[i])
	if err != nil {
		panic(fmt.Sprintf("op %d: arg %d %q", o.seq, i, o.args[i]))
	}
	return n
}
func (o *tortureOp) String() string {
	return fmt.Sprintf("#%d %s %s %s (lines %d..%d)", o.seq, o.worker, o.kind, strings.Join(o.args, " "), o.begin, o.ack)
}

// treeState is what a check reads of a tree.
type treeState struct {
	files map[string][]byte // "files/fNN" -> content
	blob  []byte            // nil: absent
	rows  map[int64]string  // nil: no database yet
	extra []string          // entries the workload never makes
}

// wstate is one state in a worker's history.
type wstate struct {
	begin int        // B line of the op that made it; -1 for the initial state
	op    *tortureOp // that op (nil for the initial state)
	next  *tortureOp // the op that replaced it; nil while current
	hash  string
	files map[string]string // files worker: path -> content sha256
	blob  []byte            // blob worker: set on checkpoints only (create, resolutions, every blobCheckpoint-th)
}

// end is the first cut at which the state can no longer be seen.
func (s *wstate) end() int {
	if s.next == nil || s.next.ack < 0 {
		return math.MaxInt
	}
	return s.next.ack
}

type whist struct {
	name     string
	states   []*wstate
	inflight *tortureOp
}

func (h *whist) last() *wstate { return h.states[len(h.states)-1] }

// tortureModel is the workload's history as the journal tells it.
type tortureModel struct {
	seed    uint64
	journal string
	offset  int64 // bytes of the journal consumed
	lines   int   // lines consumed
	nextSeq int64

	content map[string][]byte // sha256 -> file content

	files, blob, sql *whist
	// current states in full
	curFiles map[string][]byte
	curBlob  []byte
	curRows  map[int64]string

	acked, resolvedFull, resolvedPartial, resolvedVoid int
}

func newTortureModel(seed uint64, journalPath string) *tortureModel {
	m := &tortureModel{seed: seed, journal: journalPath, content: map[string][]byte{}, curFiles: map[string][]byte{}}
	m.files = &whist{name: "files", states: []*wstate{{begin: -1, files: map[string]string{}}}}
	m.files.states[0].hash = m.hashFileMap(map[string]string{})
	m.blob = &whist{name: "blob", states: []*wstate{{begin: -1, hash: hashBlob(nil)}}}
	m.sql = &whist{name: "sql", states: []*wstate{{begin: -1, hash: hashRows(nil)}}}
	return m
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

func (m *tortureModel) hashFileMap(fm map[string]string) string {
	keys := slices.Sorted(maps.Keys(fm))
	h := sha256.New()
	for _, k := range keys {
		fmt.Fprintf(h, "%s %s\n", k, fm[k])
	}
	return hex.EncodeToString(h.Sum(nil))
}

func hashBlob(b []byte) string {
	if b == nil {
		return "absent"
	}
	return sha(b)
}

func hashRows(rows map[int64]string) string {
	if rows == nil {
		return "absent"
	}
	ids := slices.Sorted(maps.Keys(rows))
	h := sha256.New()
	for _, id := range ids {
		fmt.Fprintf(h, "%d|%s\n", id, rows[id])
	}
	return hex.EncodeToString(h.Sum(nil))
}

func (m *tortureModel) hist(worker string) *whist {
	switch worker {
	case "files":
		return m.files
	case "blob":
		return m.blob
	case "sql":
		return m.sql
	}
	panic("unknown worker " + worker)
}

// readJournal consumes the lines appended since the last call (also while
// the workload runs).
func (m *tortureModel) readJournal(t *testing.T) {
	t.Helper()
	b, err := os.ReadFile(m.journal)
	if err != nil && !errors.Is(err, iofs.ErrNotExist) {
		t.Fatal(err)
	}
	if int64(len(b)) < m.offset {
		t.Fatalf("journal shrank")
	}
	rest := b[m.offset:]
	// A workload still running may be half way through a line.
	rest = rest[:bytes.LastIndexByte(rest, '\n')+1]
	m.offset += int64(len(rest))
	for _, line := range strings.Split(strings.TrimSuffix(string(rest), "\n"), "\n") {
		if line == "" {
			continue
		}
		idx := m.lines
		m.lines++
		f := strings.Fields(line)
		switch f[0] {
		case "B":
			seq, _ := strconv.ParseInt(f[1], 10, 64)
			op := &tortureOp{seq: seq, worker: f[2], kind: f[3], args: f[4:], begin: idx, ack: -1}
			h := m.hist(op.worker)
			if h.inflight != nil {
				t.Fatalf("journal line %d: %s begins while %s is in flight", idx, op, h.inflight)
			}
			h.inflight = op
			m.nextSeq = max(m.nextSeq, seq+1)
		case "A":
			seq, _ := strconv.ParseInt(f[1], 10, 64)
			h := m.inflightBySeq(t, seq)
			h.inflight.ack = idx
			m.apply(t, h, h.inflight, nil)
			h.inflight = nil
			m.acked++
		case "R": // written by the checker itself; already applied
		default:
			t.Fatalf("journal line %d: %q", idx, line)
		}
	}
}

func (m *tortureModel) inflightBySeq(t *testing.T, seq int64) *whist {
	for _, h := range []*whist{m.files, m.blob, m.sql} {
		if h.inflight != nil && h.inflight.seq == seq {
			return h
		}
	}
	t.Fatalf("journal: ack of %d, which is not in flight", seq)
	return nil
}

// apply makes op's effect the worker's new state: its full effect, or the
// observed partial one (partial != nil: the tree read after a crash).
func (m *tortureModel) apply(t *testing.T, h *whist, op *tortureOp, partial *treeState) {
	prev := h.last()
	prev.next = op
	st := &wstate{begin: op.begin, op: op}
	switch h.name {
	case "files":
		if partial != nil {
			m.curFiles = maps.Clone(partial.files)
		} else {
			m.applyFiles(m.curFiles, op)
		}
		st.files = map[string]string{}
		for p, c := range m.curFiles {
			s := sha(c)
			m.content[s] = c
			st.files[p] = s
		}
		st.hash = m.hashFileMap(st.files)
	case "blob":
		if partial != nil {
			m.curBlob = slices.Clone(partial.blob)
			st.blob = m.curBlob
		} else {
			m.curBlob = m.applyBlob(m.curBlob, op)
			// applyBlob made a new slice: keeping it costs only memory.
			// Every blobCheckpoint-th state keeps one, so rebuilding an
			// old state replays a few ops, not the whole history.
			if op.kind == "create" || len(h.states)%blobCheckpoint == 0 {
				st.blob = m.curBlob
			}
		}
		st.hash = hashBlob(m.curBlob)
	case "sql":
		if partial != nil {
			m.curRows = maps.Clone(partial.rows)
		} else {
			m.curRows = m.applySQL(m.curRows, op)
		}
		st.hash = hashRows(m.curRows)
	}
	h.states = append(h.states, st)
}

// applyFiles applies op fully to fm (in place).
func (m *tortureModel) applyFiles(fm map[string][]byte, op *tortureOp) {
	switch op.kind {
	case "write", "replace":
		fm[op.arg(0)] = tortureBytes(m.seed, op.seq, 0, op.num(1))
	case "append":
		fm[op.arg(0)] = append(slices.Clone(fm[op.arg(0)]), tortureBytes(m.seed, op.seq, 0, op.num(1))...)
	case "delete":
		delete(fm, op.arg(0))
	case "rename":
		if c, ok := fm[op.arg(0)]; ok {
			delete(fm, op.arg(0))
			fm[op.arg(1)] = c
		}
	default:
		panic("files op " + op.kind)
	}
}

func (m *tortureModel) applyBlob(b []byte, op *tortureOp) []byte {
	switch op.kind {
	case "create":
		return tortureBytes(m.seed, op.seq, 1, op.num(0))
	case "pwrite":
		b = slices.Clone(b)
		copy(b[op.num(0):], tortureBytes(m.seed, op.seq, 1, op.num(1)))
		return b
	}
	panic("blob op " + op.kind)
}

func (m *tortureModel) applySQL(rows map[int64]string, op *tortureOp) map[int64]string {
	switch op.kind {
	case "init":
		if rows == nil {
			return map[int64]string{}
		}
		return rows
	case "txn":
		out := maps.Clone(rows)
		if out == nil {
			out = map[int64]string{} // cannot happen: init comes first
		}
		out[op.seq] = sqlText(m.seed, op.seq, 0, op.num(0))
		delete(out, op.seq-int64(op.num(1)))
		if id := op.seq - int64(op.num(2)); out[id] != "" {
			out[id] = sqlText(m.seed, op.seq, 1, op.num(3))
		}
		return out
	}
	panic("sql op " + op.kind)
}

// blobReplay rebuilds blobs of the blob worker's states for ascending
// state numbers, replaying each op once per pass over the history instead
// of once per state asked for (a long run has thousands of states).
type blobReplay struct {
	m *tortureModel
	j int // the state b is the blob of; -1 before the first
	b []byte
}

// blobCheckpoint is how often a state of the blob worker keeps its blob.
const blobCheckpoint = 32

// at returns the blob of state j.
func (r *blobReplay) at(j int) []byte {
	states := r.m.blob.states
	// Start from the nearest checkpoint at or before j, unless the last
	// state asked for is nearer.
	i := j
	for i > 0 && states[i].blob == nil {
		i--
	}
	if r.j < i || j < r.j {
		r.j, r.b = i, states[i].blob
	}
	for r.j < j {
		r.j++
		if cp := states[r.j].blob; cp != nil {
			r.b = cp
		} else {
			r.b = r.m.applyBlob(r.b, states[r.j].op)
		}
	}
	return r.b
}

// cutSet is a set of journal cuts (k: lines 0..k happened), as sorted
// disjoint inclusive ranges.
type cutSet [][2]int

func (c *cutSet) add(lo, hi int) {
	if lo > hi {
		return
	}
	*c = append(*c, [2]int{lo, hi})
	sort.Slice(*c, func(i, j int) bool { return (*c)[i][0] < (*c)[j][0] })
	out := (*c)[:0]
	for _, r := range *c {
		if n := len(out); n > 0 && r[0] <= out[n-1][1]+1 {
			out[n-1][1] = max(out[n-1][1], r[1])
			continue
		}
		out = append(out, r)
	}
	*c = out
}

func (c cutSet) intersect(d cutSet) cutSet {
	var out cutSet
	for _, a := range c {
		for _, b := range d {
			if lo, hi := max(a[0], b[0]), min(a[1], b[1]); lo <= hi {
				out = append(out, [2]int{lo, hi})
			}
		}
	}
	return out
}

func (c cutSet) contains(k int) bool {
	for _, r := range c {
		if r[0] <= k && k <= r[1] {
			return true
		}
	}
	return false
}

func (c cutSet) String() string {
	var s []string
	for _, r := range c {
		hi := strconv.Itoa(r[1])
		if r[1] == math.MaxInt-1 {
			hi = "end"
		}
		s = append(s, fmt.Sprintf("%d..%s", r[0], hi))
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ",")
}

// partialFiles reports whether got is what op, done in part or whole,
// leaves of prev (path -> sha of prev; got path -> content).
func (m *tortureModel) partialFiles(prev map[string]string, op *tortureOp, got map[string][]byte) bool {
	p := op.arg(0)
	for q, s := range prev {
		if q == p {
			continue
		}
		if op.kind == "rename" && q == op.arg(1) {
			continue
		}
		if g, ok := got[q]; !ok || sha(g) != s {
			return false
		}
	}
	for q := range got {
		if _, ok := prev[q]; !ok && q != p && !(op.kind == "rename" && q == op.arg(1)) {
			return false
		}
	}
	g, has := got[p]
	old, had := prev[p]
	same := has == had && (!has || sha(g) == old)
	switch op.kind {
	case "write":
		// open(O_TRUNC) then write: the old file, or a prefix of the new.
		return same || has && bytes.HasPrefix(tortureBytes(m.seed, op.seq, 0, op.num(1)), g)
	case "append":
		base := m.content[old]
		if !has || !bytes.HasPrefix(g, base) {
			return same
		}
		return bytes.HasPrefix(tortureBytes(m.seed, op.seq, 0, op.num(1)), g[len(base):])
	case "replace":
		return same || has && bytes.Equal(g, tortureBytes(m.seed, op.seq, 0, op.num(1)))
	case "delete":
		return same || !has
	case "rename":
		to := op.arg(1)
		gt, hasTo := got[to]
		oldTo, hadTo := prev[to]
		if same && hasTo == hadTo && (!hasTo || sha(gt) == oldTo) {
			return true // not yet
		}
		return had && !has && hasTo && sha(gt) == old
	}
	return false
}

// partialBlob reports whether got is what op, done in part or whole, leaves
// of prev.
func (m *tortureModel) partialBlob(prev []byte, op *tortureOp, got []byte) bool {
	if got == nil {
		return prev == nil
	}
	if prev != nil && bytes.Equal(prev, got) {
		return true
	}
	switch op.kind {
	case "create":
		return bytes.HasPrefix(tortureBytes(m.seed, op.seq, 1, op.num(0)), got)
	case "pwrite":
		if prev == nil || len(got) != len(prev) {
			return false
		}
		off, n := op.num(0), op.num(1)
		if !bytes.Equal(got[:off], prev[:off]) || !bytes.Equal(got[off+n:], prev[off+n:]) {
			return false
		}
		data := tortureBytes(m.seed, op.seq, 1, n)
		k := 0
		for k < n && got[off+k] == data[k] {
			k++
		}
		return bytes.Equal(got[off+k:off+n], prev[off+k:off+n])
	}
	return false
}

const endCut = math.MaxInt - 1

// feasible returns the cuts at which each worker could show what s shows.
func (m *tortureModel) feasible(s *treeState) map[string]cutSet {
	out := map[string]cutSet{}
	// files
	var fc cutSet
	got := map[string]string{}
	for p, c := range s.files {
		got[p] = sha(c)
	}
	gotHash := m.hashFileMap(got)
	for _, st := range m.files.states {
		if st.hash == gotHash {
			fc.add(st.begin, st.end()-1)
		}
		next := st.next
		if next == nil {
			next = m.files.inflight
		}
		if next != nil && m.partialFiles(st.files, next, s.files) {
			hi := math.MaxInt
			if next.ack >= 0 {
				hi = next.ack
			}
			fc.add(next.begin, hi-1)
		}
	}
	out["files"] = fc
	// sql (transactions are atomic)
	var sc cutSet
	gotRows := hashRows(s.rows)
	for _, st := range m.sql.states {
		if st.hash == gotRows {
			sc.add(st.begin, st.end()-1)
		}
	}
	if op := m.sql.inflight; op != nil && hashRows(m.applySQL(m.curRows, op)) == gotRows {
		sc.add(op.begin, endCut)
	}
	out["sql"] = sc
	// blob: exact states first, then partial writes only near the cuts the
	// others allow (rebuilding a blob costs a replay).
	var bc cutSet
	gotBlob := hashBlob(s.blob)
	for _, st := range m.blob.states {
		if st.hash == gotBlob {
			bc.add(st.begin, st.end()-1)
		}
	}
	others := fc.intersect(sc)
	if len(bc.intersect(others)) == 0 {
		replay := &blobReplay{m: m, j: -1}
		for j, st := range m.blob.states {
			next := st.next
			if next == nil {
				next = m.blob.inflight
			}
			if next == nil {
				continue
			}
			hi := endCut
			if next.ack >= 0 {
				hi = next.ack - 1
			}
			// An op in the past only matters near the others' cuts; the
			// one in flight always does (the live check after a crash).
			if st.next != nil && len(others.intersect(cutSet{{next.begin, hi}})) == 0 {
				continue
			}
			if m.partialBlob(replay.at(j), next, s.blob) {
				bc.add(next.begin, hi)
			}
		}
	}
	out["blob"] = bc
	return out
}

// explain returns the cuts that explain s for all workers at once.
func (m *tortureModel) explain(s *treeState) (cutSet, map[string]cutSet) {
	per := m.feasible(s)
	all := cutSet{{-1, endCut}}
	for _, c := range per {
		all = all.intersect(c)
	}
	return all, per
}

// describe says, for a failure message, how s differs from the current
// (all acknowledged) state.
func (m *tortureModel) describe(s *treeState) string {
	var d []string
	for p, c := range m.curFiles {
		g, ok := s.files[p]
		switch {
		case !ok:
			d = append(d, fmt.Sprintf("%s missing (want %d bytes)", p, len(c)))
		case !bytes.Equal(g, c):
			d = append(d, fmt.Sprintf("%s: %d bytes, want %d (sha %.12s, want %.12s)", p, len(g), len(c), sha(g), sha(c)))
		}
	}
	for p, g := range s.files {
		if _, ok := m.curFiles[p]; !ok {
			d = append(d, fmt.Sprintf("%s unexpected (%d bytes)", p, len(g)))
		}
	}
	if !bytes.Equal(s.blob, m.curBlob) {
		n := 0
		for i := range min(len(s.blob), len(m.curBlob)) {
			if s.blob[i] != m.curBlob[i] {
				n++
			}
		}
		d = append(d, fmt.Sprintf("blob.bin: %d bytes, want %d; %d bytes differ", len(s.blob), len(m.curBlob), n))
	}
	if hashRows(s.rows) != hashRows(m.curRows) {
		var missing, extra, changed []int64
		for id, v := range m.curRows {
			g, ok := s.rows[id]
			if !ok {
				missing = append(missing, id)
			} else if g != v {
				changed = append(changed, id)
			}
		}
		for id := range s.rows {
			if _, ok := m.curRows[id]; !ok {
				extra = append(extra, id)
			}
		}
		slices.Sort(missing)
		slices.Sort(extra)
		slices.Sort(changed)
		d = append(d, fmt.Sprintf("db rows: %d, want %d; missing %v, unexpected %v, changed %v", len(s.rows), len(m.curRows), missing, extra, changed))
	}
	for _, h := range []*whist{m.files, m.blob, m.sql} {
		if h.inflight != nil {
			d = append(d, "in flight: "+h.inflight.String())
		}
	}
	sort.Strings(d)
	if len(s.extra) > 0 {
		d = append(d, "entries the workload never makes: "+strings.Join(s.extra, ", "))
	}
	return strings.Join(d, "\n")
}

// resolve checks the live tree after a crash against the end of the
// journal (everything acknowledged must be there; an op in flight may
// show in part or whole) and records what became of the ops in flight,
// as R lines in the journal.
func (m *tortureModel) resolve(t *testing.T, s *treeState) {
	t.Helper()
	if len(s.extra) > 0 {
		t.Fatalf("the tree holds entries the workload never made: %v", s.extra)
	}
	_, per := m.explain(s)
	var bad []string
	for name, c := range per {
		if !c.contains(endCut) {
			bad = append(bad, fmt.Sprintf("%s (its state fits cuts %v, the journal ends at line %d)", name, c, m.lines-1))
		}
	}
	if len(bad) > 0 {
		sort.Strings(bad)
		t.Fatalf("ACKNOWLEDGED DATA LOST OR CORRUPTED: %s\n%s", strings.Join(bad, "; "), m.describe(s))
	}
	for _, h := range []*whist{m.files, m.blob, m.sql} {
		op := h.inflight
		if op == nil {
			continue
		}
		var how string
		var same bool
		switch h.name {
		case "files":
			got := map[string]string{}
			for p, c := range s.files {
				got[p] = sha(c)
			}
			same = m.hashFileMap(got) == h.last().hash
		case "blob":
			same = hashBlob(s.blob) == h.last().hash
		case "sql":
			same = hashRows(s.rows) == h.last().hash
		}
		idx := m.lines
		m.lines++
		op.ack = idx
		switch {
		case same:
			// It never happened: the state it would have replaced lives on.
			how = "void"
			m.resolvedVoid++
		case m.fullEffect(h, op, s):
			how = "done"
			m.resolvedFull++
			m.apply(t, h, op, s)
		default:
			how = "partial"
			m.resolvedPartial++
			m.apply(t, h, op, s)
		}
		h.inflight = nil
		f, err := os.OpenFile(m.journal, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			t.Fatal(err)
		}
		line := fmt.Sprintf("R %d %s\n", op.seq, how)
		if _, err := f.WriteString(line); err != nil {
			t.Fatal(err)
		}
		f.Sync()
		f.Close()
		m.offset += int64(len(line))
	}
}

// fullEffect reports whether s shows op's whole effect on the worker's
// current state.
func (m *tortureModel) fullEffect(h *whist, op *tortureOp, s *treeState) bool {
	switch h.name {
	case "files":
		fm := maps.Clone(m.curFiles)
		m.applyFiles(fm, op)
		if len(fm) != len(s.files) {
			return false
		}
		for p, c := range fm {
			if !bytes.Equal(s.files[p], c) {
				return false
			}
		}
		return true
	case "blob":
		return bytes.Equal(m.applyBlob(m.curBlob, op), s.blob)
	}
	return hashRows(m.applySQL(m.curRows, op)) == hashRows(s.rows)
}

// readTree reads what the workload keeps of the tree at dir, and checks
// the database's integrity.
func readTree(t *testing.T, dir string) *treeState {
	t.Helper()
	s := &treeState{files: map[string][]byte{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatalf("read %s: %v", dir, err)
	}
	for _, e := range ents {
		switch e.Name() {
		case "files", "db", "blob.bin":
		default:
			s.extra = append(s.extra, e.Name())
		}
	}
	fents, err := os.ReadDir(filepath.Join(dir, "files"))
	if err != nil && !errors.Is(err, iofs.ErrNotExist) {
		t.Fatalf("read %s/files: %v", dir, err)
	}
	for _, e := range fents {
		if strings.HasSuffix(e.Name(), ".tmp") {
			continue
		}
		rel := "files/" + e.Name()
		if !e.Type().IsRegular() {
			s.extra = append(s.extra, rel)
			continue
		}
		b, err := os.ReadFile(filepath.Join(dir, rel))
		if err != nil {
			t.Fatalf("read %s: %v", rel, err)
		}
		s.files[rel] = b
	}
	if b, err := os.ReadFile(filepath.Join(dir, "blob.bin")); err == nil {
		s.blob = b
	} else if !errors.Is(err, iofs.ErrNotExist) {
		t.Fatalf("read blob.bin: %v", err)
	}
	dents, _ := os.ReadDir(filepath.Join(dir, "db"))
	for _, e := range dents {
		switch e.Name() {
		case "state.db", "state.db-wal", "state.db-shm", "state.db-journal":
		default:
			s.extra = append(s.extra, "db/"+e.Name())
		}
	}
	db := filepath.Join(dir, tortureDB)
	if _, err := os.Stat(db); err == nil {
		s.rows = readRows(t, db)
	}
	return s
}

// readRows checks db's integrity and returns its rows; nil when the table
// does not exist yet (a database whose creation was cut short).
func readRows(t *testing.T, db string) map[int64]string {
	t.Helper()
	out, err := exec.Command("sqlite3", db, "SELECT count(*) FROM sqlite_master WHERE name='t';").CombinedOutput()
	if err != nil {
		t.Fatalf("sqlite3 %s: %v: %s", db, err, out)
	}
	if strings.TrimSpace(string(out)) == "0" {
		return nil
	}
	if got := sqlite(t, db, "PRAGMA integrity_check;"); got != "ok" {
		t.Fatalf("%s: integrity_check: %s", db, got)
	}
	cmd := exec.Command("sqlite3", db, "SELECT id, v FROM t;")
	out, err = cmd.Output()
	if err != nil {
		t.Fatalf("sqlite3 %s: %v", db, err)
	}
	rows := map[int64]string{}
	sc := bufio.NewScanner(bytes.NewReader(out))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		id, v, ok := strings.Cut(sc.Text(), "|")
		n, err := strconv.ParseInt(id, 10, 64)
		if !ok || err != nil {
			t.Fatalf("%s: row %q", db, sc.Text())
		}
		rows[n] = v
	}
	return rows
}
