"""A dataset read whole or planned in pieces: every row or a refusal, and bounded planning."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
import stream_st.numpy
from stream_st.core.shards import shard_position
from stream_st.integrations.dataset import Piece, describe_dataset, plan_pieces, read_piece
from stream_st.sharded.writer import open_dataset_writer

from ..fuzz.fault_suite import Sender

SHARDS = 5


async def write_batches(directory: Path) -> list[dict[str, np.ndarray[Any, Any]]]:
    """Five shards, each holding the same columns ``x`` and ``y``, rows numbered across shards."""
    batches = []
    async with open_dataset_writer(directory, target_shard_size=1) as writer:
        for shard in range(SHARDS):
            rows = np.arange(shard * 4, shard * 4 + 4)
            batch: dict[str, np.ndarray[Any, Any]] = {
                "x": rows.astype(np.float32)[:, None] * np.ones(3, np.float32),
                "y": rows,
            }
            await writer.write_batch(batch, samples=4)
            batches.append(batch)
    return batches


async def test_load_refuses_a_manifest_whose_shards_repeat_names(tmp_path: Path) -> None:
    await write_batches(tmp_path)
    manifest = tmp_path / "dataset_manifest.json"
    with pytest.raises(stream_st.UsageError, match=r"'x' is in more than one shard.*open_stream"):
        await stream_st.load(manifest)


def test_numpy_load_file_refuses_a_manifest_whose_shards_repeat_names(tmp_path: Path) -> None:
    import anyio

    anyio.run(write_batches, tmp_path)
    with pytest.raises(stream_st.UsageError, match="more than one shard"):
        stream_st.numpy.load_file(str(tmp_path / "dataset_manifest.json"))


async def test_streaming_a_manifest_still_gives_every_row(tmp_path: Path) -> None:
    batches = await write_batches(tmp_path)
    got = [
        (name, array)
        async for name, array in stream_st.open_stream(tmp_path / "dataset_manifest.json")
    ]
    assert [name for name, _ in got] == ["x", "y"] * SHARDS
    for shard, batch in enumerate(batches):
        assert np.array_equal(got[2 * shard][1], batch["x"])
        assert np.array_equal(got[2 * shard + 1][1], batch["y"])


async def test_load_of_a_manifest_with_distinct_names_still_works(tmp_path: Path) -> None:
    async with open_dataset_writer(tmp_path, target_shard_size=1) as writer:
        await writer.write_batch({"a": np.arange(3)}, samples=1)  # KV rows: a batch of other
        await writer.write_batch({"b": np.arange(4)}, samples=1)  # columns is refused
    got = await stream_st.load(tmp_path / "dataset_manifest.json")
    assert sorted(got) == ["a", "b"] and got["b"].tolist() == [0, 1, 2, 3]


def raw_file(header: dict[str, Any], data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


async def test_planning_zero_byte_rows_is_bounded(tmp_path: Path) -> None:
    """``F32 [10**15, 0]`` holds no byte (the reference accepts it): planning makes a bounded
    number of pieces, not one per 64 MiB of rows counted as a byte each."""
    shard = tmp_path / "part-00000-0000-00000000-0000-0000-0000-000000000000.safetensors"
    shard.write_bytes(
        raw_file(
            {
                "x": {"dtype": "F32", "shape": [10**15, 0], "data_offsets": [0, 0]},
                "y": {"dtype": "U8", "shape": [10**15, 0], "data_offsets": [0, 0]},
            }
        )
    )
    dataset = await describe_dataset(tmp_path)
    assert not dataset.kv
    pieces = plan_pieces(dataset)
    assert len(pieces) == 1 and (pieces[0].start, pieces[0].stop) == (0, 10**15)
    assert len(plan_pieces(dataset, at_least=8)) == 8
    got = await read_piece(pieces[0])
    assert got["x"].shape == (10**15, 0)


async def test_planning_still_splits_real_rows(tmp_path: Path) -> None:
    await write_batches(tmp_path)
    dataset = await describe_dataset(tmp_path / "dataset_manifest.json")
    pieces = plan_pieces(dataset, max_bytes=2 * (12 + 8))  # two rows of x and y
    assert len(pieces) == SHARDS * 2
    rows = [await read_piece(piece) for piece in pieces]
    assert np.concatenate([r["y"] for r in rows]).tolist() == list(range(SHARDS * 4))


@pytest.mark.parametrize("call", ["keys", "get_tensor"])
def test_safe_open_refuses_a_manifest_whose_shards_repeat_names(tmp_path: Path, call: str) -> None:
    """The drop-in's handle never answers with one shard's tensor for a name all shards hold."""
    import anyio

    anyio.run(write_batches, tmp_path)
    with (
        pytest.raises(stream_st.UsageError, match="more than one shard"),
        stream_st.numpy.safe_open(str(tmp_path / "dataset_manifest.json"), "np") as handle,
    ):
        if call == "keys":
            handle.keys()
        else:
            handle.get_tensor("x")


async def test_the_dataset_writer_writes_the_tensor_index_when_asked(tmp_path: Path) -> None:
    """``generate_index=True`` writes ``_tensor_index.parquet`` as a directory Spark reads: a row
    per tensor of every shard; without it, none is written (and an old one is removed)."""
    pq = pytest.importorskip("pyarrow.parquet")
    async with open_dataset_writer(tmp_path, target_shard_size=1, generate_index=True) as writer:
        for shard in range(3):
            rows = np.arange(shard * 2, shard * 2 + 2)
            await writer.write_batch({"x": rows.astype(np.float32), "y": rows}, samples=2)
    index = tmp_path / "_tensor_index.parquet"
    (part,) = list(index.iterdir())
    assert part.name.startswith("part-") and part.suffix == ".parquet"
    table = pq.read_table(index).to_pylist()
    shards = json.loads((tmp_path / "dataset_manifest.json").read_text())["shards"]
    assert len(table) == 6
    assert {(row["tensor_key"], row["file_name"]) for row in table} == {
        (key, shard["shard_path"]) for shard in shards for key in ("x", "y")
    }
    assert {(row["tensor_key"], tuple(row["shape"]), row["dtype"]) for row in table} == {
        ("x", (2,), "F32"),
        ("y", (2,), "I64"),
    }
    async with open_dataset_writer(tmp_path, target_shard_size=1) as writer:
        await writer.write_batch({"x": np.zeros(2, np.float32)}, samples=2)
    assert not index.exists()


@pytest.mark.parametrize(
    "name",
    [
        f"part-{'1' * 5000}-0000-x.safetensors",  # past what int() reads: a bare ValueError
        "part-\u0661\u0662\u0663\u0664\u0665-0000-x.safetensors",  # Arabic-Indic digits
    ],
)
def test_a_shard_name_of_other_digits_is_no_shard_name(name: str) -> None:
    assert shard_position(name) is None
    assert shard_position("part-00012-0003-x.safetensors") == (12, 3)


@pytest.mark.parametrize("names", [("c",), ("b",), ("a", "c")])
async def test_rows_of_a_stream_cut_in_bytes_skipped_name_the_tensor_they_ran_out_in(
    names: tuple[str, ...],
) -> None:
    """Rows read from a source of unknown length (``tcp://``) cut before the last rows asked
    for name the tensor the bytes ran out in, and where they ran out in bytes skipped (rows
    before or after those asked for, a column not asked for) that tensor's end as the byte
    expected, as a source of known size does; never the next column asked for."""
    data = stream_st.numpy.save(
        {
            "a": np.arange(24, dtype=np.float32).reshape(6, 4),
            "b": np.arange(12, dtype=np.int16).reshape(6, 2),
            "c": np.arange(6, dtype=np.int64),
        }
    )
    header = await stream_st.read_header(data)
    base = header.data_start
    assert [(t.name, t.start, t.end) for t in header.tensors] == [
        ("c", 0, 48),
        ("a", 48, 144),
        ("b", 144, 168),
    ]
    parts = [header[name].rows(2, 4) for name in names]
    for cut in range(base, max(base + part.end for part in parts)):
        sender = Sender(data[:cut])
        try:
            with pytest.raises(stream_st.TruncatedStreamError) as info:
                await read_piece(Piece(f"tcp://127.0.0.1:{sender.port}", names, 2, 4))
        finally:
            sender.stop()
        ran_out_in = next(t for t in header.tensors if base + t.end > cut)
        assert info.value.name == ran_out_in.name, cut
        if not any(base + part.start <= cut < base + part.end for part in parts):
            assert info.value.expected == base + ran_out_in.end, cut


MANY = 20_000
"""Tensors enough that listing them all would take hundreds of kilobytes."""


async def test_a_kv_dataset_and_its_pieces_have_bounded_reprs(tmp_path: Path) -> None:
    """A dataset's :class:`DatasetInfo` and :class:`Piece` printed every shard's header and
    every name (4.5 MB for 10**5 keys); they now show counts and the first shard or name."""
    async with open_dataset_writer(tmp_path) as writer:
        keys = {f"k{i}__v": np.zeros(1, np.uint8) for i in range(MANY)}
        await writer.write_batch(keys, samples=MANY)
    for dataset in (
        await describe_dataset(tmp_path),
        await describe_dataset(tmp_path, from_manifest=True),
    ):
        assert dataset.kv
        text = repr(dataset)
        assert len(text) < 1000 and "n_shards=1" in text and str(tmp_path) in text, text[:500]
    text = repr(await describe_dataset(tmp_path))
    assert f"n_tensors={MANY}" in text, text[:500]
    (piece,) = plan_pieces(await describe_dataset(tmp_path))
    assert len(piece.names) == MANY
    text = repr(piece)
    assert len(text) < 1000 and f"names=['k0__v'] and {MANY - 1} more" in text, text[:500]
    assert "start=0, stop=0" in text, text[:500]


def test_a_pieces_repr_masks_its_address() -> None:
    text = repr(Piece("https://h/d/part-0.safetensors?X-Amz-Signature=5ec2e7", ("a",), 0, 4))
    assert "5ec2e7" not in text and "X-Amz-Signature=***" in text, text[:500]
    assert "start=0, stop=4" in text, text[:500]


async def write_wide(directory: Path) -> None:
    """A batch-mode dataset of :data:`MANY` columns of two samples each."""
    async with open_dataset_writer(directory) as writer:
        await writer.write_batch({f"c{i}": np.zeros(2, np.uint8) for i in range(MANY)}, samples=2)


async def test_a_wide_dataset_and_an_unknown_column_are_told_briefly(tmp_path: Path) -> None:
    """Planning a column a dataset of many lacks listed every column (189 KB for 20,000); the
    error now counts them and shows the first few, and the dataset's repr is bounded too."""
    await write_wide(tmp_path)
    dataset = await describe_dataset(tmp_path)
    assert not dataset.kv and len(dataset.columns) == MANY
    text = repr(dataset)
    assert len(text) < 1000 and f"n_columns={MANY}" in text, text[:500]
    with pytest.raises(stream_st.UsageError) as info:
        plan_pieces(dataset, ["c1", "nope"])
    text = str(info.value)
    assert len(text) < 500 and "'nope'" in text and f"{MANY} columns" in text, text[:500]
    assert "'c0'" in text, text[:500]


async def test_the_dataset_writers_refusals_name_a_few_columns(tmp_path: Path) -> None:
    """A batch after KV-mode rows, or of other columns than the dataset's, listed every column
    of the batch and of the dataset (2 MB for 10**5); the errors now count them and show the
    first few."""
    batch = {f"c{i}": np.zeros(2, np.uint8) for i in range(MANY)}
    async with open_dataset_writer(tmp_path / "kv") as writer:
        await writer.write_batch({"a": np.arange(3)}, samples=1)
        await writer.write_batch({"b": np.arange(3)}, samples=1)  # KV rows
        with pytest.raises(stream_st.UsageError, match="after KV-mode rows") as info:
            await writer.write_batch(batch, samples=2)
    text = str(info.value)
    assert len(text) < 1000 and f"{MANY} columns" in text and "'c0'" in text, text[:500]
    async with open_dataset_writer(tmp_path / "batches") as writer:
        await writer.write_batch(batch, samples=2)
        other = {f"d{i}": np.zeros(2, np.uint8) for i in range(MANY)}
        with pytest.raises(stream_st.UsageError, match="are not the dataset's") as info:
            await writer.write_batch(other, samples=2)
    text = str(info.value)
    assert len(text) < 1000 and "'d0'" in text and "'c0'" in text, text[:500]
    assert text.count(f"{MANY} columns") == 2, text[:500]
