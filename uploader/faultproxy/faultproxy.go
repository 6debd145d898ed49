// Package faultproxy is an HTTP proxy on 127.0.0.1 that sits between an S3
// client and a real S3 server and breaks chosen requests the ways networks
// and object stores break: 500s, 503 SlowDown, connections reset before or
// after the server acted, and responses cut short. A rule decides each
// request's fate from its sequence number and operation, so a schedule is
// deterministic. It also counts requests by S3 operation, which the store
// benchmark uses to report what a snapshot costs.
package faultproxy

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
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
)

var faultNames = [...]string{"pass", "500", "503 SlowDown", "reset", "500 after acting", "reset after acting", "truncated", "opaque ETag"}

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

	mu     sync.Mutex
	rule   Rule
	seq    int
	counts map[string]int
	faults map[Fault]int
	closed atomic.Bool
}

// Start listens on a free loopback port and forwards to target
// (http://127.0.0.1:PORT).
func Start(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{
		URL:       "http://" + ln.Addr().String(),
		target:    strings.TrimSuffix(target, "/"),
		transport: &http.Transport{MaxIdleConnsPerHost: 16, DisableCompression: true},
		ln:        ln,
		counts:    map[string]int{},
		faults:    map[Fault]int{},
	}
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
	fault := Pass
	if p.rule != nil {
		fault = p.rule(req)
	}
	if fault != Pass {
		p.faults[fault]++
	}
	p.mu.Unlock()

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
		truncate(w, resp)
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
	io.Copy(w, resp.Body)
}

func (p *Proxy) forward(r *http.Request) (*http.Response, error) {
	out, err := http.NewRequestWithContext(r.Context(), r.Method, p.target+r.URL.RequestURI(), r.Body)
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
func truncate(w http.ResponseWriter, resp *http.Response) {
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
	bw.Write(body[:len(body)/2])
	bw.Flush()
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
