"""Codecs (none / INT8 / INT4), the correctly rounded bfloat16 cast, and error statistics."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import ml_dtypes
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.extra import numpy as hnp

from stream_st import (
    ArgumentTypeError,
    SafetensorsError,
    TensorSpec,
    build_header,
    parse_header,
    save,
)
from stream_st.core.codecs import (
    CODECS,
    Codec,
    CodecError,
    Int4Codec,
    Int8Codec,
    NoneCodec,
    became_infinite,
    codec_from_metadata,
    decoded,
    error_stats,
    get_codec,
    original_code,
    to_bfloat16,
)
from stream_st.core.dtypes import dtype_for
from stream_st.tools.cp import cp

Array = npt.NDArray[Any]

BF16 = np.dtype(ml_dtypes.bfloat16)
FLOATS = [np.dtype(np.float16), BF16, np.dtype(np.float32)]
KV_SHAPE = (1, 4, 128, 64)

# Half an ulp at 1.0 (relative rounding error) of each output dtype.
HALF_ULP = {np.dtype(np.float16): 2.0**-11, BF16: 2.0**-8, np.dtype(np.float32): 2.0**-24}
HALF_ULP[np.dtype(np.float64)] = 2.0**-53
# Half the smallest subnormal (absolute rounding error near zero).
HALF_TINY = {np.dtype(np.float16): 2.0**-25, BF16: 2.0**-134, np.dtype(np.float32): 2.0**-150}


def rounding_slack(dtype: np.dtype[Any], magnitude: Array | float) -> Array | float:
    """Largest error rounding a value of ``magnitude`` to ``dtype`` can add."""
    return np.abs(magnitude) * HALF_ULP[dtype] + HALF_TINY.get(dtype, 0.0)


def kv_tensor(dtype: np.dtype[Any], shape: tuple[int, ...] = KV_SHAPE, seed: int = 0) -> Array:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def as_f64(array: Array) -> Array:
    return np.asarray(array).astype(np.float64)


def wire_layout(pairs: list[tuple[str, Array]]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(name, dtype_for(array.dtype).code, tuple(array.shape)) for name, array in pairs]


def spec_layout(specs: list[TensorSpec]) -> list[tuple[str, str, tuple[int, ...]]]:
    return [(s.name, dtype_for(s.dtype).code, tuple(s.shape)) for s in specs]


def roundtrip(codec: Codec, array: Array, name: str = "t") -> tuple[Array, dict[str, Array]]:
    parts = dict(codec.encode(name, array))
    return codec.decode(name, parts, array.dtype), parts


def check_int8_bound(x: Array, y: Array, scale: float) -> None:
    bound = 0.5 / scale + 1e-6 / scale + rounding_slack(y.dtype, as_f64(y))
    assert np.all(np.abs(as_f64(x) - as_f64(y)) <= bound)


def check_int4_bound(x: Array, y: Array, steps: Array, group_size: int) -> None:
    *lead, n = x.shape
    xs = as_f64(x).reshape(*lead, n // group_size, group_size)
    ys = as_f64(y).reshape(*lead, n // group_size, group_size)
    step = as_f64(steps)[..., None]
    bound = step * (0.5 + 1e-6) + rounding_slack(y.dtype, ys)
    assert np.all(np.abs(xs - ys) <= bound)


# ---------------------------------------------------------------- registry and metadata


def test_registry_holds_three_codecs() -> None:
    assert set(CODECS) == {"none", "int8", "int4"}
    for key, codec in CODECS.items():
        assert isinstance(codec, Codec)
        assert codec.key == key
        assert codec.compression == key.upper()
    assert isinstance(CODECS["int4"], Int4Codec)
    assert CODECS["int4"].group_size == 64


def test_get_codec() -> None:
    assert get_codec("INT8") is CODECS["int8"]
    assert get_codec("int4", group_size=32) == Int4Codec(group_size=32)
    with pytest.raises(CodecError, match="unknown codec"):
        get_codec("int3")
    with pytest.raises(CodecError, match="int4 codec only"):
        get_codec("int8", group_size=32)


def test_metadata_follows_the_kv_cache_keys() -> None:
    meta = CODECS["int4"].metadata(np.float16)
    assert meta["compression"] == "INT4"
    assert meta["group_size"] == "64"
    assert meta["original_dtype"] == "float16"
    assert meta["scale_tensor"] == ".scales"
    assert "low nibble first" in meta["packing"]
    meta8 = CODECS["int8"].metadata("BF16")
    assert meta8["compression"] == "INT8"
    assert meta8["original_dtype"] == "bfloat16"
    assert meta8["scale"].startswith("per-tensor symmetric (127 / max|x|)")
    assert CODECS["none"].metadata() == {"compression": "NONE"}
    for meta_dict in (meta, meta8):
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in meta_dict.items())
    build_header([TensorSpec("t", "F32", (1,))], meta)  # acceptable as __metadata__


def test_codec_from_metadata_round_trips() -> None:
    assert codec_from_metadata({}) is CODECS["none"]
    assert codec_from_metadata(Int8Codec().metadata("F16")) is CODECS["int8"]
    assert codec_from_metadata(Int4Codec(group_size=16).metadata("F32")) == Int4Codec(16)
    assert codec_from_metadata({"compression": "INT4"}) == Int4Codec(64)
    with pytest.raises(CodecError, match="unknown compression"):
        codec_from_metadata({"compression": "ZSTD"})
    with pytest.raises(CodecError, match="group_size"):
        codec_from_metadata({"compression": "INT4", "group_size": "sixty-four"})


def test_codec_from_metadata_refuses_what_is_not_text() -> None:
    """A compression or group_size that is no text is a CodecError (it was a bare
    AttributeError, TypeError); a long value is echoed cut to 100 characters."""
    with pytest.raises(CodecError, match="unknown compression 5 "):
        codec_from_metadata({"compression": 5})  # type: ignore[dict-item]
    with pytest.raises(CodecError, match="got None"):
        codec_from_metadata({"compression": "INT4", "group_size": None})  # type: ignore[dict-item]
    for meta in (
        {"compression": "x" * 10_000},
        {"compression": "INT4", "group_size": "x" * 10_000},
    ):
        with pytest.raises(CodecError) as caught:
            codec_from_metadata(meta)
        assert len(str(caught.value)) < 200


def test_decode_accepts_the_metadata_dtype_name() -> None:
    x = kv_tensor(BF16)
    codec = CODECS["int4"]
    meta = codec.metadata(x.dtype)
    y = codec_from_metadata(meta).decode("k", dict(codec.encode("k", x)), meta["original_dtype"])
    assert y.dtype == BF16


@pytest.mark.parametrize("group_size", [0, -2, 3, 63, True, np.True_, 2.0, np.int64(3)])
def test_int4_group_size_must_be_positive_and_even(group_size: Any) -> None:
    with pytest.raises(CodecError, match="group_size"):
        Int4Codec(group_size=group_size)


def test_int4_group_size_may_be_a_numpy_integer() -> None:
    """A numpy integer is an integer (it was refused as none); it is kept as the int it is."""
    codec = Int4Codec(np.int64(4))  # type: ignore[arg-type]
    assert codec == Int4Codec(4)
    assert type(codec.group_size) is int
    assert get_codec("int4", group_size=np.int64(64)) == CODECS["int4"]  # type: ignore[arg-type]


def test_a_long_group_size_is_echoed_cut_short() -> None:
    """An odd group_size of 4000 digits was echoed whole (a 4053-character message), as was an
    even one in the messages of the shapes it cannot group; each is cut short."""
    with pytest.raises(CodecError, match="group_size") as caught:
        codec_from_metadata({"compression": "INT4", "group_size": "3" * 4000})
    assert len(str(caught.value)) < 200
    codec = codec_from_metadata({"compression": "INT4", "group_size": "4" * 4000})
    with pytest.raises(CodecError, match="multiple of the group size") as caught:
        codec.specs("w", (2,), "F32")
    assert len(str(caught.value)) < 200
    parts: dict[str, Array] = {"w": np.zeros(1, np.uint8), "w.scales": np.ones(1, np.float16)}
    with pytest.raises(CodecError, match="do not match group size") as caught:
        codec.decode("w", parts, "F32")
    assert len(str(caught.value)) < 200


def test_codec_from_metadata_refuses_what_is_no_mapping() -> None:
    """None for the metadata was a bare AttributeError."""
    with pytest.raises(ArgumentTypeError, match="mapping"):
        codec_from_metadata(None)  # type: ignore[arg-type]


def test_int4_specs_refuse_a_negative_or_fractional_dimension() -> None:
    """A shape [-2] was planned as codes and scales of shape [-1]; [2.9] as [1]."""
    with pytest.raises(CodecError, match=r"'w': shape \[-2\] has a negative"):
        Int4Codec(2).specs("w", (-2,), "F32")
    with pytest.raises(ArgumentTypeError, match="'w'"):
        Int4Codec(2).specs("w", (2.9,), "F32")  # type: ignore[arg-type]
    assert Int4Codec(2).specs("w", (np.int64(4),), "F32")[0].shape == (2,)  # type: ignore[arg-type]


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("key", ["none", "int8", "int4"])
def test_kv_round_trip(key: str, dtype: np.dtype[Any]) -> None:
    codec = CODECS[key]
    x = kv_tensor(dtype)
    y, parts = roundtrip(codec, x, "layer_0_key")
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    stats = error_stats(x, y)
    if key == "none":
        assert np.array_equal(as_f64(x), as_f64(y))
        assert stats["snr_db"] == math.inf
    elif key == "int8":
        scale = float(parts["layer_0_key.scale"][0])
        assert scale == pytest.approx(127 / float(np.max(np.abs(as_f64(x)))), rel=1e-6)
        check_int8_bound(x, y, scale)
        assert stats["snr_db"] > 35
    else:
        check_int4_bound(x, y, parts["layer_0_key.scales"], 64)
        assert stats["snr_db"] > 17


def test_float64_round_trip_uses_float64() -> None:
    x = kv_tensor(np.dtype(np.float64), (2, 128))
    for key in ("int8", "int4"):
        y, _ = roundtrip(CODECS[key], x)
        assert y.dtype == np.float64


def test_decode_to_another_float_dtype() -> None:
    x = kv_tensor(np.dtype(np.float32))
    parts = dict(CODECS["int8"].encode("k", x))
    assert CODECS["int8"].decode("k", parts, "F16").dtype == np.float16
    assert CODECS["int8"].decode("k", parts, ml_dtypes.bfloat16).dtype == BF16


def test_none_passes_anything_through() -> None:
    codec = NoneCodec()
    x = np.arange(6, dtype=np.int32).reshape(2, 3)
    [(name, wire)] = codec.encode("ids", x)
    assert name == "ids"
    assert wire is x
    assert spec_layout(codec.specs("ids", x.shape, x.dtype)) == [("ids", "I32", (2, 3))]
    assert codec.decode("ids", {"ids": wire}, "I32") is x
    nan = np.array([np.nan, np.inf], dtype=np.float32)
    assert np.array_equal(codec.decode("n", dict(codec.encode("n", nan)), "F32"), nan, True)


# ---------------------------------------------------------------- specs match encode

SHAPES = [(), (1,), (7,), (0,), (3, 0), (0, 64), (64,), (2, 128), (1, 4, 128, 64), (2, 3, 5, 192)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize(
    "codec",
    [NoneCodec(), Int8Codec(), Int4Codec(), Int4Codec(group_size=2), Int4Codec(group_size=32)],
    ids=repr,
)
def test_specs_match_encode(codec: Codec, dtype: np.dtype[Any], shape: tuple[int, ...]) -> None:
    x = np.random.default_rng(1).standard_normal(shape).astype(dtype)
    if isinstance(codec, Int4Codec) and (not shape or shape[-1] % codec.group_size):
        with pytest.raises(CodecError):
            codec.specs("t", shape, dtype)
        with pytest.raises(CodecError):
            codec.encode("t", x)
        return
    specs = codec.specs("t", shape, dtype)
    wire = codec.encode("t", x)
    assert spec_layout(specs) == wire_layout(wire)
    assert [s.name for s in specs] == codec.part_names("t")
    # The plan is a valid safetensors header and each encoded array fills its slot exactly.
    _, header = build_header(specs)
    reparsed = parse_header(build_header(specs)[0][8:])
    assert reparsed.tensors == header.tensors
    for info, (_, array) in zip(header.tensors, wire, strict=True):
        assert info.nbytes == array.nbytes
    y = codec.decode("t", dict(wire), dtype)
    assert (y.shape, y.dtype) == (x.shape, x.dtype)


def test_specs_accept_codes_and_dtypes_alike() -> None:
    for dtype in ("F16", "float16", np.float16, np.dtype(np.float16)):
        assert spec_layout(CODECS["int4"].specs("k", [1, 4, 16, 64], dtype)) == [
            ("k", "U8", (1, 4, 16, 32)),
            ("k.scales", "F16", (1, 4, 16, 1)),
        ]
    assert spec_layout(CODECS["int8"].specs("v", (2, 3), "BF16")) == [
        ("v", "I8", (2, 3)),
        ("v.scale", "F32", (1,)),
    ]


@pytest.mark.parametrize("key", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["I32", "U8", np.int8, np.complex64, "BOOL"])
def test_quantizers_refuse_non_float_dtypes(key: str, dtype: Any) -> None:
    with pytest.raises(CodecError, match="float16, bfloat16, float32 or float64"):
        CODECS[key].specs("t", (64,), dtype)
    with pytest.raises(CodecError):
        CODECS[key].encode("t", np.zeros(64, dtype=dtype_for(dtype).numpy))


# ---------------------------------------------------------------- INT8


def test_int8_scale_and_codes_on_known_values() -> None:
    x = np.array([-2.0, -1.0, 0.0, 0.5, 1.0, 2.0], dtype=np.float32)
    parts = dict(CODECS["int8"].encode("t", x))
    assert parts["t.scale"].dtype == np.float32
    assert parts["t.scale"].shape == (1,)
    assert parts["t.scale"][0] == np.float32(127 / 2)
    assert parts["t"].tolist() == [-127, -64, 0, 32, 64, 127]  # 63.5 and 31.75 rounded
    y = CODECS["int8"].decode("t", parts, np.float32)
    assert y.tolist() == pytest.approx([-2.0, -128 / 127, 0.0, 64 / 127, 128 / 127, 2.0])


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 37.0, 1e4])
def test_int8_error_bound(dtype: np.dtype[Any], magnitude: float) -> None:
    x = (kv_tensor(np.dtype(np.float32), (4, 300), seed=3) * magnitude).astype(dtype)
    y, parts = roundtrip(CODECS["int8"], x)
    codes = parts["t"]
    assert codes.min() >= -127
    assert codes.max() <= 127
    assert 127 in np.abs(codes.astype(np.int16))  # the largest value uses the full range
    check_int8_bound(x, y, float(parts["t.scale"][0]))


def test_int8_zero_tensor_has_unit_scale() -> None:
    for x in (np.zeros((2, 64), np.float16), np.zeros((0, 3), np.float32), -np.zeros(5, BF16)):
        y, parts = roundtrip(CODECS["int8"], x)
        assert parts["t.scale"].tolist() == [1.0]
        assert not parts["t"].any()
        assert not as_f64(y).any()
        assert y.shape == x.shape


def test_int8_tiny_values_clamp_the_scale() -> None:
    x = np.array([1e-40, -3e-41, 0.0], dtype=np.float32)  # 127 / 1e-40 overflows float32
    y, parts = roundtrip(CODECS["int8"], x)
    scale = float(parts["t.scale"][0])
    assert scale == float(np.finfo(np.float32).max)
    check_int8_bound(x, y, scale)


def test_int8_refuses_float64_beyond_the_f32_scale() -> None:
    with pytest.raises(CodecError, match="too large"):
        CODECS["int8"].encode("big", np.array([1e300, 0.0]))


# ---------------------------------------------------------------- INT4


def test_int4_packing_low_nibble_first() -> None:
    codec = Int4Codec(group_size=4)
    x = np.array([[7.0, -7.0, 1.0, 0.0], [-1.0, 2.0, -3.0, 3.5]], dtype=np.float32)
    parts = dict(codec.encode("t", x))
    # Row 0: step 1, codes [7, -7, 1, 0]. -7 is 0b1001 in 4-bit two's complement.
    # Row 1: step 0.5, codes [-2, 4, -6, 7].
    assert parts["t.scales"].tolist() == [[1.0], [0.5]]
    assert parts["t"].dtype == np.uint8
    assert parts["t"].tolist() == [[0x97, 0x01], [0x4E, 0x7A]]
    assert codec.decode("t", parts, np.float32).tolist() == x.tolist()


def test_int4_decodes_hand_made_bytes() -> None:
    codec = Int4Codec(group_size=4)
    packed = np.array([[0x10, 0x8F]], dtype=np.uint8)  # codes 0, 1, -1, -8 (never written)
    scales = np.array([[2.0]], dtype=np.float16)
    y = codec.decode("h", {"h": packed, "h.scales": scales}, np.float32)
    assert y.tolist() == [[0.0, 2.0, -2.0, -16.0]]


@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
@pytest.mark.parametrize("group_size", [2, 8, 64, 128])
def test_int4_error_bound_per_group(dtype: np.dtype[Any], group_size: int) -> None:
    codec = Int4Codec(group_size=group_size)
    rng = np.random.default_rng(group_size)
    # Groups of very different magnitudes, so that each group's own step matters.
    x = rng.standard_normal((3, 5, 256)) * rng.choice([1e-3, 1.0, 100.0], size=(3, 5, 1))
    x = x.astype(dtype)
    y, parts = roundtrip(codec, x)
    steps = parts["t.scales"]
    assert steps.shape == (3, 5, 256 // group_size)
    group_max = np.max(np.abs(as_f64(x).reshape(3, 5, -1, group_size)), axis=-1)
    assert np.all(as_f64(steps) >= group_max / 7)  # rounded up: no code needs clipping
    assert np.all(as_f64(steps) <= group_max / 7 * (1 + 2**-10) + 2**-24)
    check_int4_bound(x, y, steps, group_size)


def test_int4_codes_stay_in_symmetric_range() -> None:
    x = kv_tensor(np.dtype(np.float32), (8, 640), seed=5)
    packed = CODECS["int4"].encode("t", x)[0][1]
    nibbles = np.stack([packed & 0x0F, packed >> 4])
    assert 8 not in nibbles  # -8 is never written
    assert {7, 9} <= set(nibbles.ravel().tolist())  # +7 and -7 are used


def test_int4_zero_groups() -> None:
    x = np.zeros((2, 128), dtype=np.float16)
    x[1, 64:] = np.linspace(-1, 1, 64)
    y, parts = roundtrip(CODECS["int4"], x)
    steps = parts["t.scales"]
    assert steps.tolist()[0] == [0.0, 0.0]
    assert float(steps[1, 0]) == 0.0
    assert float(steps[1, 1]) >= 1 / 7  # float16(1/7) is below 1/7, so rounded up to the next
    assert steps[1, 1] == np.nextafter(np.float16(1 / 7), np.float16(1))
    assert not parts["t"][0].any()
    assert not as_f64(y)[:, :64].any()
    assert not as_f64(y)[0].any()
    check_int4_bound(x, y, parts["t.scales"], 64)


def test_int4_shape_errors() -> None:
    codec = CODECS["int4"]
    with pytest.raises(CodecError, match="multiple of the group size 64"):
        codec.specs("k", (1, 4, 128, 96), "F16")
    with pytest.raises(CodecError, match="multiple of the group size 64"):
        codec.encode("k", np.zeros((2, 100), np.float16))
    with pytest.raises(CodecError, match="scalar"):
        codec.encode("k", np.ones((), np.float32))


@pytest.mark.parametrize(
    ("codes", "scales"),
    [((), (1,)), ((1,), ())],
    ids=["codes_0d", "scales_0d"],
)
async def test_int4_0d_parts_are_a_codec_error(
    tmp_path: Path, codes: tuple[int, ...], scales: tuple[int, ...]
) -> None:
    """0-d INT4 codes or scales (a crafted file) are a CodecError, from decode and from
    ``cp(dequantize=True)``, which leaves nothing behind (it was a bare IndexError)."""
    parts: dict[str, Array] = {
        "w": np.zeros(codes, np.uint8),
        "w.scales": np.ones(scales, np.float16),
    }
    with pytest.raises(CodecError, match="INT4 codes of shape"):
        get_codec("int4", group_size=2).decode("w", parts, "F32")
    source, out = tmp_path / "q.safetensors", tmp_path / "out.safetensors"
    await save(source, parts, metadata={"compression": "INT4", "group_size": "2"})
    await cp(source, out)  # the wire tensors copied as they are
    with pytest.raises(CodecError, match="INT4 codes of shape"):
        await cp(source, tmp_path / "d.safetensors", dequantize=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "q.safetensors"]


I8_CODES = np.array([127, -127, 3], np.int8)
SCALE = np.array([2.0], np.float32)


@pytest.mark.parametrize(
    ("parts", "metadata", "match"),
    [
        ({"w": I8_CODES}, {"original_dtype": "float16"}, "no tensor has its wire tensors"),
        ({"w": I8_CODES, "w.scale": SCALE}, {"compression": "INT4"}, "no tensor has its wire"),
        ({"w": I8_CODES, "w.scale": SCALE, "m": I8_CODES}, {}, "I8 tensor 'm' has no 'm.scale'"),
        (
            {"w": I8_CODES, "w.scale": SCALE, "v": I8_CODES, "v.scale": SCALE},
            {"quantized_tensors": "1"},
            "quantized_tensors=1, but 2 tensors",
        ),
        (
            {"w": I8_CODES, "w.scale": np.array([2], np.int8), "w.scale.scale": SCALE},
            {},
            "'w.scale' is a wire tensor of both 'w' and 'w.scale'",
        ),
    ],
)
async def test_dequantize_refuses_what_it_would_not_rebuild(
    tmp_path: Path, parts: dict[str, Array], metadata: dict[str, str], match: str
) -> None:
    """``cp(dequantize=True)`` of a file whose ``__metadata__`` names a codec but whose codes
    lack their scale, or which names the other codec, copied the codes as plain integers
    (``converted: 0``, the codec's keys dropped), exit 0; one with more tensors rebuilt than
    ``quantized_tensors`` counts, likewise; ``w``, ``w.scale``, ``w.scale.scale`` failed late
    ("not completely written"). Each is a CodecError before anything is written; an I8 tensor
    that ``quantized_tensors`` says was kept as it was is copied as it is."""
    source = tmp_path / "q.safetensors"
    await save(source, parts, metadata={"compression": "INT8", **metadata})
    with pytest.raises(CodecError, match=match):
        await cp(source, tmp_path / "d.safetensors", dequantize=True)
    assert [p.name for p in tmp_path.iterdir()] == ["q.safetensors"]
    kept = {"w": I8_CODES, "w.scale": SCALE, "m": I8_CODES}
    await save(source, kept, metadata={"compression": "INT8", "quantized_tensors": "1"})
    assert (await cp(source, tmp_path / "d.safetensors", dequantize=True)).converted == 1


def test_int4_refuses_values_beyond_the_f16_step() -> None:
    x = np.zeros(64, dtype=np.float32)
    x[3] = 7 * 65504 * 1.01
    with pytest.raises(CodecError, match="F16 step"):
        CODECS["int4"].encode("big", x)
    x[3] = 7 * 65504  # exactly representable: accepted
    y, _ = roundtrip(CODECS["int4"], x)
    assert float(y[3]) == 7 * 65504


def test_int4_decodes_the_top_of_f16_to_finite_values() -> None:
    """Every F16 value from 57344 to 65504 survives an INT4 round trip to F16 finite and within
    step / 2: 65472 and 65504 get step 9360 (max|x| / 7 rounded up), and 7 * 9360 = 65520, which
    rounds to +Inf in F16, is saturated to 65504 (it decoded to +-Inf)."""
    top = np.arange(0x7B00, 0x7C00, dtype=np.uint16).view(np.float16)
    x = np.stack([top, -top], axis=-1)  # one group of two per value
    codec = Int4Codec(group_size=2)
    with np.errstate(over="raise"):
        y, parts = roundtrip(codec, x)
    assert np.isfinite(as_f64(y)).all()
    assert float(parts["t.scales"][-1, 0]) == 9360.0
    assert y[-1].tolist() == [65504.0, -65504.0]
    check_int4_bound(x, y, parts["t.scales"], 2)
    # A product beyond 65504 by more than half a step comes from no F16 value: it overflows as
    # before (the nibble -8, never written, times 9360 is -74880).
    with np.errstate(over="ignore"):
        far = codec.decode(
            "t", {"t": np.array([0x87], np.uint8), "t.scales": np.array([9360], np.float16)}, "F16"
        )
    assert far.tolist() == [65504.0, -math.inf]


def test_int4_tiny_groups_use_subnormal_steps() -> None:
    x = np.array([1e-30, -5e-31] * 32, dtype=np.float32)
    y, parts = roundtrip(CODECS["int4"], x)
    assert float(parts["t.scales"][0]) == 2.0**-24  # smallest F16 subnormal, rounded up
    check_int4_bound(x, y, parts["t.scales"], 64)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("key", ["int8", "int4"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", FLOATS, ids=lambda d: d.name)
def test_non_finite_values_are_refused(key: str, bad: float, dtype: np.dtype[Any]) -> None:
    x = np.ones((2, 64), dtype=np.float32)
    x[1, 5] = bad
    with pytest.raises(CodecError, match=r"'layer_3_value'.*non-finite.*index \[1, 5\]") as info:
        CODECS[key].encode("layer_3_value", x.astype(dtype))
    assert isinstance(info.value, SafetensorsError)
    assert isinstance(info.value, ValueError)


SIGNALING_NANS = {
    "F16": np.array([0x7C01, 0xFC01, 0x3C00, 0], np.uint16).view(np.float16),
    "BF16": np.array([0x7F81, 0xFF81, 0x3F80, 0], np.uint16).view(BF16),
    "F32": np.array([0x7F800001, 0xFF800001, 0x3F800000, 0], np.uint32).view(np.float32),
    "F64": np.array([0x7FF << 52 | 1, 0xFFF << 52 | 1, 0x3FF << 52, 0], np.uint64).view(np.float64),
}
"""Two signaling NaNs (one negative), 1.0 and 0.0 in each float dtype."""


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("source", SIGNALING_NANS, ids=str)
@pytest.mark.parametrize("code", SIGNALING_NANS, ids=str)
def test_signaling_nans_pass_without_numpy_warnings(source: str, code: str) -> None:
    """A signaling NaN passed "none" to another dtype (and was counted, as a BF16 source) with
    numpy's bare "invalid value encountered in cast/isfinite" RuntimeWarning; it comes out a NaN
    without a word, and INT8 and INT4 refuse it as any NaN."""
    array = SIGNALING_NANS[source]
    out = decoded(NoneCodec(), "w", {"w": array}, code)
    assert out.dtype == dtype_for(code).numpy
    with np.errstate(invalid="ignore"):  # a signaling NaN out, where source is code
        values = as_f64(out)
    assert np.isnan(values[:2]).all() and list(values[2:]) == [1.0, 0.0]
    assert became_infinite(array, array) == 0
    for codec in (Int8Codec(), Int4Codec(2)):
        with pytest.raises(CodecError, match="2 NaN"):
            codec.encode("w", array)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("original", SIGNALING_NANS, ids=str)
@pytest.mark.parametrize("decoded_code", SIGNALING_NANS, ids=str)
def test_error_stats_of_signaling_nans_say_nan_without_numpy_warnings(
    original: str, decoded_code: str
) -> None:
    """error_stats of a signaling NaN printed numpy's bare "invalid value encountered in cast"
    (or "in ldexp") warning; its figures are NaN, without a word."""
    stats = error_stats(SIGNALING_NANS[original], SIGNALING_NANS[decoded_code])
    assert all(math.isnan(stats[key]) for key in ("rmse", "max_abs_error", "snr_db"))


@pytest.mark.parametrize("code", ["F16", "F32", "F64"])
def test_to_bfloat16_takes_big_endian_floats(code: str) -> None:
    """A big-endian float array (as a file of another machine's numpy gives) was refused as no
    float16/32/64; it is rounded as the same values in the machine's order are."""
    native = np.array([1.5, -2.0, np.inf, 1 + 2**-8 + 2**-9], dtype_for(code).numpy)
    swapped = native.astype(native.dtype.newbyteorder(">"))
    assert to_bfloat16(swapped).tobytes() == to_bfloat16(native).tobytes()


def test_a_group_size_too_long_to_print_is_refused_as_a_codec_error() -> None:
    """An INT4 group size of over 4,300 digits raised Python's own ValueError (its repr is
    refused) where any other bad size is a CodecError; it is one, naming its size."""
    with pytest.raises(CodecError, match=r"an integer of \d+ bits"):
        Int4Codec(10**5000 + 1)


def test_decode_refuses_bad_parts() -> None:
    x = kv_tensor(np.dtype(np.float16), (2, 64))
    p8 = dict(CODECS["int8"].encode("t", x))
    p4 = dict(CODECS["int4"].encode("t", x))
    with pytest.raises(CodecError, match=r"'t\.scale' is missing"):
        CODECS["int8"].decode("t", {"t": p8["t"]}, "F16")
    with pytest.raises(CodecError, match="must be int8"):
        CODECS["int8"].decode("t", {**p8, "t": p8["t"].view(np.uint8)}, "F16")
    with pytest.raises(CodecError, match="finite and > 0"):
        CODECS["int8"].decode("t", {**p8, "t.scale": np.zeros(1, np.float32)}, "F16")
    with pytest.raises(CodecError, match=r"float32 of shape \[1\], got float32 of shape \[2\]"):
        CODECS["int8"].decode("t", {**p8, "t.scale": np.ones(2, np.float32)}, "F16")
    with pytest.raises(CodecError, match=r"'t\.scales' is missing"):
        CODECS["int4"].decode("t", {"t": p4["t"]}, "F16")
    with pytest.raises(CodecError, match="uint8 codes and float16 scales"):
        CODECS["int4"].decode("t", {**p4, "t.scales": p4["t.scales"].astype(np.float32)}, "F16")
    with pytest.raises(CodecError, match="do not match group size 64"):
        CODECS["int4"].decode("t", {**p4, "t": p4["t"][:, :16]}, "F16")
    with pytest.raises(CodecError, match="do not match group size 32"):
        Int4Codec(group_size=32).decode("t", p4, "F16")
    with pytest.raises(CodecError, match="NaN or Inf"):
        CODECS["int4"].decode("t", {**p4, "t.scales": p4["t.scales"] * np.inf}, "F16")
    with pytest.raises(CodecError, match="not int32"):
        CODECS["int4"].decode("t", p4, np.int32)


@pytest.mark.parametrize(
    ("parts", "group_size", "match"),
    [
        ({"w.scale": np.array([2.0], np.float16)}, None, "got float16 of shape"),
        ({"w.scale": np.array(2.0, np.float32)}, None, r"got float32 of shape \[\]"),
        (
            {"w": np.array([[0x71]], np.uint8), "w.scales": np.array([[-1.0]], np.float16)},
            "2",
            "INT4 scales must be >= 0, got -1.0",
        ),
        *[
            ({"w": np.zeros((1, 32), np.uint8)}, size, "group_size must be a decimal")
            for size in ["6_4", " 64", "+64", "\u0666\u0664", "064"]
        ],
    ],
)
async def test_decode_holds_the_wire_tensors_to_the_spec(
    tmp_path: Path, parts: dict[str, Array], group_size: str | None, match: str
) -> None:
    """An INT8 scale of F16 or of shape [] (the spec: F32 [1]), a negative INT4 step (its
    values came back sign-flipped) and a group_size spelled as no canonical decimal (which
    int() took, where the KV reader refuses it) were decoded without a word by
    cp(dequantize=True); each is a CodecError, before anything is written."""
    if group_size is None:
        metadata, wire = {"compression": "INT8"}, {"w": np.array([127, -127, 3], np.int8)}
    else:
        metadata = {"compression": "INT4", "group_size": group_size}
        wire = {"w.scales": np.ones((1, 1), np.float16)}
    source = tmp_path / "q.safetensors"
    await save(source, {**wire, **parts}, metadata=metadata)
    with pytest.raises(CodecError, match=match):
        await cp(source, tmp_path / "d.safetensors", dequantize=True)
    assert [p.name for p in tmp_path.iterdir()] == ["q.safetensors"]


# ---------------------------------------------------------------- bfloat16


def bf16_bits(array: Array) -> list[int]:
    return [int(b) for b in np.asarray(array).view(np.uint16).ravel()]


def reference_rne_f32(values: Array) -> Array:
    """Round float32 to bfloat16 bits, to nearest-even, on the integer bits (non-NaN only)."""
    bits = values.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def reference_bf16(value: float) -> float:
    """Exact round-to-nearest-even of a finite float to bfloat16, with Fractions."""
    if value == 0:
        return value
    exponent = max(math.frexp(abs(value))[1] - 1, -126)
    quantum = Fraction(2) ** (exponent - 7)
    rounded = round(Fraction(value) / quantum) * quantum  # round() on Fraction is half-even
    if abs(rounded) >= 2**128:
        return math.copysign(math.inf, value)
    return math.copysign(float(rounded), value)


def test_bf16_rounds_to_nearest_even_not_truncation() -> None:
    one = 1.0
    cases = {
        one + 2**-8: one,  # tie, 1.0 is even: down
        one + 2**-8 + 2**-9: one + 2**-7,  # above the tie: up (truncation gives 1.0)
        one + 3 * 2**-8: one + 2**-6,  # tie, 1 + 2**-7 is odd: up to even
        one + 2**-7 + 2**-9: one + 2**-7,  # below the tie: down
        -(one + 2**-8 + 2**-9): -(one + 2**-7),
        3.4e38: math.inf,  # beyond the bfloat16 maximum: Inf
        2.0**-133 * 0.75: 2.0**-133,  # subnormal rounding
    }
    for dtype in (np.float32, np.float64):
        x = np.array(list(cases), dtype=dtype)
        got = to_bfloat16(x)
        assert got.dtype == BF16
        assert as_f64(got).tolist() == list(cases.values())
    truncated = (np.array(list(cases), np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert bf16_bits(to_bfloat16(np.array(list(cases), np.float32))) != truncated.tolist()


def test_bf16_keeps_nan_and_inf() -> None:
    signalling = np.array([0x7F800001, 0xFF800001, 0x7FC00000], np.uint32).view(np.float32)
    with np.errstate(invalid="ignore"):
        as_double = signalling.astype(np.float64)
    for x in (signalling, as_double, np.array([0x7C01, 0xFE00], np.uint16).view(np.float16)):
        bits = np.array(bf16_bits(to_bfloat16(x)), dtype=np.uint16)
        assert np.all(bits & 0x7FC0 == 0x7FC0)  # NaN with the quiet bit, never Inf
    infs = np.array([np.inf, -np.inf])
    for dtype in (np.float16, np.float32, np.float64):
        assert as_f64(to_bfloat16(infs.astype(dtype))).tolist() == [math.inf, -math.inf]


def test_bf16_matches_integer_rne_for_float32() -> None:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
    bits[:4096] = (bits[:4096] & 0xFFFF0000) | 0x8000  # exact ties
    bits[4096:8192] &= 0x807FFFFF  # zeros and subnormals
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    assert bf16_bits(to_bfloat16(x)) == reference_rne_f32(x).tolist()
    assert bf16_bits(x.astype(ml_dtypes.bfloat16)) == reference_rne_f32(x).tolist()


def test_bf16_matches_reference_for_every_float16() -> None:
    x = np.arange(2**16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    x = x[~np.isnan(x)]
    assert bf16_bits(to_bfloat16(x)) == reference_rne_f32(x.astype(np.float32)).tolist()


def test_bf16_from_float64_rounds_once() -> None:
    rng = np.random.default_rng(11)
    ties = ((rng.integers(0, 2**31, 2000, dtype=np.uint64) << 16) | 0x8000).astype(np.uint32)
    ties = ties.view(np.float32)
    ties = ties[np.isfinite(ties)].astype(np.float64)
    # Just above / below a bfloat16 tie, by far less than a float32 ulp: float32 would round
    # these onto the tie and a second rounding would then go the wrong way.
    hard = np.concatenate(
        [np.nextafter(ties, np.inf), np.nextafter(ties, -np.inf), ties * (1 + 2**-40), -ties]
    )
    values = np.concatenate([hard, rng.standard_normal(2000) * 10.0 ** rng.integers(-45, 39, 2000)])
    got = as_f64(to_bfloat16(values)).tolist()
    assert got == [reference_bf16(v) for v in values.tolist()]
    assert as_f64(to_bfloat16(np.float64(1 + 2**-8 + 2**-40))).tolist() == 1 + 2**-7


def test_bf16_edge_inputs() -> None:
    assert to_bfloat16(np.array([], np.float32)).shape == (0,)
    assert to_bfloat16(np.float64(1.5)).shape == ()
    already = np.array([1.0], BF16)
    copied = to_bfloat16(already)
    assert copied is not already
    assert np.array_equal(as_f64(copied), [1.0])
    assert to_bfloat16(np.ones((2, 3), np.float32)[:, ::2]).shape == (2, 2)
    with pytest.raises(CodecError, match="not int32"):
        to_bfloat16(np.ones(3, np.int32))


# ---------------------------------------------------------------- error statistics


def test_error_stats_known_values() -> None:
    x = np.array([3.0, 4.0, 0.0, 0.0])
    y = np.array([3.0, 3.0, 1.0, 0.0])
    stats = error_stats(x, y)
    assert stats["rmse"] == pytest.approx(math.sqrt(2 / 4))
    assert stats["max_abs_error"] == 1.0
    assert stats["snr_db"] == pytest.approx(10 * math.log10(25 / 2))
    assert error_stats(x, x) == {"rmse": 0.0, "max_abs_error": 0.0, "snr_db": math.inf}
    assert error_stats(np.zeros(3), np.ones(3))["snr_db"] == -math.inf
    assert error_stats(np.zeros(0), np.zeros(0))["snr_db"] == math.inf
    assert error_stats([1.0, -1.0], [1.1, -0.9])["snr_db"] == pytest.approx(20.0)


def test_error_stats_in_float64() -> None:
    x = np.array([1.0, 2.0], np.float16)
    y = np.array([1.0, 2.0], BF16)
    assert error_stats(x, y)["snr_db"] == math.inf
    big = np.full(10, 60000.0, np.float16)  # squares overflow float16, not float64
    assert error_stats(big, big * np.float16(0.5))["snr_db"] == pytest.approx(10 * math.log10(4))
    with pytest.raises(CodecError, match="shapes differ"):
        error_stats(np.zeros(3), np.zeros(4))


@pytest.mark.parametrize("magnitude", [1e-300, 1e-200, 1.0, 1e160, 1e300])
def test_error_stats_at_any_magnitude(magnitude: float) -> None:
    """The figures scale with the values: squares of 1e-200 underflowed float64 (an INT8 round
    trip to all zeros reported rmse 0 and snr inf, "identical") and of 1e160 overflowed it (rmse
    inf, snr nan)."""
    x = np.array([3.0, -4.0, 0.0, 0.0]) * magnitude
    y = np.array([3.0, -3.0, -1.0, 0.0]) * magnitude
    stats = error_stats(x, y)
    assert stats["rmse"] == pytest.approx(math.sqrt(2 / 4) * magnitude, rel=1e-12)
    assert stats["max_abs_error"] == pytest.approx(magnitude, rel=1e-12)
    assert stats["snr_db"] == pytest.approx(10 * math.log10(25 / 2), rel=1e-12)
    assert error_stats(x, np.zeros(4))["snr_db"] == pytest.approx(0.0, abs=1e-12)
    assert error_stats(x, x)["snr_db"] == math.inf
    assert error_stats(np.zeros(4), y)["snr_db"] == -math.inf


def test_error_stats_beyond_float64() -> None:
    """An error beyond float64 is infinite; the ratio of the sums still holds."""
    x = np.array([1.5e308, 1.0])
    stats = error_stats(x, -x)
    assert stats["max_abs_error"] == math.inf
    assert stats["rmse"] == math.inf
    assert stats["snr_db"] == pytest.approx(10 * math.log10(1 / 4))


# ---------------------------------------------------------------- properties


@st.composite
def codec_and_array(draw: st.DrawFn) -> tuple[Codec, Array]:
    choices: list[Codec] = [
        NoneCodec(),
        Int8Codec(),
        Int4Codec(2),
        Int4Codec(4),
        Int4Codec(16),
        Int4Codec(),
    ]
    codec = draw(st.sampled_from(choices))
    dtype = draw(st.sampled_from(FLOATS))
    lead = draw(st.lists(st.integers(0, 3), max_size=3))
    if isinstance(codec, Int4Codec):
        shape = (*lead, codec.group_size * draw(st.integers(0, 3)))
    else:
        shape = (*lead, *draw(st.lists(st.integers(0, 5), max_size=1)))
    magnitude = draw(st.sampled_from([2.0**-10, 1.0, 1024.0]))
    elements = st.floats(-magnitude, magnitude, width=32, allow_subnormal=False)
    values = draw(hnp.arrays(np.float32, shape, elements=elements))
    return codec, values.astype(dtype)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec_and_array())
def test_encode_decode_invariants(case: tuple[Codec, Array]) -> None:
    codec, x = case
    specs = codec.specs("p", x.shape, x.dtype)
    wire = codec.encode("p", x)
    assert spec_layout(specs) == wire_layout(wire)
    parts = dict(wire)
    y = codec.decode("p", parts, x.dtype)
    assert y.shape == x.shape
    assert y.dtype == x.dtype
    if isinstance(codec, Int8Codec):
        check_int8_bound(x, y, float(parts["p.scale"][0]))
    elif isinstance(codec, Int4Codec):
        check_int4_bound(x, y, parts["p.scales"], codec.group_size)
    else:
        assert np.array_equal(as_f64(x), as_f64(y))


@pytest.mark.parametrize("max_abs", [3.0, 1e-3], ids=["scale folded", "scale in two steps"])
def test_int8_of_f16_widened_by_its_bits_is_that_of_its_float32_values(max_abs: float) -> None:
    """F16 is widened by moving its bits into float32's, divided by 2**112, the scale multiplied
    back: the codes and scale are those of the same values as float32 (numpy's cast), for every
    finite bit pattern (subnormals included) and on random data with halves. Below a max|x| of
    about 0.002 the folded scale is no finite float32, and the two are multiplied apart."""
    from stream_st.core.codecs import _int8_codes

    patterns = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    finite = patterns[np.isfinite(patterns.astype(np.float32))]
    small = finite[np.abs(finite.astype(np.float32)) <= max_abs]
    noisy = (np.random.default_rng(7).standard_normal(200_000) * max_abs / 4).astype(np.float16)
    noisy[:6] = (np.array([2.5, -2.5, 0.5, -0.5, 0.0, -0.0]) * max_abs / 4).astype(np.float16)
    for values in (small, noisy):
        (_, codes), (_, scale) = Int8Codec().encode("x", values)
        wide = values.astype(np.float32)
        (_, expected), (_, expected_scale) = Int8Codec().encode("x", wide)
        assert float(scale[0]) == float(expected_scale[0])
        assert np.array_equal(codes, expected)
        assert np.array_equal(codes, _int8_codes(wide, np.float32(scale[0])))


@pytest.mark.parametrize("dtype", [">f4", ">f2", ">f8"])
def test_int8_of_a_big_endian_array_is_that_of_its_values(dtype: str) -> None:
    """Was: codes and scale read from the bytes in the wrong order ([127, -125, -2], scale 127
    for [1, -3, 2]; a negative max|x| for >f2)."""
    values = np.array([1.0, -3.0, 2.0], dtype=dtype)
    native = values.astype(values.dtype.newbyteorder("="))
    (_, codes), (_, scale) = Int8Codec().encode("w", values)
    (_, expected), (_, expected_scale) = Int8Codec().encode("w", native)
    assert codes.tolist() == expected.tolist() == [42, -127, 85]
    assert scale.tolist() == expected_scale.tolist()


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        ("float16", "F16"),
        ("bfloat16", "BF16"),
        ("float", "F64"),  # numpy's name
        ("torch.float", "F32"),  # torch's: float32, where it was read as numpy's float64
        ("torch.half", "F16"),
        ("torch.double", "F64"),
        ("torch.bfloat16", "BF16"),
        ("F32", "F32"),
        ("zzz", ""),
    ],
)
def test_original_code_reads_numpy_torch_and_code_names(raw: str, code: str) -> None:
    """The reading of ``original_dtype`` for ``cp --dequantize`` (the KV reader takes only the
    spellings its format names)."""
    assert original_code(raw) == code
