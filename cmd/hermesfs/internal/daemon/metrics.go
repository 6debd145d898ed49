package daemon

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/hermesfs/hermesfs/fs"
	"github.com/hermesfs/hermesfs/uploader"
)

// Prometheus metrics of `hermesfs mount --metrics-addr`. The parts keep
// plain counters and callbacks (fs.Stats, memguard's OnVerdict,
// uploader.Observed); this file turns them into metrics and serves them.
// Values that describe the daemon's state are read at scrape time. The
// README section "Metrics" lists them and the alerts to set.
//
// Every method of *daemonMetrics does nothing on a nil receiver: metrics
// are off unless --metrics-addr is given.

// daemonMetrics is the metrics of one daemon.
type daemonMetrics struct {
	d     *daemon
	reg   *prometheus.Registry
	stats *fs.Stats
	ln    net.Listener
	srv   *http.Server
	// booted is set once the mount is up: the daemon's state (overlay,
	// lease) is read at scrape time only from then on.
	booted atomic.Bool

	snapshots        prometheus.Counter
	failures         *prometheus.CounterVec
	duration         prometheus.Histogram
	freezes          prometheus.Counter
	freezeStall      prometheus.Histogram
	packed, uploaded prometheus.Counter
	copied           prometheus.Counter
	verdicts         *prometheus.CounterVec
	storeRequests    *prometheus.CounterVec
	storeDuration    *prometheus.HistogramVec
	storeRetries     *prometheus.CounterVec
	storeRead        prometheus.Counter

	// Providers of subsystems that report progress; nil when absent.
	provMu         sync.Mutex
	lazyFill       func() (lazyFillStats, bool)
	partialCopyUps func() (partialCopyUpStats, bool)
}

// lazyFillStats is the fill of a lower archive read lazily (lazyFillOf).
type lazyFillStats struct {
	TotalBytes, PresentBytes   int64
	OnDemandChunks, FillChunks uint64
	Errors                     uint64
}

// partialCopyUpStats are the partial copy-ups in progress (partialCopyUpsOf).
type partialCopyUpStats struct {
	InProgress int64
	Bytes      int64
}

const metricsNS = "hermesfs"

