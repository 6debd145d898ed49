package daemon

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/s3test"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// The daemon's write-back through Run, with a real mount and real time.
// Nothing here asserts how long anything took: only what the scheduler
// promises whatever the load (never two starts within D, a burst shorter
// than D gives one snapshot, nothing written gives none) and what must
// eventually happen (generous deadlines).

// wbStatus asks the daemon of state for its status, and checks that the
// recovery point agrees with the unpublished flag.
func wbStatus(t *testing.T, state string) statusReport {
	t.Helper()
	resp, err := ControlCall(t.Context(), filepath.Join(state, "control.sock"), controlRequest{Op: "status"})
	if err != nil || resp.Status == nil {
		t.Fatalf("status: %+v %v", resp, err)
	}
	st := *resp.Status
	if st.Unpublished != !st.UnpublishedSince.IsZero() {
		t.Errorf("status: unpublished %v but oldest unpublished change %v", st.Unpublished, st.UnpublishedSince)
	}
	return st
}

// waitStatus polls the status until ok says yes, for up to a minute and a
// half.
func waitStatus(t *testing.T, r *running, state, what string, ok func(statusReport) bool) statusReport {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		st := wbStatus(t, state)
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 90s; status %+v\nlogs:\n%s", what, st, r.logs)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// starts returns the "snapshot starting" log lines' reasons and the time
// since the start before each (0 for the first).
var startLine = regexp.MustCompile(`msg="snapshot starting" .*reason=(\S+|"[^"]*") since_last_start=(\S+)`)

type startRec struct {
	reason string
	since  time.Duration
}

func starts(logs string) []startRec {
	var out []startRec
	for _, m := range startLine.FindAllStringSubmatch(logs, -1) {
		d, _ := time.ParseDuration(m[2])
		out = append(out, startRec{strings.Trim(m[1], `"`), d})
	}
	return out
}

// checkSpacing fails if two snapshots the daemon started were less than d
// apart, by its own clock.
func checkSpacing(t *testing.T, ss []startRec, d time.Duration) {
	t.Helper()
	for i, s := range ss {
		if i > 0 && s.since < d {
			t.Errorf("snapshot %d (%s) started %s after the one before: less than the write-back delay %s", i, s.reason, s.since, d)
		}
	}
}

// TestRunWriteBackDebounce: nothing written gives no snapshot; a burst of
// writes gives one; a steady stream gives about one per D and never two
// within D; each ends with everything published.
func TestRunWriteBackDebounce(t *testing.T) {
	needFUSE(t)
	root := tempDir(t)
	store, mp, state := filepath.Join(root, "store"), filepath.Join(root, "home"), filepath.Join(root, "state")
	for _, d := range []string{store, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	const D = time.Second
	r := startDaemonWith(t, store, mp, state, filepath.Join(root, "run"), func(c *Config, _ *Options) {
		c.Interval, c.WriteBack = 0, D
	})

	// Idle: three times D, nothing.
	time.Sleep(3 * D)
	if st := wbStatus(t, state); st.Snapshots != 0 || st.Unpublished || st.WriteBack != D {
		t.Errorf("idle mount: %d snapshots, unpublished %v, write-back %s", st.Snapshots, st.Unpublished, st.WriteBack)
	}
	if ss := starts(r.logs.String()); len(ss) != 0 {
		t.Errorf("idle mount started snapshots: %v", ss)
	}

	// A burst: ten files at once.
	t0 := time.Now()
	for i := range 10 {
		writeSynced(t, filepath.Join(mp, fmt.Sprintf("burst-%d", i)), "burst\n")
	}
	burst := time.Since(t0)
	if st := wbStatus(t, state); st.Unpublished && st.UnpublishedAge <= 0 {
		t.Errorf("right after the burst: unpublished with age %s", st.UnpublishedAge)
	}
	waitStatus(t, r, state, "the burst published", func(s statusReport) bool { return s.Snapshots >= 1 && !s.Unpublished })
	time.Sleep(3 * D) // nothing more may come
	st := wbStatus(t, state)
	// A burst shorter than D less a poll (the oldest change's time is
	// known to a poll) is one snapshot; a longer one (a loaded machine)
	// at most one per D and a last one.
	if burst < D-pollEvery(D) {
		if st.Snapshots != 1 {
			t.Errorf("a burst of %s: %d snapshots, want 1", burst, st.Snapshots)
		}
	} else if limit := int(burst/D) + 2; st.Snapshots > limit {
		t.Errorf("a burst of %s: %d snapshots, want at most %d", burst, st.Snapshots, limit)
	}
	if st.UnpublishedAge != 0 || st.RecoveryPointWarning != "" {
		t.Errorf("after the burst was published: recovery point %s, warning %q", st.UnpublishedAge, st.RecoveryPointWarning)
	}
	burstSnaps := st.Snapshots

	// A steady stream: a line appended and fsynced every 100ms for 5 D.
	f, err := os.OpenFile(filepath.Join(mp, "session.jsonl"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	t0 = time.Now()
	for i := 0; time.Since(t0) < 5*D; i++ {
		if _, err := fmt.Fprintf(f, "{\"n\":%d}\n", i); err != nil {
			t.Fatal(err)
		}
		if err := f.Sync(); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	stream := time.Since(t0)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	st = waitStatus(t, r, state, "the stream published", func(s statusReport) bool { return !s.Unpublished })
	n := st.Snapshots - burstSnaps
	if limit := int(stream/D) + 2; n < 2 || n > limit {
		t.Errorf("a %s stream of writes: %d snapshots, want 2 to %d (about one per D)", stream.Round(time.Millisecond), n, limit)
	}
	ss := starts(r.logs.String())
	checkSpacing(t, ss, D)
	for _, s := range ss {
		if s.reason != "write-back" {
			t.Errorf("snapshot started for %q; only write-back runs here", s.reason)
		}
	}
	t.Logf("burst %s: %d snapshot(s); stream %s: %d snapshots", burst.Round(time.Millisecond), burstSnaps, stream.Round(time.Millisecond), n)
	if err := r.stop(t); err != nil {
		t.Fatalf("stop: %v (exit %d)", err, ExitCode(err))
	}
}

func writeSynced(t *testing.T, p, content string) {
	t.Helper()
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteString(content); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
}

var (
	backoffLine = regexp.MustCompile(`msg="write-back: trying again after the backoff" .*in=(\S+) failures_in_a_row=(\d+)`)
	metricsLine = regexp.MustCompile(`msg="serving metrics" .*url=(\S+)`)
)

// TestRunWriteBackStoreOutage: with every store request failing, writes go
// on at local speed, the recovery point grows in status and the metrics
// and passes its bound with a warning, write-back retries with backoff
// rather than every D, and once the store is back everything is
// published and the warning goes.
func TestRunWriteBackStoreOutage(t *testing.T) {
	needFUSE(t)
	endpoint, bucket, key, secret := s3test.Start(t)
	fp, err := faultproxy.Start(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fp.Close() })
	root := tempDir(t)
	mp, state := filepath.Join(root, "home"), filepath.Join(root, "state")
	if err := os.Mkdir(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	const D, grace = time.Second, 2 * time.Second
	r := startDaemonWith(t, "", mp, state, filepath.Join(root, "run"), func(c *Config, o *Options) {
		c.Interval, c.WriteBack, c.recoveryGrace = 0, D, grace
		c.MetricsAddr = "127.0.0.1:0"
		base := o.Getenv
		getenv := func(k string) string {
			switch k {
			case "AWS_ACCESS_KEY_ID":
				return key
			case "AWS_SECRET_ACCESS_KEY":
				return secret
			case "AWS_REGION":
				return "us-east-1"
			}
			return base(k)
		}
		o.Getenv = getenv
		o.Store = func(*slog.Logger) (string, storeurl.Options, error) {
			return fmt.Sprintf("s3://%s/home?endpoint=%s&path_style=true", bucket, fp.URL), storeurl.Options{Getenv: getenv, UID: os.Getuid()}, nil
		}
	})
	m := metricsLine.FindStringSubmatch(r.logs.String())
	if m == nil {
		t.Fatalf("no metrics address in the logs:\n%s", r.logs)
	}
	metricsURL := m[1]

	writeSynced(t, filepath.Join(mp, "before"), "before the outage\n")
	st := waitStatus(t, r, state, "the first write published", func(s statusReport) bool { return s.Snapshots >= 1 && !s.Unpublished })
	published := st.LastPublished

	// The outage: every request fails.
	fp.SetRule(func(faultproxy.Request) faultproxy.Fault { return faultproxy.Error500 })
	t0 := time.Now()
	var ages []time.Duration
	writes, slowest := 0, time.Duration(0)
	for {
		w0 := time.Now()
		writeSynced(t, filepath.Join(mp, fmt.Sprintf("during-%d", writes)), "written while the store is down\n")
		slowest = max(slowest, time.Since(w0))
		writes++
		st = wbStatus(t, state)
		if st.LastPublished != published {
			t.Fatalf("published %s while every request failed", st.LastPublished)
		}
		ages = append(ages, st.UnpublishedAge)
		// Long enough for the warning and three failed attempts in a
		// row (waits of about D, 2D, 4D).
		if st.RecoveryPointWarning != "" && writes >= 10 && len(backoffLine.FindAllString(r.logs.String(), -1)) >= 3 &&
			strings.Contains(r.logs.String(), "recovery point: changes older than the bound are not in the store") {
			break
		}
		if time.Since(t0) > 90*time.Second {
			t.Fatalf("after 90s of outage, not yet: a recovery point warning in status and log, three failed attempts in a row; status %+v\n%s", st, r.logs)
		}
		time.Sleep(100 * time.Millisecond)
	}
	outage := time.Since(t0)
	if st.RecoveryPointBound != D+grace || st.UnpublishedAge <= st.RecoveryPointBound || !strings.Contains(st.RecoveryPointWarning, "not in the store") {
		t.Errorf("status past the bound: age %s, bound %s, warning %q", st.UnpublishedAge, st.RecoveryPointBound, st.RecoveryPointWarning)
	}
	for i := 1; i < len(ages); i++ {
		if ages[i] < ages[i-1] {
			t.Errorf("the recovery point went from %s to %s while nothing was published", ages[i-1], ages[i])
			break
		}
	}
	metrics := scrape(t, metricsURL)
	if metrics["hermesfs_recovery_point_warning"] != 1 || metrics["hermesfs_unpublished_change_age_seconds"] <= (D+grace).Seconds() ||
		metrics["hermesfs_write_back_seconds"] != D.Seconds() || metrics["hermesfs_recovery_point_bound_seconds"] != (D+grace).Seconds() {
		t.Errorf("metrics during the outage: warning %v, age %v, write-back %v, bound %v", metrics["hermesfs_recovery_point_warning"],
			metrics["hermesfs_unpublished_change_age_seconds"], metrics["hermesfs_write_back_seconds"], metrics["hermesfs_recovery_point_bound_seconds"])
	}
	logs := r.logs.String()
	// Backoff: the wait after the n-th failure in a row is D·2^(n-1)
	// (±25%), and so the attempts during the outage are about
	// log2(outage/D), not outage/D.
	var waits []time.Duration
	for _, m := range backoffLine.FindAllStringSubmatch(logs, -1) {
		d, _ := time.ParseDuration(m[1])
		n, _ := strconv.Atoi(m[2])
		if n != len(waits)+1 {
			t.Errorf("failure %d in a row logged as %d", len(waits)+1, n)
		}
		if lo := time.Duration(float64(D) * 0.75 * float64(int(1)<<min(n-1, 20))); d < min(lo, time.Duration(0.75*float64(writeBackRetryCap))) {
			t.Errorf("after failure %d in a row, the next attempt in %s, want at least %s", n, d, lo)
		}
		waits = append(waits, d)
	}
	if len(waits) == 0 {
		t.Fatalf("no failed write-back attempt logged during a %s outage:\n%s", outage, logs)
	}
	attempts := len(starts(logs)) - 1 // the first one succeeded
	if limit := 3 + int(float64(outage)/float64(D)/4); attempts > limit && attempts > 4 {
		t.Errorf("%d snapshot attempts during a %s outage: want backoff, not one per D", attempts, outage)
	}
	checkSpacing(t, starts(logs), D)
	t.Logf("outage %s: %d writes (slowest %s), %d attempts, waits %v", outage.Round(time.Millisecond), writes, slowest.Round(time.Millisecond), attempts, waits)

	// The store is back: everything goes out, the warning goes.
	fp.SetRule(nil)
	st = waitStatus(t, r, state, "everything published after the outage", func(s statusReport) bool { return !s.Unpublished })
	if st.RecoveryPointWarning != "" || st.UnpublishedAge != 0 || st.LastPublished == published {
		t.Errorf("after the outage: warning %q, age %s, last published %s", st.RecoveryPointWarning, st.UnpublishedAge, st.LastPublished)
	}
	deadline := time.Now().Add(30 * time.Second)
	for !strings.Contains(r.logs.String(), "recovery point back within its bound") {
		if time.Now().After(deadline) {
			t.Fatalf("the log never said the recovery point is back within its bound")
		}
		time.Sleep(100 * time.Millisecond)
	}
	if metrics := scrape(t, metricsURL); metrics["hermesfs_recovery_point_warning"] != 0 || metrics["hermesfs_unpublished_change_age_seconds"] != 0 {
		t.Errorf("metrics after the outage: warning %v, age %v", metrics["hermesfs_recovery_point_warning"], metrics["hermesfs_unpublished_change_age_seconds"])
	}
	if err := r.stop(t); err != nil {
		t.Fatalf("stop: %v (exit %d)", err, ExitCode(err))
	}
}

// scrape reads the unlabelled samples of a Prometheus text page.
func scrape(t *testing.T, url string) map[string]float64 {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, line := range strings.Split(string(b), "\n") {
		name, v, ok := strings.Cut(line, " ")
		if !ok || strings.HasPrefix(line, "#") || strings.Contains(name, "{") {
			continue
		}
		if f, err := strconv.ParseFloat(v, 64); err == nil {
			out[name] = f
		}
	}
	return out
}
