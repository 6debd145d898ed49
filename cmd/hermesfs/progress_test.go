package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

// TestProgressWithoutTerminal: a long restore or export whose stderr is a
// log or a pipe says how far it is every progressEvery, one plain line
// each (no carriage returns), and nothing for what ends sooner.
func TestProgressWithoutTerminal(t *testing.T) {
	var b bytes.Buffer
	clock := time.Date(2026, 11, 22, 13, 0, 0, 0, time.UTC)
	p := newProgressAt(&b, "download", false, func() time.Time { return clock })
	const total = 400 << 20
	for s := 1; s <= 12; s++ {
		clock = clock.Add(time.Second)
		p.update(int64(s)*10<<20, total)
	}
	p.update(total, total)
	p.done()
	lines := strings.Split(strings.TrimSuffix(b.String(), "\n"), "\n")
	want := []string{
		"download: 50.0 MiB of 400.0 MiB (12%, 10.0 MiB/s)",
		"download: 100.0 MiB of 400.0 MiB (25%, 10.0 MiB/s)",
	}
	if strings.Join(lines, "\n") != strings.Join(want, "\n") {
		t.Errorf("progress lines:\n%s\nwant:\n%s", b.String(), strings.Join(want, "\n"))
	}

	b.Reset()
	p = newProgressAt(&b, "download", false, func() time.Time { return clock })
	p.update(1, 2)
	p.update(2, 2)
	p.done()
	if b.Len() != 0 {
		t.Errorf("a transfer shorter than %s printed %q", progressEvery, b.String())
	}
}