// newDaemonMetrics returns nil when addr is "" (metrics off); otherwise
// the metrics, listening on addr and serving /metrics.
func newDaemonMetrics(d *daemon, addr string) (*daemonMetrics, error) {
	if addr == "" {
		return nil, nil
	}
	m := &daemonMetrics{d: d, reg: prometheus.NewRegistry(), stats: fs.NewStats()}
	f := func(name, help string) prometheus.Opts {
		return prometheus.Opts{Namespace: metricsNS, Name: name, Help: help}
	}
	m.snapshots = prometheus.NewCounter(prometheus.CounterOpts(f("snapshots_published_total", "Snapshots published to the store.")))
	m.failures = prometheus.NewCounterVec(prometheus.CounterOpts(f("snapshot_failures_total",
		"Snapshots that failed, by cause: freeze, pack, publish, conflict (another host published), lease_lost, lease (the lease could not be taken again), canceled, panic (a bug; the stack is in the log), other.")), []string{"cause"})
	m.duration = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: metricsNS, Name: "snapshot_duration_seconds",
		Help:    "Time from freeze to published, of each published snapshot.",
		Buckets: []float64{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}})
	m.freezes = prometheus.NewCounter(prometheus.CounterOpts(f("snapshot_freezes_total", "Freezes taken by snapshots (each holds the tree's writers for an instant).")))
	m.freezeStall = prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: metricsNS, Name: "snapshot_freeze_stall_seconds",
		Help:    "How long the freeze of each published snapshot held writers.",
		Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}})
	m.packed = prometheus.NewCounter(prometheus.CounterOpts(f("snapshot_bytes_packed_total", "File data bytes packed into snapshot archives (before compression).")))
	m.uploaded = prometheus.NewCounter(prometheus.CounterOpts(f("snapshot_bytes_uploaded_total", "Archive bytes sent to the store.")))
	m.copied = prometheus.NewCounter(prometheus.CounterOpts(f("snapshot_bytes_copied_total", "Image bytes of published snapshots that are ranges of segments already in the store, not uploaded again.")))
	m.verdicts = prometheus.NewCounterVec(prometheus.CounterOpts(f("memory_hook_verdicts_total",
		"Decisions of the memory write hook on changes to guarded memory files, by verdict (accepted, rejected, error) and reason.")), []string{"verdict", "reason"})
	m.storeRequests = prometheus.NewCounterVec(prometheus.CounterOpts(f("store_requests_total",
		"Store requests (each attempt), by operation and outcome (ok, not_found, precondition, canceled, error).")), []string{"op", "outcome"})
	m.storeDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: metricsNS, Name: "store_request_duration_seconds",
		Help:    "Store request latency by operation (for a get, until the body starts).",
		Buckets: []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}}, []string{"op"})
	m.storeRetries = prometheus.NewCounterVec(prometheus.CounterOpts(f("store_retries_total", "Store requests retried after a transient failure, by operation.")), []string{"op"})
	m.storeRead = prometheus.NewCounter(prometheus.CounterOpts(f("store_bytes_downloaded_total", "Bytes read from the store.")))
	m.reg.MustRegister(m.snapshots, m.failures, m.duration, m.freezes, m.freezeStall, m.packed, m.uploaded, m.copied,
		m.verdicts, m.storeRequests, m.storeDuration, m.storeRetries, m.storeRead,
		stateCollector{m},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-addr %s: %w", addr, err)
	}
	m.ln = ln
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprintln(w, "hermesfs: metrics at /metrics")
	})
	m.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := m.srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			d.log.Error("metrics server stopped", "err", err)
		}
	}()
	d.log.Info("serving metrics", "addr", ln.Addr().String(), "url", "http://"+ln.Addr().String()+"/metrics")
	return m, nil
}

// close stops serving.
func (m *daemonMetrics) close() {
	if m == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	m.srv.Shutdown(ctx)
}

// ready says the mount is up: the daemon's state can be read.
func (m *daemonMetrics) ready() {
	if m != nil {
		m.booted.Store(true)
	}
}

// fsStats is what the overlay records its figures in (nil: none).
func (m *daemonMetrics) fsStats() *fs.Stats {
	if m == nil {
		return nil
	}
	return m.stats
}

// verdictFunc is memguard's Options.OnVerdict (nil: none).
func (m *daemonMetrics) verdictFunc() func(verdict, reason string) {
	if m == nil {
		return nil
	}
	return func(verdict, reason string) {
		if strings.HasPrefix(reason, "char ") {
			reason = "char" // "char U+XXXX": one series for all blocked characters
		}
		m.verdicts.WithLabelValues(verdict, reason).Inc()
	}
}

// wrapStore has s report its requests.
func (m *daemonMetrics) wrapStore(s uploader.Store) uploader.Store {
	if m == nil {
		return s
	}
	return uploader.WithObserver(s, storeObserver{m})
}

type storeObserver struct{ m *daemonMetrics }

func (o storeObserver) StoreRequest(op, outcome string, took time.Duration) {
	o.m.storeRequests.WithLabelValues(op, outcome).Inc()
	o.m.storeDuration.WithLabelValues(op).Observe(took.Seconds())
}

func (o storeObserver) StoreRetry(op string) { o.m.storeRetries.WithLabelValues(opLabel(op)).Inc() }

func (o storeObserver) StoreRead(n int64) { o.m.storeRead.Add(float64(n)) }

// opLabel turns a retried request's name ("upload part 12", "put
// composed") into a label value of bounded variety ("upload_part",
// "put_composed").
func opLabel(op string) string {
	op = strings.TrimRight(op, " 0123456789")
	return strings.ReplaceAll(op, " ", "_")
}

// setLazyFill registers the progress of a lazily read lower layer: the
// hermesfs_lazy_* metrics exist only once it is set.
func (m *daemonMetrics) setLazyFill(fn func() (lazyFillStats, bool)) {
	if m == nil {
		return
	}
	m.provMu.Lock()
	m.lazyFill = fn
	m.provMu.Unlock()
}

