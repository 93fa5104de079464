"""The sans-IO header core: every rule of the format, and the edge cases it must accept."""

from __future__ import annotations

import gc
import json
import random
import struct
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from stream_st import (
    DTYPES,
    ArgumentTypeError,
    Header,
    HeaderError,
    HeaderTooLargeError,
    SafetensorsError,
    TensorInfo,
    TensorNotFoundError,
    TensorSpec,
    UnknownDtypeError,
    build_header,
    parse_header,
)
from stream_st.core.dtypes import array_shape, dtype_for, dtype_from_code
from stream_st.core.header import NameIndex, data_size, parse_header_length
from stream_st.core.layout import plan_order
from stream_st.core.message import lay_out
from stream_st.errors import DtypeError, UsageError


def entry(dtype: str = "U8", shape: Any = (1,), offsets: Any = (0, 1)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def parse(obj: Any) -> Any:
    text = obj if isinstance(obj, str) else json.dumps(obj)
    return parse_header(text.encode())


# ---------------------------------------------------------------- length prefix


def test_length_prefix_needs_eight_bytes() -> None:
    with pytest.raises(HeaderError, match="8-byte"):
        parse_header_length(b"\x01\x00\x00")


def test_length_prefix_limit_checked_before_allocating() -> None:
    with pytest.raises(HeaderTooLargeError) as info:
        parse_header_length(struct.pack("<Q", 100_000_001))
    assert info.value.declared == 100_000_001
    assert parse_header_length(struct.pack("<Q", 1000), max_header_size=1000) == 1000
    with pytest.raises(HeaderTooLargeError):
        parse_header_length(struct.pack("<Q", 1001), max_header_size=1000)
    with pytest.raises(HeaderTooLargeError):
        parse_header_length(b"\xff" * 8)


def test_length_prefix_too_small_for_json() -> None:
    with pytest.raises(HeaderError, match="too small"):
        parse_header_length(struct.pack("<Q", 0))


# ---------------------------------------------------------------- refused headers

BAD_HEADERS: list[tuple[str, Any, str]] = [
    ("not utf-8", b'{"a\xff": 1}', "UTF-8"),
    ("leading space", ' {"a": ' + json.dumps(entry()) + "}", "begin with"),
    ("array", "[1, 2]", "begin with"),
    ("not json", "{nope", "not valid JSON"),
    ("trailing garbage", "{} x", "not valid JSON"),
    ("comma after the metadata", '{"__metadata__":{},}', "not valid JSON"),
    (
        "comma after the last tensor",
        '{"a":' + json.dumps(entry(), separators=(",", ":")) + ",}",
        "not valid JSON",
    ),
    (
        "no comma between tensors",
        '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}',
        "not valid JSON",
    ),
    (
        "duplicate tensor",
        '{"a": ' + json.dumps(entry()) + ', "a": ' + json.dumps(entry()) + "}",
        "duplicate key 'a'",
    ),
    (
        "duplicate field",
        '{"a": {"dtype": "U8", "dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
        "duplicate key 'dtype'",
    ),
    ("duplicate metadata key", '{"__metadata__": {"k": "1", "k": "2"}}', "duplicate key 'k'"),
    ("nan", '{"a": {"dtype": "U8", "shape": [NaN], "data_offsets": [0, 1]}}', "NaN"),
    ("entry not object", {"a": [1]}, "must be a JSON object"),
    ("unknown dtype", {"a": entry(dtype="F17")}, "unknown safetensors dtype 'F17'"),
    ("dtype not string", {"a": {**entry(), "dtype": 8}}, "unknown safetensors dtype 8"),
    ("lower-case dtype", {"a": entry(dtype="f32")}, "unknown safetensors dtype"),
    ("missing dtype", {"a": {"shape": [1], "data_offsets": [0, 1]}}, "missing field"),
    ("missing shape", {"a": {"dtype": "U8", "data_offsets": [0, 1]}}, "missing field"),
    ("missing offsets", {"a": {"dtype": "U8", "shape": [1]}}, "missing field"),
    ("unknown field", {"a": {**entry(), "extra": 1}}, "unknown field"),
    ("negative dim", {"a": entry(shape=[-1])}, "shape must be"),
    ("float dim", {"a": entry(shape=[1.0])}, "shape must be"),
    ("string dim", {"a": entry(shape=["1"])}, "shape must be"),
    ("bool dim", {"a": entry(shape=[True])}, "shape must be"),
    ("shape not list", {"a": {**entry(), "shape": 1}}, "shape must be"),
    ("dim over u64", {"a": entry(shape=[2**64])}, "shape must be"),
    ("one offset", {"a": {**entry(), "data_offsets": [0]}}, "exactly two"),
    ("three offsets", {"a": {**entry(), "data_offsets": [0, 1, 1]}}, "exactly two"),
    ("negative offset", {"a": entry(offsets=[-1, 0], shape=[1])}, "exactly two"),
    ("float offset", {"a": entry(offsets=[0.0, 1])}, "exactly two"),
    ("bool offset", {"a": entry(offsets=[False, True])}, "exactly two"),
    ("offsets not list", {"a": {**entry(), "data_offsets": "0,1"}}, "exactly two"),
    ("not from zero", {"a": entry(offsets=[1, 2])}, "leave a hole"),
    (
        "hole",
        {"a": entry(offsets=[0, 1]), "b": entry(offsets=[2, 3])},
        "'b'.*leave a hole",
    ),
    (
        "overlap",
        {"a": entry(shape=[2], offsets=[0, 2]), "b": entry(shape=[2], offsets=[1, 3])},
        "'b'.*overlap",
    ),
    (
        "reversed",
        {"a": entry(shape=[0], offsets=[0, 0]), "b": entry(offsets=[1, 0])},
        "reversed",
    ),
    ("size mismatch", {"a": entry(dtype="F32", shape=[2], offsets=[0, 4])}, "needs 8 bytes"),
    (
        "size overflow",
        {"a": entry(dtype="F64", shape=[2**62, 2**62], offsets=[0, 8])},
        r"shape \[4611686018427387904, 4611686018427387904\] holds more than 2\*\*64 - 1 values",
    ),
    # Limits of numpy, not of the format: the reference accepts these headers.
    ("65 dimensions", {"a": entry(shape=[1] * 65, offsets=[0, 1])}, "65 dimensions, more than"),
    (
        "empty tensor, huge dimension",
        {"a": entry(dtype="F32", shape=[0, 2**64 - 1], offsets=[0, 0])},
        r"'a': shape \[0, 18446744073709551615\] x F32 is too large for a numpy array",
    ),
    (
        "empty tensor, nonzero dimensions x item size past intp",
        {"a": entry(dtype="F32", shape=[2**61, 0], offsets=[0, 0])},
        "too large for a numpy array",
    ),
    (
        "bits past u64",
        {"a": entry(dtype="U8", shape=[2**61], offsets=[0, 2**61])},
        r"2305843009213693952 values of U8 take more than 2\*\*64 - 1 bits",
    ),
    ("f4 half byte", {"a": entry(dtype="F4", shape=[3], offsets=[0, 2])}, "whole number"),
    ("f6 partial byte", {"a": entry(dtype="F6_E2M3", shape=[3], offsets=[0, 2])}, "whole number"),
    ("metadata not object", {"__metadata__": ["a"]}, "must be a JSON object"),
    ("metadata null", {"__metadata__": None}, "must be a JSON object"),
    ("metadata int value", {"__metadata__": {"a": 1}}, "must be a string"),
    ("metadata nested", {"__metadata__": {"a": {"b": "c"}}}, "must be a string"),
]


@pytest.mark.parametrize(
    ("case", "header", "message"), BAD_HEADERS, ids=[c[0] for c in BAD_HEADERS]
)
def test_refused(case: str, header: Any, message: str) -> None:
    raw = header if isinstance(header, bytes) else None
    with pytest.raises(HeaderError, match=message):
        if raw is not None:
            parse_header(raw)
        else:
            parse(header)


def test_deeply_nested_json_is_a_header_error() -> None:
    with pytest.raises(HeaderError):
        parse('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")


def test_integer_too_long_to_convert_is_a_header_error() -> None:
    with pytest.raises(HeaderError, match="not valid JSON"):
        parse('{"a": {"dtype": "U8", "shape": [1' + "0" * 5000 + '], "data_offsets": [0, 1]}}')


@pytest.mark.parametrize(
    ("code", "shape", "nbytes"),
    [
        ("U8", (2**61 - 1,), 2**61 - 1),  # 2**64 - 8 bits: the most a U8 tensor takes
        ("U8", (2**61,), None),  # 2**64 bits
        ("F32", (2**29, 2**29), 2**60),
        ("F64", (2**32, 2**29), None),  # 2**61 values of 64 bits
        ("F32", (2**32, 2**32), None),  # 2**64 values
        ("U8", (1,) * 64, 1),
        ("U8", (1,) * 65, None),  # more dimensions than a numpy array has
        ("F32", (0, 2**61 - 1), 0),  # empty, nonzero dimensions x 4 bytes within intp
        ("F32", (0, 2**61), None),
        ("F4", (3,), None),  # half a byte
        ("F4", (2, 2), 2),
    ],
)
def test_data_size_at_the_limits(code: str, shape: tuple[int, ...], nbytes: int | None) -> None:
    if nbytes is None:
        with pytest.raises(HeaderError):
            data_size("t", DTYPES[code], shape)
    else:
        assert data_size("t", DTYPES[code], shape) == nbytes


def test_shapes_at_numpy_limits_are_accepted() -> None:
    header = parse(
        {
            "dims64": entry(shape=[1] * 64, offsets=[0, 1]),
            "empty": entry(dtype="F32", shape=[0, 2**61 - 1], offsets=[1, 1]),
            "empty_u8": entry(shape=[2**63 - 1, 0], offsets=[1, 1]),
            # 65 dimensions of F6 arrive as 1-D packed bytes: numpy can hold that.
            "f6": entry(dtype="F6_E2M3", shape=[4] + [1] * 64, offsets=[1, 4]),
        }
    )
    assert [t.array_shape for t in header] == [(1,) * 64, (0, 2**61 - 1), (2**63 - 1, 0), (3,)]
    for info in header:  # as the reader allocates them
        np.empty(info.nbytes, np.uint8).view(info.array_dtype).reshape(info.array_shape)


# ---------------------------------------------------------------- accepted edge cases


def test_no_tensors() -> None:
    header = parse("{}")
    assert header.tensors == ()
    assert header.metadata == {}
    assert header.data_size == 0
    assert header.file_size == 8 + 2


def test_scalar_and_empty_tensors() -> None:
    header = parse(
        {
            "s": entry(dtype="F32", shape=[], offsets=[0, 4]),
            "e1": entry(dtype="F32", shape=[0, 7], offsets=[4, 4]),
            "e2": entry(dtype="I64", shape=[3, 0, 2], offsets=[4, 4]),
            "t": entry(dtype="U8", shape=[2], offsets=[4, 6]),
        }
    )
    assert [t.name for t in header] == ["s", "e1", "e2", "t"]
    assert header["s"].shape == ()
    assert header["s"].nelements == 1
    assert header["e2"].nbytes == 0
    assert header.data_size == 6


def test_key_order_differs_from_offset_order() -> None:
    header = parse(
        {
            "late": entry(offsets=[2, 3]),
            "first": entry(offsets=[0, 1]),
            "middle": entry(offsets=[1, 2]),
        }
    )
    assert header.names() == ["first", "middle", "late"]
    assert [(t.start, t.end) for t in header] == [(0, 1), (1, 2), (2, 3)]
    assert [header[name].start for name in ("late", "first", "middle")] == [2, 0, 1]


def test_unicode_and_escaped_names_and_metadata() -> None:
    names = ["名前", 'quote"d', "back\\slash", "tab\there", "emoji 🚀", "", "nul\u0000"]
    obj: dict[str, Any] = {"__metadata__": {"clé": "välue ✓", "esc": 'a"b\\c\n'}}
    for i, name in enumerate(names):
        obj[name] = entry(offsets=[i, i + 1])
    header = parse(obj)
    assert header.names() == names
    assert header.metadata == obj["__metadata__"]


def test_three_thousand_tensors() -> None:
    obj = {f"t{i}": entry(dtype="F16", shape=[i % 5], offsets=[0, 0]) for i in range(3000)}
    offset = 0
    for i in range(3000):
        size = 2 * (i % 5)
        obj[f"t{i}"]["data_offsets"] = [offset, offset + size]
        offset += size
    header = parse(obj)
    assert len(header) == 3000
    assert header.data_size == offset
    assert header["t2999"].end == offset


def test_a_big_header_leaves_the_collector_almost_nothing_to_walk() -> None:
    """A parsed header is a few objects for the cyclic garbage collector, not one per tensor:
    every full collection in the process would walk them for as long as the header lives."""
    tensors, offset, parts = 100_000, 0, []
    for i in range(tensors):  # 5000 distinct shapes, more than one parse remembers
        size = 1 + i % 5000
        parts.append(
            f'"t{i}":{{"dtype":"U8","shape":[{size}],"data_offsets":[{offset},{offset + size}]}}'
        )
        offset += size
    text = ("{" + ",".join(parts) + "}").encode()
    del parts
    gc.collect()
    before = len(gc.get_objects())
    header = parse_header(text)
    gc.collect()
    gc.collect()  # a tuple is untracked once its items are: a row after its shape
    kept = len(gc.get_objects()) - before
    assert kept < 100, f"{kept} objects left for the collector by a header of {tensors} tensors"
    assert len(header) == tensors
    assert header["t99999"] == ("t99999", "U8", (5000,), offset - 5000, offset)


def test_tensors_is_a_read_only_sequence_of_tensor_info() -> None:
    header = parse(
        {
            "b": entry(offsets=[1, 2]),
            "a": entry(offsets=[0, 1]),
            "c": entry(shape=[2], offsets=[2, 4]),
        }
    )
    tensors, a, b, c = header.tensors, header["a"], header["b"], header["c"]
    assert type(tensors[0]) is TensorInfo and tensors[0] == TensorInfo("a", "U8", (1,), 0, 1)
    assert tensors[-1] == c and c.nbytes == 2
    with pytest.raises(IndexError):
        tensors[3]
    assert tensors == (a, b, c) == tuple(tensors) and tensors != (a, b)
    assert tensors[1:] == (b, c) and len(tensors[:0]) == 0
    assert b in tensors and tensors.index(c) == 2 and list(reversed(tensors)) == [c, b, a]
    assert repr(tensors).startswith(f"TensorTable(n_tensors=3, first=[{a!r}, {b!r}, ...")
    again = Header.from_tensors(tensors, {}, header.header_size)
    assert again == header and again.tensors == tensors and again["c"] == c
    assert Header.from_tensors(tensors[:2], {}, header.header_size) != header


def test_header_padded_with_many_spaces() -> None:
    text = json.dumps({"a": entry()}) + " " * 10_000
    header = parse_header(text.encode())
    assert header.header_size == len(text)
    assert header.names() == ["a"]


def test_lookup_of_missing_tensor() -> None:
    header = parse({"a": entry()})
    assert "a" in header
    assert "b" not in header
    with pytest.raises(TensorNotFoundError, match="'b'"):
        header["b"]


@pytest.mark.parametrize("count", [1, 2000])  # a dict of names; a NameIndex (a long header)
def test_lookup_of_a_name_no_header_can_hold(count: int) -> None:
    """A key that is no string is in no header; an unhashable one, looked up, is refused as a
    misuse (a SafetensorsError, still a TypeError), whatever the header's size."""
    names = {f"t{i}": entry(offsets=(i, i + 1)) for i in range(count)}
    header = parse_header(json.dumps(names).encode(), stop=lambda: False)
    assert type(header._index) is (dict if count == 1 else NameIndex)
    unhashable: Any = ["t0"]
    assert unhashable not in header and 0 not in header and "t0" in header
    with pytest.raises(ArgumentTypeError, match="tensor names are str, got list"):
        header[unhashable]
    with pytest.raises(TensorNotFoundError, match="no tensor named 0"):
        header[0]  # type: ignore[index]  # the wrong type on purpose
    # the table of tensors is indexed by position: a name there was a bare TypeError
    assert header.tensors[0].name == "t0" and header.tensors[-1].name == f"t{count - 1}"
    with pytest.raises(ArgumentTypeError, match="indexed by position, got str 't0'"):
        header.tensors["t0"]  # type: ignore[call-overload]  # the wrong type on purpose


@pytest.mark.parametrize("code", list(DTYPES))
def test_every_dtype(code: str) -> None:
    dtype = DTYPES[code]
    shape = [2, 4]
    nbytes = 8 * dtype.bits // 8
    header = parse({"x": entry(dtype=code, shape=shape, offsets=[0, nbytes])})
    info = header["x"]
    assert info.dtype == code
    assert info.nbytes == nbytes
    assert int(np.prod(info.array_shape)) * info.array_dtype.itemsize == nbytes


def test_dtype_table_maps_to_numpy_and_ml_dtypes() -> None:
    assert len(DTYPES) == 22
    expected = {
        "BF16": ml_dtypes.bfloat16,
        "F8_E4M3": ml_dtypes.float8_e4m3fn,
        "F8_E5M2": ml_dtypes.float8_e5m2,
        "F8_E8M0": ml_dtypes.float8_e8m0fnu,
        "F8_E4M3FNUZ": ml_dtypes.float8_e4m3fnuz,
        "F8_E5M2FNUZ": ml_dtypes.float8_e5m2fnuz,
        "F16": np.float16,
        "C64": np.complex64,
        "BOOL": np.bool_,
    }
    for code, numpy_type in expected.items():
        assert dtype_from_code(code).numpy == np.dtype(numpy_type)
        assert dtype_for(numpy_type).code == code
    assert dtype_for(np.dtype(">f4")).code == "F32"
    with pytest.raises(DtypeError):
        dtype_for(np.dtype("U3"))
    with pytest.raises(DtypeError):
        dtype_for("float128-ish")
    with pytest.raises(SafetensorsError):
        dtype_from_code("F17")


def test_packed_shapes() -> None:
    assert array_shape(DTYPES["F4"], (3, 8)) == (3, 4)
    assert array_shape(DTYPES["F4"], (2, 3)) == (3,)  # odd last dimension: packed bytes, 1-D
    assert array_shape(DTYPES["F6_E3M2"], (2, 4)) == (6,)
    assert array_shape(DTYPES["F32"], (2, 4)) == (2, 4)
    with pytest.raises(DtypeError):
        array_shape(DTYPES["F6_E2M3"], (3,))


# ---------------------------------------------------------------- building headers


def test_build_then_parse_round_trip() -> None:
    specs = [
        TensorSpec("k", "F16", (1, 4, 8, 64)),
        TensorSpec("v", np.float16, (1, 4, 8, 64)),
        TensorSpec("s", ml_dtypes.bfloat16, ()),
        TensorSpec("q", "F4", (3, 2)),
    ]
    prefix, header = build_header(specs, {"compression": "none"})
    assert len(prefix) % 8 == 0
    (n,) = struct.unpack("<Q", prefix[:8])
    assert n == len(prefix) - 8
    parsed = parse_header(prefix[8:])
    assert parsed == header
    assert parsed.metadata == {"compression": "none"}
    assert prefix[8:].startswith(b'{"__metadata__":{"compression":"none"}')


def _random_text(rng: random.Random) -> str:
    """A short text of ASCII, control characters, quotes, backslashes and non-ASCII (BMP and
    beyond)."""
    alphabet = 'ab_.09 "\\/\n\t\x00\x1f\x7f\x80\u2028é中😀'
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6)))


