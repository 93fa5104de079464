package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
)

// NumpyName maps a KV dtype code to the original_dtype metadata value.
var NumpyName = map[string]string{"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

// KVOptions says how a KV cache is written.
type KVOptions struct {
	Layers    int
	Shape     []int64 // [batch, n_kv_heads, seq, head_dim]
	DType     string  // F32, F16, BF16: the original dtype
	Codec     string  // none, int8, int4
	GroupSize int     // int4 only
	Style     string  // "stream_st" (kv_* metadata, layer digests, layer order) or "seed"
	Checksum  bool    // stream_st.digest sha256 keys for every tensor
}

// EncodeInt8 quantizes float32 values per tensor: scale = 127 / max|x| (F32), code =
// round(x * scale) with halves away from zero, clipped to [-127, 127].
func EncodeInt8(values []float32) ([]byte, float32) {
	maxAbs := float32(0)
	for _, v := range values {
		if a := float32(math.Abs(float64(v))); a > maxAbs {
			maxAbs = a
		}
	}
	scale := float32(1)
	if maxAbs != 0 {
		s := 127 / float64(maxAbs)
		if s > math.MaxFloat32 {
			s = math.MaxFloat32
		}
		scale = float32(s)
	}
	codes := make([]byte, len(values))
	for i, v := range values {
		y := v * scale
		c := math.Round(float64(y))
		c = math.Max(-127, math.Min(127, c))
		codes[i] = byte(int8(c))
	}
	return codes, scale
}

// DecodeInt8 is code / scale in float32.
func DecodeInt8(codes []byte, scale float32) ([]float32, error) {
	if math.IsNaN(float64(scale)) || math.IsInf(float64(scale), 0) || scale <= 0 {
		return nil, fmt.Errorf("INT8 scale %v is not finite and > 0", scale)
	}
	out := make([]float32, len(codes))
	for i, c := range codes {
		out[i] = float32(int8(c)) / scale
	}
	return out, nil
}

// EncodeInt4 quantizes rows of n values in groups of g along the last axis: the F16 step is
// max|x| / 7 rounded up to a binary16, code = round(x / step) (ties to even) in [-7, 7], two
// codes per byte, the even-indexed one in the low nibble.
func EncodeInt4(values []float32, n, g int) ([]byte, []byte, error) {
	if g <= 0 || g%2 != 0 || n%g != 0 {
		return nil, nil, fmt.Errorf("INT4: row of %d values, group size %d", n, g)
	}
	groups := len(values) / g
	packed := make([]byte, len(values)/2)
	steps := make([]byte, 2*groups)
	for k := 0; k < groups; k++ {
		group := values[k*g : (k+1)*g]
		maxAbs := float32(0)
		for _, v := range group {
			if a := float32(math.Abs(float64(v))); a > maxAbs {
				maxAbs = a
			}
		}
		step := maxAbs / 7
		h := Float32ToFP16(step)
		if FP16ToFloat32(h) < step {
			h++ // the next binary16 up: no code needs clipping
		}
		if h&0x7C00 == 0x7C00 {
			return nil, nil, fmt.Errorf("INT4: group max %v too large for an F16 step", maxAbs)
		}
		binary.LittleEndian.PutUint16(steps[2*k:], h)
		divisor := FP16ToFloat32(h)
		for j, v := range group {
			q := float64(0)
			if divisor != 0 {
				q = math.RoundToEven(float64(v / divisor))
			}
			q = math.Max(-7, math.Min(7, q))
			nibble := byte(int8(q)) & 0x0F
			at := k*g + j
			if at%2 == 0 {
				packed[at/2] |= nibble
			} else {
				packed[at/2] |= nibble << 4
			}
		}
	}
	return packed, steps, nil
}

// DecodeInt4 is code * step in float32 for rows of n values in groups of g.
func DecodeInt4(packed, steps []byte, n, g int) ([]float32, error) {
	count := 2 * len(packed)
	if g <= 0 || n%g != 0 || count%n != 0 || len(steps) != 2*(count/g) {
		return nil, fmt.Errorf("INT4: %d codes, %d scale bytes, group size %d", count, len(steps), g)
	}
	out := make([]float32, count)
	for i := 0; i < count; i++ {
		nibble := int(packed[i/2])
		if i%2 == 1 {
			nibble >>= 4
		}
		code := nibble & 0x0F
		if code >= 8 {
			code -= 16
		}
		step := FP16ToFloat32(binary.LittleEndian.Uint16(steps[2*(i/g):]))
		if math.IsNaN(float64(step)) || math.IsInf(float64(step), 0) {
			return nil, fmt.Errorf("INT4 scale is not finite")
		}
		out[i] = float32(code) * step
	}
	return out, nil
}

func shapeText(shape []int64) string {
	parts := make([]string, len(shape))
	for i, d := range shape {
		parts[i] = strconv.FormatInt(d, 10)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

// EncodeLayerTensor turns one key or value (float32 values of the original dtype) into its
// wire tensors, codes first.
func EncodeLayerTensor(name string, values []float32, o KVOptions) ([]*Tensor, error) {
	shape := o.Shape
	switch o.Codec {
	case "none":
		data, err := EncodeFloats32(values, o.DType)
		return []*Tensor{{name, o.DType, shape, data}}, err
	case "int8":
		codes, scale := EncodeInt8(values)
		s := make([]byte, 4)
		binary.LittleEndian.PutUint32(s, math.Float32bits(scale))
		return []*Tensor{{name, "I8", shape, codes}, {name + ".scale", "F32", []int64{1}, s}}, nil
	case "int4":
		n := int(shape[len(shape)-1])
		packed, steps, err := EncodeInt4(values, n, o.GroupSize)
		if err != nil {
			return nil, err
		}
		lead := append([]int64{}, shape[:len(shape)-1]...)
		return []*Tensor{
			{name, "U8", append(append([]int64{}, lead...), int64(n/2)), packed},
			{name + ".scales", "F16", append(append([]int64{}, lead...), int64(n/o.GroupSize)), steps},
		}, nil
	}
	return nil, fmt.Errorf("unknown codec %q", o.Codec)
}

// BuildKV lays a cache out: layers[i] = (key, value) as float32 values exactly representable
// in the original dtype.
func BuildKV(layers [][2][]float32, o KVOptions) ([]*Tensor, map[string]string, error) {
	meta := map[string]string{"compression": strings.ToUpper(o.Codec), "original_dtype": NumpyName[o.DType]}
	if o.Codec == "int4" {
		meta["group_size"] = strconv.Itoa(o.GroupSize)
	}
	var tensors []*Tensor
	for i, kv := range layers {
		var parts []*Tensor
		for j, role := range []string{"key", "value"} {
			wire, err := EncodeLayerTensor(fmt.Sprintf("layer_%d_%s", i, role), kv[j], o)
			if err != nil {
				return nil, nil, err
			}
			parts = append(parts, wire...)
		}
		if o.Style == "stream_st" { // the layer digest: SHA-256 of the parts' bytes, in order
			h := sha256.New()
			for _, p := range parts {
				h.Write(p.Data)
			}
			parts = append(parts, &Tensor{fmt.Sprintf("layer_%d_digest", i), "U8", []int64{32}, h.Sum(nil)})
		}
		tensors = append(tensors, parts...)
	}
	if o.Style == "stream_st" {
		meta["kv_layers"] = strconv.Itoa(o.Layers)
		meta["kv_shape"] = shapeText(o.Shape)
		meta["kv_dtype"] = o.DType
		meta["kv_digest"] = "sha256"
	} else { // as a writer that sorts by name lays it out: layer_0, layer_1, layer_10, ...
		sort.SliceStable(tensors, func(i, j int) bool { return tensors[i].Name < tensors[j].Name })
	}
	return tensors, meta, nil
}

// KVLayer is one decoded layer.
type KVLayer struct{ Key, Value []float32 }

// DecodedKV is a cache read back: its layers as float32 values and what was checked.
type DecodedKV struct {
	Layers       []KVLayer
	DType        string
	Shape        []int64
	Codec        string
	LayerDigests bool
}

func layerIndex(name string) (int, string, bool) {
	if !strings.HasPrefix(name, "layer_") {
		return 0, "", false
	}
	rest := name[len("layer_"):]
	cut := strings.IndexByte(rest, '_')
	if cut <= 0 {
		return 0, "", false
	}
	i, err := strconv.Atoi(rest[:cut])
	if err != nil || strconv.Itoa(i) != rest[:cut] || i < 0 {
		return 0, "", false
	}
	return i, rest[cut+1:], true
}

// ReadKV decodes a KV cache: a stream_st transfer (kv_* metadata; layer digests verified) or a
// seed-style cache (layer_{i}_key / layer_{i}_value, layout from names and shapes).
func ReadKV(f *File) (*DecodedKV, error) {
	meta := f.Metadata
	out := &DecodedKV{}
	layers := map[int]bool{}
	for _, t := range f.Tensors {
		i, _, ok := layerIndex(t.Name)
		if !ok {
			return nil, fmt.Errorf("tensor %q is not a KV tensor", t.Name)
		}
		layers[i] = true
	}
	count := len(layers)
	if text, ok := meta["kv_layers"]; ok {
		n, err := strconv.Atoi(text)
		if err != nil || n != count {
			return nil, fmt.Errorf("kv_layers %q, the header holds %d layers", text, count)
		}
		out.LayerDigests = meta["kv_digest"] == "sha256"
	}
	if count == 0 {
		return nil, fmt.Errorf("no layers")
	}
	key0 := f.Get("layer_0_key")
	if key0 == nil {
		return nil, fmt.Errorf("no layer_0_key")
	}
	switch key0.DType {
	case "I8":
		out.Codec = "int8"
	case "U8":
		out.Codec = "int4"
	default:
		out.Codec = "none"
	}
	if c, ok := meta["compression"]; ok && out.Codec != "none" && strings.ToLower(c) != out.Codec {
		return nil, fmt.Errorf("compression %q, tensors are %s", c, out.Codec)
	}
	out.DType = key0.DType
	if o, ok := meta["original_dtype"]; ok {
		found := false
		for code, name := range NumpyName {
			if name == strings.TrimPrefix(o, "torch.") || code == o {
				out.DType, found = code, true
			}
		}
		if !found {
			return nil, fmt.Errorf("original_dtype %q", o)
		}
	} else if out.Codec != "none" {
		out.DType = "F32"
	}
	out.Shape = append([]int64{}, key0.Shape...)
	if out.Codec == "int4" {
		out.Shape[len(out.Shape)-1] *= 2
	}
	if kvShape, ok := meta["kv_shape"]; ok {
		var s []int64
		if err := json.Unmarshal([]byte(kvShape), &s); err != nil || shapeText(s) != shapeText(out.Shape) {
			return nil, fmt.Errorf("kv_shape %q does not match the tensors %v", kvShape, out.Shape)
		}
	}
	n := int(out.Shape[len(out.Shape)-1])
	for i := 0; i < count; i++ {
		var parts []*Tensor
		var layer KVLayer
		for _, role := range []string{"key", "value"} {
			name := fmt.Sprintf("layer_%d_%s", i, role)
			t := f.Get(name)
			if t == nil {
				return nil, fmt.Errorf("%s is missing", name)
			}
			if shapeText(t.Shape) != shapeText(key0.Shape) || t.DType != key0.DType {
				return nil, fmt.Errorf("%s is %s %v, layer_0_key %s %v", name, t.DType, t.Shape, key0.DType, key0.Shape)
			}
			parts = append(parts, t)
			var values []float32
			var err error
			switch out.Codec {
			case "none":
				values, err = Floats32(t)
			case "int8":
				s := f.Get(name + ".scale")
				if s == nil || s.DType != "F32" || Elements(s.Shape) != 1 {
					return nil, fmt.Errorf("%s.scale is missing or not one F32", name)
				}
				parts = append(parts, s)
				values, err = DecodeInt8(t.Data, math.Float32frombits(binary.LittleEndian.Uint32(s.Data)))
			case "int4":
				s := f.Get(name + ".scales")
				if s == nil || s.DType != "F16" {
					return nil, fmt.Errorf("%s.scales is missing or not F16", name)
				}
				parts = append(parts, s)
				last := s.Shape[len(s.Shape)-1]
				if last <= 0 || int64(n)%last != 0 {
					return nil, fmt.Errorf("%s.scales shape %v", name, s.Shape)
				}
				g := n / int(last)
				if gs, ok := meta["group_size"]; ok && gs != strconv.Itoa(g) {
					return nil, fmt.Errorf("group_size %s, scales say %d", gs, g)
				}
				values, err = DecodeInt4(t.Data, s.Data, n, g)
			}
			if err != nil {
				return nil, fmt.Errorf("%s: %v", name, err)
			}
			if role == "key" {
				layer.Key = values
			} else {
				layer.Value = values
			}
		}
		if out.LayerDigests {
			d := f.Get(fmt.Sprintf("layer_%d_digest", i))
			if d == nil || d.DType != "U8" || len(d.Data) != 32 {
				return nil, fmt.Errorf("layer %d has no U8[32] digest", i)
			}
			h := sha256.New()
			for _, p := range parts {
				h.Write(p.Data)
			}
			if !bytes.Equal(h.Sum(nil), d.Data) {
				return nil, fmt.Errorf("layer %d failed its SHA-256 check", i)
			}
		}
		out.Layers = append(out.Layers, layer)
	}
	return out, nil
}