// setPartialCopyUps registers the progress of partial copy-ups: the
// hermesfs_partial_copyup* metrics exist only once it is set.
func (m *daemonMetrics) setPartialCopyUps(fn func() (partialCopyUpStats, bool)) {
	if m == nil {
		return
	}
	m.provMu.Lock()
	m.partialCopyUps = fn
	m.provMu.Unlock()
}

// snapshotFrozen is called after a snapshot's freeze.
func (m *daemonMetrics) snapshotFrozen() {
	if m == nil {
		return
	}
	m.freezes.Inc()
}

// snapshotPublished counts a published snapshot.
func (m *daemonMetrics) snapshotPublished(r snapshotDone) {
	if m == nil {
		return
	}
	m.freezeStall.Observe(r.FreezeStall.Seconds())
	m.count(r.Duration, r.BytesPacked, r.BytesUploaded, r.Size-r.segment)
}

// seedPublished counts the first snapshot, made at boot from the
// mountpoint directory's contents.
func (m *daemonMetrics) seedPublished(ps packStats, pr uploader.Published, took time.Duration) {
	if m == nil {
		return
	}
	m.count(took, ps.BytesPacked, pr.Sent, pr.Copied)
}

func (m *daemonMetrics) count(took time.Duration, packed, uploaded, copied int64) {
	m.snapshots.Inc()
	m.duration.Observe(took.Seconds())
	m.packed.Add(float64(packed))
	m.uploaded.Add(float64(uploaded))
	m.copied.Add(float64(copied))
}

// snapshotFailed counts a failed snapshot. err is snapshotOnce's error
// (its message starts with the step that failed), or the reason a
// snapshot was not attempted.
func (m *daemonMetrics) snapshotFailed(err error) {
	if m == nil {
		return
	}
	m.failures.WithLabelValues(failureCause(err)).Inc()
}

// failureCause classifies a snapshot failure.
func failureCause(err error) string {
	switch {
	case errors.Is(err, errLeaseLost):
		return "lease_lost"
	case errors.Is(err, errConflict):
		return "conflict"
	case errors.Is(err, errLeaseReacquire):
		return "lease"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return "canceled"
	case panicStack(err) != nil:
		return "panic"
	}
	step, _, _ := strings.Cut(err.Error(), ":")
	switch step {
	case "freeze", "pack", "publish":
		return step
	}
	return "other"
}

// errLeaseReacquire marks a snapshot not attempted because the lapsed
// lease could not be taken again.
var errLeaseReacquire = errors.New("the writer lease could not be taken again")

// stateCollector reads the daemon's state at scrape time.
type stateCollector struct{ m *daemonMetrics }

func desc(name, help string, labels ...string) *prometheus.Desc {
	return prometheus.NewDesc(metricsNS+"_"+name, help, labels, nil)
}

