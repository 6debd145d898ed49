package fs

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/hermesfs/hermesfs/archive"
)

// The test binary doubles as a mount helper: tests re-execute it with
// helperEnv set to run a mount in another process (to kill -9 it, or to run
// it as another user).
const helperEnv = "HERMESFS_FS_HELPER"

// runHelper runs helper mode h and returns the exit code.
func runHelper(h string) int {
	if h == "hold" {
		return holdFile(os.Getenv("HELPER_FILE"))
	}
	if h == "stamp" {
		return stampFiles(os.Getenv("HELPER_A"), os.Getenv("HELPER_B"))
	}
	if h == "mmap-write" {
		return mmapWriteHelper(os.Getenv("HELPER_FILE"), os.Getenv("HELPER_OFF"))
	}
	mnt, upper, img := os.Getenv("HELPER_MNT"), os.Getenv("HELPER_UPPER"), os.Getenv("HELPER_LOWER")
	opts := Options{Upper: upper, ReadOnly: os.Getenv("HELPER_RO") == "1"}
	// Warnings and errors go to stderr, which the test logs.
	opts.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	helperRangeOpts(&opts)
	if img != "" {
		f, err := os.Open(img)
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		st, _ := f.Stat()
		r, err := archive.Open(f, st.Size(), archive.ReaderOptions{Name: img})
		if err != nil {
			fmt.Println("error:", err)
			return 1
		}
		opts.Lower = r
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	m, err := Mount(ctx, mnt, opts)
	cancel()
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	switch h {
	case "mount":
		// Serve until told to stop (or killed).
		fmt.Println("ready")
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
		<-sig
	case "mount-exit":
		// Serve until SIGTERM, then unmount with a short deadline and
		// exit whatever happened.
		fmt.Println("ready")
		sig := make(chan os.Signal, 1)
		signal.Notify(sig, syscall.SIGTERM)
		<-sig
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		fmt.Println("unmount:", m.Unmount(ctx))
		return 0
	case "changes":
		// What the view of HELPER_FILE offers the packer, checked
		// against the lower file (partial_changes_test.go).
		fmt.Println(helperChanges(m, os.Getenv("HELPER_FILE")))
	case "unpriv", "unpriv-ro":
		checks := unprivChecks
		if h == "unpriv-ro" {
			checks = roChecks
		}
		code := 0
		if err := checks(m, mnt); err != nil {
			fmt.Println("error:", err)
			code = 1
		} else {
			fmt.Println("ok")
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := m.Unmount(ctx); err != nil {
			fmt.Println("error: unmount:", err)
			code = 1
		}
		return code
	}
	ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := m.Unmount(ctx); err != nil {
		fmt.Println("error: unmount:", err)
		return 1
	}
	return 0
}

// holdFile opens path, says so, and on SIGUSR1 reads it and prints what
// the read gave.
func holdFile(path string) int {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGUSR1)
	f, err := os.Open(path)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	defer f.Close()
	fmt.Println("open")
	<-sig
	_, err = f.ReadAt(make([]byte, 1), 0)
	if errors.Is(err, syscall.ENOTCONN) {
		fmt.Println("read: ENOTCONN")
	} else {
		fmt.Println("read:", err)
	}
	return 0
}

// stampFiles opens files a and b for writing, says so, and until killed
// stamps a counter into the first 8 bytes of a, then of b, then into a
// block of a further on (ptwrite_test.go).
func stampFiles(a, b string) int {
	fa, err := os.OpenFile(a, os.O_RDWR, 0)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fb, err := os.OpenFile(b, os.O_RDWR, 0)
	if err != nil {
		fmt.Println("error:", err)
		return 1
	}
	fmt.Println("open")
	buf := make([]byte, 4096)
	for i := uint64(1); ; i++ {
		binary.LittleEndian.PutUint64(buf, i)
		for _, w := range []struct {
			f   *os.File
			off int64
		}{{fa, 0}, {fb, 0}, {fa, int64(1+i%1023) * 4096}} {
			if _, err := w.f.WriteAt(buf, w.off); err != nil {
				fmt.Println("error:", err)
				return 1
			}
		}
	}
}

// unprivChecks is the basic I/O an unprivileged mount must serve.
func unprivChecks(m *Mounted, mnt string) error {
	if m.Passthrough() {
		return errors.New("passthrough enabled without CAP_SYS_ADMIN")
	}
	if got, err := os.ReadFile(filepath.Join(mnt, "top.txt")); err != nil || string(got) != "top" {
		return fmt.Errorf("read lower file: %q, %v", got, err)
	}
	p := filepath.Join(mnt, "dir", "new.txt")
	if err := os.Mkdir(filepath.Join(mnt, "dir"), 0o700); err != nil {
		return err
	}
	if err := os.WriteFile(p, []byte("written by nobody"), 0o600); err != nil {
		return err
	}
	if got, err := os.ReadFile(p); err != nil || string(got) != "written by nobody" {
		return fmt.Errorf("read back: %q, %v", got, err)
	}
	if err := os.WriteFile(filepath.Join(mnt, "a", "one.txt"), []byte("copied up"), 0o644); err != nil {
		return fmt.Errorf("copy-up write: %w", err)
	}
	if err := os.Rename(p, filepath.Join(mnt, "moved.txt")); err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(mnt, "top.txt")); err != nil {
		return err
	}
	if _, err := os.Stat(filepath.Join(mnt, "top.txt")); !os.IsNotExist(err) {
		return fmt.Errorf("deleted lower file: %v", err)
	}
	st, err := os.Stat(filepath.Join(mnt, "moved.txt"))
	if err != nil {
		return err
	}
	if st.Mode().Perm() != 0o600 {
		return fmt.Errorf("mode %v, want 0600", st.Mode())
	}
	if uid := st.Sys().(*syscall.Stat_t).Uid; uid != uint32(os.Getuid()) {
		return fmt.Errorf("owner %d, want %d", uid, os.Getuid())
	}
	return nil
}

