// Package s3test runs a real S3-compatible server (versitygw, posix
// backend) on 127.0.0.1 for tests and benchmarks, so the S3 store is tested
// against S3 semantics instead of a mock.
//
// versitygw must be in PATH or in $(go env GOPATH)/bin (scripts/deps.sh
// installs it: go install github.com/versity/versitygw/cmd/versitygw@v1.8.0).
// Without it Start skips the test, or fails it under HERMESFS_TEST_STRICT=1.
package s3test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/credentials"
	awss3 "github.com/aws/aws-sdk-go-v2/service/s3"
)

// Credentials of the root user of every server started here.
const (
	AccessKey = "hermesfs-test"
	SecretKey = "hermesfs-test-secret"
	Region    = "us-east-1"
)

// Start runs a fresh server with one empty bucket and returns where it
// listens (http://127.0.0.1:PORT, path-style addressing) and how to sign
// in. The server stops, and its data goes, when the test ends.
func Start(t testing.TB) (endpoint, bucket, accessKey, secretKey string) {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		if os.Getenv("HERMESFS_TEST_STRICT") == "1" {
			t.Fatalf("s3test: %v", err)
		}
		t.Skipf("s3test: %v", err)
	}
	out := &tail{max: 16 << 10}
	srv, err := Launch(bin, t.TempDir(), out)
	if err != nil {
		t.Fatalf("s3test: %v; its output: %s", err, out)
	}
	t.Cleanup(func() {
		// A server that died under a test explains that test's failure
		// ("connection refused"): say so, with what it said.
		if gone, err := srv.Exited(); gone {
			t.Errorf("s3test: versitygw exited during the test (%v); its output: %s", err, out)
			return
		}
		if err := srv.Close(); err != nil {
			t.Errorf("s3test: stop versitygw: %v", err)
		}
	})
	bucket = "hermesfs-test"
	if err := srv.CreateBucket(context.Background(), bucket); err != nil {
		t.Fatalf("s3test: %v", err)
	}
	return srv.Endpoint, bucket, AccessKey, SecretKey
}

// Binary finds the versitygw executable.
func Binary() (string, error) {
	if p, err := exec.LookPath("versitygw"); err == nil {
		return p, nil
	}
	gopath := os.Getenv("GOPATH")
	if gopath == "" {
		if out, err := exec.Command("go", "env", "GOPATH").Output(); err == nil {
			gopath = strings.TrimSpace(string(out))
		}
	}
	for _, dir := range filepath.SplitList(gopath) {
		p := filepath.Join(dir, "bin", "versitygw")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("versitygw not found in PATH or $(go env GOPATH)/bin; install it with: go install github.com/versity/versitygw/cmd/versitygw@v1.8.0")
}

// Server is a running versitygw.
type Server struct {
	Endpoint string
	cmd      *exec.Cmd
	exited   chan struct{} // closed once the process has exited
	waitErr  error         // its exit status, set before exited closes
}

// Launch starts the versitygw binary serving dir (whose subdirectories are
// buckets) on a free loopback port, and waits until it answers. Its output
// goes to logw (nil discards it).
func Launch(bin, dir string, logw io.Writer) (*Server, error) {
	if logw == nil {
		logw = io.Discard
	}
	var lastErr error
	for range 5 { // the free port can be taken between probe and bind
		port, err := freePort()
		if err != nil {
			return nil, err
		}
		addr := fmt.Sprintf("127.0.0.1:%d", port)
		cmd := exec.Command(bin, "--access", AccessKey, "--secret", SecretKey, "--region", Region,
			"--port", addr, "--quiet", "posix", dir)
		cmd.Stdout, cmd.Stderr = logw, logw
		// Killed with the test binary, so that a test killed by its
		// deadline leaves no server behind. The kernel sends Pdeathsig
		// when the forking THREAD ends, and Go ends the thread of a
		// goroutine that returns while locked to it (the FUSE file
		// system's requests to its own mount do): the process is started
		// and waited for by a goroutine locked to its thread until the
		// process has exited.
		cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		s := &Server{Endpoint: "http://" + addr, cmd: cmd, exited: make(chan struct{})}
		started := make(chan error, 1)
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			err := cmd.Start()
			started <- err
			if err == nil {
				s.waitErr = cmd.Wait()
			}
			close(s.exited)
		}()
		if err := <-started; err != nil {
			return nil, fmt.Errorf("start versitygw: %w", err)
		}
		if lastErr = s.waitReady(addr, 15*time.Second); lastErr == nil {
			return s, nil
		}
		s.Close()
	}
	return nil, lastErr
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func (s *Server) waitReady(addr string, limit time.Duration) error {
	deadline := time.Now().Add(limit)
	for time.Now().Before(deadline) {
		select {
		case <-s.exited:
			return fmt.Errorf("versitygw exited before serving: %v", s.waitErr)
		default:
		}
		resp, err := http.Get("http://" + addr + "/")
		if err == nil {
			resp.Body.Close()
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("versitygw did not answer on %s within %v", addr, limit)
}

// Client returns an SDK client signed in as the root user.
func (s *Server) Client() *awss3.Client {
	return Client(s.Endpoint)
}

// Client returns an SDK client for a server started here at endpoint.
func Client(endpoint string) *awss3.Client {
	return awss3.New(awss3.Options{
		Region:       Region,
		BaseEndpoint: aws.String(endpoint),
		UsePathStyle: true,
		Credentials:  credentials.NewStaticCredentialsProvider(AccessKey, SecretKey, ""),
	})
}

// CreateBucket creates bucket name.
func (s *Server) CreateBucket(ctx context.Context, name string) error {
	if _, err := s.Client().CreateBucket(ctx, &awss3.CreateBucketInput{Bucket: aws.String(name)}); err != nil {
		return fmt.Errorf("create bucket %s: %w", name, err)
	}
	return nil
}

// Exited reports whether the server's process has ended, and how.
func (s *Server) Exited() (bool, error) {
	select {
	case <-s.exited:
		return true, s.waitErr
	default:
		return false, nil
	}
}

// tail keeps the last max bytes written to it.
type tail struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (w *tail) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b = append(w.b, p...)
	if over := len(w.b) - w.max; over > 0 {
		w.b = append(w.b[:0], w.b[over:]...)
	}
	return len(p), nil
}

func (w *tail) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.b) == 0 {
		return "(none)"
	}
	return string(w.b)
}

// Close stops the server; closing it again does nothing.
func (s *Server) Close() error {
	select {
	case <-s.exited:
		return nil
	default:
	}
	s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.exited:
		return nil
	case <-time.After(10 * time.Second):
		s.cmd.Process.Kill()
		<-s.exited
		return errors.New("versitygw ignored SIGTERM for 10s; killed")
	}
}
