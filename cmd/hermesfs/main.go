// Command hermesfs keeps an agent's home directory on object storage while the
// agent works at local-disk speed. See README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"github.com/hermesfs/hermesfs/cmd/hermesfs/internal/daemon"
	"github.com/hermesfs/hermesfs/uploader"
)

// Exit codes (defined with the daemon, whose errors carry them). Scripts
// rely on these numbers; never renumber them.
const (
	exitOK       = daemon.ExitOK
	exitFailure  = daemon.ExitFailure
	exitUsage    = daemon.ExitUsage
	exitCorrupt  = daemon.ExitCorrupt
	exitConflict = daemon.ExitConflict
	exitUnsynced = daemon.ExitUnsynced
	exitCrypt    = daemon.ExitCrypt
	exitNotFound = daemon.ExitNotFound
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// env is what a subcommand sees of the process: its streams and environment.
// Tests build one directly to run commands in-process.
type env struct {
	stdout, stderr io.Writer
	getenv         func(string) string
}

// command is one subcommand. run receives the arguments after the subcommand
// name; it returns an error, which runCommand turns into a message and an exit
// code (see exitError).
type command struct {
	name    string
	summary string                 // one line, shown in `hermesfs --help`
	usage   string                 // the synopsis after "hermesfs NAME"
	help    string                 // paragraphs shown by `hermesfs NAME --help`, before the flags
	flags   func(fs *flag.FlagSet) // declares the flags; may be nil
	run     func(ctx context.Context, e *env, fs *flag.FlagSet, args []string) error
}

// commands is filled by init functions in this package's files, one file per
// subcommand, so each stays self-contained.
var commands = map[string]*command{}

func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("hermesfs: command registered twice: " + c.name)
	}
	commands[c.name] = c
}

// exitError carries an exit code other than exitFailure through an error
// chain. Commands return it (usually via usageError or withCode).
type exitError = daemon.ExitError

// withCode marks err to exit with code.
func withCode(code int, err error) error { return daemon.WithCode(code, err) }

// usageError reports a bad command line; the caller's help hint is appended.
func usageError(format string, a ...any) error { return daemon.UsageError(format, a...) }

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	e := &env{stdout: stdout, stderr: stderr, getenv: os.Getenv}
	return e.main(ctx, args)
}

func (e *env) main(ctx context.Context, args []string) int {
	if len(args) == 0 {
		e.topUsage(e.stderr)
		return exitUsage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		if len(args) > 1 {
			if c, ok := commands[args[1]]; ok {
				return e.runCommand(ctx, c, []string{"--help"})
			}
		}
		e.topUsage(e.stdout)
		return exitOK
	case "-version", "--version", "version":
		fmt.Fprintf(e.stdout, "hermesfs %s\n", version)
		return exitOK
	}
	c, ok := commands[args[0]]
	if !ok {
		fmt.Fprintf(e.stderr, "hermesfs: unknown command %q\nRun 'hermesfs --help' for the list of commands.\n", args[0])
		return exitUsage
	}
	return e.runCommand(ctx, c, args[1:])
}

func (e *env) runCommand(ctx context.Context, c *command, args []string) int {
	fset := flag.NewFlagSet("hermesfs "+c.name, flag.ContinueOnError)
	fset.SetOutput(io.Discard)
	if c.flags != nil {
		c.flags(fset)
	}
	fset.Usage = func() {} // runCommand prints usage itself, once
	positional, err := parseInterspersed(fset, args)
	if errors.Is(err, flag.ErrHelp) {
		e.commandUsage(e.stdout, c, fset)
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(e.stderr, "hermesfs %s: %v\nRun 'hermesfs %s --help' for usage.\n", c.name, err, c.name)
		return exitUsage
	}
	err = c.run(ctx, e, fset, positional)
	if err == nil {
		return exitOK
	}
	code := daemon.ExitCode(err)
	fmt.Fprintf(e.stderr, "hermesfs %s: %s\n", c.name, explainError(err))
	if code == exitUsage {
		fmt.Fprintf(e.stderr, "Run 'hermesfs %s --help' for usage.\n", c.name)
	}
	return code
}

// parseInterspersed parses flags that may appear before, between or after
// positional arguments ("pack DIR FILE --level 9"). A lone "--" ends flag
// parsing.
func parseInterspersed(fset *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fset.Parse(args); err != nil {
			return nil, err
		}
		rest := fset.Args()
		if len(rest) == 0 {
			return positional, nil
		}
		// flag.Parse consumed a "--" terminator if that is what stopped it.
		if consumed := len(args) - len(rest); consumed > 0 && args[consumed-1] == "--" {
			return append(positional, rest...), nil
		}
		positional = append(positional, rest[0])
		args = rest[1:]
	}
}

func (e *env) topUsage(w io.Writer) {
	fmt.Fprint(w, `hermesfs keeps an agent's home directory (~/.hermes) on object storage while
the agent works at local-disk speed: the newest snapshot archive is mounted
read-only under a local writable layer, and the merged tree is packed into one
squashfs/zstd archive and uploaded every interval and at shutdown.

Usage:
  hermesfs <command> [flags] [arguments]

Commands:
`)
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		fmt.Fprintf(w, "  %-9s %s\n", n, commands[n].summary)
	}
	fmt.Fprint(w, `
Run 'hermesfs <command> --help' for a command's flags and examples.
Quick start:  hermesfs mount ~/.hermes
`)
}

func (e *env) commandUsage(w io.Writer, c *command, fset *flag.FlagSet) {
	fmt.Fprintf(w, "Usage: hermesfs %s %s\n\n%s\n", c.name, c.usage, c.summary)
	if h := strings.TrimSpace(c.help); h != "" {
		fmt.Fprintf(w, "\n%s\n", h)
	}
	hasFlags := false
	fset.VisitAll(func(*flag.Flag) { hasFlags = true })
	if hasFlags {
		fmt.Fprint(w, "\nFlags:\n")
		fset.SetOutput(w)
		fset.PrintDefaults()
		fset.SetOutput(io.Discard)
	}
}

// explainError is err's message led by the plain sentence the store gave
// it (uploader.Explained: "the bucket does not exist"), if any: the
// detail, an SDK's error, follows.
func explainError(err error) string {
	msg := err.Error()
	if plain := uploader.Explain(err); plain != "" && !strings.HasPrefix(msg, plain) {
		return plain + "\n  detail: " + msg
	}
	return msg
}
