// Command retentioncost measures what a store keeps under a retention
// policy over simulated days, with the real code and a fake clock: every
// -every of simulated time it applies -rounds rounds of a busy agent
// (genhome churn) to the home -home, packs the tree as the daemon packs a
// snapshot (archive.Pack with Segment on the previous image: a file with
// the path, size and mtime it had there is its blocks, never read; every
// other file is read, and its blocks the previous image holds are copied
// from there), lays the image out as extents of segments with the
// daemon's image.LayOut (a segment the image uses less than a quarter of
// is copied into the new segment), publishes it with Catalog.PublishImage under a
// clock that says the simulated time, and prunes with the policy, as the
// daemon does after each snapshot. It prints one line per snapshot and a
// summary; with -restic REPO it also backs the same tree up with restic
// after each round (restic backup --time) and forgets and prunes with the
// same policy (restic forget --keep-* --prune) every -restic-prune-every
// snapshots and at the end, so both stores hold the same history.
//
// scripts/bench-cost.sh runs it; see BENCHMARKS.md ("Retention cost").
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/archive"
	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/crypt"
	"github.com/hermesfs/hermesfs/uploader/image"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "retentioncost:", err)
		os.Exit(1)
	}
}

type config struct {
	home, store, cache, churn, restic string
	days                              int
	every                             time.Duration
	rounds, resticPruneEvery          int
	seed                              uint64
	encryptTo, identity               string
	// fresh lays every image out afresh on the last (as snapshots did
	// before they extended the image before them); no compaction.
	fresh bool
	// policy is when the last image is compacted (the daemon's default
	// unless told).
	policy image.CompactPolicy
	// apply applies busy-agent rounds [from, from+n) to the home (main:
	// the genhome churn command).
	apply func(from, n int) error
}

func run() error {
	var c config
	flag.StringVar(&c.home, "home", "", "the home to churn and snapshot (changed in place)")
	flag.StringVar(&c.store, "store", "", "local store directory (created)")
	flag.StringVar(&c.cache, "cache", "", "the image cache directory (created)")
	flag.StringVar(&c.churn, "churn", "", "the genhome binary (its churn command is run)")
	flag.IntVar(&c.days, "days", 30, "simulated days")
	flag.DurationVar(&c.every, "every", time.Hour, "simulated time between snapshots")
	flag.IntVar(&c.rounds, "rounds", 1, "busy-agent rounds applied before each snapshot")
	flag.Uint64Var(&c.seed, "seed", 1, "churn seed")
	flag.StringVar(&c.restic, "restic", "", "restic repository to back the same tree up to (initialised; RESTIC_PASSWORD must be set)")
	flag.IntVar(&c.resticPruneEvery, "restic-prune-every", 1, "run restic forget --prune every this many snapshots")
	flag.StringVar(&c.encryptTo, "encrypt-to", "", "age recipient: encrypted snapshots")
	flag.StringVar(&c.identity, "identity", "", "age identity file (with -encrypt-to)")
	flag.BoolVar(&c.fresh, "fresh", false, "lay every image out afresh (no extending, no compaction), as before images extended")
	c.policy = image.DefaultCompactPolicy()
	flag.Float64Var(&c.policy.GarbageShare, "compact-garbage", c.policy.GarbageShare, "compact once the image's garbage passes this share of it")
	flag.IntVar(&c.policy.Extents, "compact-extents", c.policy.Extents, "compact once the image has more extents")
	flag.IntVar(&c.policy.Generation, "compact-generation", c.policy.Generation, "compact once this many snapshots extended the image since the last compaction")
	flag.Parse()
	if c.home == "" || c.store == "" || c.cache == "" || c.churn == "" || flag.NArg() != 0 {
		flag.Usage()
		return errors.New("-home, -store, -cache and -churn are required")
	}
	c.apply = func(from, n int) error {
		cmd := exec.Command(c.churn, "churn", "-dir", c.home, "-round", fmt.Sprint(from), "-rounds", fmt.Sprint(n), "-seed", fmt.Sprint(c.seed))
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("churn: %v: %s", err, out)
		}
		return nil
	}
	_, err := simulate(context.Background(), c, os.Stdout)
	return err
}

