// Package main is a small, dependency-free reader and writer of safetensors files and of the
// KV-cache wire format described in docs/kv-wire-format.md, used by the interoperability tests.
package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"sort"
)

// MaxHeaderSize bounds the JSON header this reader accepts (100 MB).
const MaxHeaderSize = 100 << 20

// DigestAlgorithmKey names a checksummed file's algorithm in __metadata__.
const DigestAlgorithmKey = "stream_st.digest"

// DigestKeyPrefix + a tensor's name is the __metadata__ key of its hex digest.
const DigestKeyPrefix = "stream_st.digest:"

// DTypeSize is the size in bytes of one element of each dtype this program handles.
var DTypeSize = map[string]int{
	"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
	"U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8,
}

// Tensor is one tensor: its name, dtype code, shape and little-endian bytes.
type Tensor struct {
	Name  string
	DType string
	Shape []int64
	Data  []byte
}

// File is a whole safetensors file: tensors in data-offset order and the metadata.
type File struct {
	Tensors  []*Tensor
	Metadata map[string]string
}

// Get returns the tensor called name, or nil.
func (f *File) Get(name string) *Tensor {
	for _, t := range f.Tensors {
		if t.Name == name {
			return t
		}
	}
	return nil
}

// Elements is the product of the shape (1 for a scalar).
func Elements(shape []int64) int64 {
	n := int64(1)
	for _, d := range shape {
		n *= d
	}
	return n
}

type entry struct {
	DType       string   `json:"dtype"`
	Shape       []int64  `json:"shape"`
	DataOffsets [2]int64 `json:"data_offsets"`
}

// Parse reads a whole safetensors file from memory and checks its structure: the header's
// length, the JSON, each tensor's dtype, shape and byte size, and that the offsets tile the data
// section exactly (no gap, no overlap, nothing after the last tensor).
func Parse(raw []byte) (*File, error) {
	if len(raw) < 8 {
		return nil, errors.New("shorter than the 8-byte header length")
	}
	n := binary.LittleEndian.Uint64(raw[:8])
	if n > MaxHeaderSize || n > uint64(len(raw)-8) {
		return nil, fmt.Errorf("header length %d exceeds the file or the limit", n)
	}
	var fields map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(raw[8 : 8+n]))
	if err := dec.Decode(&fields); err != nil {
		return nil, fmt.Errorf("header is not a JSON object: %v", err)
	}
	data := raw[8+n:]
	file := &File{Metadata: map[string]string{}}
	type placed struct {
		t          *Tensor
		start, end int64
	}
	var all []placed
	for name, value := range fields {
		if name == "__metadata__" {
			if err := json.Unmarshal(value, &file.Metadata); err != nil {
				return nil, fmt.Errorf("__metadata__ is not a map of strings: %v", err)
			}
			continue
		}
		var e entry
		if err := json.Unmarshal(value, &e); err != nil {
			return nil, fmt.Errorf("tensor %q: %v", name, err)
		}
		size, ok := DTypeSize[e.DType]
		if !ok {
			return nil, fmt.Errorf("tensor %q: unsupported dtype %q", name, e.DType)
		}
		for _, d := range e.Shape {
			if d < 0 {
				return nil, fmt.Errorf("tensor %q: negative dimension", name)
			}
		}
		start, end := e.DataOffsets[0], e.DataOffsets[1]
		if start < 0 || end < start || end > int64(len(data)) {
			return nil, fmt.Errorf("tensor %q: offsets %v outside the data", name, e.DataOffsets)
		}
		if end-start != Elements(e.Shape)*int64(size) {
			return nil, fmt.Errorf("tensor %q: %d bytes for shape %v of %s", name, end-start, e.Shape, e.DType)
		}
		t := &Tensor{Name: name, DType: e.DType, Shape: e.Shape, Data: data[start:end]}
		all = append(all, placed{t, start, end})
	}
	sort.Slice(all, func(i, j int) bool {
		if all[i].start != all[j].start {
			return all[i].start < all[j].start
		}
		return all[i].end < all[j].end
	})
	at := int64(0)
	for _, p := range all {
		if p.start != at {
			return nil, fmt.Errorf("tensor %q starts at %d, expected %d", p.t.Name, p.start, at)
		}
		at = p.end
		file.Tensors = append(file.Tensors, p.t)
	}
	if at != int64(len(data)) {
		return nil, fmt.Errorf("%d bytes after the last tensor", int64(len(data))-at)
	}
	return file, nil
}

// ReadFile reads and parses a safetensors file.
func ReadFile(path string) (*File, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return Parse(raw)
}

