package main

import (
	"errors"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// scrape fetches and parses the metrics at addr.
func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	c := http.Client{Timeout: 30 * time.Second}
	resp, err := c.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s %v\n%s", resp.Status, err, body)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(string(body)))
	if err != nil {
		t.Fatalf("scrape does not parse: %v\n%s", err, body)
	}
	return fams
}

// metricValue is the value of the series of family name whose labels
// include want (counter, gauge, or a histogram's sample count); ok is
// false when there is none.
func metricValue(fams map[string]*dto.MetricFamily, name string, want ...string) (v float64, ok bool) {
	f := fams[name]
	if f == nil {
		return 0, false
	}
next:
	for _, m := range f.GetMetric() {
		for i := 0; i+1 < len(want); i += 2 {
			found := false
			for _, l := range m.GetLabel() {
				if l.GetName() == want[i] && l.GetValue() == want[i+1] {
					found = true
				}
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

func TestE2EMetrics(t *testing.T) {
	t.Parallel()
	need(t, "/dev/fuse")
	storeDir := e2eDir(t, "store")
	mp := e2eDir(t, "home")
	h := newHost(t, "file://"+storeDir)
	d := h.mount(mp, "--interval", "0", "--metrics-addr", "127.0.0.1:0")
	m := regexp.MustCompile(`msg="serving metrics" .*addr=(127\.0\.0\.1:\d+)`).FindStringSubmatch(d.stderr.String())
	if m == nil {
		t.Fatalf("no metrics address logged:\n%s", d.stderr)
	}
	addr := m[1]

	get := func(fams map[string]*dto.MetricFamily, name string, labels ...string) float64 {
		t.Helper()
		v, ok := metricValue(fams, name, labels...)
		if !ok {
			t.Fatalf("no %s%v in the scrape", name, labels)
		}
		return v
	}
	before := scrape(t, addr)
	if v := get(before, "hermesfs_lease_held"); v != 1 {
		t.Errorf("lease held %v, want 1", v)
	}
	if v := get(before, "hermesfs_unpublished_changes"); v != 0 {
		t.Errorf("unpublished changes %v on a fresh mount", v)
	}
	published0 := get(before, "hermesfs_snapshots_published_total")
	puts0, _ := metricValue(before, "hermesfs_store_requests_total", "op", "put", "outcome", "ok")

	writeFile(t, filepath.Join(mp, "notes.txt"), strings.Repeat("some notes\n", 20000), 0o644)
	os.MkdirAll(filepath.Join(mp, "memories"), 0o755)
	if err := os.WriteFile(filepath.Join(mp, "memories", "MEMORY.md"), []byte(strings.Repeat("x", 3000)), 0o644); !errors.Is(err, syscall.EFBIG) {
		t.Errorf("MEMORY.md over the limit: %v, want EFBIG", err)
	}
	dirty := scrape(t, addr)
	if v := get(dirty, "hermesfs_unpublished_changes"); v != 1 {
		t.Errorf("unpublished changes %v after a write", v)
	}
	if v := get(dirty, "hermesfs_dirty_bytes"); v < 220000 {
		t.Errorf("dirty bytes %v after writing 220000", v)
	}
	if v := get(dirty, "hermesfs_unpublished_change_age_seconds"); v <= 0 {
		t.Errorf("unpublished change age %v after a write", v)
	}
	if v := get(dirty, "hermesfs_memory_hook_verdicts_total", "verdict", "rejected", "reason", "limit"); v != 1 {
		t.Errorf("memory hook rejections for the limit: %v, want 1", v)
	}

	if code, out, errOut := h.run("snapshot", mp); code != 0 || strings.TrimSpace(out) == "" {
		t.Fatalf("snapshot: exit %d %q %s", code, out, errOut)
	}
	after := scrape(t, addr)
	if v := get(after, "hermesfs_snapshots_published_total"); v != published0+1 {
		t.Errorf("snapshots published %v, want %v", v, published0+1)
	}
	if v := get(after, "hermesfs_snapshot_bytes_uploaded_total"); v <= 0 {
		t.Errorf("bytes uploaded %v after a snapshot", v)
	}
	if v := get(after, "hermesfs_snapshot_bytes_packed_total"); v < 220000 {
		t.Errorf("bytes packed %v, want at least the 220000 written", v)
	}
	if v := get(after, "hermesfs_snapshot_duration_seconds"); v != 1 {
		t.Errorf("snapshot duration observations %v, want 1", v)
	}
	if v := get(after, "hermesfs_store_requests_total", "op", "put", "outcome", "ok"); v <= puts0 {
		t.Errorf("store put requests %v, were %v before the snapshot", v, puts0)
	}
	if v := get(after, "hermesfs_unpublished_changes"); v != 0 {
		t.Errorf("unpublished changes %v after the snapshot", v)
	}
	if v := get(after, "hermesfs_unpublished_change_age_seconds"); v != 0 {
		t.Errorf("unpublished change age %v after the snapshot", v)
	}
	if v := get(after, "hermesfs_seconds_since_last_snapshot"); v < 0 || v > 600 {
		t.Errorf("seconds since the last snapshot: %v", v)
	}
	if v := get(after, "hermesfs_lease_expiry_seconds"); v <= 0 {
		t.Errorf("lease expiry in %v s", v)
	}
	if get(after, "hermesfs_fuse_requests_total", "op", "lookup") == 0 || get(after, "hermesfs_fuse_request_duration_seconds", "op", "lookup") == 0 {
		t.Error("no FUSE lookups counted and sampled")
	}
	if v := get(after, "hermesfs_copyups_in_progress"); v != 0 {
		t.Errorf("copy-ups in progress %v while idle", v)
	}
	if _, ok := metricValue(after, "hermesfs_lazy_bytes_total"); ok {
		t.Error("lazy fill metrics without a lazily read lower layer")
	}
	d.stopOK(t)
}
