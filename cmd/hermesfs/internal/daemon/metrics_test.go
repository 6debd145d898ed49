package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"testing"

	"github.com/hermesfs/hermesfs/archive"
)

func TestFailureCause(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{errors.New("freeze: fs: freeze: context deadline"), "freeze"},
		{fmt.Errorf("pack: %w", errors.New("disk full")), "pack"},
		{fmt.Errorf("publish: %w", errors.New("503")), "publish"},
		{fmt.Errorf("publish: %w", mark(errors.New("LATEST moved"), errConflict)), "conflict"},
		{errLeaseLost, "lease_lost"},
		{mark(errors.New("store down"), errLeaseReacquire), "lease"},
		{fmt.Errorf("pack: %w", context.Canceled), "canceled"},
		{fmt.Errorf("pack: %w", &archive.PanicError{Value: "bug", Stack: []byte("goroutine 7")}), "panic"},
		{contain(func() error { panic("bug") }), "panic"},
		{errors.New("something else"), "other"},
	} {
		if got := failureCause(c.err); got != c.want {
			t.Errorf("failureCause(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}

func TestOpLabel(t *testing.T) {
	for in, want := range map[string]string{
		"put": "put", "upload part 12": "upload_part", "put composed": "put_composed",
		"create multipart upload": "create_multipart_upload",
	} {
		if got := opLabel(in); got != want {
			t.Errorf("opLabel(%q) = %q, want %q", in, got, want)
		}
	}
}

// Progress metrics of optional parts appear only when a part reports them.
func TestMetricsWatchParts(t *testing.T) {
	d := &daemon{cfg: &Config{}, e: &env{}, log: slog.New(slog.DiscardHandler)}
	m, err := newDaemonMetrics(d, "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer m.close()
	gather := func() map[string]float64 {
		fams, err := m.reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		out := map[string]float64{}
		for _, f := range fams {
			for _, mt := range f.GetMetric() {
				out[f.GetName()] = mt.GetGauge().GetValue() + mt.GetCounter().GetValue()
			}
		}
		return out
	}
	got := gather()
	if _, ok := got["hermesfs_lazy_bytes_total"]; ok {
		t.Error("lazy metrics without a lazy part")
	}
	if _, ok := got["hermesfs_partial_copyups_in_progress"]; ok {
		t.Error("partial copy-up metrics without a part making them")
	}
	m.setPartialCopyUps(func() (partialCopyUpStats, bool) { return partialCopyUpStats{InProgress: 2, Bytes: 4096}, true })
	m.setLazyFill(func() (lazyFillStats, bool) {
		return lazyFillStats{TotalBytes: 1000, PresentBytes: 250, OnDemandChunks: 3, FillChunks: 7, Errors: 1}, true
	})
	got = gather()
	for name, want := range map[string]float64{
		"hermesfs_lazy_bytes_total": 1000, "hermesfs_lazy_bytes_present": 250,
		"hermesfs_lazy_on_demand_chunks_total": 3, "hermesfs_lazy_fill_chunks_total": 7, "hermesfs_lazy_errors_total": 1,
		"hermesfs_partial_copyups_in_progress": 2, "hermesfs_partial_copyup_bytes": 4096,
	} {
		if got[name] != want {
			t.Errorf("%s = %v, want %v", name, got[name], want)
		}
	}
}
