"""Differential property tests against the reference ``safetensors`` package.

Random valid files must read identically; random mutations of valid files must be refused by both
implementations, or by stream_st alone where the written spec is stricter: never by us alone
accepted.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import safetensors
import safetensors.numpy as reference_numpy
from hypothesis import HealthCheck, assume, event, given, settings

import stream_st

from .._util import REFERENCE_DTYPES, chunked

names = st.text(
    st.characters(codec="utf-8", exclude_characters="\x00"), min_size=0, max_size=12
).filter(lambda n: n != "__metadata__")
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=4)


@st.composite
def tensor_dicts(draw: st.DrawFn) -> dict[str, np.ndarray[Any, Any]]:
    keys = draw(st.lists(names, min_size=0, max_size=6, unique=True))
    result: dict[str, np.ndarray[Any, Any]] = {}
    for key in keys:
        dtype = np.dtype(draw(st.sampled_from(REFERENCE_DTYPES)))
        shape = tuple(draw(shapes))
        size = int(np.prod(shape)) * dtype.itemsize
        raw = draw(st.binary(min_size=size, max_size=size))
        result[key] = np.frombuffer(raw, dtype=np.uint8).view(dtype).reshape(shape).copy()
    return result


metadata_maps = st.one_of(st.none(), st.dictionaries(names, st.text(max_size=8), max_size=3))


async def read(source: Any) -> dict[str, np.ndarray[Any, Any]]:
    return {name: array async for name, array in stream_st.open_stream(source)}


def reference_read(data: bytes) -> dict[str, tuple[str, list[int], bytes]]:
    return {
        name: (info["dtype"], list(info["shape"]), bytes(info["data"]))
        for name, info in safetensors.deserialize(data)
    }


def ours_as_reference(arrays: dict[str, np.ndarray[Any, Any]], header: Any) -> dict[str, Any]:
    return {
        name: (header[name].dtype, list(header[name].shape), array.tobytes())
        for name, array in arrays.items()
    }


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=tensor_dicts(), metadata=metadata_maps, chunk=st.integers(1, 97))
async def test_reference_files_read_identically(
    tensors: dict[str, np.ndarray[Any, Any]], metadata: dict[str, str] | None, chunk: int
) -> None:
    assume(tensors or metadata != {})  # the reference writes invalid JSON there: see below
    data = reference_numpy.save(tensors, metadata=metadata)
    expected = reference_numpy.load(data)
    for source in (data, chunked(data, chunk)):
        got = await read(source)
        assert sorted(got) == sorted(expected)
        for name, array in expected.items():
            assert got[name].dtype == array.dtype
            assert got[name].shape == array.shape
            assert got[name].tobytes() == array.tobytes()
    header = await stream_st.read_header(data)
    assert header.metadata == (metadata or {})


async def test_reference_quirk_empty_file_with_empty_metadata_is_refused() -> None:
    """The reference writer emits ``{},"__metadata__":{}}`` here; both readers refuse it."""
    data = reference_numpy.save({}, metadata={})
    with pytest.raises(stream_st.HeaderError, match="not valid JSON"):
        await stream_st.read_header(data)
    with pytest.raises(Exception, match="trailing characters"):
        safetensors.deserialize(data)


# ---------------------------------------------------------------- mutations

STRICTER = (
    "duplicate key",  # the reference's JSON layer lets the last one win
    "begin with '{'",  # the spec: the header is a JSON object
    "unknown field",  # the spec names exactly dtype, shape and data_offsets
    "__metadata__ must be a JSON object",  # null is not a map of strings
    "dimensions, more than the",  # numpy cannot make the array
    "too large for a numpy",  # nor one whose dims x item size exceed its address space
)


def _has_duplicate_keys(data: bytes) -> bool:
    """True when the JSON header of ``data`` names a key twice in some object."""
    found = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal found
        found = found or len({key for key, _ in items}) < len(items)
        return dict(items)

    try:
        (n,) = struct.unpack("<Q", data[:8])
        json.loads(data[8 : 8 + n], object_pairs_hook=pairs)
    except (ValueError, struct.error, RecursionError):
        return False
    return found


def stricter_reason(data: bytes, error: BaseException) -> str | None:
    """Which deliberate strictness (:data:`STRICTER`) explains our refusal of ``data``, if any.

    A header with a key named twice is refused at its first bad member, which may come before
    the duplicate: the reference, keeping the last one only, never sees that member.
    """
    text = str(error)
    known = next((reason for reason in STRICTER if reason in text), None)
    if known is None and _has_duplicate_keys(data):
        known = STRICTER[0]
    return known


def mutate_bytes(data: bytes, draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["flip", "set", "delete", "insert", "truncate", "append"]))
    if kind == "append":
        return data + draw(st.binary(min_size=1, max_size=4))
    at = draw(st.integers(0, max(0, len(data) - 1)))
    if kind == "truncate":
        return data[:at]
    if kind == "delete":
        return data[:at] + data[at + 1 :]
    if kind == "insert":
        return data[:at] + draw(st.binary(min_size=1, max_size=3)) + data[at:]
    value = (
        data[at] ^ (1 << draw(st.integers(0, 7))) if kind == "flip" else draw(st.integers(0, 255))
    )
    return data[:at] + bytes([value]) + data[at + 1 :]


def with_header(data: bytes, text: str) -> bytes:
    """Replace the JSON header of ``data`` by ``text``, keeping the data section."""
    (n,) = struct.unpack("<Q", data[:8])
    body = text.encode()
    return struct.pack("<Q", len(body)) + body + data[8 + n :]


def mutate_json(data: bytes, draw: st.DrawFn) -> bytes:
    (n,) = struct.unpack("<Q", data[:8])
    obj = json.loads(data[8 : 8 + n])
    tensors = [k for k in obj if k != "__metadata__"]
    kind = draw(
        st.sampled_from(
            [
                "dtype",
                "shape",
                "offsets",
                "drop_field",
                "extra_field",
                "duplicate",
                "metadata",
                "leading_space",
                "swap_offsets",
                "drop_tensor",
            ]
        )
    )
    if kind == "leading_space":
        return with_header(data, " " + json.dumps(obj))
    if kind == "metadata":
        obj["__metadata__"] = draw(
            st.sampled_from([None, 1, "x", [], {"a": 1}, {"a": None}, {"a": "b"}])
        )
        return with_header(data, json.dumps(obj))
    if not tensors:
        return with_header(data, json.dumps(obj) + draw(st.sampled_from(["", "x", "}"])))
    name = draw(st.sampled_from(tensors))
    entry = obj[name]
    if kind == "dtype":
        entry["dtype"] = draw(st.sampled_from([*stream_st.DTYPES, "F17", "f32", 4, None]))
    elif kind == "shape":
        entry["shape"] = draw(
            st.one_of(
                st.lists(st.integers(-2, 2**65), max_size=3),
                st.just([1.5]),
                st.just("3"),
                st.just([True]),
            )
        )
    elif kind == "offsets":
        entry["data_offsets"] = draw(st.lists(st.integers(-1, 200), min_size=0, max_size=3))
    elif kind == "drop_field":
        del entry[draw(st.sampled_from(sorted(entry)))]
    elif kind == "extra_field":
        entry["extra"] = 1
    elif kind == "swap_offsets":
        entry["data_offsets"] = entry["data_offsets"][::-1]
    elif kind == "drop_tensor":
        del obj[name]
    elif kind == "duplicate":
        text = json.dumps(obj)
        text = text[:-1] + ", " + json.dumps(name) + ": " + json.dumps(entry) + "}"
        return with_header(data, text)
    return with_header(data, json.dumps(obj))


@st.composite
def mutated_files(draw: st.DrawFn) -> bytes:
    tensors = draw(tensor_dicts())
    metadata = draw(metadata_maps)
    assume(tensors or metadata != {})
    data = reference_numpy.save(tensors, metadata=metadata)
    if draw(st.booleans()):
        return mutate_json(data, draw)
    return mutate_bytes(data, draw)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=mutated_files())
async def test_mutations_are_never_accepted_by_us_alone(data: bytes) -> None:
    try:
        expected = reference_read(data)
    except Exception:  # the reference raises several exception types
        expected = None
    try:
        header = await stream_st.read_header(data)
        got = ours_as_reference(await read(data), header)
    except stream_st.SafetensorsError as error:
        if expected is not None:
            assert stricter_reason(data, error) is not None, str(error)
        event("refused by us alone (stricter)" if expected else "refused by both")
        return
    event("accepted by both")
    assert expected is not None, "stream_st accepted a file the reference refuses"
    assert got == expected
