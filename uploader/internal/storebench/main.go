// Command storebench measures the store: upload and verified-download
// throughput of an archive-sized object through the snapshot catalog, to a
// local directory store and to an S3 server (versitygw) on loopback, each
// against a plain cp of the same file on the same disk; and the requests
// one snapshot publish costs. scripts/bench-store.sh runs it.
package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/hermesfs/hermesfs/uploader"
	"github.com/hermesfs/hermesfs/uploader/faultproxy"
	"github.com/hermesfs/hermesfs/uploader/s3"
	"github.com/hermesfs/hermesfs/uploader/s3test"
)

func main() {
	size := flag.String("size", "1G", "object size (K, M, G suffixes)")
	dir := flag.String("dir", os.TempDir(), "scratch directory (the disk under test)")
	flag.Parse()
	n, err := parseSize(*size)
	if err == nil {
		err = run(context.Background(), n, *dir)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "storebench:", err)
		os.Exit(1)
	}
}

func parseSize(s string) (int64, error) {
	mult := int64(1)
	switch {
	case strings.HasSuffix(s, "G"):
		mult, s = 1<<30, strings.TrimSuffix(s, "G")
	case strings.HasSuffix(s, "M"):
		mult, s = 1<<20, strings.TrimSuffix(s, "M")
	case strings.HasSuffix(s, "K"):
		mult, s = 1<<10, strings.TrimSuffix(s, "K")
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v <= 0 {
		return 0, fmt.Errorf("size %q: want a positive number with an optional K, M or G", s)
	}
	return v * mult, nil
}

func mbps(n int64, d time.Duration) float64 { return float64(n) / (1 << 20) / d.Seconds() }

func run(ctx context.Context, size int64, base string) error {
	work, err := os.MkdirTemp(base, "storebench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(work)

	// An archive is compressed data: random bytes stand in for it.
	src := filepath.Join(work, "archive.sqfs")
	sum, err := writeRandom(src, size)
	if err != nil {
		return err
	}
	fmt.Printf("object: %d MiB of incompressible data in %s\n", size>>20, work)

	var cpRates []float64
	for range runs {
		exec.Command("sync").Run()
		t0 := time.Now()
		if out, err := exec.Command("cp", src, filepath.Join(work, "copy.sqfs")).CombinedOutput(); err != nil {
			return fmt.Errorf("cp: %v: %s", err, out)
		}
		exec.Command("sync").Run()
		cpRates = append(cpRates, mbps(size, time.Since(t0)))
		os.Remove(filepath.Join(work, "copy.sqfs"))
	}
	cp := median(cpRates)
	fmt.Printf("baseline  cp + sync, same disk:        %s\n", spread(cpRates))

	// Local directory store.
	local, err := uploader.NewLocal(filepath.Join(work, "store"))
	if err != nil {
		return err
	}
	if err := measure(ctx, "local", local, src, sum, size, work, cp); err != nil {
		return err
	}
	os.RemoveAll(filepath.Join(work, "store"))

	// S3 on loopback, requests counted by a pass-through proxy.
	bin, err := s3test.Binary()
	if err != nil {
		return err
	}
	gwDir := filepath.Join(work, "gw")
	os.MkdirAll(gwDir, 0o755)
	srv, err := s3test.Launch(bin, gwDir, nil)
	if err != nil {
		return err
	}
	defer srv.Close()
	if err := srv.CreateBucket(ctx, "bench"); err != nil {
		return err
	}
	proxy, err := faultproxy.Start(srv.Endpoint)
	if err != nil {
		return err
	}
	defer proxy.Close()
	cfg := s3.Config{Bucket: "bench", Prefix: "agent", Endpoint: srv.Endpoint, Region: s3test.Region, PathStyle: true,
		AccessKeyID: s3test.AccessKey, SecretAccessKey: s3test.SecretKey}
	direct, err := s3.New(ctx, cfg)
	if err != nil {
		return err
	}
	if err := measure(ctx, "s3", direct, src, sum, size, work, cp); err != nil {
		return err
	}
	fmt.Printf("          (versitygw posix backend on the same disk, part size %d MiB, %d parts in flight)\n",
		s3.DefaultPartSize>>20, s3.DefaultConcurrency)

	cfg.Endpoint, cfg.Prefix = proxy.URL, "counted"
	counted, err := s3.New(ctx, cfg)
	if err != nil {
		return err
	}
	cat := uploader.NewCatalog(uploader.WithRetry(counted, uploader.RetryPolicy{}, nil), uploader.CatalogOptions{Host: "bench"})
	small := filepath.Join(work, "small.sqfs")
	smallSum, _ := writeRandom(small, 1<<20)
	for _, c := range []struct {
		name, path, sum string
		size            int64
	}{{"1 MiB", small, smallSum, 1 << 20}, {fmt.Sprintf("%d MiB", size>>20), src, sum, size}} {
		latest, err := cat.LatestID(ctx)
		if err != nil {
			return err
		}
		proxy.ResetCounts()
		if _, err := cat.Publish(ctx, uploader.PublishInput{Path: c.path, SHA256: c.sum, Size: c.size, Parent: latest, Expect: latest}); err != nil {
			return err
		}
		ops, _ := proxy.Counts()
		fmt.Printf("requests  publish of a %s snapshot: %d (%s)\n", c.name, proxy.Total(), opList(ops))
		proxy.ResetCounts()
		if _, err := cat.Prune(ctx, uploader.DefaultKeep); err != nil {
			return err
		}
		ops, _ = proxy.Counts()
		fmt.Printf("requests  prune with nothing to delete: %d (%s)\n", proxy.Total(), opList(ops))
	}
	return nil
}

func opList(ops map[string]int) string {
	var parts []string
	for k, v := range ops {
		parts = append(parts, fmt.Sprintf("%d %s", v, k))
	}
	sort.Strings(parts)
	return strings.Join(parts, ", ")
}

// runs is how many times each measurement is repeated; the median is
// reported, with the range, because a shared disk is noisy.
const runs = 3

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

func spread(v []float64) string {
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return fmt.Sprintf("%7.1f MB/s (median of %d; %.0f-%.0f)", median(s), len(s), s[0], s[len(s)-1])
}

// measure publishes src to s and restores it, verified, printing MB/s.
func measure(ctx context.Context, name string, s uploader.Store, src, sum string, size int64, work string, cp float64) error {
	cat := uploader.NewCatalog(uploader.WithRetry(s, uploader.RetryPolicy{}, nil), uploader.CatalogOptions{Host: "bench"})
	var ups, downs []float64
	for range runs {
		latest, err := cat.LatestID(ctx)
		if err != nil {
			return err
		}
		exec.Command("sync").Run()
		t0 := time.Now()
		if _, err := cat.Publish(ctx, uploader.PublishInput{Path: src, SHA256: sum, Size: size, Parent: latest, Expect: latest}); err != nil {
			return fmt.Errorf("%s publish: %w", name, err)
		}
		ups = append(ups, mbps(size, time.Since(t0)))
		dst := filepath.Join(work, "restored.sqfs")
		exec.Command("sync").Run()
		t0 = time.Now()
		if _, err := cat.Restore(ctx, dst, uploader.RestoreOptions{}); err != nil {
			return fmt.Errorf("%s restore: %w", name, err)
		}
		downs = append(downs, mbps(size, time.Since(t0)))
		os.Remove(dst)
		if _, err := cat.Prune(ctx, 1); err != nil {
			return err
		}
	}
	fmt.Printf("%-9s upload (publish):            %s = %.2f x cp\n", name, spread(ups), median(ups)/cp)
	fmt.Printf("%-9s verified download (restore): %s = %.2f x cp\n", name, spread(downs), median(downs)/cp)
	return nil
}

func writeRandom(path string, size int64) (string, error) {
	f, err := os.Create(path)
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := sha256.New()
	r := rand.NewChaCha8([32]byte{1})
	if _, err := io.CopyN(io.MultiWriter(f, h), r, size); err != nil {
		return "", err
	}
	if err := f.Sync(); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}