@pytest.mark.parametrize("seed", range(5))
def test_built_header_text_is_what_json_dumps_writes(seed: int) -> None:
    rng = random.Random(seed)
    names = list({_random_text(rng) for _ in range(rng.randint(1, 8))})
    shapes = [(), (0,), (3,), (2, 5), (1, 1, 7)]
    specs = [
        TensorSpec(name, rng.choice(["F32", "U8", "I64"]), rng.choice(shapes)) for name in names
    ]
    metadata = {_random_text(rng): _random_text(rng) for _ in range(rng.randint(0, 3))}
    prefix, header = build_header(specs, metadata)
    expected: dict[str, Any] = {"__metadata__": metadata}
    for info in header.tensors:
        expected[info.name] = {
            "dtype": info.dtype,
            "shape": list(info.shape),
            "data_offsets": [info.start, info.end],
        }
    text = json.dumps(expected, separators=(",", ":"), ensure_ascii=False).encode()
    assert prefix[8:].rstrip(b" ") == text
    arrays = {spec.name: np.zeros(spec.shape, DTYPES[str(spec.dtype)].numpy) for spec in specs}
    laid_out, laid_header, _ = lay_out(arrays, metadata, order="plan")
    assert (laid_out, laid_header) == (prefix, header)


def test_a_laid_out_dict_finds_errors_as_its_plan_does() -> None:
    with pytest.raises(HeaderError, match="reserved"):
        lay_out({"a": np.zeros(1), "__metadata__": np.zeros(1)})
    with pytest.raises(UsageError, match="must be a string"):
        lay_out({1: np.zeros(1)})  # type: ignore[dict-item]
    with pytest.raises(DtypeError, match="tensor 'b'"):
        lay_out({"a": np.zeros(1), "b": ["x"]})
    with pytest.raises(UsageError, match="order must be"):  # before a converted tensor's dtype
        lay_out({"b": ["x"]}, order="bogus")  # type: ignore[arg-type]
    mixed = {"b": np.zeros((2, 3), np.float32), "a": [[1, 2]], "c": np.zeros(2, np.int8)}
    arrays = {name: np.asarray(value) for name, value in mixed.items()}
    specs = [TensorSpec(name, array.dtype, array.shape) for name, array in arrays.items()]
    assert lay_out(mixed, {"k": "v"})[:2] == build_header(plan_order(specs), {"k": "v"})


