package uploader

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
)

// Extents: a snapshot image (format 4) as byte ranges of segments.
//
// A snapshot is one logical squashfs image; the store holds it as a list
// of extents, each a range of an immutable segment object, which laid end
// to end give the image. Segments are shared: a new snapshot uploads one
// segment with the bytes no earlier image has, and names the ranges of
// older segments for the rest. The list is stored next to the manifest as
// plain text, one extent a line,
//
//	segments/20261128T154501.123Z-host-1a2b3c4d.seg 0 1048576
//
// so that the image can be put back together with ranged reads and
// nothing but standard tools (see the README's recipe).

// Extent is Length bytes of segment Key from Offset (plaintext offsets for
// an encrypted segment).
type Extent struct {
	Key            string
	Offset, Length int64
}

// Extents is an image as extents, in image order. Image offsets are
// implicit: each extent starts where the one before ends.
type Extents struct {
	list  []Extent
	start []int64 // image offset of each extent
	size  int64
}

// NewExtents builds the image of list, merging adjacent ranges of one
// segment. Empty extents are dropped.
func NewExtents(list []Extent) (*Extents, error) {
	e := &Extents{}
	for _, x := range list {
		if err := e.add(x); err != nil {
			return nil, err
		}
	}
	return e, nil
}

func (e *Extents) add(x Extent) error {
	if x.Length == 0 {
		return nil
	}
	if x.Offset < 0 || x.Length < 0 || x.Offset+x.Length < x.Offset {
		return fmt.Errorf("extent %s %d %d: negative or overflowing range", x.Key, x.Offset, x.Length)
	}
	if err := ValidKey(x.Key); err != nil {
		return fmt.Errorf("extent: %w", err)
	}
	if n := len(e.list); n > 0 {
		last := &e.list[n-1]
		if last.Key == x.Key && last.Offset+last.Length == x.Offset {
			last.Length += x.Length
			e.size += x.Length
			return nil
		}
	}
	e.list = append(e.list, x)
	e.start = append(e.start, e.size)
	e.size += x.Length
	return nil
}

// Size is the image's size.
func (e *Extents) Size() int64 { return e.size }

// Len is the number of extents.
func (e *Extents) Len() int { return len(e.list) }

// List returns the extents in image order (not a copy: do not modify).
func (e *Extents) List() []Extent { return e.list }

// Segments returns each segment the image uses with the image bytes taken
// from it, in order of first use.
func (e *Extents) Segments() (keys []string, bytes map[string]int64) {
	bytes = map[string]int64{}
	for _, x := range e.list {
		if _, ok := bytes[x.Key]; !ok {
			keys = append(keys, x.Key)
		}
		bytes[x.Key] += x.Length
	}
	return keys, bytes
}

// Slice returns the extents of image bytes [off, off+n), cut at both ends.
func (e *Extents) Slice(off, n int64) []Extent {
	if off < 0 || n <= 0 || off >= e.size {
		return nil
	}
	end := min(off+n, e.size)
	i := sort.Search(len(e.start), func(i int) bool { return e.start[i] > off }) - 1
	var out []Extent
	for ; i < len(e.list) && e.start[i] < end; i++ {
		x := e.list[i]
		lo, hi := max(off, e.start[i]), min(end, e.start[i]+x.Length)
		out = append(out, Extent{Key: x.Key, Offset: x.Offset + lo - e.start[i], Length: hi - lo})
	}
	return out
}

// Builder assembles an image's extents in image order.
type Builder struct {
	e   Extents
	err error
}

// Add appends x.
func (b *Builder) Add(x Extent) {
	if b.err == nil {
		b.err = b.e.add(x)
	}
}

// AddImage appends image bytes [off, off+n) of src.
func (b *Builder) AddImage(src *Extents, off, n int64) {
	if b.err != nil {
		return
	}
	if off < 0 || n < 0 || off+n > src.size {
		b.err = fmt.Errorf("extents: bytes %d+%d outside a %d-byte image", off, n, src.size)
		return
	}
	for _, x := range src.Slice(off, n) {
		b.Add(x)
	}
}

// Size is what has been added so far.
func (b *Builder) Size() int64 { return b.e.size }

// Extents returns the image built.
func (b *Builder) Extents() (*Extents, error) {
	if b.err != nil {
		return nil, b.err
	}
	e := b.e
	return &e, nil
}

// Marshal is the text form stored next to a manifest.
func (e *Extents) Marshal() []byte {
	var buf bytes.Buffer
	for _, x := range e.list {
		buf.WriteString(x.Key)
		buf.WriteByte(' ')
		buf.WriteString(strconv.FormatInt(x.Offset, 10))
		buf.WriteByte(' ')
		buf.WriteString(strconv.FormatInt(x.Length, 10))
		buf.WriteByte('\n')
	}
	return buf.Bytes()
}

// MaxExtents bounds the lines of an extents list read from a store.
const MaxExtents = 1 << 22

// ParseExtents reads the text form.
func ParseExtents(r io.Reader) (*Extents, error) {
	e := &Extents{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<10)
	line := 0
	for sc.Scan() {
		line++
		if line > MaxExtents {
			return nil, fmt.Errorf("extents: more than %d lines", MaxExtents)
		}
		f := strings.Fields(sc.Text())
		if len(f) != 3 {
			return nil, fmt.Errorf("extents line %d: want \"key offset length\", got %q", line, sc.Text())
		}
		off, err1 := strconv.ParseInt(f[1], 10, 64)
		n, err2 := strconv.ParseInt(f[2], 10, 64)
		if err1 != nil || err2 != nil || n <= 0 {
			return nil, fmt.Errorf("extents line %d: bad offset or length in %q", line, sc.Text())
		}
		if err := e.add(Extent{Key: f[0], Offset: off, Length: n}); err != nil {
			return nil, fmt.Errorf("extents line %d: %w", line, err)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("extents: %w", err)
	}
	return e, nil
}
