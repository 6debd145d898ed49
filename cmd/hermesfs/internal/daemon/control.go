package daemon

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The control socket (<state dir>/control.sock, mode 0600) carries one
// request and one response per connection, each a line of JSON. Requests:
//
//	{"op":"status"}    -> {"status":{...}}
//	{"op":"snapshot"}  -> {"snapshot":{...}} once the snapshot is published (or failed)
//	{"op":"shutdown"}  -> {"shutdown":{...}} once the daemon has taken its final
//	                      snapshot and unmounted; the daemon exits right after
//
// While the daemon stops, status is still answered (statusReport.Stopping
// says what the stop is doing), snapshot is refused, and shutdown waits
// for the stop's outcome.
//
// A failure is {"error":"...","code":N}, N being the exit code the client
// should end with. Only the owner can connect (0600 in a 0700 directory).

type controlRequest struct {
	Op string `json:"op"`
}

type controlResponse struct {
	Error    string          `json:"error,omitempty"`
	Code     int             `json:"code,omitempty"`
	Status   *statusReport   `json:"status,omitempty"`
	Snapshot *snapshotResult `json:"snapshot,omitempty"`
	Shutdown *shutdownResult `json:"shutdown,omitempty"`
}

// snapshotResult describes one snapshot attempt.
type snapshotResult struct {
	ID string `json:"id,omitempty"` // empty when nothing changed
	// Unchanged is true when nothing changed since the last published
	// snapshot, so nothing was uploaded; ID is then that snapshot.
	Unchanged bool `json:"unchanged,omitempty"`
	snapshotFigures
}

// shutdownResult is the daemon's outcome, sent before it exits.
type shutdownResult struct {
	FinalID string `json:"final_id,omitempty"`
	Code    int    `json:"code"`
	Error   string `json:"error,omitempty"`
}

// controlHandler is what the daemon answers requests with. Methods are
// called on the connection's goroutine, possibly concurrently.
type controlHandler interface {
	status() statusReport
	snapshot(ctx context.Context) (snapshotResult, error)
	// shutdown asks the daemon to stop and returns a channel that receives
	// the outcome once (the same channel for every caller).
	shutdown() <-chan shutdownResult
}

// controlServer serves the control socket.
type controlServer struct {
	ln     *net.UnixListener
	path   string
	h      controlHandler
	log    *slog.Logger
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// closing is closed once the daemon stops: snapshots are refused,
	// status and shutdown still answered; closed once the listener is.
	closing    chan struct{}
	closed     chan struct{}
	refuseOnce sync.Once
	once       sync.Once
}