def test_build_refuses_bad_plans() -> None:
    with pytest.raises(HeaderError, match="twice"):
        build_header([TensorSpec("a", "U8", (1,)), TensorSpec("a", "U8", (1,))])
    with pytest.raises(HeaderError, match="reserved"):
        build_header([TensorSpec("__metadata__", "U8", (1,))])
    with pytest.raises(HeaderError, match="negative"):
        build_header([TensorSpec("a", "U8", (-1,))])
    with pytest.raises(HeaderError, match="whole number"):
        build_header([TensorSpec("a", "F4", (1,))])
    with pytest.raises(HeaderError, match="strings"):
        build_header([], {"a": 1})  # type: ignore[dict-item]
    with pytest.raises(HeaderError, match="65 dimensions"):
        build_header([TensorSpec("a", "U8", (1,) * 65)])
    with pytest.raises(HeaderError, match="too large for a numpy array"):
        build_header([TensorSpec("a", "F32", (0, 2**63))])


@pytest.mark.parametrize(
    ("name", "shape"),
    [("a", 3), ("a", ("x",)), ("a", "12"), ("a", (2.5,)), ("a", None), (1, (2,))],
)
def test_spec_with_a_bad_name_or_shape_is_a_usage_error(name: Any, shape: Any) -> None:
    with pytest.raises(UsageError, match="must be a s"):
        TensorSpec(name, "F32", shape)