// sim is the simulation's state: the catalog, the image pool, and the
// last published image (what the next snapshot is packed on).
type sim struct {
	c       config
	cat     *uploader.Catalog
	pool    *image.Pool
	now     time.Time
	policy  uploader.RetentionPolicy
	last    *image.Image
	lastArc *archive.Reader
	enc     bool
	// baseExtents: the last image's lineage's extents right after its
	// last compaction or fresh layout (the daemon's state.json keeps it).
	baseExtents int
	// firstSent, firstSegment: the first snapshot's figures (the whole
	// home), left out of the averages.
	firstSent, firstSegment int64
}

// simulate runs the simulation and prints its lines to w; it returns the
// simulation, its last image open.
func simulate(ctx context.Context, c config, w io.Writer) (*sim, error) {
	st, err := uploader.NewLocal(c.store)
	if err != nil {
		return nil, err
	}
	s := &sim{c: c, policy: uploader.DefaultRetention()}
	// The simulated days start at a midnight at least a day after the
	// real now: the store's object times (real) are then older than the
	// simulated clock, as they would be, and prune's grace for a publish
	// in progress (an hour, by the objects' real times) never holds back
	// a segment no snapshot uses.
	s.now = time.Now().UTC().Add(25 * time.Hour).Truncate(24 * time.Hour)
	opts := uploader.CatalogOptions{Host: "sim", Version: "retentioncost", Now: func() time.Time { return s.now }}
	po := image.Options{Store: st, CacheDir: c.cache}
	if c.encryptTo != "" {
		r, err := crypt.ParseRecipients([]string{c.encryptTo})
		if err != nil {
			return s, err
		}
		ids, err := crypt.LoadIdentities([]string{c.identity})
		if err != nil {
			return s, err
		}
		opts.Recipients, opts.Identities, po.Identities = r, ids, ids
		s.enc = true
	}
	s.cat = uploader.NewCatalog(st, opts)
	if s.pool, err = image.NewPool(po); err != nil {
		return s, err
	}
	if c.restic != "" {
		if err := s.restic("init", "--repository-version", "2"); err != nil {
			return s, err
		}
	}
	n := int(time.Duration(c.days) * 24 * time.Hour / c.every)
	fmt.Fprintf(w, "# %d snapshots, one every %s for %d days from %s, %d busy-agent round(s) before each (the first: the home as generated); policy %s\n",
		n, c.every, c.days, s.now.Format(time.RFC3339), c.rounds, s.policy)
	fmt.Fprintln(w, "# i time pack_s segment_bytes rewritten_bytes sent_bytes image_bytes extents kept store_bytes store_objects restic_bytes")
	start := s.now
	var sent, segs, restic, compactSent int64
	compactions := 0
	for i := range n {
		s.now = start.Add(time.Duration(i) * c.every)
		if i > 0 {
			if err := c.apply((i-1)*c.rounds, c.rounds); err != nil {
				return s, err
			}
		}
		r, err := s.snapshot(ctx)
		if err != nil {
			return s, fmt.Errorf("snapshot %d: %w", i, err)
		}
		if r.fallback != "" {
			fmt.Fprintf(w, "# snapshot %d laid out afresh: %s\n", i, r.fallback)
		}
		pr, err := s.cat.PruneWith(ctx, uploader.PruneOptions{Policy: s.policy})
		if err != nil {
			return s, err
		}
		// The daemon compacts in the background after a snapshot, and
		// prunes after the compaction publishes.
		cr, err := s.compact(ctx)
		if err != nil {
			return s, fmt.Errorf("compaction after snapshot %d: %w", i, err)
		}
		if cr.why != "" && !s.c.fresh {
			if pr, err = s.cat.PruneWith(ctx, uploader.PruneOptions{Policy: s.policy}); err != nil {
				return s, err
			}
			compactions++
			compactSent += cr.pub.Sent
			fmt.Fprintf(w, "# compacted after snapshot %d (%s): %.3f s, segment %d bytes (%d rewritten), sent %d, image %d bytes in %d extents\n",
				i, cr.why, cr.took.Seconds(), cr.segment, cr.rewritten, cr.pub.Sent, cr.pub.Size, cr.pub.ExtentCount)
		}
		if c.restic != "" {
			if err := s.restic("backup", "--quiet", "--host", "sim", "--time", s.now.Format("2006-01-02 15:04:05"), "."); err != nil {
				return s, err
			}
			if (i+1)%c.resticPruneEvery == 0 || i == n-1 {
				if err := s.resticForget(); err != nil {
					return s, err
				}
			}
			if restic, _, err = du(c.restic); err != nil {
				return s, err
			}
		}
		bytes, objects, err := du(c.store)
		if err != nil {
			return s, err
		}
		sent += r.pub.Sent
		segs += r.segment
		fmt.Fprintf(w, "%d %s %.3f %d %d %d %d %d %d %d %d %d\n", i, s.now.Format("2006-01-02T15:04"), r.pack.Seconds(), r.segment, r.rewritten,
			r.pub.Sent, r.pub.Size, r.pub.ExtentCount, len(pr.Kept), bytes, objects, restic)
	}
	bytes, objects, err := du(c.store)
	if err != nil {
		return s, err
	}
	kept, err := s.cat.Complete(ctx)
	if err != nil {
		return s, err
	}
	fmt.Fprintf(w, "summary: %d snapshots published (%d after the first: %.0f bytes sent each on average, %.0f of them segment); %d compactions (%.0f bytes sent each, %.0f per snapshot amortised); kept %d; store %d bytes in %d objects",
		n, n-1, float64(sent-s.firstSent)/float64(max(n-1, 1)), float64(segs-s.firstSegment)/float64(max(n-1, 1)),
		compactions, float64(compactSent)/float64(max(compactions, 1)), float64(compactSent)/float64(max(n-1, 1)), len(kept), bytes, objects)
	if c.restic != "" {
		rb, ro, err := du(c.restic)
		if err != nil {
			return s, err
		}
		out, err := s.resticOut("snapshots", "--json")
		if err != nil {
			return s, err
		}
		var snaps []json.RawMessage
		json.Unmarshal(out, &snaps)
		fmt.Fprintf(w, "; restic kept %d, repository %d bytes in %d files (ratio %.2f)", len(snaps), rb, ro, float64(bytes)/float64(rb))
	}
	fmt.Fprintln(w)
	return s, nil
}

