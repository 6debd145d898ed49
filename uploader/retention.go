package uploader

import (
	"fmt"
	"strings"
	"time"
)

// Retention decides which snapshots a prune keeps. Each rule walks the
// snapshots newest first and keeps the newest snapshot of each of its
// time buckets (an hour, a day, an ISO week, a month, a year) until it has
// kept as many as its count: buckets without a snapshot do not count, so
// --keep-daily 7 keeps the newest snapshot of each of the last seven days
// that have one. Last keeps the newest N outright, Within every snapshot
// less than the duration older than the newest one. A snapshot is kept if
// any rule keeps it; the rules are counted independently, so one snapshot
// may satisfy several (the newest of an hour is usually the newest of its
// day too). A count below zero means no limit.
type RetentionPolicy struct {
	Last, Hourly, Daily, Weekly, Monthly, Yearly int
	Within                                       time.Duration
	// Location is the time zone whose hours and days the buckets follow;
	// nil means UTC.
	Location *time.Location
}

// DefaultKeep is the count of the default policy's Last rule.
const DefaultKeep = 10

// DefaultRetention is the policy used when none is given: the newest 10
// snapshots (two and a half hours at the default interval), then one an
// hour for a day, one a day for two weeks and one a week for two months.
func DefaultRetention() RetentionPolicy {
	return RetentionPolicy{Last: DefaultKeep, Hourly: 24, Daily: 14, Weekly: 8}
}

// IsZero reports whether the policy has no rule: it would keep nothing.
func (p RetentionPolicy) IsZero() bool {
	return p.Last == 0 && p.Hourly == 0 && p.Daily == 0 && p.Weekly == 0 && p.Monthly == 0 && p.Yearly == 0 && p.Within <= 0
}

// String lists the rules, e.g. "last 10, hourly 24, daily 14".
func (p RetentionPolicy) String() string {
	var parts []string
	for _, r := range p.rules() {
		if r.count == 0 {
			continue
		}
		n := fmt.Sprint(r.count)
		if r.count < 0 {
			n = "all"
		}
		parts = append(parts, r.name+" "+n)
	}
	if p.Within > 0 {
		parts = append(parts, "within "+p.Within.String())
	}
	if len(parts) == 0 {
		return "(nothing)"
	}
	return strings.Join(parts, ", ")
}

type retentionRule struct {
	name   string
	count  int
	bucket func(t time.Time) int
}

func (p RetentionPolicy) rules() []retentionRule {
	return []retentionRule{
		{"last", p.Last, nil},
		{"hourly", p.Hourly, func(t time.Time) int { return (t.Year()*1000+t.YearDay())*100 + t.Hour() }},
		{"daily", p.Daily, func(t time.Time) int { return t.Year()*1000 + t.YearDay() }},
		{"weekly", p.Weekly, func(t time.Time) int { y, w := t.ISOWeek(); return y*100 + w }},
		{"monthly", p.Monthly, func(t time.Time) int { return t.Year()*100 + int(t.Month()) }},
		{"yearly", p.Yearly, func(t time.Time) int { return t.Year() }},
	}
}

// Keep applies the policy to snapshot times given newest first and
// returns, for each, the rules that keep it ("hourly", "within 48h0m0s",
// ...); nil for a snapshot the policy lets go. Each reason names the rule
// and, for counted rules, which of its buckets it is ("daily 3": the
// newest snapshot of the third newest day that has one).
func (p RetentionPolicy) Keep(newestFirst []time.Time) [][]string {
	out := make([][]string, len(newestFirst))
	loc := p.Location
	if loc == nil {
		loc = time.UTC
	}
	rules := p.rules()
	kept := make([]int, len(rules))
	last := make([]int, len(rules))
	for i := range last {
		last[i] = -1 << 62
	}
	var cutoff time.Time
	if p.Within > 0 && len(newestFirst) > 0 {
		cutoff = newestFirst[0].Add(-p.Within)
	}
	for i, t := range newestFirst {
		lt := t.In(loc)
		for j, r := range rules {
			if r.count == 0 || (r.count > 0 && kept[j] >= r.count) {
				continue
			}
			b := i // "last": every snapshot is its own bucket
			if r.bucket != nil {
				b = r.bucket(lt)
			}
			if b == last[j] {
				continue
			}
			last[j] = b
			kept[j]++
			out[i] = append(out[i], fmt.Sprintf("%s %d", r.name, kept[j]))
		}
		if p.Within > 0 && t.After(cutoff) {
			out[i] = append(out[i], "within "+p.Within.String())
		}
	}
	return out
}

// ParseRetentionDuration reads a --keep-within duration the way restic
// writes them: numbers with the units y (365 days), m (a month: 30 days),
// w, d and h, e.g. "36h", "7d", "2w", "1y6m".
func ParseRetentionDuration(s string) (time.Duration, error) {
	units := map[byte]time.Duration{'y': 365 * 24 * time.Hour, 'm': 30 * 24 * time.Hour, 'w': 7 * 24 * time.Hour, 'd': 24 * time.Hour, 'h': time.Hour}
	var total time.Duration
	rest := strings.TrimSpace(s)
	if rest == "" {
		return 0, fmt.Errorf("empty duration")
	}
	for rest != "" {
		i := 0
		for i < len(rest) && rest[i] >= '0' && rest[i] <= '9' {
			i++
		}
		if i == 0 || i == len(rest) || i > 6 {
			return 0, fmt.Errorf("duration %q: want e.g. 36h, 7d, 2w or 1y6m (units y m w d h)", s)
		}
		u, ok := units[rest[i]]
		if !ok {
			return 0, fmt.Errorf("duration %q: unknown unit %q (units y m w d h)", s, rest[i])
		}
		var n int64
		fmt.Sscan(rest[:i], &n)
		total += time.Duration(n) * u
		rest = rest[i+1:]
	}
	return total, nil
}