def test_spec_shape_takes_numpy_integers() -> None:
    spec = TensorSpec("a", "F32", (np.int64(2), np.uint8(3)))  # type: ignore[arg-type]
    assert spec.shape == (2, 3) and all(type(d) is int for d in spec.shape)


def test_plan_and_metadata_of_the_wrong_type_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="TensorSpec"):
        build_header([("a", "F32", (2,))])  # type: ignore[list-item]
    with pytest.raises(UsageError, match="TensorSpec"):
        plan_order([("a", "F32", (2,))])  # type: ignore[list-item]
    with pytest.raises(UsageError, match="a plan is a list"):
        build_header(None)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="metadata must be a mapping"):
        build_header([], [("k", "v")])  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["(-1,)f4", "f4,(", {"x": 1}, [("a",)], "M8[xyz]"])
def test_dtype_for_refuses_what_numpy_refuses_with_a_dtype_error(value: Any) -> None:
    with pytest.raises(DtypeError, match="not a dtype"):
        dtype_for(value)


def test_plan_order_is_descending_alignment_then_name() -> None:
    specs = [
        TensorSpec("b", "U8", (1,)),
        TensorSpec("a", "U8", (1,)),
        TensorSpec("z", "F64", (1,)),
        TensorSpec("m", "F16", (1,)),
    ]
    assert [s.name for s in plan_order(specs)] == ["z", "m", "a", "b"]


