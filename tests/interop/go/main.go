// Command stinterop writes and reads safetensors files and KV caches with Go's standard library
// only, for the tests that exchange files with stream_st. Every command exits 1 with a message
// on stderr when the input is invalid.
//
//	inspect FILE                   the header as JSON; sha256 digests (stream_st.digest) checked
//	to-f64 IN OUT                  every tensor as F64 (exact), same names and metadata
//	cast-f32 IN OUT F16|BF16       every F32 tensor rounded to F16 or BF16 (nearest, ties to even)
//	write-plain OUT [-checksum]    tensors of every dtype from fixed formulas
//	kv-write [flags] OUT REF       a KV cache, and the values it encodes (REF, plain)
//	kv-decode IN OUT               a KV cache's layers decoded into their original dtype
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"math"
	"os"
	"strings"
)

func fail(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "stinterop: "+format+"\n", args...)
	os.Exit(1)
}

func must(err error) {
	if err != nil {
		fail("%v", err)
	}
}

func readChecked(path string) (*File, bool) {
	f, err := ReadFile(path)
	must(err)
	verified, err := VerifyDigests(f)
	must(err)
	return f, verified
}

func withoutDigests(meta map[string]string) map[string]string {
	out := map[string]string{}
	for k, v := range meta {
		if !strings.HasPrefix(k, DigestAlgorithmKey) {
			out[k] = v
		}
	}
	return out
}

func inspect(args []string) {
	if len(args) != 1 {
		fail("inspect FILE")
	}
	f, verified := readChecked(args[0])
	type info struct {
		Name   string  `json:"name"`
		DType  string  `json:"dtype"`
		Shape  []int64 `json:"shape"`
		SHA256 string  `json:"sha256"`
	}
	report := struct {
		Metadata map[string]string `json:"metadata"`
		Tensors  []info            `json:"tensors"`
		Digests  string            `json:"digests"`
	}{Metadata: f.Metadata, Digests: "none"}
	if verified {
		report.Digests = "verified"
	}
	for _, t := range f.Tensors {
		sum := sha256.Sum256(t.Data)
		shape := t.Shape
		if shape == nil {
			shape = []int64{}
		}
		report.Tensors = append(report.Tensors, info{t.Name, t.DType, shape, hex.EncodeToString(sum[:])})
	}
	must(json.NewEncoder(os.Stdout).Encode(report))
}

func toF64(args []string) {
	if len(args) != 2 {
		fail("to-f64 IN OUT")
	}
	f, _ := readChecked(args[0])
	var out []*Tensor
	for _, t := range f.Tensors {
		values, err := Float64s(t)
		must(err)
		data := make([]byte, 8*len(values))
		for i, v := range values {
			binary.LittleEndian.PutUint64(data[8*i:], math.Float64bits(v))
		}
		out = append(out, &Tensor{t.Name, "F64", t.Shape, data})
	}
	must(WriteFile(args[1], out, withoutDigests(f.Metadata), false))
}

func castF32(args []string) {
	if len(args) != 3 || (args[2] != "F16" && args[2] != "BF16") {
		fail("cast-f32 IN OUT F16|BF16")
	}
	f, _ := readChecked(args[0])
	var out []*Tensor
	for _, t := range f.Tensors {
		if t.DType != "F32" {
			out = append(out, t)
			continue
		}
		values, err := Floats32(t)
		must(err)
		data, err := EncodeFloats32(values, args[2])
		must(err)
		out = append(out, &Tensor{t.Name, args[2], t.Shape, data})
	}
	must(WriteFile(args[1], out, withoutDigests(f.Metadata), false))
}

// plainTensor fills a tensor of dtype and shape from the formula the tests recompute.
func plainTensor(name, dtype string, shape []int64) *Tensor {
	n := Elements(shape)
	size := DTypeSize[dtype]
	data := make([]byte, n*int64(size))
	le := binary.LittleEndian
	for i := int64(0); i < n; i++ {
		quarter := float32(i%17-8) * 0.25
		switch dtype {
		case "F64":
			le.PutUint64(data[8*i:], math.Float64bits(float64(i)*0.1-3))
		case "F32":
			le.PutUint32(data[4*i:], math.Float32bits(quarter))
		case "F16":
			le.PutUint16(data[2*i:], Float32ToFP16(quarter))
		case "BF16":
			le.PutUint16(data[2*i:], Float32ToBF16(quarter))
		case "I8":
			data[i] = byte(int8(i*37%251 - 125))
		case "U8":
			data[i] = byte(i * 37 % 251)
		case "BOOL":
			if i%3 == 0 {
				data[i] = 1
			}
		case "I16":
			le.PutUint16(data[2*i:], uint16(int16(i*1237%65521-32760)))
		case "U16":
			le.PutUint16(data[2*i:], uint16(i*1237%65521))
		case "I32":
			le.PutUint32(data[4*i:], uint32(int32(i*1000003%2147483647-1073741823)))
		case "U32":
			le.PutUint32(data[4*i:], uint32(i*1000003%4294967291))
		case "I64":
			le.PutUint64(data[8*i:], uint64(i*1000000007-5000000000000))
		case "U64":
			le.PutUint64(data[8*i:], uint64(i)*1000000007+1<<60)
		}
	}
	return &Tensor{name, dtype, shape, data}
}

