package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader/storeurl"
)

// runBackground starts the daemon again as a child in its own session
// (so a terminal's signals do not reach it), working directory "/" (never
// inside the mount, which would keep it busy), output appended to the log
// file. It returns once the child printed its ready line (echoed here) or
// exited (its exit code, and the last lines it logged).
func runBackground(ctx context.Context, e *env, cfg *mountConfig, fset *flag.FlagSet) error {
	stateDir := cfg.StateDir
	if stateDir == "" {
		var err error
		if stateDir, err = daemon.DefaultStateDir(cfg.Mountpoint, os.Getuid(), e.getenv); err != nil {
			return err
		}
	}
	logFile := cfg.LogFile
	if logFile == "" {
		logFile = filepath.Join(stateDir, "hermesfs.log")
	}
	logFile, err := filepath.Abs(logFile)
	if err != nil {
		return err
	}
	// What is made here for the log is taken away again if the daemon
	// does not get ready: a refused mount leaves no state dir behind.
	made, err := mkdirAllNoting(filepath.Dir(logFile))
	if err != nil {
		return fmt.Errorf("log file: %w", err)
	}
	_, statErr := os.Stat(logFile)
	newLog := errors.Is(statErr, os.ErrNotExist)
	f, err := os.OpenFile(logFile, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		removeMade(made)
		return fmt.Errorf("log file: %w", err)
	}
	defer f.Close()
	undo := func() {
		if newLog {
			os.Remove(logFile)
		}
		removeMade(made)
	}
	start, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return fmt.Errorf("log file: %w", err)
	}

	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("background: %w", err)
	}
	// The child runs in "/": a relative path would name something else
	// there. The state dir, log file and mountpoint are absolute already
	// (validate, above); the store and the key files are made so here,
	// from their flags or environment variables.
	paths, err := absolutePathFlags(e, fset)
	if err != nil {
		return err
	}
	args := []string{"mount"}
	fset.Visit(func(fl *flag.Flag) {
		switch fl.Name {
		case "background", "store", "identity", "encrypt-to":
		case "state-dir":
			args = append(args, "--state-dir="+stateDir)
		default:
			if l, ok := fl.Value.(*listFlag); ok { // repeatable: one argument each
				for _, v := range *l {
					args = append(args, "--"+fl.Name+"="+v)
				}
				return
			}
			args = append(args, "--"+fl.Name+"="+fl.Value.String())
		}
	})
	if cfg.StateDir == "" {
		args = append(args, "--state-dir="+stateDir)
	}
	args = append(args, paths...)
	args = append(args, "--", cfg.Mountpoint)
	cmd := exec.Command(exe, args...)
	cmd.Dir = "/"
	cmd.Stdout, cmd.Stderr = f, f
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		undo()
		return fmt.Errorf("background: start %s: %w", exe, err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()

	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	saidWait := false
	for {
		if line := findWaiting(logFile, start); line != "" && !saidWait {
			// A wait for the writer lease or the store can take minutes.
			saidWait = true
			fmt.Fprintf(e.stderr, "hermesfs: the mount is not writable yet, waiting (up to --lease-wait): %s\n", line)
		}
		if line := findReady(logFile, start); line != "" {
			fmt.Fprintln(e.stdout, line)
			fmt.Fprintf(e.stderr, "hermesfs: running in the background as pid %d, logging to %s\n", cmd.Process.Pid, logFile)
			return nil
		}
		select {
		case err := <-exited:
			if line := findReady(logFile, start); line != "" {
				fmt.Fprintln(e.stdout, line)
			}
			code := exitFailure
			var ee *exec.ExitError
			if errors.As(err, &ee) && ee.ExitCode() > 0 {
				code = ee.ExitCode()
			}
			tail := tailLines(logFile, start, 10)
			if newLog {
				// Its lines are here; the log and the directories
				// made for it go.
				f.Close()
				undo()
				return withCode(code, fmt.Errorf("the daemon exited before it was ready (%v); its last log lines:\n%s", err, tail))
			}
			return withCode(code, fmt.Errorf("the daemon exited before it was ready (%v); last lines of %s:\n%s", err, logFile, tail))
		case <-ctx.Done():
			cmd.Process.Signal(syscall.SIGTERM)
			<-exited
			return fmt.Errorf("interrupted while waiting for the mount; stopped the daemon (log: %s)", logFile)
		case <-t.C:
		}
	}
}

// absolutePathFlags returns the settings of mount that may name a file
// relative to the working directory (--store as a bare path, --identity,
// --encrypt-to @FILE), from their flags or else their environment
// variables, as flags naming it absolutely.
func absolutePathFlags(e *env, fset *flag.FlagSet) ([]string, error) {
	var out []string
	if raw := storeSetting(e, fset, "store"); raw != "" {
		if !strings.Contains(raw, "://") {
			loc, err := storeurl.Parse(raw, storeurl.Options{Getenv: e.getenv, UID: os.Getuid()})
			if err != nil {
				return nil, usageError("%v", err)
			}
			raw = loc.Dir
		}
		out = append(out, "--store="+raw)
	}
	for _, id := range cryptSettings(e, fset, "identity") {
		abs, err := filepath.Abs(id)
		if err != nil {
			return nil, usageError("--identity %s: %v", id, err)
		}
		out = append(out, "--identity="+abs)
	}
	for _, r := range cryptSettings(e, fset, "encrypt-to") {
		if file, ok := strings.CutPrefix(strings.TrimSpace(r), "@"); ok {
			abs, err := filepath.Abs(file)
			if err != nil {
				return nil, usageError("--encrypt-to %s: %v", r, err)
			}
			r = "@" + abs
		}
		out = append(out, "--encrypt-to="+r)
	}
	return out, nil
}

// findWaiting returns the log line, written after offset off, of a daemon
// that waits for the writer lease or the store.
func findWaiting(path string, off int64) string {
	for _, l := range strings.Split(string(readFrom(path, off)), "\n") {
		if strings.Contains(l, `msg="waiting for the`) {
			return l
		}
	}
	return ""
}

// mkdirAllNoting is os.MkdirAll(dir, 0o700) that returns the directories
// it made, deepest last.
func mkdirAllNoting(dir string) ([]string, error) {
	var missing []string
	for p := filepath.Clean(dir); ; p = filepath.Dir(p) {
		if _, err := os.Lstat(p); err == nil || !errors.Is(err, os.ErrNotExist) {
			break
		}
		missing = append(missing, p)
		if filepath.Dir(p) == p {
			break
		}
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	slices.Reverse(missing)
	return missing, nil
}

// removeMade removes the directories mkdirAllNoting made, deepest first,
// each only if empty.
func removeMade(made []string) {
	for i := len(made) - 1; i >= 0; i-- {
		os.Remove(made[i])
	}
}

// findReady returns the ready line written to the log after offset off.
func findReady(path string, off int64) string {
	b := readFrom(path, off)
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "ready ") {
			return l
		}
	}
	return ""
}

func readFrom(path string, off int64) []byte {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	b, _ := io.ReadAll(io.NewSectionReader(f, off, 1<<30))
	return b
}

func tailLines(path string, off int64, n int) string {
	lines := bytes.Split(bytes.TrimRight(readFrom(path, off), "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}
