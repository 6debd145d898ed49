// Package faultproxy is an HTTP proxy on 127.0.0.1 that sits between an S3
// client and a real S3 server and breaks chosen requests the ways networks
// and object stores break: 500s, 503 SlowDown, connections reset before or
// after the server acted, responses cut short, and bodies with a byte
// changed. A rule decides each request's fate from its sequence number,
// operation and Range, so a schedule is deterministic. It also counts
// requests by S3 operation, which the store benchmark uses to report what a
// snapshot costs, and can shape the link (latency per request, a shared
// bandwidth cap) so loopback looks like a WAN; see Options.
package faultproxy

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Fault is what the proxy does to one request.
type Fault int

const (
	// Pass forwards the request and its answer untouched.
	Pass Fault = iota
	// Error500 answers 500 InternalError without forwarding.
	Error500
	// SlowDown answers 503 SlowDown without forwarding.
	SlowDown
	// Reset reads part of the request, then closes the connection without
	// forwarding or answering.
	Reset
	// ErrorAfter forwards the request (the server acts on it) and answers
	// 500 instead of the server's answer: the client cannot tell the write
	// happened.
	ErrorAfter
	// ResetAfter forwards the request and closes the connection instead of
	// answering.
	ResetAfter
	// Truncate forwards the request and relays the server's status and
	// headers but only half the body, then closes the connection.
	Truncate
	// OpaqueETag forwards the request and relays the answer with every
	// ETag in its body made into one that is not an MD5 (as servers
	// encrypting with SSE-KMS or SSE-C answer).
	OpaqueETag
	// FlipByte forwards the request and relays the answer with the middle
	// byte of a successful body inverted: a store returning wrong bytes
	// with a plausible status and length.
	FlipByte
	// ShortBody forwards the request and relays the status and headers
	// with only the first half of the body, its Content-Length saying so
	// (Content-Range unchanged): a well-framed answer that is short.
	ShortBody
)

var faultNames = [...]string{"pass", "500", "503 SlowDown", "reset", "500 after acting", "reset after acting", "truncated", "opaque ETag", "flipped byte", "short body"}

func (f Fault) String() string {
	if int(f) < len(faultNames) {
		return faultNames[f]
	}
	return fmt.Sprintf("Fault(%d)", int(f))
}

// Request is what a rule sees of a request.
type Request struct {
	Seq    int    // 1 for the first request through the proxy
	Op     string // S3 operation: PutObject, UploadPart, GetObject...
	Method string
	Path   string // /bucket/key
	URI    string // path and query
	Range  string // the Range header ("bytes=0-1023"), if any
}

// Rule picks the fault for a request. It is called serially.
type Rule func(Request) Fault

// Proxy is a running fault proxy.
type Proxy struct {
	// URL is the proxy's address, http://127.0.0.1:PORT: use it as the S3
	// endpoint (path-style).
	URL string

	target    string
	transport *http.Transport
	srv       *http.Server
	ln        net.Listener

	latency   atomic.Int64 // time.Duration
	down, up  link
	bytesDown atomic.Int64
	bytesUp   atomic.Int64

	mu     sync.Mutex
	rule   Rule
	seq    int
	counts map[string]int
	faults map[Fault]int
	gets   map[string]int
	closed atomic.Bool
}

// Start listens on a free loopback port and forwards to target
// (http://127.0.0.1:PORT) over an unshaped link.
func Start(target string) (*Proxy, error) {
	return StartWith(target, Options{})
}

// StartWith is Start with a shaped link.
func StartWith(target string, o Options) (*Proxy, error) {
	return StartOn("127.0.0.1:0", target, o)
}

// StartOn is StartWith listening on addr (host:port, port 0 for a free one).
func StartOn(addr, target string, o Options) (*Proxy, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		URL:       "http://" + ln.Addr().String(),
		target:    strings.TrimSuffix(target, "/"),
		transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true},
		ln:        ln,
		counts:    map[string]int{},
		faults:    map[Fault]int{},
		gets:      map[string]int{},
	}
	p.SetLatency(o.Latency)
	p.SetRate(o.Rate)
	p.srv = &http.Server{Handler: p}
	go p.srv.Serve(ln)
	return p, nil
}

// Close stops the proxy.
func (p *Proxy) Close() error {
	p.closed.Store(true)
	p.transport.CloseIdleConnections()
	return p.srv.Close()
}

// SetRule replaces the rule; nil passes everything.
func (p *Proxy) SetRule(r Rule) {
	p.mu.Lock()
	p.rule = r
	p.mu.Unlock()
}

// Counts returns the requests seen per S3 operation since the last
// ResetCounts, and the number of faults injected per kind.
func (p *Proxy) Counts() (ops map[string]int, faults map[Fault]int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	ops, faults = make(map[string]int, len(p.counts)), make(map[Fault]int, len(p.faults))
	for k, v := range p.counts {
		ops[k] = v
	}
	for k, v := range p.faults {
		faults[k] = v
	}
	return ops, faults
}

