package main

import (
	"flag"
	"io"
	"testing"
)

func TestCopyUpByRangeMinFlag(t *testing.T) {
	for _, c := range []struct {
		args []string
		env  string
		want int64
		bad  bool
	}{
		{nil, "", 4 << 20, false},
		{[]string{"--copy-up-by-range-min", "64M"}, "", 64 << 20, false},
		{[]string{"--copy-up-by-range-min", "off"}, "", -1, false},
		{nil, "1G", 1 << 30, false},
		{[]string{"--copy-up-by-range-min", "8M"}, "off", 8 << 20, false},
		{[]string{"--copy-up-by-range-min", "lots"}, "", 0, true},
	} {
		cfg := newMountConfig()
		fl := flag.NewFlagSet("mount", flag.ContinueOnError)
		fl.SetOutput(io.Discard)
		cfg.addFlags(fl)
		if err := fl.Parse(append(c.args, "/tmp/mnt")); err != nil {
			t.Fatal(err)
		}
		cfg.Mountpoint = fl.Arg(0)
		getenv := func(k string) string {
			if k == "HERMESFS_COPY_UP_BY_RANGE_MIN" {
				return c.env
			}
			return ""
		}
		if err := applyEnv(fl, getenv); err != nil {
			t.Fatal(err)
		}
		err := cfg.validate()
		if c.bad {
			if err == nil {
				t.Errorf("%v: accepted", c.args)
			}
			continue
		}
		if err != nil {
			t.Errorf("%v env %q: %v", c.args, c.env, err)
		} else if cfg.CopyUpMin != c.want {
			t.Errorf("%v env %q: %d, want %d", c.args, c.env, cfg.CopyUpMin, c.want)
		}
	}
}
