package archive

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"

	"github.com/klauspost/compress/zlib"
	"github.com/klauspost/compress/zstd"
	"github.com/pierrec/lz4/v4"
	"github.com/ulikunitz/xz"
	"github.com/ulikunitz/xz/lzma"
)

// Compression names a block compressor.
type Compression string

const (
	Zstd Compression = "zstd" // the default: fast, good ratio, kernel-readable
	Gzip Compression = "gzip" // zlib streams, readable everywhere
	LZ4  Compression = "lz4"  // fastest to decompress (fast restore), larger
	None Compression = "none" // stored uncompressed
)

// zstdWindow is the largest window the kernel's squashfs decompressor
// accepts for the default block size: frames with a larger window fail to
// mount.
const zstdWindow = 128 << 10

// lz4Legacy is the only LZ4 format squashfs knows; its compressor options
// (version, flags) must be present or the kernel refuses the image.
const lz4Legacy = 1

// codec is the compression side of a Compression, shared by the workers of
// one Pack. newWorker gives each worker its own state.
type codec interface {
	id() uint16
	// options returns the compressor options written after the superblock,
	// or nil for none.
	options() []byte
	newWorker() blockCompressor
}

// blockCompressor compresses one block. It is used by one goroutine.
// compress appends the compressed form of src to dst[:0] and returns it, or
// ok=false when compression does not make the block smaller, in which case
// the caller stores the block as is (as mksquashfs does).
type blockCompressor interface {
	compress(dst, src []byte) (out []byte, ok bool, err error)
}

func newCodec(c Compression, level, blockSize, workers int) (codec, error) {
	switch c {
	case "", Zstd:
		if level == 0 {
			level = 3
		}
		if level < 1 || level > 22 {
			return nil, fmt.Errorf("zstd level %d out of range 1..22", level)
		}
		window := zstdWindow
		if blockSize < window {
			// A frame's window may not exceed what the kernel allocates for
			// the larger of a data block and a metadata block.
			window = max(blockSize, metaBlockSize)
		}
		enc, err := zstd.NewWriter(nil,
			zstd.WithEncoderLevel(zstd.EncoderLevelFromZstd(level)),
			zstd.WithWindowSize(window),
			zstd.WithEncoderCRC(false),
			zstd.WithEncoderConcurrency(max(workers, 1)),
			zstd.WithZeroFrames(true))
		if err != nil {
			return nil, err
		}
		return &zstdCodec{enc: enc, level: level}, nil
	case Gzip:
		if level == 0 {
			level = 9 // squashfs-tools' default
		}
		if level < 1 || level > 9 {
			return nil, fmt.Errorf("gzip level %d out of range 1..9", level)
		}
		return gzipCodec{level: level}, nil
	case LZ4:
		if level < 0 || level > 9 {
			return nil, fmt.Errorf("lz4 level %d out of range 0..9", level)
		}
		return lz4Codec{level: level}, nil
	case None:
		return noneCodec{}, nil
	}
	return nil, fmt.Errorf("unknown compression %q (want zstd, gzip, lz4 or none)", c)
}

type zstdCodec struct {
	enc   *zstd.Encoder
	level int
}

func (z *zstdCodec) id() uint16 { return compZstd }
func (z *zstdCodec) options() []byte {
	return binary.LittleEndian.AppendUint32(nil, uint32(z.level))
}
func (z *zstdCodec) newWorker() blockCompressor { return &zstdWorker{enc: z.enc} }

type zstdWorker struct{ enc *zstd.Encoder }

func (w *zstdWorker) compress(dst, src []byte) ([]byte, bool, error) {
	out := w.enc.EncodeAll(src, dst[:0])
	if len(out) >= len(src) {
		return nil, false, nil
	}
	return out, true, nil
}

type gzipCodec struct{ level int }

func (g gzipCodec) id() uint16 { return compGzip }
func (g gzipCodec) options() []byte {
	if g.level == 9 {
		return nil
	}
	// compression_level, window_size (15 is zlib's default), strategy (none).
	b := binary.LittleEndian.AppendUint32(nil, uint32(g.level))
	b = binary.LittleEndian.AppendUint16(b, 15)
	return binary.LittleEndian.AppendUint16(b, 0)
}
func (g gzipCodec) newWorker() blockCompressor { return &gzipWorker{level: g.level} }

type gzipWorker struct {
	level int
	zw    *zlib.Writer
}

func (w *gzipWorker) compress(dst, src []byte) ([]byte, bool, error) {
	buf := bytes.NewBuffer(dst[:0])
	if w.zw == nil {
		zw, err := zlib.NewWriterLevel(buf, w.level)
		if err != nil {
			return nil, false, err
		}
		w.zw = zw
	} else {
		w.zw.Reset(buf)
	}
	if _, err := w.zw.Write(src); err != nil {
		return nil, false, err
	}
	if err := w.zw.Close(); err != nil {
		return nil, false, err
	}
	if buf.Len() >= len(src) {
		return nil, false, nil
	}
	return buf.Bytes(), true, nil
}

type lz4Codec struct{ level int }

func (l lz4Codec) id() uint16 { return compLz4 }
func (l lz4Codec) options() []byte {
	var flags uint32
	if l.level > 1 {
		flags = 1 // LZ4_HC
	}
	b := binary.LittleEndian.AppendUint32(nil, lz4Legacy)
	return binary.LittleEndian.AppendUint32(b, flags)
}
func (l lz4Codec) newWorker() blockCompressor { return &lz4Worker{level: l.level} }

type lz4Worker struct {
	level int
	fast  lz4.Compressor
	hc    lz4.CompressorHC
}

