package faultproxy

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"
)

// origin serves one object, with ranges, at /bucket/obj.
func origin(t *testing.T, size int) ([]byte, string) {
	t.Helper()
	data := make([]byte, size)
	rand.NewChaCha8([32]byte{1}).Read(data)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method == http.MethodPut {
			io.Copy(io.Discard, r.Body)
			return
		}
		http.ServeContent(w, r, "obj", time.Time{}, bytes.NewReader(data))
	}))
	t.Cleanup(srv.Close)
	return data, srv.URL
}

func start(t *testing.T, target string, o Options) *Proxy {
	t.Helper()
	p, err := StartWith(target, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// get fetches /bucket/obj, with rng ("a-b") as its Range if not "".
func get(p *Proxy, rng string) (int, []byte, error) {
	req, _ := http.NewRequest(http.MethodGet, p.URL+"/bucket/obj", nil)
	if rng != "" {
		req.Header.Set("Range", "bytes="+rng)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, body, err
}

func TestRateCapsOneBody(t *testing.T) {
	t.Parallel()
	data, target := origin(t, 2<<20)
	p := start(t, target, Options{Rate: 8 << 20})
	t0 := time.Now()
	_, body, err := get(p, "")
	if err != nil || !bytes.Equal(body, data) {
		t.Fatalf("body of %d bytes, err %v", len(body), err)
	}
	// 2 MiB at 8 MiB/s is 250 ms; the link lends one 84 KiB chunk of burst.
	if d := time.Since(t0); d < 200*time.Millisecond {
		t.Fatalf("2 MiB through an 8 MiB/s link took %v, want >= 200ms", d)
	}
	// The body's bytes are counted once all are relayed, which may be
	// just after the client read the last one.
	st := p.Stats()
	for deadline := time.Now().Add(30 * time.Second); st.BytesDown != int64(len(data)) && time.Now().Before(deadline); st = p.Stats() {
		time.Sleep(5 * time.Millisecond)
	}
	if st.BytesDown != int64(len(data)) || st.Gets["/bucket/obj"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

// Parallel bodies share the link: 4 x 1 MiB at 8 MiB/s is 500 ms in all,
// however many connections carry it.
func TestRateIsShared(t *testing.T) {
	t.Parallel()
	data, target := origin(t, 1<<20)
	p := start(t, target, Options{Rate: 8 << 20})
	t0 := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for range 4 {
		wg.Go(func() {
			_, body, err := get(p, "")
			if err == nil && !bytes.Equal(body, data) {
				err = fmt.Errorf("body differs (%d bytes)", len(body))
			}
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(t0); d < 400*time.Millisecond {
		t.Fatalf("4 parallel MiB through an 8 MiB/s link took %v, want >= 400ms", d)
	}
}

func TestRateCapsUploads(t *testing.T) {
	t.Parallel()
	_, target := origin(t, 1)
	p := start(t, target, Options{Rate: 4 << 20})
	t0 := time.Now()
	req, _ := http.NewRequest(http.MethodPut, p.URL+"/bucket/up", bytes.NewReader(make([]byte, 1<<20)))
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if d := time.Since(t0); d < 200*time.Millisecond {
		t.Fatalf("1 MiB up a 4 MiB/s link took %v, want >= 200ms", d)
	}
	if st := p.Stats(); st.BytesUp != 1<<20 || st.Ops["PutObject"] != 1 {
		t.Fatalf("stats %+v", st)
	}
}

func TestLatencyAndSetters(t *testing.T) {
	t.Parallel()
	data, target := origin(t, 4096)
	p := start(t, target, Options{Latency: 40 * time.Millisecond})
	t0 := time.Now()
	for range 5 {
		if _, body, err := get(p, "0-99"); err != nil || !bytes.Equal(body, data[:100]) {
			t.Fatalf("range: %d bytes, err %v", len(body), err)
		}
	}
	if d := time.Since(t0); d < 200*time.Millisecond {
		t.Fatalf("5 requests at 40 ms latency took %v, want >= 200ms", d)
	}
	// Off again, then a cap set on the running proxy.
	p.SetLatency(0)
	p.SetRate(0)
	if _, _, err := get(p, ""); err != nil {
		t.Fatal(err)
	}
	big, target2 := origin(t, 512<<10)
	p2 := start(t, target2, Options{})
	p2.SetRate(1 << 20)
	t0 = time.Now()
	if _, body, err := get(p2, ""); err != nil || !bytes.Equal(body, big) {
		t.Fatal(len(body), err)
	}
	if d := time.Since(t0); d < 400*time.Millisecond {
		t.Fatalf("512 KiB at 1 MiB/s (set on the running proxy) took %v, want >= 400ms", d)
	}
}

func TestRangeFaults(t *testing.T) {
	t.Parallel()
	data, target := origin(t, 64<<10)
	p := start(t, target, Options{})
	var seen []string
	var mu sync.Mutex
	p.SetRule(func(r Request) Fault {
		mu.Lock()
		seen = append(seen, r.Range)
		mu.Unlock()
		switch r.Range {
		case "bytes=0-999":
			return FlipByte
		case "bytes=1000-1999":
			return ShortBody
		case "bytes=2000-2999":
			return Truncate
		}
		return Pass
	})

	status, body, err := get(p, "0-999")
	if err != nil || status != http.StatusPartialContent || len(body) != 1000 {
		t.Fatalf("flip: status %d, %d bytes, err %v", status, len(body), err)
	}
	diff := 0
	for i := range body {
		if body[i] != data[i] {
			diff++
		}
	}
	if diff != 1 || body[500] == data[500] {
		t.Fatalf("flip: %d bytes differ, want exactly byte 500", diff)
	}

	status, body, err = get(p, "1000-1999")
	if err != nil || status != http.StatusPartialContent || !bytes.Equal(body, data[1000:1500]) {
		t.Fatalf("short: status %d, %d bytes, err %v", status, len(body), err)
	}

	_, body, err = get(p, "2000-2999")
	if err == nil || len(body) >= 1000 {
		t.Fatalf("truncate: %d bytes, err %v; want an unexpected EOF", len(body), err)
	}

	if _, body, err = get(p, "3000-3999"); err != nil || !bytes.Equal(body, data[3000:4000]) {
		t.Fatalf("pass: %d bytes, err %v", len(body), err)
	}
	if strings.Join(seen, ",") != "bytes=0-999,bytes=1000-1999,bytes=2000-2999,bytes=3000-3999" {
		t.Fatalf("rule saw ranges %q", seen)
	}
	st := p.Stats()
	if st.Faults["flipped byte"] != 1 || st.Faults["short body"] != 1 || st.Faults["truncated"] != 1 || st.Gets["/bucket/obj"] != 4 {
		t.Fatalf("stats %+v", st)
	}
	p.ResetCounts()
	if st := p.Stats(); len(st.Gets) != 0 || st.BytesDown != 0 {
		t.Fatalf("stats after reset %+v", st)
	}
}

func TestFractionAndRanged(t *testing.T) {
	t.Parallel()
	data, target := origin(t, 1024)
	p := start(t, target, Options{})
	p.SetRule(Fraction(0.3, 7, "GetObject", Error500))
	failed := 0
	for range 100 {
		status, body, err := get(p, "0-9")
		switch {
		case err != nil:
			t.Fatal(err)
		case status == http.StatusInternalServerError:
			failed++
		case !bytes.Equal(body, data[:10]):
			t.Fatalf("status %d body %q", status, body)
		}
	}
	// Seeded: the share is fixed for seed 7, near 30 of 100.
	if failed < 15 || failed > 45 {
		t.Fatalf("%d of 100 GETs failed, want about 30", failed)
	}
	if _, faults := p.Counts(); faults[Error500] != failed {
		t.Fatalf("counted %d faults, saw %d", faults[Error500], failed)
	}

	p.SetRule(Ranged(1, SlowDown))
	if status, _, _ := get(p, ""); status != http.StatusOK {
		t.Fatalf("unranged GET: %d", status)
	}
	if status, _, _ := get(p, "0-9"); status != http.StatusServiceUnavailable {
		t.Fatalf("first ranged GET: %d, want 503", status)
	}
	if status, _, _ := get(p, "0-9"); status != http.StatusPartialContent {
		t.Fatalf("second ranged GET: %d, want 206", status)
	}
}
