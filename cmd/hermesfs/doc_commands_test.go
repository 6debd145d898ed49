package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// The command lines the documentation shows must be ones hermesfs
// accepts: a user copies them. Every `hermesfs COMMAND ...` in the README,
// DEVELOPERS.md, the example units and every command's --help is parsed
// with that command's real flags and checked against its synopsis: flags
// it has, values they take, as many arguments as it wants. Placeholders
// (ID, FILE, D, $id, age1...) stand for any valid value.

// docCommand is one hermesfs command line found in a document.
type docCommand struct {
	where string
	line  string
}

var (
	codeSpanRE    = regexp.MustCompile("`([^`]+)`")
	placeholderRE = regexp.MustCompile(`^(?:[A-Z][A-Z0-9_]*(?:\|[A-Z-]+)?|\$\{?[A-Za-z_]+\}?|.*\.\.\..*|<[^>]*>.*)$`)
)

// docCommandLines returns the hermesfs command lines of a Markdown or
// text document: the lines of its indented code blocks (a "$ " prompt
// dropped, "\" continuations joined) and its code spans.
func docCommandLines(where, text string) []docCommand {
	var out []docCommand
	lines := strings.Split(text, "\n")
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if strings.HasPrefix(l, "    ") || strings.HasPrefix(l, "\t") || strings.HasPrefix(l, "  hermesfs ") {
			start := i + 1
			full := strings.TrimSpace(l)
			for strings.HasSuffix(full, "\\") && i+1 < len(lines) {
				i++
				full = strings.TrimSuffix(full, "\\") + " " + strings.TrimSpace(lines[i])
			}
			full = strings.TrimPrefix(full, "$ ")
			if strings.Contains(full, "hermesfs ") {
				out = append(out, docCommand{fmt.Sprintf("%s:%d", where, start), full})
			}
		}
	}
	// Code spans may run over a line break.
	for _, para := range strings.Split(text, "\n\n") {
		joined := strings.Join(strings.Fields(para), " ")
		for _, m := range codeSpanRE.FindAllStringSubmatch(joined, -1) {
			if strings.Contains(m[1], "hermesfs ") || strings.HasPrefix(m[1], "--") {
				line := 1 + strings.Count(text[:strings.Index(text, para)], "\n")
				out = append(out, docCommand{fmt.Sprintf("%s:%d (code span)", where, line), m[1]})
			}
		}
	}
	return out
}

// shellWords splits a command line into simple commands (at ;, &&, ||, |
// and &) of words, with quotes removed and comments dropped. Enough shell
// for documentation, not a shell.
func shellWords(line string) [][]string {
	var cmds [][]string
	var words []string
	var cur strings.Builder
	inWord := false
	flushWord := func() {
		if inWord {
			words = append(words, cur.String())
			cur.Reset()
			inWord = false
		}
	}
	flushCmd := func() {
		flushWord()
		if len(words) > 0 {
			cmds = append(cmds, words)
		}
		words = nil
	}
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case c == '\'' || c == '"':
			j := strings.IndexByte(line[i+1:], c)
			if j < 0 {
				j = len(line) - i - 1
			}
			cur.WriteString(line[i+1 : i+1+j])
			inWord = true
			i += j + 1
		case c == '#' && !inWord:
			flushCmd()
			return cmds
		case c == ';' || c == '|' || c == '&':
			flushCmd()
			if i+1 < len(line) && (line[i+1] == '|' || line[i+1] == '&') {
				i++
			}
		case c == '(' && !inWord, c == ')':
			flushCmd()
		case c == ' ' || c == '\t':
			flushWord()
		default:
			cur.WriteByte(c)
			inWord = true
		}
	}
	flushCmd()
	return cmds
}

// synopsis says how many positional arguments a command takes, from its
// usage line: "[flags] DIR FILE" two, "[--json] [MOUNTPOINT]" zero or one.
func synopsis(usage string) (min, max int) {
	for _, group := range regexp.MustCompile(`\[[^\]]*\]|\S+`).FindAllString(usage, -1) {
		switch {
		case group == "[flags]":
		case strings.HasPrefix(group, "[-"):
		case strings.HasPrefix(group, "["):
			max++
		default:
			min++
			max++
		}
	}
	return min, max
}

