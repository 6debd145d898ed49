package archive

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"
)

// BenchmarkExtendOneLine packs a one-line change to a session file of a
// home of benchEntries entries (120k; HERMESFS_BENCH_ENTRIES=1000000 for
// 1M) by extending the previous image, b.N times in a row: the pack's
// time and the segment's bytes per change; then the last image's Open
// time and reads, and the reader's heap after looking the changed file up.
// The fresh layout's pack of the same change (a Segment pack on the same
// base, as before Extend) is measured once beside it.
func BenchmarkExtendOneLine(b *testing.B) {
	n := benchEntries()
	src := filepath.Join(b.TempDir(), "home")
	manyFiles(b, src, n)
	for i := range 200 {
		writeFile(b, filepath.Join(src, "sessions", fmt.Sprintf("s%04d.json", i)), text(2000+i*37, i), 0o644)
	}
	baseBytes := packBytes(b, src)
	base := openBytes(b, baseBytes)
	tr := newTracker(src, base)
	session := filepath.Join(src, "sessions", "s0100.json")
	when := time.Date(2026, 6, 1, 0, 0, 0, 0, time.UTC)
	change := func(i int) {
		f, err := os.OpenFile(session, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			b.Fatal(err)
		}
		fmt.Fprintf(f, "{\"role\":\"user\",\"content\":\"line %d\"}\n", i)
		f.Close()
		when = when.Add(time.Second)
		os.Chtimes(session, when, when)
		tr.touch("sessions/s0100.json")
	}

	change(0)
	fresh, _, freshTime := packSegment(b, tr, PackOptions{Base: base, Segment: true})

	var packTime time.Duration
	var segBytes int64
	var parts segmentParts
	var last PackResult
	b.ResetTimer()
	for i := range b.N {
		b.StopTimer()
		change(i + 1)
		b.StartTimer()
		res, seg, el := packSegment(b, tr, PackOptions{Base: base, Segment: true, Extend: true})
		b.StopTimer()
		if res.Base != BaseExtended {
			b.Fatalf("not extended: %s", res.ExtendFallback)
		}
		packTime += el
		segBytes += res.SegmentSize
		last = res
		// The next change extends this image.
		baseBytes = layOutRuns(b, res, seg, map[*Reader][]byte{base: baseBytes})
		base = openBytes(b, baseBytes)
		parts.add(base, res)
		tr.reset(base)
		b.StartTimer()
	}
	b.StopTimer()
	b.ReportMetric(float64(packTime.Microseconds())/1000/float64(b.N), "pack-ms")
	b.ReportMetric(float64(segBytes)/1024/float64(b.N), "segment-KiB")
	parts.report(b)
	b.ReportMetric(float64(len(last.Runs)), "runs")
	b.ReportMetric(float64(len(baseBytes))/(1<<20), "image-MiB")
	b.ReportMetric(float64(trailerIndexBytes(base))/1024, "trailer-index-KiB")
	b.ReportMetric(float64(fresh.SegmentSize)/1024, "fresh-segment-KiB")
	b.ReportMetric(float64(freshTime.Microseconds())/1000, "fresh-pack-ms")

	// Open the last image, from a file, and look the changed file up.
	p := filepath.Join(b.TempDir(), "last.sqfs")
	if err := os.WriteFile(p, baseBytes, 0o644); err != nil {
		b.Fatal(err)
	}
	base, baseBytes, tr = nil, nil, nil
	openTime, reads, readBytes, heap, cached := openAndLookUp(b, p, "sessions/s0100.json")
	b.ReportMetric(float64(openTime.Microseconds())/1000, "open-ms")
	b.ReportMetric(float64(reads), "open-reads")
	b.ReportMetric(float64(readBytes)/1024, "open-KiB")
	b.ReportMetric(float64(heap)/1024, "reader-heap-KiB")
	b.ReportMetric(float64(cached)/1024, "reader-cache-KiB")
}

// openAndLookUp opens the archive at p and looks name up: the time and the
// reads of Open, and then the heap the reader holds (after a GC) and the
// bytes in its caches.
func openAndLookUp(b *testing.B, p, name string) (el time.Duration, reads, readBytes, heap, cached int64) {
	f, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		b.Fatal(err)
	}
	var m0, m1 runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m0)
	c := &countReads{f: f}
	start := time.Now()
	r, err := Open(c, st.Size(), ReaderOptions{})
	if err != nil {
		b.Fatal(err)
	}
	el = time.Since(start)
	reads, readBytes = c.calls.Load(), c.bytes.Load()
	if _, err := r.resolve("t", name, false); err != nil {
		b.Fatal(err)
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m1)
	r.meta.mu.Lock()
	cached = r.meta.cur
	r.meta.mu.Unlock()
	runtime.KeepAlive(r)
	return el, reads, readBytes, int64(m1.HeapAlloc) - int64(m0.HeapAlloc), cached
}