type snapResult struct {
	pub                uploader.Published
	segment, rewritten int64
	pack               time.Duration
	fallback           string // why an extending pack laid the image out afresh
}

// snapshot packs the home on the last image, publishes it and makes it
// the last image.
func (s *sim) snapshot(ctx context.Context) (snapResult, error) {
	var r snapResult
	out := filepath.Join(s.c.cache, "next.seg")
	f, err := os.Create(out)
	if err != nil {
		return r, err
	}
	defer os.Remove(out)
	t0 := time.Now()
	var src fs.FS = os.DirFS(s.c.home)
	opts := archive.PackOptions{Segment: true}
	if s.lastArc != nil {
		opts.Base = s.lastArc
		if s.c.fresh {
			src = archive.WithBase(src, s.lastArc)
		} else {
			// As the daemon: extend the last image by what changed.
			cfs, err := newChangeFS(s.c.home, s.lastArc)
			if err != nil {
				return r, fmt.Errorf("compare with the last image: %w", err)
			}
			src, opts.Extend = cfs, true
		}
	}
	res, err := archive.Pack(ctx, f, src, opts)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return r, fmt.Errorf("pack: %w", err)
	}
	if opts.Extend && res.Base != archive.BaseExtended {
		r.fallback = res.ExtendFallback
	}
	sources := map[*archive.Reader]*image.Image{}
	if s.last != nil {
		sources[s.lastArc] = s.last
	}
	ext, rewritten, err := image.LayOut(context.Background(), res.Runs, out, sources, s.enc)
	if err != nil {
		return r, fmt.Errorf("lay out: %w", err)
	}
	r.pack = time.Since(t0)
	r.segment, r.rewritten = res.SegmentSize+rewritten, rewritten
	mf, err := os.Open(out)
	if err != nil {
		return r, err
	}
	meta := uploader.SquashfsMetaOffset(mf, res.Size)
	mf.Close()
	in := uploader.ImageInput{Segment: out, Extents: ext, Files: res.Files, MetaOffset: meta}
	if s.last != nil {
		m := s.last.Manifest()
		in.Sources, in.Parent, in.Expect = []uploader.Manifest{m}, m.ID, m.ID
	}
	pub, err := s.cat.PublishImage(ctx, in)
	if err != nil {
		return r, fmt.Errorf("publish: %w", err)
	}
	r.pub = pub
	if s.last == nil {
		s.firstSent, s.firstSegment = pub.Sent, r.segment
	}
	if res.Generation == 0 {
		s.baseExtents = pub.ExtentCount
	}
	return r, s.adopt(ctx, out, pub)
}

