"""A ``repr`` of anything that holds a header is a few hundred characters, whatever the header.

A header may list millions of tensors: a ``repr`` of all of them (which asyncio's runner makes
of a coroutine's result, a debugger or a log of any object) would take seconds and megabytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import numpy as np

import stream_st
import stream_st.numpy as st_np
from stream_st import Header, build_header, tools
from stream_st.core.layout import TensorSpec
from stream_st.sharded import ShardIndex

BOUND = 700
TENSORS = 1000
LONG = "n" * 500


def many_tensors(path: Path) -> Header:
    """A file of ``TENSORS`` tensors with long names, many dimensions and long metadata."""
    specs = [TensorSpec(f"{LONG}.{i}", "U8", (1,) * 60) for i in range(TENSORS)]
    metadata = {f"{LONG}{i}": LONG for i in range(20)}
    prefix, header = build_header(specs, metadata)
    path.write_bytes(prefix + bytes(header.data_size))
    return header


def test_a_header_and_its_table_show_counts_and_first_tensors(tmp_path: Path) -> None:
    header = many_tensors(tmp_path / "many.safetensors")
    for obj in (header, header.tensors, header.tensors[1:]):
        text = repr(obj)
        assert len(text) < BOUND, text
    assert repr(header).startswith(f"Header(n_tensors={TENSORS}, data_bytes={TENSORS}, ")
    assert "TensorInfo(name='nnn" in repr(header) and "..." in repr(header)
    assert repr(header.tensors[:1]).startswith("TensorTable(n_tensors=1, first=[TensorInfo(")


def test_objects_that_hold_a_header_have_a_bounded_repr(tmp_path: Path) -> None:
    path = tmp_path / "many.safetensors"
    many_tensors(path)

    async def held() -> list[object]:
        async with stream_st.open_stream(path) as stream:
            return [stream, stream.stats, stream.header]

    objects = anyio.run(held)
    index = {"metadata": {}, "weight_map": {f"{LONG}.{i}": "many.safetensors" for i in range(99)}}
    objects.append(ShardIndex(json.dumps(index).encode(), str(tmp_path / "m.index.json")))
    with st_np.safe_open(path, "np") as handle:
        objects += [handle, handle.get_slice(f"{LONG}.0")]
        assert isinstance(handle.get_tensor(f"{LONG}.1"), np.ndarray)
    for obj in objects:
        assert len(repr(obj)) < BOUND, (type(obj), repr(obj)[:BOUND])


def test_digests_specs_and_the_commands_results_have_a_bounded_repr(tmp_path: Path) -> None:
    """Digests, inspect's, validate's and diff's results showed every tensor in their repr
    (megabytes for 20,000 tensors), a TensorSpec its whole name: each now shows how many and
    the first, shortened."""
    path = tmp_path / "many.safetensors"
    header = many_tensors(path)
    other = tmp_path / "other.safetensors"  # half the tensors, other bytes, other metadata
    specs = [TensorSpec(f"{LONG}.{i}", "U8", (1,) * 60) for i in range(TENSORS // 2)]
    prefix, half = build_header([*specs, TensorSpec(f"{LONG}+", "U8", [2])], {LONG: LONG})
    other.write_bytes(prefix + b"\1" * half.data_size)

    async def results() -> tuple[tools.Inspection, tools.Validation, tools.Diff]:
        return (
            await tools.inspect(path),
            await tools.validate(path),
            await tools.diff(path, other, content=True),
        )

    inspection, validation, diff = anyio.run(results)
    digests = stream_st.Digests("sha256", {info.name: "ab" * 32 for info in header.tensors})
    spec = TensorSpec(LONG * 2000, "F32", (1,) * 60)
    for obj in (digests, spec, inspection, validation, diff):
        assert len(repr(obj)) < BOUND, (type(obj), repr(obj)[:BOUND])
    assert repr(digests).startswith(f"Digests(algorithm='sha256', n_tensors={TENSORS}, ")
    assert repr(spec).startswith("TensorSpec(name='nnn") and "dtype='F32'" in repr(spec)
    assert "tensors=[{'bytes': 1, 'dtype': 'U8', 'name': 'nnn" in repr(inspection)
    assert f"...] ({TENSORS} in all), tensor_count={TENSORS}" in repr(inspection)
    assert repr(validation).startswith("Validation(ok=True, source=")
    assert "tensors=[TensorStats(name='nnn" in repr(validation)
    assert f"...] ({TENSORS} in all)" in repr(validation)
    assert repr(diff).startswith("Diff(equal=False, added=['nnn") and diff.content_differs
    for kind, count in (("removed", TENSORS // 2), ("content_differs", TENSORS // 2)):
        assert f"{kind}=['nnn" in repr(diff) and f"...] ({count} in all)" in repr(diff)
