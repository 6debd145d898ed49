package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
)

// A handful of real snapshots spread over days: prune --dry-run says what
// would go and why, prune removes exactly that, and every kept snapshot
// restores and verifies.
func TestPruneRetentionCLI(t *testing.T) {
	t.Parallel()
	storeDir := t.TempDir()
	s, err := uploader.NewLocal(storeDir)
	if err != nil {
		t.Fatal(err)
	}
	// Seven snapshots: two a day for three days, then one more.
	// (10:00 and 13:00 UTC stay on one day in the local zones of -10 to
	// +10 hours that the buckets follow.)
	start := time.Date(2026, 11, 20, 10, 0, 0, 0, time.UTC)
	var at time.Time
	cat := uploader.NewCatalog(s, uploader.CatalogOptions{Host: "box", Now: func() time.Time { return at }})
	var ms []uploader.Manifest
	for i := range 7 {
		at = start.Add(time.Duration(i/2)*24*time.Hour + time.Duration(i%2)*3*time.Hour)
		ms = append(ms, publishTree(t, cat, makeTree(t, i)))
	}
	environ := map[string]string{"HERMESFS_STORE": "file://" + storeDir}

	code, out, errOut := runCLIEnv(t, environ, "prune", "--keep-daily", "2", "--dry-run", "--json")
	if code != exitOK {
		t.Fatalf("prune --dry-run --json: %d %q", code, errOut)
	}
	var ds []uploader.PruneDecision
	if err := json.Unmarshal([]byte(out), &ds); err != nil || len(ds) != 7 {
		t.Fatalf("prune --json: %v, %d decisions\n%s", err, len(ds), out)
	}
	var wantKept []string
	for _, d := range ds {
		if d.Keep {
			wantKept = append(wantKept, d.ID)
		}
	}
	// Newest first: ms[6] (LATEST, day 4) and ms[5] (day 3's newest) are
	// the two newest days; nothing else.
	if !slices.Equal(wantKept, []string{ms[6].ID, ms[5].ID}) || !slices.Contains(ds[0].Reasons, "LATEST") || !slices.Contains(ds[1].Reasons, "daily 2") {
		t.Errorf("dry run decisions: %+v", ds)
	}

	code, out, _ = runCLIEnv(t, environ, "prune", "--keep-daily", "3", "--keep-last", "1", "--dry-run")
	if code != exitOK || !strings.Contains(out, "remove  "+ms[0].ID) || !strings.Contains(out, "keep    "+ms[3].ID) ||
		!strings.Contains(out, "daily 3") || !strings.Contains(out, "would delete 4") {
		t.Errorf("prune --dry-run table: %d\n%s", code, out)
	}
	if list, _ := filepath.Glob(filepath.Join(storeDir, "snapshots", "*.json")); len(list) != 7 {
		t.Fatalf("a dry run deleted snapshots: %d left", len(list))
	}

	code, out, errOut = runCLIEnv(t, environ, "prune", "--keep-daily", "3", "--keep-last", "1")
	if code != exitOK || !strings.Contains(out, "deleted "+ms[0].ID) || !strings.Contains(out, "deleted 4") {
		t.Fatalf("prune: %d %q %q", code, out, errOut)
	}
	kept := []uploader.Manifest{ms[6], ms[5], ms[3]}
	for _, m := range kept {
		dst := filepath.Join(t.TempDir(), "r")
		if code, _, errOut := runCLIEnv(t, environ, "restore", "--snapshot", m.ID, dst); code != exitOK {
			t.Errorf("restore of kept %s: %d %q", m.ID, code, errOut)
			continue
		}
		i := slices.IndexFunc(ms, func(x uploader.Manifest) bool { return x.ID == m.ID })
		if got := readMarker(t, dst); got != fmt.Sprintf("version %d", i) {
			t.Errorf("kept snapshot %d restored %q", i, got)
		}
	}
	for _, m := range []uploader.Manifest{ms[0], ms[1], ms[2], ms[4]} {
		if _, err := cat.Manifest(t.Context(), m.ID); err == nil {
			t.Errorf("pruned snapshot %s still in the store", m.ID)
		}
	}
}

func TestRetentionFlags(t *testing.T) {
	parse := func(env map[string]string, args ...string) (uploader.RetentionPolicy, error) {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		addRetentionFlags(fs, nil)
		if err := fs.Parse(args); err != nil {
			return uploader.RetentionPolicy{}, err
		}
		if err := applyEnv(fs, func(k string) string { return env[k] }); err != nil {
			return uploader.RetentionPolicy{}, err
		}
		return retentionPolicy(fs)
	}
	same := func(a, b uploader.RetentionPolicy) bool {
		a.Location, b.Location = nil, nil
		return a == b
	}
	for _, c := range []struct {
		env  map[string]string
		args []string
		want uploader.RetentionPolicy
	}{
		{nil, nil, uploader.DefaultRetention()},
		{nil, []string{"--keep", "5"}, uploader.RetentionPolicy{Last: 5}},
		{map[string]string{"HERMESFS_KEEP": "7"}, nil, uploader.RetentionPolicy{Last: 7}},
		{map[string]string{"HERMESFS_KEEP_DAILY": "7"}, []string{"--keep-hourly", "3"}, uploader.RetentionPolicy{Hourly: 3, Daily: 7}},
		{nil, []string{"--keep-weekly", "-1", "--keep-within", "2w"}, uploader.RetentionPolicy{Weekly: -1, Within: 14 * 24 * time.Hour}},
		{nil, []string{"--keep", "4", "--keep-last", "4", "--keep-monthly", "12"}, uploader.RetentionPolicy{Last: 4, Monthly: 12}},
	} {
		got, err := parse(c.env, c.args...)
		if err != nil || !same(got, c.want) {
			t.Errorf("%v %q: %v, %v; want %v", c.env, c.args, got, err, c.want)
		}
	}
	for _, args := range [][]string{
		{"--keep", "0"}, {"--keep-daily", "0"}, {"--keep-hourly", "-2"}, {"--keep", "3", "--keep-last", "4"},
		{"--keep-within", "soon"}, {"--keep-within", "5x"},
	} {
		if _, err := parse(nil, args...); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
}