func (w *lz4Worker) compress(dst, src []byte) ([]byte, bool, error) {
	n := lz4.CompressBlockBound(len(src))
	if cap(dst) < n {
		dst = make([]byte, n)
	}
	dst = dst[:n]
	var err error
	if w.level > 1 {
		w.hc.Level = lz4.CompressionLevel(1 << (8 + w.level))
		n, err = w.hc.CompressBlock(src, dst)
	} else {
		n, err = w.fast.CompressBlock(src, dst)
	}
	if err != nil {
		return nil, false, err
	}
	if n == 0 || n >= len(src) {
		return nil, false, nil
	}
	return dst[:n], true, nil
}

type noneCodec struct{}

func (noneCodec) id() uint16                 { return compGzip } // unused, but must be one the kernel knows
func (noneCodec) options() []byte            { return nil }
func (noneCodec) newWorker() blockCompressor { return noneWorker{} }

type noneWorker struct{}

func (noneWorker) compress(_, _ []byte) ([]byte, bool, error) { return nil, false, nil }

// decompressor expands one block. It is safe for concurrent use.
// decompress appends to dst[:0] and fails if the output would exceed limit.
type decompressor interface {
	decompress(dst, src []byte, limit int) ([]byte, error)
}

var errTooLarge = errors.New("decompressed block larger than its limit")

func newDecompressor(id uint16) (decompressor, error) {
	switch id {
	case compZstd:
		return zstdDecompressor{}, nil
	case compGzip:
		return gzipDecompressor{}, nil
	case compLz4:
		return lz4Decompressor{}, nil
	case compXz:
		return xzDecompressor{}, nil
	case compLzma:
		return lzmaDecompressor{}, nil
	case compLzo:
		return nil, fmt.Errorf("lzo compression is not supported")
	}
	return nil, fmt.Errorf("unknown compressor id %d", id)
}

var (
	zstdDecOnce sync.Once
	zstdDec     *zstd.Decoder
	zstdDecErr  error
)

// sharedZstd is one decoder for the process: DecodeAll is safe for
// concurrent use and keeps no goroutines, so readers need no Close.
func sharedZstd() (*zstd.Decoder, error) {
	zstdDecOnce.Do(func() {
		zstdDec, zstdDecErr = zstd.NewReader(nil,
			zstd.WithDecoderConcurrency(0),
			zstd.WithDecoderMaxMemory(2*maxBlockSize),
			zstd.WithDecoderMaxWindow(maxBlockSize))
	})
	return zstdDec, zstdDecErr
}

type zstdDecompressor struct{}

func (zstdDecompressor) decompress(dst, src []byte, limit int) ([]byte, error) {
	d, err := sharedZstd()
	if err != nil {
		return nil, err
	}
	out, err := d.DecodeAll(src, dst[:0])
	if err != nil {
		return nil, err
	}
	if len(out) > limit {
		return nil, errTooLarge
	}
	return out, nil
}

type lz4Decompressor struct{}

func (lz4Decompressor) decompress(dst, src []byte, limit int) ([]byte, error) {
	if cap(dst) < limit {
		dst = make([]byte, limit)
	}
	n, err := lz4.UncompressBlock(src, dst[:limit])
	if err != nil {
		return nil, err
	}
	return dst[:n], nil
}

// readLimited reads all of r into dst[:0], failing beyond limit bytes.
func readLimited(dst []byte, r io.Reader, limit int) ([]byte, error) {
	buf := bytes.NewBuffer(dst[:0])
	n, err := buf.ReadFrom(io.LimitReader(r, int64(limit)+1))
	if err != nil {
		return nil, err
	}
	if n > int64(limit) {
		return nil, errTooLarge
	}
	return buf.Bytes(), nil
}

var zlibReaders sync.Pool

type gzipDecompressor struct{}

func (gzipDecompressor) decompress(dst, src []byte, limit int) ([]byte, error) {
	br := bytes.NewReader(src)
	var zr io.ReadCloser
	if v := zlibReaders.Get(); v != nil {
		zr = v.(io.ReadCloser)
		if err := zr.(zlib.Resetter).Reset(br, nil); err != nil {
			return nil, err
		}
	} else {
		var err error
		if zr, err = zlib.NewReader(br); err != nil {
			return nil, err
		}
	}
	out, err := readLimited(dst, zr, limit)
	if err == nil {
		zlibReaders.Put(zr)
	}
	return out, err
}

type xzDecompressor struct{}

func (xzDecompressor) decompress(dst, src []byte, limit int) ([]byte, error) {
	r, err := xz.ReaderConfig{DictCap: 1 << 20, SingleStream: true}.NewReader(bytes.NewReader(src))
	if err != nil {
		return nil, err
	}
	return readLimited(dst, r, limit)
}

type lzmaDecompressor struct{}

func (lzmaDecompressor) decompress(dst, src []byte, limit int) ([]byte, error) {
	r, err := lzma.ReaderConfig{DictCap: 1 << 20}.NewReader(bytes.NewReader(src))
	if err != nil {
		return nil, err
	}
	return readLimited(dst, r, limit)
}

// compressionName gives the Compression for a superblock compressor id and
// flags, for reuse decisions and reports.
func compressionName(id uint16, flags uint16) Compression {
	if flags&(flagUncompData|flagUncompFrags|flagUncompInodes) == flagUncompData|flagUncompFrags|flagUncompInodes {
		return None
	}
	switch id {
	case compZstd:
		return Zstd
	case compGzip:
		return Gzip
	case compLz4:
		return LZ4
	case compXz:
		return "xz"
	case compLzma:
		return "lzma"
	case compLzo:
		return "lzo"
	}
	return Compression(fmt.Sprintf("unknown(%d)", id))
}