// adopt makes the image just published from the segment file out the
// last image, as the daemon's adoptSegment does.
func (s *sim) adopt(ctx context.Context, out string, pub uploader.Published) error {
	// The new segment goes into the cache as the daemon's adoptSegment
	// puts it, and the image is opened from there.
	if pub.Segment != "" {
		name := filepath.Join(s.c.cache, image.PlainName(pub.Segment))
		if err := os.Rename(out, name); err != nil {
			return err
		}
		if err := os.WriteFile(name+uploader.SumsExt, pub.SegmentSums, 0o600); err != nil {
			return err
		}
	}
	if err := os.WriteFile(filepath.Join(s.c.cache, path.Base(pub.Extents)), pub.ExtentsList, 0o600); err != nil {
		return err
	}
	im, err := s.pool.Open(ctx, pub.Manifest, nil)
	if err != nil {
		return fmt.Errorf("open the published image: %w", err)
	}
	arc, err := archive.Open(im, im.Size(), archive.ReaderOptions{Name: pub.ID})
	if err != nil {
		im.Close()
		return fmt.Errorf("open the published image: %w", err)
	}
	if s.last != nil {
		s.last.Close()
	}
	s.last, s.lastArc = im, arc
	s.cleanCache(pub.Manifest)
	return nil
}

// compact compacts the last image when the daemon's policy says so
// (image.CompactPolicy.Due, image.Compact), publishes it as a snapshot
// that compacts its parent and makes it the last image.
func (s *sim) compact(ctx context.Context) (compactResult, error) {
	var c compactResult
	m := s.last.Manifest()
	c.why = s.c.policy.Due(m.Size, s.lastArc.GarbageBytes(), m.ExtentCount, s.baseExtents, s.lastArc.Generation())
	if c.why == "" || s.c.fresh {
		return c, nil
	}
	out := filepath.Join(s.c.cache, "compact.seg")
	defer os.Remove(out)
	t0 := time.Now()
	cr, err := image.Compact(ctx, out, s.lastArc, s.last, s.enc, 0)
	if err != nil {
		return c, err
	}
	c.took = time.Since(t0)
	mf, err := os.Open(out)
	if err != nil {
		return c, err
	}
	meta := uploader.SquashfsMetaOffset(mf, cr.Size)
	mf.Close()
	in := uploader.ImageInput{Segment: out, Extents: cr.Extents, Files: cr.Files, MetaOffset: meta,
		Sources: []uploader.Manifest{m}, Parent: m.ID, Expect: m.ID, Compacts: m.ID}
	pub, err := s.cat.PublishImage(ctx, in)
	if err != nil {
		return c, fmt.Errorf("publish the compaction: %w", err)
	}
	c.pub, c.segment, c.rewritten = pub, cr.SegmentSize+cr.Rewritten, cr.Rewritten
	s.baseExtents = pub.ExtentCount
	return c, s.adopt(ctx, out, pub)
}

type compactResult struct {
	why                string
	pub                uploader.Published
	segment, rewritten int64
	took               time.Duration
}

// cleanCache removes the cached segments the image m does not use.
func (s *sim) cleanCache(m uploader.Manifest) {
	used := map[string]bool{path.Base(m.Extents): true}
	for _, r := range m.Segments {
		used[image.PlainName(r.Key)] = true
	}
	ents, _ := os.ReadDir(s.c.cache)
	for _, e := range ents {
		base := strings.TrimSuffix(strings.TrimSuffix(e.Name(), uploader.SumsExt), uploader.EncryptedExt)
		if !used[base] {
			os.Remove(filepath.Join(s.c.cache, e.Name()))
		}
	}
}

func (s *sim) resticForget() error {
	p := s.policy
	return s.restic("forget", "--quiet", "--prune", "--keep-last", fmt.Sprint(p.Last), "--keep-hourly", fmt.Sprint(p.Hourly),
		"--keep-daily", fmt.Sprint(p.Daily), "--keep-weekly", fmt.Sprint(p.Weekly))
}

func (s *sim) restic(args ...string) error {
	_, err := s.resticOut(args...)
	return err
}

// resticOut runs restic on the repository, in the home (its snapshots
// name ".").
func (s *sim) resticOut(args ...string) ([]byte, error) {
	cmd := exec.Command("restic", append([]string{"-r", s.c.restic}, args...)...)
	cmd.Dir = s.c.home
	cmd.Env = append(os.Environ(), "TZ=UTC")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("restic %s: %v: %s", args[0], err, stderr.String())
	}
	return out, nil
}

// du adds up the sizes of the regular files under dir.
func du(dir string) (bytes, files int64, err error) {
	err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		bytes += fi.Size()
		files++
		return nil
	})
	return bytes, files, err
}