// Stats is what the proxy has counted since the last ResetCounts.
type Stats struct {
	Ops       map[string]int `json:"ops"`        // requests per S3 operation
	Faults    map[string]int `json:"faults"`     // faults injected per kind
	Gets      map[string]int `json:"gets"`       // GetObject requests per path
	BytesDown int64          `json:"bytes_down"` // response body bytes relayed
	BytesUp   int64          `json:"bytes_up"`   // request body bytes relayed
}

// Stats returns the counters.
func (p *Proxy) Stats() Stats {
	ops, faults := p.Counts()
	st := Stats{Ops: ops, Faults: make(map[string]int, len(faults)), Gets: map[string]int{},
		BytesDown: p.bytesDown.Load(), BytesUp: p.bytesUp.Load()}
	for k, v := range faults {
		st.Faults[k.String()] = v
	}
	p.mu.Lock()
	for k, v := range p.gets {
		st.Gets[k] = v
	}
	p.mu.Unlock()
	return st
}

// Total is the number of requests seen since the last ResetCounts.
func (p *Proxy) Total() int {
	ops, _ := p.Counts()
	n := 0
	for _, v := range ops {
		n += v
	}
	return n
}

// ResetCounts zeroes the counters (not the sequence numbers rules see).
func (p *Proxy) ResetCounts() {
	p.mu.Lock()
	clear(p.counts)
	clear(p.faults)
	clear(p.gets)
	p.bytesDown.Store(0)
	p.bytesUp.Store(0)
	p.mu.Unlock()
}

// Op names the S3 operation of a path-style request.
func Op(r *http.Request) string {
	q := r.URL.Query()
	_, uploads := q["uploads"]
	uploadID := q.Get("uploadId") != ""
	bucketOnly := strings.Count(strings.Trim(r.URL.Path, "/"), "/") == 0
	switch r.Method {
	case http.MethodGet:
		switch {
		case uploads:
			return "ListMultipartUploads"
		case uploadID:
			return "ListParts"
		case bucketOnly:
			return "ListObjects"
		}
		return "GetObject"
	case http.MethodHead:
		if bucketOnly {
			return "HeadBucket"
		}
		return "HeadObject"
	case http.MethodPut:
		switch {
		case q.Get("partNumber") != "" && r.Header.Get("X-Amz-Copy-Source") != "":
			return "UploadPartCopy"
		case q.Get("partNumber") != "":
			return "UploadPart"
		case r.Header.Get("X-Amz-Copy-Source") != "":
			return "CopyObject"
		case bucketOnly:
			return "CreateBucket"
		}
		return "PutObject"
	case http.MethodPost:
		switch {
		case uploads:
			return "CreateMultipartUpload"
		case uploadID:
			return "CompleteMultipartUpload"
		}
		return "Post"
	case http.MethodDelete:
		if uploadID {
			return "AbortMultipartUpload"
		}
		return "DeleteObject"
	}
	return r.Method
}

func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	req := Request{Op: Op(r), Method: r.Method, Path: r.URL.Path, URI: r.URL.RequestURI(), Range: r.Header.Get("Range")}
	p.mu.Lock()
	p.seq++
	req.Seq = p.seq
	p.counts[req.Op]++
	if req.Op == "GetObject" {
		p.gets[req.Path]++
	}
	fault := Pass
	if p.rule != nil {
		fault = p.rule(req)
	}
	if fault != Pass {
		p.faults[fault]++
	}
	p.mu.Unlock()

	if err := sleep(r.Context(), time.Duration(p.latency.Load())); err != nil {
		return
	}
	switch fault {
	case Error500:
		s3Error(w, r, http.StatusInternalServerError, "InternalError", "injected fault")
		return
	case SlowDown:
		s3Error(w, r, http.StatusServiceUnavailable, "SlowDown", "Please reduce your request rate.")
		return
	case Reset:
		io.CopyN(io.Discard, r.Body, max(r.ContentLength/2, 0))
		hangUp(w)
		return
	}
	resp, err := p.forward(r)
	if err != nil {
		s3Error(w, r, http.StatusBadGateway, "ProxyError", err.Error())
		return
	}
	defer resp.Body.Close()
	switch fault {
	case ErrorAfter:
		io.Copy(io.Discard, resp.Body)
		s3Error(w, r, http.StatusInternalServerError, "InternalError", "injected fault after the request took effect")
		return
	case ResetAfter:
		hangUp(w)
		return
	case Truncate:
		p.truncate(w, r, resp)
		return
	case FlipByte, ShortBody:
		body, _ := io.ReadAll(resp.Body)
		ok := resp.StatusCode/100 == 2 && len(body) > 0
		if ok && fault == FlipByte {
			body[len(body)/2] ^= 0xff
		}
		if ok && fault == ShortBody {
			body = body[:len(body)/2]
		}
		for k, vs := range resp.Header {
			w.Header()[k] = vs
		}
		w.Header().Del("Transfer-Encoding")
		w.Header().Set("Content-Length", fmt.Sprint(len(body)))
		w.WriteHeader(resp.StatusCode)
		n, _ := copyShaped(r.Context(), &p.down, w, bytes.NewReader(body))
		p.bytesDown.Add(n)
		return
	case OpaqueETag:
		body, _ := io.ReadAll(resp.Body)
		body = etagRe.ReplaceAll(body, []byte("${1}opaque-${2}${3}"))
		for k, vs := range resp.Header {
			w.Header()[k] = vs
		}
		w.Header().Set("Content-Length", fmt.Sprint(len(body)))
		w.WriteHeader(resp.StatusCode)
		w.Write(body)
		return
	}
	for k, vs := range resp.Header {
		w.Header()[k] = vs
	}
	w.WriteHeader(resp.StatusCode)
	n, _ := copyShaped(r.Context(), &p.down, w, resp.Body)
	p.bytesDown.Add(n)
}