// VerifyDigests checks a checksummed file's sha256 digests. It returns false when the file
// records none, an error when the record is malformed, uses another algorithm, or a digest does
// not match its tensor's bytes.
func VerifyDigests(f *File) (bool, error) {
	algorithm, has := f.Metadata[DigestAlgorithmKey]
	count := 0
	for key := range f.Metadata {
		if len(key) > len(DigestKeyPrefix) && key[:len(DigestKeyPrefix)] == DigestKeyPrefix {
			count++
			if f.Get(key[len(DigestKeyPrefix):]) == nil {
				return false, fmt.Errorf("digest %q names no tensor", key)
			}
		}
	}
	if !has && count == 0 {
		return false, nil
	}
	if algorithm != "sha256" {
		return false, fmt.Errorf("digest algorithm %q is not supported (only sha256)", algorithm)
	}
	for _, t := range f.Tensors {
		want, ok := f.Metadata[DigestKeyPrefix+t.Name]
		if !ok {
			return false, fmt.Errorf("tensor %q has no digest", t.Name)
		}
		sum := sha256.Sum256(t.Data)
		if hex.EncodeToString(sum[:]) != want {
			return false, fmt.Errorf("tensor %q: sha256 mismatch", t.Name)
		}
	}
	return true, nil
}

// Serialize lays tensors out in the given order, adds sha256 digests to the metadata when
// checksum is set, and pads the header with spaces to a multiple of 8 bytes.
func Serialize(tensors []*Tensor, metadata map[string]string, checksum bool) ([]byte, error) {
	meta := map[string]string{}
	for k, v := range metadata {
		meta[k] = v
	}
	if checksum {
		meta[DigestAlgorithmKey] = "sha256"
		for _, t := range tensors {
			sum := sha256.Sum256(t.Data)
			meta[DigestKeyPrefix+t.Name] = hex.EncodeToString(sum[:])
		}
	}
	header := map[string]interface{}{}
	if len(meta) > 0 {
		header["__metadata__"] = meta
	}
	at := int64(0)
	for _, t := range tensors {
		size, ok := DTypeSize[t.DType]
		if !ok {
			return nil, fmt.Errorf("tensor %q: unsupported dtype %q", t.Name, t.DType)
		}
		if int64(len(t.Data)) != Elements(t.Shape)*int64(size) {
			return nil, fmt.Errorf("tensor %q: %d bytes for shape %v", t.Name, len(t.Data), t.Shape)
		}
		if _, dup := header[t.Name]; dup {
			return nil, fmt.Errorf("tensor %q twice", t.Name)
		}
		shape := t.Shape
		if shape == nil {
			shape = []int64{}
		}
		header[t.Name] = entry{t.DType, shape, [2]int64{at, at + int64(len(t.Data))}}
		at += int64(len(t.Data))
	}
	text, err := json.Marshal(header)
	if err != nil {
		return nil, err
	}
	for len(text)%8 != 0 {
		text = append(text, ' ')
	}
	out := make([]byte, 8, 8+len(text)+int(at))
	binary.LittleEndian.PutUint64(out, uint64(len(text)))
	out = append(out, text...)
	for _, t := range tensors {
		out = append(out, t.Data...)
	}
	return out, nil
}

// WriteFile writes tensors (in this order) and metadata as a safetensors file.
func WriteFile(path string, tensors []*Tensor, metadata map[string]string, checksum bool) error {
	out, err := Serialize(tensors, metadata, checksum)
	if err != nil {
		return err
	}
	return os.WriteFile(path, out, 0o644)
}

// FP16ToFloat32 widens an IEEE binary16 value exactly.
func FP16ToFloat32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1F
	frac := uint32(h) & 0x3FF
	switch {
	case exp == 0: // zero or subnormal: frac * 2^-24, exact in float32
		v := float32(math.Ldexp(float64(frac), -24))
		return math.Float32frombits(math.Float32bits(v) | sign)
	case exp == 31: // infinity or NaN (payload kept)
		return math.Float32frombits(sign | 0x7F800000 | frac<<13)
	default:
		return math.Float32frombits(sign | (exp+127-15)<<23 | frac<<13)
	}
}