// checkDocCommand parses the words of one hermesfs command line (the
// words after "hermesfs") as runCommand would, and says what is wrong
// with it ("" if nothing). A synopsis ("[--json] [MOUNTPOINT]") has its
// flag names checked only.
func checkDocCommand(words []string, codeSpan bool) string {
	c, ok := commands[words[0]]
	if !ok {
		return fmt.Sprintf("no command %q", words[0])
	}
	args := words[1:]
	fset := flag.NewFlagSet("hermesfs "+c.name, flag.ContinueOnError)
	fset.SetOutput(io.Discard)
	if c.flags != nil {
		c.flags(fset)
	}
	isSynopsis := false
	var parsed []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if strings.HasPrefix(a, "[") || strings.HasSuffix(a, "]") {
			isSynopsis = true
			a = strings.Trim(a, "[]")
		}
		if a == "--help" || a == "-h" {
			return ""
		}
		if !strings.HasPrefix(a, "-") || a == "-" || a == "--" {
			parsed = append(parsed, a)
			continue
		}
		name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if strings.Contains(name, "*") {
			i++ // --keep-* N
			continue
		}
		f := fset.Lookup(name)
		if f == nil {
			return fmt.Sprintf("hermesfs %s has no flag --%s", c.name, name)
		}
		if bf, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && bf.IsBoolFlag() {
			if !hasValue {
				value = "true"
			}
		} else if !hasValue {
			if i+1 >= len(args) {
				return fmt.Sprintf("--%s needs a value", name)
			}
			i++
			value = strings.Trim(args[i], "[]")
		}
		if placeholderRE.MatchString(value) {
			continue // any valid value
		}
		if err := fset.Set(name, value); err != nil {
			return fmt.Sprintf("--%s %s: %v", name, value, err)
		}
	}
	if isSynopsis {
		return ""
	}
	if codeSpan && len(parsed) == 0 {
		// "`hermesfs mount`", "`hermesfs mount --metrics-addr HOST:PORT`":
		// the command or a flag of it named in prose, not a command line.
		return ""
	}
	min, max := synopsis(c.usage)
	if len(parsed) < min || len(parsed) > max {
		want := fmt.Sprintf("%d", min)
		if max != min {
			want = fmt.Sprintf("%d to %d", min, max)
		}
		return fmt.Sprintf("%d arguments (%q), but 'hermesfs %s %s' takes %s", len(parsed), parsed, c.name, c.usage, want)
	}
	return ""
}

// hermesfsInvocations returns the hermesfs command lines in line, each
// as its words after "hermesfs".
func hermesfsInvocations(line string) [][]string {
	var out [][]string
	for _, words := range shellWords(line) {
		for len(words) > 0 && (strings.Contains(words[0], "=") || words[0] == "sudo" || words[0] == "exec" || words[0] == "$") {
			words = words[1:]
		}
		if len(words) < 2 || filepath.Base(words[0]) != "hermesfs" {
			continue
		}
		if _, ok := commands[words[1]]; !ok && !regexp.MustCompile(`^[a-z]+$`).MatchString(words[1]) {
			continue // "hermesfs 1.2", "hermesfs' status"...
		}
		out = append(out, words[1:])
	}
	return out
}

var flagSpanRE = regexp.MustCompile(`^--([a-z0-9][a-z0-9-]*)(?:[ =](\S+))?$`)

// checkFlagMention checks a flag named in prose ("--stop-timeout 120"):
// some command has it, and takes value for it.
func checkFlagMention(name, value string) string {
	if name == "help" {
		return ""
	}
	var errs []string
	for _, cname := range commandNames() {
		fset := commandFlags(commands[cname])
		f := fset.Lookup(name)
		if f == nil {
			continue
		}
		if value == "" || placeholderRE.MatchString(value) {
			return ""
		}
		err := fset.Set(name, value)
		if err == nil {
			return ""
		}
		errs = append(errs, fmt.Sprintf("%s: %v", cname, err))
	}
	if strings.Contains(name, "*") {
		return ""
	}
	if errs == nil {
		return fmt.Sprintf("no command has a flag --%s", name)
	}
	return fmt.Sprintf("--%s %s is refused (%s)", name, value, strings.Join(errs, "; "))
}

func TestDocumentedCommandLinesParse(t *testing.T) {
	var docs []docCommand
	for _, f := range []string{"../../README.md", "../../DEVELOPERS.md"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		docs = append(docs, docCommandLines(filepath.Base(f), string(b))...)
	}
	units, _ := filepath.Glob("../../scripts/*.service")
	for _, f := range units {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "ExecStart="); ok {
				docs = append(docs, docCommand{fmt.Sprintf("%s:%d", filepath.Base(f), i+1), v})
			}
		}
	}
	for _, name := range commandNames() {
		docs = append(docs, docCommandLines("hermesfs "+name+" --help", commands[name].help)...)
	}
	checked := 0
	for _, d := range docs {
		if m := flagSpanRE.FindStringSubmatch(d.line); m != nil && strings.HasSuffix(d.where, "(code span)") {
			checked++
			if msg := checkFlagMention(m[1], m[2]); msg != "" {
				t.Errorf("%s: %q: %s", d.where, d.line, msg)
			}
			continue
		}
		for _, words := range hermesfsInvocations(d.line) {
			checked++
			if msg := checkDocCommand(words, strings.HasSuffix(d.where, "(code span)")); msg != "" {
				t.Errorf("%s: %q: %s", d.where, d.line, msg)
			}
		}
	}
	t.Logf("%d documented command lines checked", checked)
	if checked < 50 {
		t.Errorf("only %d command lines found in the documentation: the extraction is broken", checked)
	}
}
