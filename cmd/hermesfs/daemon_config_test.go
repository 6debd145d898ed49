package main

import (
	"errors"
	"flag"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
)

func TestMountConfigEnvAndValidate(t *testing.T) {
	cfg := newMountConfig()
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	cfg.addFlags(fs)
	if err := fs.Parse([]string{"--keep", "3"}); err != nil {
		t.Fatal(err)
	}
	env := map[string]string{"HERMESFS_INTERVAL": "2s", "HERMESFS_KEEP": "7", "HERMESFS_STATE_DIR": "rel/state"}
	if err := applyEnv(fs, func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if cfg.Interval != 2*time.Second || cfg.Keep != 3 || cfg.StateDir != "rel/state" {
		t.Errorf("env mapping: interval %s keep %d state dir %q (the flag must win over the env)", cfg.Interval, cfg.Keep, cfg.StateDir)
	}
	cfg.Mountpoint = "m"
	if err := cfg.validate(); err != nil {
		t.Fatal(err)
	}
	if !filepath.IsAbs(cfg.Mountpoint) || !filepath.IsAbs(cfg.StateDir) {
		t.Errorf("paths not made absolute: %q %q", cfg.Mountpoint, cfg.StateDir)
	}

	env = map[string]string{"HERMESFS_INTERVAL": "soon"}
	fs = flag.NewFlagSet("t", flag.ContinueOnError)
	newMountConfig().addFlags(fs)
	if err := applyEnv(fs, func(k string) string { return env[k] }); err == nil || !strings.Contains(err.Error(), "HERMESFS_INTERVAL") {
		t.Errorf("bad env value: err %v", err)
	}
	for _, keep := range []string{"0", "-1"} {
		c := newMountConfig()
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		c.addFlags(fs)
		if err := fs.Parse([]string{"--keep", keep}); err != nil {
			t.Fatal(err)
		}
		c.Mountpoint = "/m"
		var xe *daemon.ExitError
		if err := c.validate(); !errors.As(err, &xe) || xe.Code != exitUsage {
			t.Errorf("--keep %s: want a usage error, got %v", keep, err)
		}
	}
	for _, bad := range []func(c *mountConfig){
		func(c *mountConfig) { c.OnConflict = "merge" },
		func(c *mountConfig) { c.Interval = time.Millisecond },
		func(c *mountConfig) { c.StateDir = c.Mountpoint + "/state" },
		func(c *mountConfig) { c.LogFormat = "xml" },
		func(c *mountConfig) { c.Mountpoint = "" },
		func(c *mountConfig) { c.WritePassthroughMax = "-5M" },
		func(c *mountConfig) { c.WritePassthroughMax = "lots" },
		func(c *mountConfig) { c.WritePassthroughMax = "17179869184G" }, // overflows int64
	} {
		c := newMountConfig()
		c.Mountpoint = "/m"
		bad(c)
		err := c.validate()
		var xe *daemon.ExitError
		if !errors.As(err, &xe) || xe.Code != exitUsage {
			t.Errorf("config %+v: want a usage error, got %v", c, err)
		}
	}
}

func TestWritePassthroughMaxFlag(t *testing.T) {
	for in, want := range map[string]int64{"32M": 32 << 20, "0": -1, "1G": 1 << 30, "4096": 4096, "128KiB": 128 << 10} {
		c := newMountConfig()
		c.Mountpoint = "/m"
		c.WritePassthroughMax = in
		if err := c.validate(); err != nil || c.PassthroughWriteMax != want {
			t.Errorf("--write-passthrough-max %s: %d, %v; want %d", in, c.PassthroughWriteMax, err, want)
		}
	}
}

func TestMetricsAddrValidated(t *testing.T) {
	for addr, ok := range map[string]bool{"127.0.0.1:0": true, ":9452": true, "localhost": false, "9452": false} {
		c := newMountConfig()
		c.Mountpoint = "/tmp/x"
		c.MetricsAddr = addr
		if err := c.validate(); (err == nil) != ok {
			t.Errorf("--metrics-addr %q: %v", addr, err)
		}
	}
}

// What --background passes its daemon (which runs in "/") names files
// absolutely, whether they came from flags or from the environment; URLs
// and keys stay as they are.
func TestAbsolutePathFlags(t *testing.T) {
	abs := func(p string) string {
		a, err := filepath.Abs(p)
		if err != nil {
			t.Fatal(err)
		}
		return a
	}
	for _, c := range []struct {
		args []string
		env  map[string]string
		want []string
	}{
		{[]string{"--store", "st", "--identity", "k1", "--identity", "/abs/k2", "--encrypt-to", "@r.txt", "--encrypt-to", "age1xyz"}, nil,
			[]string{"--store=" + abs("st"), "--identity=" + abs("k1"), "--identity=/abs/k2", "--encrypt-to=@" + abs("r.txt"), "--encrypt-to=age1xyz"}},
		{nil, map[string]string{"HERMESFS_STORE": "./a:b", "HERMESFS_IDENTITY": "k1:k2", "HERMESFS_ENCRYPT_TO": "@r.txt"},
			[]string{"--store=" + abs("a:b"), "--identity=" + abs("k1"), "--identity=" + abs("k2"), "--encrypt-to=@" + abs("r.txt")}},
		{[]string{"--store", "s3://bucket/prefix"}, map[string]string{"HERMESFS_STORE": "ignored"}, []string{"--store=s3://bucket/prefix"}},
		{[]string{"--store", "file:///srv/store"}, nil, []string{"--store=file:///srv/store"}},
		{nil, nil, nil},
	} {
		cfg := newMountConfig()
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		cfg.addFlags(fs)
		if err := fs.Parse(c.args); err != nil {
			t.Fatal(err)
		}
		e := &env{getenv: func(k string) string { return c.env[k] }}
		got, err := absolutePathFlags(e, fs)
		if err != nil || strings.Join(got, " ") != strings.Join(c.want, " ") {
			t.Errorf("%v %v: %q, %v; want %q", c.args, c.env, got, err, c.want)
		}
	}
	cfg := newMountConfig()
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	cfg.addFlags(fs)
	fs.Parse([]string{"--store", "s3:bucket"})
	if _, err := absolutePathFlags(&env{getenv: func(string) string { return "" }}, fs); daemon.ExitCode(err) != exitUsage {
		t.Errorf("a malformed store URL: %v, want a usage error", err)
	}
}

func TestWriteBackFlag(t *testing.T) {
	cfg := newMountConfig()
	if cfg.WriteBack != 10*time.Second {
		t.Errorf("write-back by default: %s, want 10s", cfg.WriteBack)
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	cfg.addFlags(fs)
	if err := applyEnv(fs, func(k string) string { return map[string]string{"HERMESFS_WRITE_BACK": "10s"}[k] }); err != nil {
		t.Fatal(err)
	}
	cfg.Mountpoint = "/m"
	if err := cfg.validate(); err != nil || cfg.WriteBack != 10*time.Second {
		t.Errorf("HERMESFS_WRITE_BACK=10s: %s, %v", cfg.WriteBack, err)
	}
	for in, ok := range map[time.Duration]bool{0: true, time.Second: true, 2 * time.Minute: true, 500 * time.Millisecond: false, -time.Second: false} {
		c := newMountConfig()
		c.Mountpoint = "/m"
		c.WriteBack = in
		err := c.validate()
		var xe *daemon.ExitError
		if ok && err != nil || !ok && (!errors.As(err, &xe) || xe.Code != exitUsage || !strings.Contains(err.Error(), "--write-back")) {
			t.Errorf("--write-back %s: %v", in, err)
		}
	}
}
