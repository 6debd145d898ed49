package main

import (
	"flag"
	"io"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
)

// Every default a help text or the README states in words must be the
// flag's real default: a user reads "off by default" in one place and
// "(default 10s)" in another and believes neither.

var (
	// "off by default", "on by default".
	byDefaultRE = regexp.MustCompile(`(?i)\b(off|on) by default\b`)
	// "default 10s", "default: 15m", "default is 90s" (a value that starts
	// with a digit, or a boolean word), unless a condition follows
	// ("default 10 when no --keep-* flag is given": a rule, not a value).
	defaultValueRE = regexp.MustCompile(`(?i)\bdefaults?:?\s+(?:is\s+)?([0-9][^\s;,)]*(?:\s[KMGT]i?B\b)?|true|false|off|on)\b(\s+(?:when|with|if|unless|for)\b)?`)
	// "--interval 15m" inside a "Defaults:" paragraph.
	flagValueRE = regexp.MustCompile(`--([a-z0-9][a-z0-9-]*)\s+([0-9][^\s;,)]*)`)
	flagNameRE  = regexp.MustCompile(`--([a-z0-9][a-z0-9-]*)`)
)

// defaultClaim is a default stated in words: flag NAME's default is VALUE.
type defaultClaim struct {
	where, flag, value, text string
}

// defaultClaims finds the defaults paragraph states. owner, if set, is
// the flag the paragraph is the help of; otherwise a claim is about the
// flag named last before it in its sentence, or, with bySubject, about
// the first flag the paragraph names (a command's help is written so;
// the README's prose also states the defaults of other programs).
func defaultClaims(where, para, owner string, bySubject bool) []defaultClaim {
	para = strings.Join(strings.Fields(strings.ReplaceAll(para, "`", "")), " ")
	var out []defaultClaim
	// A claim is about the flag named last before it in its sentence,
	// else about the paragraph's subject, the first flag it names
	// ("Write-back: with --write-back D, ... Default 10s").
	about := func(at int) string {
		if owner != "" {
			return owner
		}
		start := strings.LastIndex(para[:at], ". ") + 1
		if ms := flagNameRE.FindAllStringSubmatch(para[start:at], -1); len(ms) > 0 {
			return ms[len(ms)-1][1]
		}
		if f := flagNameRE.FindStringSubmatch(para); f != nil && bySubject {
			return f[1]
		}
		return ""
	}
	snippet := func(at int) string {
		return para[max(0, at-60):min(len(para), at+40)]
	}
	for _, m := range byDefaultRE.FindAllStringSubmatchIndex(para, -1) {
		out = append(out, defaultClaim{where, about(m[0]), strings.ToLower(para[m[2]:m[3]]), snippet(m[0])})
	}
	for _, m := range defaultValueRE.FindAllStringSubmatchIndex(para, -1) {
		if m[4] >= 0 {
			continue // a conditional default
		}
		out = append(out, defaultClaim{where, about(m[0]), para[m[2]:m[3]], snippet(m[0])})
	}
	if strings.HasPrefix(strings.TrimSpace(para), "Defaults:") {
		for _, m := range flagValueRE.FindAllStringSubmatchIndex(para, -1) {
			out = append(out, defaultClaim{where, para[m[2]:m[3]], strings.TrimRight(para[m[4]:m[5]], "."), snippet(m[0])})
		}
	}
	return out
}