// listenControl binds path (removing a stale socket left by a killed
// daemon: the state dir lock proves no live daemon owns it) and serves it.
func listenControl(path string, h controlHandler, log *slog.Logger) (*controlServer, error) {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	var ln *net.UnixListener
	err := withShortPath(path, func(p string) error {
		var err error
		ln, err = net.ListenUnix("unix", &net.UnixAddr{Name: p, Net: "unix"})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	ln.SetUnlinkOnClose(false)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("control socket %s: %w", path, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &controlServer{ln: ln, path: path, h: h, log: log, ctx: ctx, cancel: cancel, closing: make(chan struct{}), closed: make(chan struct{})}
	s.wg.Add(1)
	go s.serve()
	return s, nil
}

func (s *controlServer) serve() {
	defer s.wg.Done()
	for {
		c, err := s.ln.AcceptUnix()
		if err != nil {
			select {
			case <-s.closed:
				return
			default:
			}
			s.log.Warn("control socket: accept", "err", err)
			time.Sleep(100 * time.Millisecond)
			continue
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer c.Close()
			s.handle(c)
		}()
	}
}

func (s *controlServer) handle(c *net.UnixConn) {
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		return
	}
	c.SetReadDeadline(time.Time{})
	var req controlRequest
	var resp controlResponse
	if err := json.Unmarshal(line, &req); err != nil {
		resp = controlResponse{Error: "bad request: " + err.Error(), Code: exitUsage}
	} else {
		resp = s.dispatch(req)
	}
	b, _ := json.Marshal(resp)
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	c.Write(append(b, '\n'))
}

func (s *controlServer) dispatch(req controlRequest) controlResponse {
	switch req.Op {
	case "status":
		st := s.h.status()
		return controlResponse{Status: &st}
	case "snapshot":
		select {
		case <-s.closing:
			return controlResponse{Error: "the daemon is stopping: its final snapshot is the last one ('hermesfs status' says how far it is)", Code: exitFailure}
		default:
		}
		r, err := s.h.snapshot(s.ctx)
		if err != nil {
			return controlResponse{Error: err.Error(), Code: exitCodeOf(err)}
		}
		return controlResponse{Snapshot: &r}
	case "shutdown":
		r := <-s.h.shutdown()
		return controlResponse{Shutdown: &r}
	}
	return controlResponse{Error: fmt.Sprintf("unknown op %q", req.Op), Code: exitUsage}
}

// refuse makes the server refuse new snapshots: the daemon is stopping.
// Status and shutdown requests are still answered.
func (s *controlServer) refuse() {
	s.refuseOnce.Do(func() { close(s.closing) })
}

// stopAccepting closes the listener: no new requests. Requests in flight
// (a shutdown waiting for its answer) go on.
func (s *controlServer) stopAccepting() {
	s.refuse()
	s.once.Do(func() {
		close(s.closed)
		s.ln.Close()
		os.Remove(s.path)
	})
}

// close stops accepting, cancels requests still running after grace, and
// waits for their handlers.
func (s *controlServer) close(grace time.Duration) {
	s.stopAccepting()
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		s.cancel()
		<-done
	}
	s.cancel()
}

// exitCodeOf returns the exit code an error carries (exitFailure if none).
func exitCodeOf(err error) int {
	var xe *exitError
	if errors.As(err, &xe) {
		return xe.Code
	}
	return exitFailure
}

// ErrNoDaemon reports that nothing answers on a control socket.
var ErrNoDaemon = errors.New("no hermesfs daemon is running for it")

// ControlCall sends req to the socket at path and returns the response.
// A socket nobody listens on gives ErrNoDaemon.
func ControlCall(ctx context.Context, path string, req controlRequest) (controlResponse, error) {
	var resp controlResponse
	var c net.Conn
	err := withShortPath(path, func(p string) error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, "unix", p)
		return err
	})
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) {
			return resp, ErrNoDaemon
		}
		return resp, fmt.Errorf("control socket %s: %w", path, err)
	}
	defer c.Close()
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Now()) })
	defer stop()
	b, _ := json.Marshal(req)
	if _, err := c.Write(append(b, '\n')); err != nil {
		return resp, fmt.Errorf("control socket %s: %w", path, err)
	}
	line, err := bufio.NewReader(c).ReadBytes('\n')
	if err != nil {
		if ctx.Err() != nil {
			return resp, ctx.Err()
		}
		return resp, fmt.Errorf("control socket %s: no answer (the daemon may have died): %w", path, err)
	}
	if err := json.Unmarshal(line, &resp); err != nil {
		return resp, fmt.Errorf("control socket %s: bad answer: %w", path, err)
	}
	if resp.Error != "" {
		code := resp.Code
		if code == 0 {
			code = exitFailure
		}
		return resp, withCode(code, errors.New(resp.Error))
	}
	return resp, nil
}

// withShortPath calls fn with a name for the socket at path that fits in
// sun_path (108 bytes): long paths go through /proc/self/fd/N of an O_PATH
// descriptor of the socket's directory.
func withShortPath(path string, fn func(string) error) error {
	if len(path) < 100 {
		return fn(path)
	}
	fd, err := unix.Open(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return fn("/proc/self/fd/" + strconv.Itoa(fd) + "/" + filepath.Base(path))
}