// Float32ToFP16 rounds to the nearest binary16, ties to even; overflow gives infinity, NaN
// stays a quiet NaN.
func Float32ToFP16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xFF
	man := b & 0x7FFFFF
	if exp == 0xFF {
		if man != 0 {
			return sign | 0x7E00 | uint16(man>>13)
		}
		return sign | 0x7C00
	}
	if exp == 0 { // float32 zero or subnormal: below half the smallest binary16 subnormal
		return sign
	}
	m := man | 0x800000
	e := exp - 127 + 15
	shift := uint32(13)
	if e <= 0 { // binary16 subnormal
		shift = uint32(14 - e)
		e = 0
	}
	if shift > 24 {
		return sign
	}
	r := m >> shift
	rem := m & (1<<shift - 1)
	half := uint32(1) << (shift - 1)
	if rem > half || (rem == half && r&1 == 1) {
		r++
	}
	if e == 0 {
		return sign | uint16(r) // 0x400 after rounding up is the smallest normal: still right
	}
	if r == 0x800 {
		e++
		r = 0x400
	}
	if e >= 31 {
		return sign | 0x7C00
	}
	return sign | uint16(e)<<10 | uint16(r&0x3FF)
}

// BF16ToFloat32 widens a bfloat16 exactly: it is the top half of a float32.
func BF16ToFloat32(h uint16) float32 {
	return math.Float32frombits(uint32(h) << 16)
}

// Float32ToBF16 rounds to the nearest bfloat16, ties to even; NaN stays a quiet NaN.
func Float32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7FFFFFFF > 0x7F800000 {
		return uint16(b>>16) | 0x0040
	}
	b += 0x7FFF + (b>>16)&1
	return uint16(b >> 16)
}

// Floats32 decodes an F16, BF16 or F32 tensor into float32 values (exact).
func Floats32(t *Tensor) ([]float32, error) {
	n := Elements(t.Shape)
	out := make([]float32, n)
	for i := int64(0); i < n; i++ {
		switch t.DType {
		case "F32":
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(t.Data[4*i:]))
		case "F16":
			out[i] = FP16ToFloat32(binary.LittleEndian.Uint16(t.Data[2*i:]))
		case "BF16":
			out[i] = BF16ToFloat32(binary.LittleEndian.Uint16(t.Data[2*i:]))
		default:
			return nil, fmt.Errorf("tensor %q: %s is not F16, BF16 or F32", t.Name, t.DType)
		}
	}
	return out, nil
}

// EncodeFloats32 stores float32 values as F32, F16 or BF16 bytes (rounding to nearest even).
func EncodeFloats32(values []float32, dtype string) ([]byte, error) {
	size, ok := map[string]int{"F32": 4, "F16": 2, "BF16": 2}[dtype]
	if !ok {
		return nil, fmt.Errorf("cannot store floats as %s", dtype)
	}
	out := make([]byte, len(values)*size)
	for i, v := range values {
		switch dtype {
		case "F32":
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		case "F16":
			binary.LittleEndian.PutUint16(out[2*i:], Float32ToFP16(v))
		case "BF16":
			binary.LittleEndian.PutUint16(out[2*i:], Float32ToBF16(v))
		}
	}
	return out, nil
}

// Float64s decodes any numeric tensor into float64 values (exact for every float type, and
// for integers up to 2^53; BOOL is 0 or 1).
func Float64s(t *Tensor) ([]float64, error) {
	n := Elements(t.Shape)
	out := make([]float64, n)
	d := t.Data
	le := binary.LittleEndian
	for i := int64(0); i < n; i++ {
		var v float64
		switch t.DType {
		case "F64":
			v = math.Float64frombits(le.Uint64(d[8*i:]))
		case "F32":
			v = float64(math.Float32frombits(le.Uint32(d[4*i:])))
		case "F16":
			v = float64(FP16ToFloat32(le.Uint16(d[2*i:])))
		case "BF16":
			v = float64(BF16ToFloat32(le.Uint16(d[2*i:])))
		case "I8":
			v = float64(int8(d[i]))
		case "U8":
			v = float64(d[i])
		case "BOOL":
			if d[i] > 1 {
				return nil, fmt.Errorf("tensor %q: BOOL byte %d is not 0 or 1", t.Name, d[i])
			}
			v = float64(d[i])
		case "I16":
			v = float64(int16(le.Uint16(d[2*i:])))
		case "U16":
			v = float64(le.Uint16(d[2*i:]))
		case "I32":
			v = float64(int32(le.Uint32(d[4*i:])))
		case "U32":
			v = float64(le.Uint32(d[4*i:]))
		case "I64":
			v = float64(int64(le.Uint64(d[8*i:])))
		case "U64":
			v = float64(le.Uint64(d[8*i:]))
		default:
			return nil, fmt.Errorf("tensor %q: unsupported dtype %s", t.Name, t.DType)
		}
		out[i] = v
	}
	return out, nil
}