// helperProc is a mount served by a helper process.
type helperProc struct {
	cmd *exec.Cmd
	out *bufio.Reader
}

// startHelper starts the test binary in helper mode h and waits for it to
// print its first line ("ready", "ok" or "error: ...").
func startHelper(t *testing.T, h, mnt, upper, img string, cred *syscall.Credential, env ...string) (*helperProc, string) {
	t.Helper()
	bin, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if cred != nil {
		// The test binary lives in a private build directory: give the
		// other user a copy it can run.
		dir := tempDir(t)
		cp := filepath.Join(dir, "fs.test")
		b, err := os.ReadFile(bin)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(cp, b, 0o755); err != nil {
			t.Fatal(err)
		}
		bin = cp
	}
	cmd := exec.Command(bin, "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+h, "HELPER_MNT="+mnt, "HELPER_UPPER="+upper, "HELPER_LOWER="+img)
	cmd.Env = append(cmd.Env, env...)
	if strings.HasSuffix(h, "-ro") {
		cmd.Env = append(cmd.Env, "HELPER_RO=1")
	}
	cmd.Stderr = testWriter{t}
	cmd.Dir = "/"
	if cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
		cmd.Env = append(cmd.Env, "HOME=/")
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &helperProc{cmd: cmd, out: bufio.NewReader(stdout)}
	line := make(chan string, 1)
	go func() {
		l, _ := p.out.ReadString('\n')
		line <- strings.TrimSpace(l)
	}()
	select {
	case l := <-line:
		return p, l
	case <-time.After(60 * time.Second):
		cmd.Process.Kill()
		t.Fatal("helper did not answer")
	}
	return p, ""
}

// wait reaps the helper and returns the rest of its output.
func (p *helperProc) wait() (string, error) {
	rest, _ := io.ReadAll(p.out)
	return string(rest), p.cmd.Wait()
}