def test_a_name_index_in_several_dicts_is_one_mapping() -> None:
    index = NameIndex(expected=300_000)  # several dicts, chosen by hash
    assert len(index._dicts) > 1
    names = [f"layer.{i}" for i in range(1000)]
    index.add(names[:600], 0)
    index.add(names[600:], 600)
    assert index == {name: i for i, name in enumerate(names)} and len(index) == 1000
    assert index["layer.999"] == 999 and "layer.5" in index and "x" not in index
    unhashable: object = []
    assert unhashable not in index  # in no dict, as no dict holds it
    index.add(["layer.3"], 1000)  # a name again: its last position, one entry
    assert len(index) == 1000 and index["layer.3"] == 1000
    with pytest.raises(KeyError):
        index["missing"]


@pytest.mark.parametrize(
    ("dtype", "kind"),
    [({"F32": None}, "an object"), (["F32"], "an array"), (32, "a number"), (None, "null")],
)
def test_a_dtype_that_is_no_string_is_named_as_such(dtype: object, kind: str) -> None:
    """A dtype written as another JSON value (the reference reads ``{"F32": null}``) is refused
    with a message that says a dtype is a string."""
    text = json.dumps({"a": {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}}).encode()
    with pytest.raises(UnknownDtypeError, match=f"a dtype is a JSON string, got {kind}"):
        parse_header(text)