func writePlain(args []string) {
	fs := flag.NewFlagSet("write-plain", flag.ExitOnError)
	checksum := fs.Bool("checksum", false, "record sha256 digests (stream_st.digest)")
	must(fs.Parse(args))
	if fs.NArg() != 1 {
		fail("write-plain [-checksum] OUT")
	}
	specs := []struct {
		name, dtype string
		shape       []int64
	}{
		{"f64", "F64", []int64{3, 5}}, {"f32", "F32", []int64{2, 3, 4}}, {"f16", "F16", []int64{7}},
		{"bf16", "BF16", []int64{2, 8}}, {"i8", "I8", []int64{300}}, {"u8", "U8", []int64{4, 4}},
		{"i16", "I16", []int64{9}}, {"u16", "U16", []int64{9}}, {"i32", "I32", []int64{5}},
		{"u32", "U32", []int64{5}}, {"i64", "I64", []int64{6}}, {"u64", "U64", []int64{6}},
		{"bool", "BOOL", []int64{10}}, {"scalar", "F32", []int64{}}, {"empty", "F32", []int64{0, 3}},
	}
	var tensors []*Tensor
	for _, s := range specs {
		tensors = append(tensors, plainTensor(s.name, s.dtype, s.shape))
	}
	meta := map[string]string{"writer": "go", "note": "ünïcode ✓ \"quoted\""}
	must(WriteFile(fs.Arg(0), tensors, meta, *checksum))
}

// kvValues are the values of one key or value: halves in [-127, 127] (many exact INT8 ties)
// with the first one 127, exactly representable in F16, BF16 and F32.
func kvValues(seed uint64, n int64) []float32 {
	out := make([]float32, n)
	state := seed*0x9E3779B97F4A7C15 + 1
	for i := range out {
		state ^= state << 13
		state ^= state >> 7
		state ^= state << 17
		out[i] = float32(int64(state%509)-254) / 2
	}
	if n > 0 {
		out[0] = 127
	}
	return out
}

func kvWrite(args []string) {
	fs := flag.NewFlagSet("kv-write", flag.ExitOnError)
	layers := fs.Int("layers", 3, "layers")
	seq := fs.Int64("seq", 8, "sequence length")
	heads := fs.Int64("heads", 4, "KV heads")
	headDim := fs.Int64("head-dim", 64, "head dimension")
	dtype := fs.String("dtype", "F32", "original dtype: F32, F16, BF16")
	codec := fs.String("codec", "none", "none, int8, int4")
	group := fs.Int("group", 64, "INT4 group size")
	style := fs.String("style", "stream_st", "stream_st or seed")
	checksum := fs.Bool("checksum", false, "record sha256 digests (stream_st.digest)")
	seedExample := fs.Bool("seed-example", false, "the metadata of the format's own example "+
		"(compression INT4, group_size 64, original_dtype float32) on plain tensors")
	must(fs.Parse(args))
	if fs.NArg() != 2 {
		fail("kv-write [flags] OUT REF")
	}
	if _, ok := NumpyName[*dtype]; !ok {
		fail("dtype %q", *dtype)
	}
	o := KVOptions{*layers, []int64{1, *heads, *seq, *headDim}, *dtype, *codec, *group, *style, *checksum}
	var values [][2][]float32
	var reference []*Tensor
	n := Elements(o.Shape)
	for i := 0; i < o.Layers; i++ {
		var kv [2][]float32
		for j, role := range []string{"key", "value"} {
			kv[j] = kvValues(uint64(2*i+j+1), n)
			data, err := EncodeFloats32(kv[j], o.DType)
			must(err)
			reference = append(reference, &Tensor{fmt.Sprintf("layer_%d_%s", i, role), o.DType, o.Shape, data})
		}
		values = append(values, kv)
	}
	tensors, meta, err := BuildKV(values, o)
	must(err)
	if *seedExample {
		if o.Codec != "none" || o.Style != "seed" {
			fail("-seed-example goes with -codec none -style seed")
		}
		meta = map[string]string{"compression": "INT4", "group_size": "64", "original_dtype": "float32"}
	}
	must(WriteFile(fs.Arg(0), tensors, meta, o.Checksum))
	must(WriteFile(fs.Arg(1), reference, nil, false))
}

func kvDecode(args []string) {
	if len(args) != 2 {
		fail("kv-decode IN OUT")
	}
	f, verified := readChecked(args[0])
	kv, err := ReadKV(f)
	must(err)
	integrity := "unverified"
	if kv.LayerDigests {
		integrity = "layer-sha256"
	} else if verified {
		integrity = "tensor-digests"
	}
	var out []*Tensor
	for i, layer := range kv.Layers {
		for j, values := range [][]float32{layer.Key, layer.Value} {
			data, err := EncodeFloats32(values, kv.DType)
			must(err)
			name := fmt.Sprintf("layer_%d_%s", i, []string{"key", "value"}[j])
			out = append(out, &Tensor{name, kv.DType, kv.Shape, data})
		}
	}
	meta := map[string]string{"integrity": integrity, "codec": kv.Codec}
	must(WriteFile(args[1], out, meta, false))
}

func main() {
	if len(os.Args) < 2 {
		fail("a command: inspect, to-f64, cast-f32, write-plain, kv-write, kv-decode")
	}
	commands := map[string]func([]string){
		"inspect": inspect, "to-f64": toF64, "cast-f32": castF32,
		"write-plain": writePlain, "kv-write": kvWrite, "kv-decode": kvDecode,
	}
	run, ok := commands[os.Args[1]]
	if !ok {
		fail("unknown command %q", os.Args[1])
	}
	run(os.Args[2:])
}