// segmentParts sums the new bytes of extending packs by what they hold.
type segmentParts struct {
	n                                  int
	data, meta, tables, padding        int64
	trailerFront, trailerTail, trailer int64 // pages and index pages of the data, inode and directory tables; of the rest; the root and footer
}

// add counts the new runs of res, whose image r is.
func (s *segmentParts) add(r *Reader, res PackResult) {
	s.n++
	var pos int64
	sb := &r.sb
	for _, run := range res.Runs {
		if run.Source == nil {
			for at := pos; at < pos+run.Length; {
				var end int64
				var into *int64
				switch {
				case at < int64(sb.InodeTable):
					end, into = int64(sb.InodeTable), &s.data
				case at < int64(r.dirEnd):
					end, into = int64(r.dirEnd), &s.meta
				case at < int64(sb.BytesUsed):
					end, into = int64(sb.BytesUsed), &s.tables
				case at < int64(r.trailerStart()):
					end, into = int64(r.trailerStart()), &s.padding
				case at < int64(r.tr2.tailOff):
					end, into = int64(r.tr2.tailOff), &s.trailerFront
				case at < int64(r.tr2.tailOff)+int64(len(r.tr2.tail)):
					end, into = int64(r.tr2.tailOff)+int64(len(r.tr2.tail)), &s.trailerTail
				default:
					end, into = res.Size, &s.trailer
				}
				n := min(end, pos+run.Length) - at
				*into += n
				at += n
			}
		}
		pos += run.Length
	}
}

func (s *segmentParts) report(b *testing.B) {
	n := float64(max(s.n, 1)) * 1024
	b.ReportMetric(float64(s.data)/n, "seg-data-KiB")
	b.ReportMetric(float64(s.meta)/n, "seg-inodes+dirs-KiB")
	b.ReportMetric(float64(s.tables)/n, "seg-tables-KiB")
	b.ReportMetric(float64(s.padding)/n, "seg-padding-KiB")
	b.ReportMetric(float64(s.trailerFront)/n, "seg-trailer-front-KiB")
	b.ReportMetric(float64(s.trailerTail)/n, "seg-trailer-tail-KiB")
	b.ReportMetric(float64(s.trailer)/n, "seg-trailer-root-KiB")
}

// packSegment packs src with opts (Segment) and returns the result, the
// segment and the time the pack took.
func packSegment(b *testing.B, src *changeTracker, opts PackOptions) (PackResult, []byte, time.Duration) {
	p := filepath.Join(b.TempDir(), "seg")
	f, err := os.Create(p)
	if err != nil {
		b.Fatal(err)
	}
	start := time.Now()
	res, err := Pack(b.Context(), f, src, opts)
	el := time.Since(start)
	f.Close()
	if err != nil {
		b.Fatal(err)
	}
	seg, err := os.ReadFile(p)
	if err != nil {
		b.Fatal(err)
	}
	os.Remove(p)
	return res, seg, el
}

// layOutRuns lays an image packed with Segment out from its runs.
func layOutRuns(tb testing.TB, res PackResult, seg []byte, srcs map[*Reader][]byte) []byte {
	out := make([]byte, 0, res.Size)
	for _, r := range res.Runs {
		if r.Source == nil {
			out = append(out, seg[r.Offset:r.Offset+r.Length]...)
			continue
		}
		out = append(out, srcs[r.Source][r.Offset:r.Offset+r.Length]...)
	}
	if int64(len(out)) != res.Size {
		tb.Fatalf("runs add up to %d bytes, the image has %d", len(out), res.Size)
	}
	return out
}

// trailerIndexBytes is the trailer's index: the root and the index pages.
func trailerIndexBytes(r *Reader) int64 {
	if r.tr2 == nil {
		return 0
	}
	n := int64(rootHeaderSize + groupEntrySize*len(r.tr2.groups))
	for _, g := range r.tr2.groups {
		n += int64(g.idxLen)
	}
	return n
}

func packBytes(b *testing.B, dir string) []byte {
	p := filepath.Join(b.TempDir(), "base.sqfs")
	f, err := os.Create(p)
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	if _, err := PackDir(b.Context(), f, dir, PackOptions{}); err != nil {
		b.Fatal(err)
	}
	data, err := os.ReadFile(p)
	if err != nil {
		b.Fatal(err)
	}
	return data
}

func openBytes(b *testing.B, data []byte) *Reader {
	r, err := Open(bytes.NewReader(data), int64(len(data)), ReaderOptions{Name: "image"})
	if err != nil {
		b.Fatal(err)
	}
	return r
}