// commandFlags returns the flag set command c declares.
func commandFlags(c *command) *flag.FlagSet {
	fs := flag.NewFlagSet(c.name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if c.flags != nil {
		c.flags(fs)
	}
	return fs
}

// checkClaim reports whether claim agrees with the default of its flag in
// fs, by setting a fresh copy of the flag to the claimed value and
// comparing what it prints ("90s" and "1m30s" are one duration).
func checkClaim(c *command, cl defaultClaim) (ok bool, def string) {
	fs := commandFlags(c)
	f := fs.Lookup(cl.flag)
	if f == nil {
		return true, "" // not this command's flag
	}
	value := cl.value
	zero := map[string]bool{"": true, "0": true, "0s": true, "false": true, "off": true}
	switch value {
	case "off":
		return zero[f.DefValue], f.DefValue
	case "on":
		return !zero[f.DefValue], f.DefValue
	}
	if a, err := parseSize(strings.ReplaceAll(value, " ", "")); err == nil {
		if b, err := parseSize(f.DefValue); err == nil {
			return a == b, f.DefValue
		}
	}
	if err := fs.Set(cl.flag, value); err != nil {
		return false, f.DefValue
	}
	return f.Value.String() == f.DefValue, f.DefValue
}

func commandNames() []string {
	var names []string
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func TestHelpDefaultsAgree(t *testing.T) {
	checked := 0
	for _, name := range commandNames() {
		c := commands[name]
		var claims []defaultClaim
		for _, para := range strings.Split(c.help, "\n\n") {
			claims = append(claims, defaultClaims(name+" --help", para, "", true)...)
		}
		commandFlags(c).VisitAll(func(f *flag.Flag) {
			claims = append(claims, defaultClaims(name+" --help, --"+f.Name, f.Usage, f.Name, false)...)
		})
		for _, cl := range claims {
			if cl.flag == "" {
				t.Errorf("%s: a default with no flag to check it against: %q", cl.where, cl.text)
				continue
			}
			if commandFlags(c).Lookup(cl.flag) == nil {
				t.Errorf("%s: says the default of --%s, which %s does not have: %q", cl.where, cl.flag, name, cl.text)
				continue
			}
			checked++
			if ok, def := checkClaim(c, cl); !ok {
				t.Errorf("%s: says --%s defaults to %q, but its default is %q: %q", cl.where, cl.flag, cl.value, def, cl.text)
			}
		}
	}
	t.Logf("%d defaults stated in help texts checked", checked)
	if checked < 5 {
		t.Errorf("only %d defaults stated in help texts were checked: the parser finds nothing", checked)
	}
}

// TestREADMEDefaultsAgree: the same for the README. A claim there is about
// the flag named last before it; it must be the default of that flag in
// some command that has it.
func TestREADMEDefaultsAgree(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for i, para := range strings.Split(string(b), "\n\n") {
		for _, cl := range defaultClaims("README paragraph "+strconv.Itoa(i+1), para, "", false) {
			if cl.flag == "" {
				continue // a default of something other than a flag
			}
			var defs []string
			found, ok := false, false
			for _, name := range commandNames() {
				c := commands[name]
				if commandFlags(c).Lookup(cl.flag) == nil {
					continue
				}
				found = true
				good, def := checkClaim(c, cl)
				ok = ok || good
				defs = append(defs, name+": "+def)
			}
			if !found {
				continue // "--keep-*" and the like
			}
			checked++
			if !ok {
				t.Errorf("%s: says --%s defaults to %q, but its default is %s: %q", cl.where, cl.flag, cl.value, strings.Join(defs, ", "), cl.text)
			}
		}
	}
	t.Logf("%d defaults stated in the README checked", checked)
	if checked < 3 {
		t.Errorf("only %d defaults stated in the README were checked: the parser finds nothing", checked)
	}
}

// TestRetentionFlagsShowNoDefault: given no --keep-* flag the default
// policy applies, given any the policy is exactly the rules given; so no
// retention flag has a default of its own ("--keep (default 10)" read as
// a keep-last of 10 that --keep-daily 7 alone does not have).
func TestRetentionFlagsShowNoDefault(t *testing.T) {
	for _, name := range []string{"mount", "prune"} {
		commandFlags(commands[name]).VisitAll(func(f *flag.Flag) {
			if strings.HasPrefix(f.Name, "keep") && f.DefValue != "0" && f.DefValue != "" {
				t.Errorf("%s --%s shows the default %q; the policy's defaults apply only when no --keep-* flag is given", name, f.Name, f.DefValue)
			}
		})
	}
}

// TestEnvVariablesNamedInHelp: every HERMESFS_* variable a flag reads is
// named in that flag's help.
func TestEnvVariablesNamedInHelp(t *testing.T) {
	for env, flagName := range envFlags {
		f := commandFlags(commands["mount"]).Lookup(flagName)
		if f == nil {
			continue
		}
		if !strings.Contains(f.Usage, env) {
			t.Errorf("mount --%s reads %s, but its help does not say so: %q", flagName, env, f.Usage)
		}
	}
}
