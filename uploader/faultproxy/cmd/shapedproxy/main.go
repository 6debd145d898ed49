// Command shapedproxy runs the fault proxy in front of an S3 server so that
// shell scripts (the benchmarks) can put a WAN between hermesfs and a store on
// loopback. It prints one line with its addresses, then serves until SIGINT
// or SIGTERM:
//
//	proxy http://127.0.0.1:PORT control http://127.0.0.1:PORT2
//
// The control address answers GET /stats (the counters as JSON), POST /reset
// (zero them) and POST /shape?latency=20ms&rate=50MB (change the link).
// SIGUSR1 writes the counters to stderr.
//
//	go run ./uploader/faultproxy/cmd/shapedproxy -target http://127.0.0.1:7070 -latency 20ms -rate 50MB
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/uploader/faultproxy"
)

const usage = `shapedproxy forwards to an S3 server over a shaped, optionally faulty link.

Usage:
  shapedproxy -target URL [-listen ADDR] [-control ADDR] [-latency D] [-rate R] [-fail-gets P] [-seed N]

Flags:
  -target URL     the S3 server, http://127.0.0.1:PORT (required)
  -listen ADDR    where clients connect (default 127.0.0.1:0, a free port)
  -control ADDR   the control server: GET /stats, POST /reset, POST /shape
                  (default 127.0.0.1:0)
  -latency D      added to every request before its answer, e.g. 20ms
  -rate R         bytes per second shared by all connections in each
                  direction: 50MB (10^6), 50MiB (2^20), 400000; 0 = no cap
  -fail-gets P    answer this share of GetObject requests 500, e.g. 0.3
  -seed N         seed of the failing GETs' draw (default 1)

Prints "proxy URL control URL" once listening.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("shapedproxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage) }
	target := fs.String("target", "", "")
	listen := fs.String("listen", "127.0.0.1:0", "")
	control := fs.String("control", "127.0.0.1:0", "")
	latency := fs.Duration("latency", 0, "")
	rateFlag := fs.String("rate", "0", "")
	failGets := fs.Float64("fail-gets", 0, "")
	seed := fs.Uint64("seed", 1, "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	rate, err := parseRate(*rateFlag)
	if err == nil && (*target == "" || fs.NArg() != 0) {
		err = errors.New("-target is required and there are no arguments")
	}
	if err == nil && (*failGets < 0 || *failGets > 1 || *latency < 0) {
		err = errors.New("-fail-gets must be within [0, 1] and -latency not negative")
	}
	if err != nil {
		fmt.Fprintln(stderr, "shapedproxy:", err)
		fmt.Fprintln(stderr, "run 'shapedproxy -h' for usage")
		return 2
	}

	p, err := faultproxy.StartOn(*listen, *target, faultproxy.Options{Latency: *latency, Rate: rate})
	if err != nil {
		fmt.Fprintln(stderr, "shapedproxy:", err)
		return 1
	}
	defer p.Close()
	if *failGets > 0 {
		p.SetRule(faultproxy.Fraction(*failGets, *seed, "GetObject", faultproxy.Error500))
	}
	ln, err := net.Listen("tcp", *control)
	if err != nil {
		fmt.Fprintln(stderr, "shapedproxy: control:", err)
		return 1
	}
	csrv := &http.Server{Handler: controlHandler(p)}
	go csrv.Serve(ln)
	defer csrv.Close()
	fmt.Fprintf(stdout, "proxy %s control http://%s\n", p.URL, ln.Addr())

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	usr1 := make(chan os.Signal, 1)
	signal.Notify(usr1, syscall.SIGUSR1)
	for {
		select {
		case <-ctx.Done():
			return 0
		case <-usr1:
			b, _ := json.Marshal(p.Stats())
			fmt.Fprintf(stderr, "%s\n", b)
		}
	}
}

func controlHandler(p *faultproxy.Proxy) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /stats", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(p.Stats())
	})
	mux.HandleFunc("POST /reset", func(w http.ResponseWriter, r *http.Request) {
		p.ResetCounts()
	})
	mux.HandleFunc("POST /shape", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		if v := q.Get("latency"); v != "" {
			d, err := time.ParseDuration(v)
			if err != nil || d < 0 {
				http.Error(w, "bad latency "+strconv.Quote(v), http.StatusBadRequest)
				return
			}
			p.SetLatency(d)
		}
		if v := q.Get("rate"); v != "" {
			n, err := parseRate(v)
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			p.SetRate(n)
		}
	})
	return mux
}

// parseRate reads bytes per second: a number with an optional unit, K/M/G
// (powers of 1000) or Ki/Mi/Gi (powers of 1024), a trailing B or "/s"
// allowed: 50MB, 50MiB/s, 400000.
func parseRate(s string) (int64, error) {
	v := strings.TrimSuffix(strings.TrimSpace(s), "/s")
	v = strings.TrimSuffix(v, "B")
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"Ki", 1 << 10}, {"Mi", 1 << 20}, {"Gi", 1 << 30}, {"K", 1e3}, {"k", 1e3}, {"M", 1e6}, {"G", 1e9}} {
		if strings.HasSuffix(v, u.suffix) {
			v, mult = strings.TrimSuffix(v, u.suffix), u.mult
			break
		}
	}
	f, err := strconv.ParseFloat(v, 64)
	if err != nil || f < 0 || f*float64(mult) > 1e15 {
		return 0, fmt.Errorf("bad rate %q (want e.g. 50MB, 50MiB or a number of bytes per second)", s)
	}
	return int64(f * float64(mult)), nil
}
