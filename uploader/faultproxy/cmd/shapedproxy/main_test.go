package main

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/uploader/faultproxy"
)

func TestParseRate(t *testing.T) {
	for in, want := range map[string]int64{"0": 0, "400000": 400000, "50MB": 50e6, "50M": 50e6, "50MiB/s": 50 << 20, "1.5GB": 15e8, "64Ki": 64 << 10} {
		if got, err := parseRate(in); err != nil || got != want {
			t.Errorf("parseRate(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "fast", "-1", "5XB"} {
		if _, err := parseRate(in); err == nil {
			t.Errorf("parseRate(%q) accepted", in)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	for _, args := range [][]string{{}, {"-target", "http://x", "-rate", "lots"}, {"-target", "http://x", "-fail-gets", "2"}} {
		var out, errb strings.Builder
		if code := run(args, &out, &errb); code != 2 || !strings.Contains(errb.String(), "shapedproxy:") {
			t.Errorf("run(%q) = %d, stderr %q", args, code, errb.String())
		}
	}
}

func TestControl(t *testing.T) {
	origin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte("hello"))
	}))
	defer origin.Close()
	p, err := faultproxy.Start(origin.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	ctl := httptest.NewServer(controlHandler(p))
	defer ctl.Close()

	resp, err := http.Post(ctl.URL+"/shape?latency=30ms&rate=50MB", "", nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatal(resp, err)
	}
	t0 := time.Now()
	resp, err = http.Get(p.URL + "/bucket/key")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "hello" || time.Since(t0) < 30*time.Millisecond {
		t.Fatalf("%q after %v", body, time.Since(t0))
	}
	if resp, _ := http.Post(ctl.URL+"/shape?rate=lots", "", nil); resp.StatusCode != 400 {
		t.Fatalf("bad rate answered %d", resp.StatusCode)
	}

	// The proxy counts a body's bytes once it has relayed all of them,
	// which may be just after the client read the last one.
	var st faultproxy.Stats
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		st = faultproxy.Stats{}
		resp, err = http.Get(ctl.URL + "/stats")
		if err != nil {
			t.Fatal(err)
		}
		err = json.NewDecoder(bufio.NewReader(resp.Body)).Decode(&st)
		resp.Body.Close()
		if err != nil || st.BytesDown == 5 || time.Now().After(deadline) {
			break
		}
	}
	if err != nil || st.Gets["/bucket/key"] != 1 || st.Ops["GetObject"] != 1 || st.BytesDown != 5 {
		t.Fatalf("stats %+v, %v", st, err)
	}
	http.Post(ctl.URL+"/reset", "", nil)
	if p.Total() != 0 {
		t.Fatalf("%d requests counted after reset", p.Total())
	}
}