var (
	descInfo          = desc("info", "Always 1; labels say the version, the store and whether the mount is read-only.", "version", "store", "read_only")
	descInterval      = desc("snapshot_interval_seconds", "The configured time between periodic snapshots (0: none).")
	descLastTime      = desc("last_snapshot_timestamp_seconds", "Unix time of the last snapshot published from this state dir (absent when none).")
	descSinceLast     = desc("seconds_since_last_snapshot", "Seconds since the last snapshot published from this state dir (absent when none).")
	descUnpublished   = desc("unpublished_changes", "1 while the tree holds changes no published snapshot has.")
	descUnpubAge      = desc("unpublished_change_age_seconds", "Age of the oldest change not in a published snapshot (what a host lost now would lose); 0 when everything is published.")
	descWriteBack     = desc("write_back_seconds", "The configured write-back delay: a change is published this long after it is made (0: off).")
	descRPBound       = desc("recovery_point_bound_seconds", "The age of the oldest unpublished change above which the daemon warns (absent when there is no bound).")
	descRPWarning     = desc("recovery_point_warning", "1 while the oldest unpublished change is older than the bound: the store is down, or snapshots fail or take long.")
	descDirtyFiles    = desc("dirty_files", "Files changed since the last published snapshot (upper layer).")
	descDirtyBytes    = desc("dirty_bytes", "Bytes written to files changed since the last published snapshot (upper layer).")
	descInProgress    = desc("snapshot_in_progress", "1 while a snapshot is being taken.")
	descLeaseHeld     = desc("lease_held", "1 while this daemon holds the store's writer lease.")
	descLeaseLost     = desc("lease_lost", "1 once the writer lease was lost (taken over, or lapsed while the store was unreachable); the mount no longer publishes.")
	descLeaseExpiry   = desc("lease_expiry_seconds", "Seconds until the held lease expires unless renewed (absent when no lease is held).")
	descCopyUps       = desc("copyups_in_progress", "Copy-ups of lower files into the upper layer in progress.")
	descCopyUpsDone   = desc("copyups_total", "Copy-ups of lower files into the upper layer finished.")
	descFUSECalls     = desc("fuse_requests_total", "FUSE requests served by the daemon, by operation (requests the kernel serves itself, by passthrough or from its caches, are not seen).", "op")
	descFUSELatency   = desc("fuse_request_duration_seconds", fmt.Sprintf("Latency of FUSE requests by operation, sampled: the first and then one in %d requests of each operation are timed.", fs.OpSampleEvery), "op")
	descLazyTotal     = desc("lazy_bytes_total", "Size of the lower archive read lazily from the store.")
	descLazyPresent   = desc("lazy_bytes_present", "Bytes of the lazily read lower archive fetched so far.")
	descLazyOnDemand  = desc("lazy_on_demand_chunks_total", "Chunks of the lazily read lower archive fetched because a read needed them (misses).")
	descLazyFill      = desc("lazy_fill_chunks_total", "Chunks of the lazily read lower archive fetched by the background fill.")
	descLazyErrors    = desc("lazy_errors_total", "Failed fetches of the lazily read lower archive.")
	descPartialCopies = desc("partial_copyups_in_progress", "Copy-ups that copy only part of a file, in progress.")
	descPartialBytes  = desc("partial_copyup_bytes", "Bytes copied by partial copy-ups in progress.")
	descImageGarbage  = desc("image_garbage_bytes", "Bytes of the last published image that its tree no longer uses (its trailer's estimate), until a compaction drops them.")
	descImageExtents  = desc("image_extents", "Extents (stretches of segments) the last published image is laid out in.")
	descCompacting    = desc("compaction_running", "1 while the last published image is being compacted in the background.")
	descCompactions   = desc("compactions_total", "Compactions of the last published image published, by outcome (published, failed).", "outcome")
	descCompactFreed  = desc("compaction_bytes_freed_total", "Image bytes compactions left out of the images they rewrote.")
	descCompactUp     = desc("compaction_bytes_uploaded_total", "Bytes compactions sent to the store.")
)

var opBounds = func() []float64 {
	b := make([]float64, len(fs.OpBuckets))
	for i, d := range fs.OpBuckets {
		b[i] = d.Seconds()
	}
	return b
}()

func (c stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descInfo, descInterval, descLastTime, descSinceLast, descUnpublished, descUnpubAge, descWriteBack, descRPBound, descRPWarning,
		descDirtyFiles, descDirtyBytes, descInProgress, descLeaseHeld, descLeaseLost, descLeaseExpiry,
		descCopyUps, descCopyUpsDone, descFUSECalls, descFUSELatency,
		descLazyTotal, descLazyPresent, descLazyOnDemand, descLazyFill, descLazyErrors, descPartialCopies, descPartialBytes,
		descImageGarbage, descImageExtents, descCompacting, descCompactions, descCompactFreed, descCompactUp} {
		ch <- d
	}
}

// leaseRecorder is a lease that tells its expiry (*uploader.Lease).
type leaseRecorder interface {
	Record() uploader.LeaseRecord
}