func (p *Proxy) forward(r *http.Request) (*http.Response, error) {
	var body io.ReadCloser = r.Body
	if r.ContentLength != 0 {
		body = &shapedReader{ctx: r.Context(), l: &p.up, r: r.Body, max: p.up.chunk(), n: &p.bytesUp}
	}
	out, err := http.NewRequestWithContext(r.Context(), r.Method, p.target+r.URL.RequestURI(), body)
	if err != nil {
		return nil, err
	}
	out.Header = r.Header.Clone()
	out.Host = r.Host // the client signed this Host
	out.ContentLength = r.ContentLength
	if r.ContentLength == 0 {
		out.Body = http.NoBody
	}
	return p.transport.RoundTrip(out)
}

func s3Error(w http.ResponseWriter, r *http.Request, status int, code, msg string) {
	w.Header().Set("Content-Type", "application/xml")
	w.WriteHeader(status)
	if r.Method != http.MethodHead {
		fmt.Fprintf(w, `<?xml version="1.0" encoding="UTF-8"?>`+"\n<Error><Code>%s</Code><Message>%s</Message><RequestId>faultproxy</RequestId></Error>", code, msg)
	}
}

// etagRe matches an ETag element of an XML answer, quoted or not.
var etagRe = regexp.MustCompile(`(<ETag>(?:&#34;|&quot;|")?)([0-9a-fA-F]+)((?:&#34;|&quot;|")?</ETag>)`)

// hangUp closes the client's connection without an answer.
func hangUp(w http.ResponseWriter) {
	conn, _, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	if tc, ok := conn.(*net.TCPConn); ok {
		tc.SetLinger(0) // a RST, not a polite FIN
	}
	conn.Close()
}

// truncate relays resp's head and half its body, then hangs up.
func (p *Proxy) truncate(w http.ResponseWriter, r *http.Request, resp *http.Response) {
	conn, buf, err := http.NewResponseController(w).Hijack()
	if err != nil {
		panic(http.ErrAbortHandler)
	}
	defer conn.Close()
	body, _ := io.ReadAll(resp.Body)
	bw := buf.Writer
	fmt.Fprintf(bw, "HTTP/1.1 %s\r\n", resp.Status)
	resp.Header.Del("Transfer-Encoding")
	resp.Header.Set("Content-Length", fmt.Sprint(len(body)))
	resp.Header.Write(bw)
	bw.WriteString("\r\n")
	bw.Flush()
	n, _ := copyShaped(r.Context(), &p.down, conn, bytes.NewReader(body[:len(body)/2]))
	p.bytesDown.Add(n)
}

// Every returns a rule that gives every nth request (n, 2n, ...) the next
// fault of faults in turn, and passes the rest, except that a request
// whose previous attempt (same method and URI) was faulted always passes:
// with parts uploaded in parallel, retries could otherwise keep landing on
// multiples of n and exhaust the client's retries by chance, making a
// test flaky instead of deterministic in outcome.
func Every(n int, faults ...Fault) Rule {
	i := 0
	faulted := map[string]bool{}
	return func(r Request) Fault {
		id := r.Method + " " + r.URI
		if r.Seq%n != 0 || faulted[id] {
			delete(faulted, id)
			return Pass
		}
		f := faults[i%len(faults)]
		i++
		faulted[id] = true
		return f
	}
}

// Fraction returns a rule that gives each request of operation op (every
// operation if op is "") the fault f with probability share, drawn from a
// generator seeded with seed: the same seed and the same sequence of
// requests fault the same ones. Retries are drawn afresh, so a client that
// retries gets through eventually.
func Fraction(share float64, seed uint64, op string, f Fault) Rule {
	rng := rand.New(rand.NewPCG(seed, 0x5348415045))
	return func(r Request) Fault {
		if op != "" && r.Op != op {
			return Pass
		}
		if rng.Float64() < share {
			return f
		}
		return Pass
	}
}

// Ranged returns a rule that gives f to the first n GetObject requests
// that carry a Range header and passes everything else.
func Ranged(n int, f Fault) Rule {
	return func(r Request) Fault {
		if n > 0 && r.Op == "GetObject" && r.Range != "" {
			n--
			return f
		}
		return Pass
	}
}