func (c stateCollector) Collect(ch chan<- prometheus.Metric) {
	m := c.m
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, labels...)
	}
	b2f := func(b bool) float64 {
		if b {
			return 1
		}
		return 0
	}
	d := m.d
	gauge(descInterval, d.cfg.Interval.Seconds())
	gauge(descWriteBack, d.cfg.WriteBack.Seconds())

	for _, o := range m.stats.Ops() {
		counter(descFUSECalls, float64(o.Calls), o.Op)
		buckets := make(map[float64]uint64, len(o.Buckets))
		for i, n := range o.Buckets {
			buckets[opBounds[i]] = n
		}
		ch <- prometheus.MustNewConstHistogram(descFUSELatency, o.Samples, o.Sum.Seconds(), buckets, o.Op)
	}
	n, done := m.stats.CopyUps()
	gauge(descCopyUps, float64(n))
	counter(descCopyUpsDone, float64(done))

	m.provMu.Lock()
	lazy, partial := m.lazyFill, m.partialCopyUps
	m.provMu.Unlock()
	if lazy != nil {
		if s, ok := lazy(); ok {
			gauge(descLazyTotal, float64(s.TotalBytes))
			gauge(descLazyPresent, float64(s.PresentBytes))
			counter(descLazyOnDemand, float64(s.OnDemandChunks))
			counter(descLazyFill, float64(s.FillChunks))
			counter(descLazyErrors, float64(s.Errors))
		}
	}
	if partial != nil {
		if s, ok := partial(); ok {
			gauge(descPartialCopies, float64(s.InProgress))
			gauge(descPartialBytes, float64(s.Bytes))
		}
	}

	if !m.booted.Load() {
		return
	}
	now := time.Now()
	oldest := d.recoveryPoint(now)
	d.mu.Lock()
	publishedAt, inProgress, leaseState, l := d.st.PublishedAt, d.inProgress, d.leaseState, d.lease
	store := d.st.Store
	var (
		unpublished bool
		files       int
		bytes       int64
	)
	if !d.cfg.ReadOnly {
		unpublished = d.pending || d.ov.Generation() != d.publishedGen
		files, bytes = d.ov.Dirty(d.publishedGen)
	}
	comp, last := d.compact, d.st.LastPublished
	d.mu.Unlock()
	if !d.cfg.ReadOnly {
		gauge(descCompacting, b2f(comp.running))
		counter(descCompactions, float64(comp.done), "published")
		counter(descCompactions, float64(comp.failed), "failed")
		counter(descCompactFreed, float64(comp.freed))
		counter(descCompactUp, float64(comp.uploaded))
		if o := d.openedImage(last); o != nil && last != "" {
			if r, err := o.archive(); err == nil {
				gauge(descImageGarbage, float64(r.GarbageBytes()))
				gauge(descImageExtents, float64(o.im.Manifest().ExtentCount))
			}
		}
	}

	gauge(descInfo, 1, d.e.Version, store, fmt.Sprint(d.cfg.ReadOnly))
	if !publishedAt.IsZero() {
		gauge(descLastTime, float64(publishedAt.UnixNano())/1e9)
		gauge(descSinceLast, now.Sub(publishedAt).Seconds())
	}
	gauge(descUnpublished, b2f(unpublished))
	age := 0.0
	if !oldest.IsZero() {
		age = max(0, now.Sub(oldest).Seconds())
	}
	gauge(descUnpubAge, age)
	if bound := d.recoveryBound(); bound > 0 {
		gauge(descRPBound, bound.Seconds())
		gauge(descRPWarning, b2f(age > bound.Seconds()))
	}
	gauge(descDirtyFiles, float64(files))
	gauge(descDirtyBytes, float64(bytes))
	gauge(descInProgress, b2f(inProgress))
	gauge(descLeaseHeld, b2f(leaseState == "held"))
	gauge(descLeaseLost, b2f(leaseState == "lost"))
	if lr, ok := l.(leaseRecorder); ok && leaseState == "held" {
		gauge(descLeaseExpiry, lr.Record().Expires.Sub(now).Seconds())
	}
}
