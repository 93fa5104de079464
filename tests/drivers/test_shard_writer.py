"""Rolling shard writers: Hugging Face checkpoints and safetensors-spark datasets."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.core.header import DEFAULT_MAX_HEADER_SIZE
from stream_st.core.shards import MANIFEST_DTYPES
from stream_st.integrations.dataset import describe_dataset
from stream_st.sharded.reader import MAX_INDEX_SIZE
from stream_st.sharded.writer import (
    DatasetWriter,
    ShardedWriter,
    open_dataset_writer,
    open_sharded_writer,
)
from stream_st.transports.file import atomic
from stream_st.transports.file.sink import FileSink

from .._util import nameless_works

Arrays = dict[str, np.ndarray[Any, Any]]
MB = 1_000_000
LAYOUT = "uses/dataset_manifest.schema.json"


def tensors(count: int, size: int = MB) -> Arrays:
    return {f"layers.{i}.weight": np.full(size // 4, i, dtype=np.float32) for i in range(count)}


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


async def test_checkpoint_rolls_over_and_writes_its_index(tmp_path: Path) -> None:
    arrays = tensors(10)
    async with open_sharded_writer(tmp_path, max_shard_size=3 * MB, metadata={"k": "v"}) as w:
        for name, array in arrays.items():
            await w.write(name, array)
            assert not (tmp_path / "model.safetensors.index.json").exists()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)] + [
        "model.safetensors.index.json"
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["layers.0.weight"] == "model-00001-of-00004.safetensors"
    assert index["weight_map"]["layers.9.weight"] == "model-00004-of-00004.safetensors"
    # the tensors' bytes, as huggingface_hub and transformers count them (not the files')
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in arrays.values())
    for shard in files[:-1]:  # every shard is a plain file the reference reads
        reference_numpy.load_file(str(tmp_path / shard))
    got = await read_all(tmp_path / "model.safetensors.index.json")
    assert list(got) == list(arrays)
    for name, array in arrays.items():
        assert np.array_equal(got[name], array)


async def test_single_shard_is_model_safetensors(tmp_path: Path) -> None:
    async with open_sharded_writer(tmp_path, max_shard_size=100 * MB) as w:
        await w.write("a", np.arange(3))
    assert (tmp_path / "model.safetensors").exists()
    assert (await read_all(tmp_path / "model.safetensors.index.json"))["a"].tolist() == [0, 1, 2]


async def test_dataset_shards_and_manifest(tmp_path: Path) -> None:
    """KV-mode rows (a name's tensors, one sample a group) roll over at the target size."""
    async with open_dataset_writer(tmp_path, target_shard_size=2_100_000, task_id=3) as w:
        for batch in range(5):
            await w.write_batch(
                {
                    f"batch{batch}.image": np.full((10, 25_000), batch, dtype=np.float32),
                    f"batch{batch}.label": np.arange(10, dtype=np.int64),
                },
                samples=1,
            )
    manifest = json.loads((tmp_path / "dataset_manifest.json").read_text())
    assert manifest["format_version"] == "1.0"
    assert manifest["total_samples"] == 5
    shards = manifest["shards"]
    assert len(shards) == 3  # 1 MB per row: two rows per 2 MB shard
    for index, shard in enumerate(shards):
        assert re.fullmatch(
            rf"part-00003-{index:04d}-[0-9a-f-]{{36}}\.safetensors", shard["shard_path"]
        )
        assert shard["bytes"] == (tmp_path / shard["shard_path"]).stat().st_size
    assert [s["samples_count"] for s in shards] == [2, 2, 1]
    assert manifest["total_bytes"] == sum(s["bytes"] for s in shards)
    assert manifest["schema"]["batch0.image"] == {"dtype": "F32", "shape": [10, 25000]}
    got = await read_all(tmp_path / "dataset_manifest.json", include=["batch4.label"])
    assert got["batch4.label"].tolist() == list(range(10))
    all_names = list(await read_all(tmp_path / "dataset_manifest.json"))
    assert len(all_names) == 10


async def test_reader_checks_the_manifest(tmp_path: Path) -> None:
    async with open_dataset_writer(tmp_path, target_shard_size=MB) as w:
        await w.write_batch({"x": np.ones(10)}, samples=1)
    path = tmp_path / "dataset_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["shards"][0]["bytes"] += 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(stream_st.HeaderError, match="manifest says"):
        await read_all(path)
    manifest["shards"][0]["bytes"] -= 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(stream_st.TensorNotFoundError, match="nope"):
        await read_all(path, include=["nope"])


async def test_a_manifest_listing_a_shard_twice_is_refused(tmp_path: Path) -> None:
    """Every reader (the stream, the datasets' description) read its samples twice."""
    async with open_dataset_writer(tmp_path, target_shard_size=MB) as w:
        await w.write_batch({"x": np.arange(3)}, samples=3)
    path = tmp_path / "dataset_manifest.json"
    manifest = json.loads(path.read_text())
    manifest["shards"].append(manifest["shards"][0])
    manifest["total_samples"] *= 2
    path.write_text(json.dumps(manifest))
    with pytest.raises(stream_st.HeaderError, match=r"lists shard 'part-.*' twice"):
        await read_all(path)
    with pytest.raises(stream_st.HeaderError, match="twice"):
        await describe_dataset(tmp_path)


class Boom(Exception):
    pass


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
async def test_failure_leaves_nothing(tmp_path: Path, kind: str) -> None:
    before = set(tmp_path.iterdir())
    with pytest.raises(Boom):
        if kind == "checkpoint":
            async with open_sharded_writer(tmp_path, max_shard_size=2 * MB) as w:
                for name, array in tensors(5).items():
                    await w.write(name, array)
                raise Boom
        else:
            async with open_dataset_writer(tmp_path, target_shard_size=2 * MB) as d:
                for name, array in tensors(5).items():
                    await d.write_batch({name: array}, samples=1)
                raise Boom
    assert set(tmp_path.iterdir()) == before


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
@pytest.mark.parametrize("nameless", [True, False], ids=["nameless", "named"])
async def test_a_writer_dropped_unclosed_leaves_no_folder_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, nameless: bool
) -> None:
    """Dropped without being closed, after writes, a writer leaves the destination as it found
    it, as a failed one does: its shards go and so do the folders it made, also where the file
    system has no nameless file (the shards' hidden temporaries, removed by their own
    finalizers, are gone before the folders are removed, where they kept them)."""
    if nameless and not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    monkeypatch.setattr(atomic, "USE_TMPFILE", nameless)
    writer: ShardedWriter | DatasetWriter
    if kind == "checkpoint":
        writer = open_sharded_writer(tmp_path / "new" / "model", max_shard_size=2 * MB)
        await writer.__aenter__()
        for name, array in tensors(5).items():
            await writer.write(name, array)
    else:
        writer = open_dataset_writer(tmp_path / "new" / "ds", target_shard_size=2 * MB)
        await writer.__aenter__()
        for name, array in tensors(5).items():
            await writer.write_batch({name: array}, samples=1)
    with pytest.warns(ResourceWarning):  # the unclosed shards, let go of
        del writer
        gc.collect()
    assert list(tmp_path.iterdir()) == []


FORKED_WRITER = """
import os, sys
import anyio, numpy as np
from stream_st.sharded.writer import open_sharded_writer
from stream_st.transports.file import atomic
atomic.USE_TMPFILE = sys.argv[2] == "nameless"
writer = open_sharded_writer(os.path.join(sys.argv[1], "new", "model"), max_shard_size=64)
async def write():
    for name in ("a", "b"):
        await writer.write(name, np.ones(16, np.float32))
anyio.run(write)
if os.fork() == 0:
    sys.exit(0)  # a forked helper that ends normally: its exit runs the finalizers it copied
os.wait()
anyio.run(writer.aclose)
"""


@pytest.mark.parametrize("nameless", [True, False], ids=["nameless", "named"])
def test_a_forked_copy_leaves_the_writers_folders_alone(tmp_path: Path, nameless: bool) -> None:
    """A process forked while a writer that made its folders is at work (a helper that ends
    normally) inherits the finalizer that takes them away from a writer dropped unclosed: it
    removed the parent's folders (and, named, its shards' temporaries), whose commit then
    failed. Only the parent's own writer is cleaned up by it."""
    if nameless and not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    mode = "nameless" if nameless else "named"
    done = subprocess.run(
        [sys.executable, "-c", FORKED_WRITER, str(tmp_path), mode],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert done.returncode == 0, done.stderr
    index = tmp_path / "new" / "model" / "model.safetensors.index.json"
    assert sorted(json.loads(index.read_text())["weight_map"]) == ["a", "b"]


async def test_misuse(tmp_path: Path) -> None:
    async with open_sharded_writer(tmp_path, max_shard_size=MB) as w:
        await w.write("a", np.zeros(2))
        with pytest.raises(stream_st.WriterError, match="already written"):
            await w.write("a", np.zeros(2))
        with pytest.raises(stream_st.DtypeError):
            await w.write("s", np.array(["text"]))
    with pytest.raises(stream_st.UsageError):
        await w.write("b", np.zeros(2))
    with pytest.raises(stream_st.UsageError, match="the writer is closed"):
        async with w:  # entered again once committed: it did nothing, silently
            pass
    dataset = open_dataset_writer(tmp_path / "data")
    async with dataset:
        pass
    with pytest.raises(stream_st.UsageError, match="the writer is closed"):
        async with dataset:
            pass


def _writer(kind: str, directory: str | Path) -> Any:
    if kind == "checkpoint":
        return open_sharded_writer(directory, max_shard_size=MB)
    return open_dataset_writer(directory, target_shard_size=MB)


async def _add(writer: Any, name: Any, array: np.ndarray[Any, Any]) -> None:
    if isinstance(writer, stream_st.ShardedWriter):
        await writer.write(name, array)
    else:
        await writer.write_batch({name: array}, samples=1)


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
@pytest.mark.parametrize("name", ["__metadata__", "\udcff", 7])
async def test_a_name_no_header_takes_is_refused_at_its_write(
    tmp_path: Path, kind: str, name: Any
) -> None:
    """A group's names are checked as a header checks them (the error save gives), before any
    write, as a dtype is: the writer takes the next write and commits. Into a shard already
    started, '__metadata__' or a lone surrogate was taken, then refused when the shard was
    sealed, which threw every shard away; a name that is no string aborted the writer."""
    error = _header_error(name)
    with pytest.raises(type(error)):  # the single-file writer's error
        await stream_st.save(tmp_path / "single.safetensors", {name: np.ones(2)})
    async with _writer(kind, tmp_path / "out") as writer:
        await _add(writer, "a", np.ones(4, np.float32))
        with pytest.raises(type(error), match=re.escape(str(error))):
            await _add(writer, name, np.ones(4, np.float32))
        await _add(writer, "b", np.zeros(4, np.float32))
    index = "model.safetensors.index.json" if kind == "checkpoint" else "dataset_manifest.json"
    got = await read_all(tmp_path / "out" / index)
    assert sorted(got) == ["a", "b"]


def _header_error(name: Any) -> stream_st.SafetensorsError:
    """The error a header of the tensor ``name`` is refused with."""
    try:
        stream_st.build_header([stream_st.TensorSpec(name, "F32", (4,))])
    except stream_st.SafetensorsError as exc:
        return exc
    raise AssertionError(f"{name!r} was taken")


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
@pytest.mark.parametrize("how", ["caught", "timed out"])
async def test_a_writer_aborted_by_a_failed_write_says_so_at_the_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, how: str
) -> None:
    """A write that failed (here the disk refuses its bytes) or was cancelled aborts the writer
    (its shards are gone); its error caught (or the cancellation swallowed by the caller's own
    time limit), the block ended normally and the close said nothing: no checkpoint, and no
    error. It raises WriterError saying why, as open_writer's does; a write after it says why,
    not just "closed"."""

    async def refused(*_: object) -> None:
        raise stream_st.TransportError("disk full")

    directory = tmp_path / "out"
    with pytest.raises(stream_st.WriterError, match=r"aborted \((TransportError|Cancelled)"):
        async with _writer(kind, directory) as writer:
            await _add(writer, "a", np.ones(4, np.float32))
            if how == "caught":
                with pytest.raises(stream_st.TransportError), monkeypatch.context() as patch:
                    patch.setattr(FileSink, "write_at", refused)
                    await _add(writer, "b", np.ones(4, np.float32))
            else:
                with anyio.move_on_after(0) as scope:
                    await _add(writer, "b", np.zeros(4 * MB, np.float32))
                assert scope.cancelled_caught
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(stream_st.UsageError, match="aborted"):  # a write says why too
        await _add(writer, "c", np.ones(4, np.float32))


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
async def test_abort_by_the_user(tmp_path: Path, kind: str) -> None:
    """``abort()`` leaves nothing, and the close then raises WriterError saying so (as
    open_writer's does), where it said nothing; ``abort()`` once committed does nothing, where
    it removed the committed shards under the index."""
    with pytest.raises(stream_st.WriterError, match=r"aborted by abort\(\)"):
        async with _writer(kind, tmp_path / "out") as writer:
            await _add(writer, "a", np.ones(4, np.float32))
            await writer.abort()
    assert list(tmp_path.iterdir()) == []
    async with _writer(kind, tmp_path / "out") as writer:
        await _add(writer, "a", np.ones(4, np.float32))
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    await writer.abort()
    await writer.aclose()  # committed: nothing to do
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == written


def _index_of(kind: str, directory: Path) -> Path:
    name = "model.safetensors.index.json" if kind == "checkpoint" else "dataset_manifest.json"
    return directory / name


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
def test_writes_from_tasks_at_once_each_land_whole(tmp_path: Path, kind: str, backend: str) -> None:
    """Tasks writing to one writer at once (three tensors a shard): every tensor lands whole and
    every shard is listed, where each task that found no shard open made its own (the last one
    kept, the others never sealed nor listed), tensors of one shard were written at the same
    offset, over each other, and the commit said nothing."""
    arrays = tensors(8, MB // 3)

    async def main() -> Arrays:
        async with _writer(kind, tmp_path) as writer, anyio.create_task_group() as group:
            for name, array in arrays.items():
                group.start_soon(_add, writer, name, array)
        return await read_all(_index_of(kind, tmp_path))

    got = anyio.run(main, backend=backend)
    assert sorted(got) == sorted(arrays)
    if backend == "asyncio":  # tasks begin in the order they were started (trio's vary)
        assert list(got) == list(arrays)
    for name, array in arrays.items():
        assert np.array_equal(got[name], array)
    if kind == "dataset":
        manifest = json.loads(_index_of(kind, tmp_path).read_text())
        assert manifest["total_samples"] == len(arrays)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_batches_from_tasks_at_once_each_take_a_shard(tmp_path: Path, backend: str) -> None:
    """Batches of a dataset written by tasks at once each take a shard of their own, every one
    listed: the manifest counted one batch's samples of four."""

    async def main() -> None:
        async with open_dataset_writer(tmp_path) as writer, anyio.create_task_group() as group:
            for value in range(4):
                batch = {"x": np.full((1000, 4), value, np.float32)}
                group.start_soon(writer.write_batch, batch, 1000)

    anyio.run(main, backend=backend)
    manifest = json.loads(_index_of("dataset", tmp_path).read_text())
    assert manifest["total_samples"] == 4000
    shards = manifest["shards"]
    columns = [reference_numpy.load_file(str(tmp_path / s["shard_path"]))["x"] for s in shards]
    assert sorted(int(column[0, 0]) for column in columns) == [0, 1, 2, 3]
    for column in columns:
        assert column.shape == (1000, 4) and (column == column[0, 0]).all()


def _gate(monkeypatch: pytest.MonkeyPatch) -> tuple[anyio.Event, anyio.Event]:
    """Hold every shard write (``FileSink.write_at``) until the second event is set; the first
    is set once one is held."""
    held, go = anyio.Event(), anyio.Event()
    write_at = FileSink.write_at

    async def gated(sink: FileSink, offset: int, data: memoryview) -> None:
        held.set()
        await go.wait()
        await write_at(sink, offset, data)

    monkeypatch.setattr(FileSink, "write_at", gated)
    return held, go


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
def test_a_close_with_writes_in_flight_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, backend: str
) -> None:
    """A close while other tasks' writes are in flight (one writing, one waiting its turn)
    aborts the writer and raises WriterError, as open_writer's does with tensors not written
    whole, where it committed a checkpoint lacking them; the waiting write then says why. A
    write cancelled while it waits its turn aborts the writer, as one cancelled while it writes
    does."""
    one = np.ones(4, np.float32)

    async def main() -> list[Exception]:
        with anyio.fail_after(10):  # a close let through waits for the held write for ever
            return await both()

    async def both() -> list[Exception]:
        waiting: list[Exception] = []

        async def first(writer: Any) -> None:
            with contextlib.suppress(stream_st.SafetensorsError):  # its shard thrown away
                await _add(writer, "a", one)

        async def second(writer: Any) -> None:
            try:
                await _add(writer, "b", one)
            except stream_st.UsageError as exc:
                waiting.append(exc)

        writer = _writer(kind, tmp_path / "closed")
        held, go = _gate(monkeypatch)
        async with anyio.create_task_group() as group:
            group.start_soon(first, writer)
            await held.wait()
            group.start_soon(second, writer)
            await anyio.wait_all_tasks_blocked()
            with pytest.raises(stream_st.WriterError, match=r"2 write\(s\) .* in flight"):
                await writer.aclose()
            go.set()
        writer = _writer(kind, tmp_path / "cancelled")
        held, go = _gate(monkeypatch)
        async with anyio.create_task_group() as group:
            group.start_soon(first, writer)
            await held.wait()
            with anyio.move_on_after(0) as scope:
                await _add(writer, "b", one)
            assert scope.cancelled_caught
            go.set()
        with pytest.raises(stream_st.WriterError, match="aborted"):
            await writer.aclose()
        return waiting

    waiting = anyio.run(main, backend=backend)
    assert [str(exc) for exc in waiting] == [
        "the write was aborted (WriterError('the writer closed while 2 write(s) of other tasks "
        "were in flight: nothing was committed; let every write end before closing the "
        "writer')); no shard was committed"
    ]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
def test_a_write_while_the_writer_closes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, backend: str
) -> None:
    """A write begun while the writer commits is refused (it changed the shard being sealed);
    a second close meanwhile waits for the first, which commits once."""

    async def main() -> Arrays:
        writer = _writer(kind, tmp_path)
        await _add(writer, "a", np.ones(4, np.float32))
        held, go = _gate(monkeypatch)
        with anyio.fail_after(10):  # a write let through waits for the held close for ever
            await closing(writer, held, go)
        return await read_all(_index_of(kind, tmp_path))

    async def closing(writer: Any, held: anyio.Event, go: anyio.Event) -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(writer.aclose)
            await held.wait()  # the close writes the shard's header
            with pytest.raises(stream_st.UsageError, match="the writer is closing"):
                await _add(writer, "b", np.ones(4, np.float32))
            group.start_soon(writer.aclose)
            await anyio.wait_all_tasks_blocked()
            go.set()

    assert list(anyio.run(main, backend=backend)) == ["a"]


@pytest.mark.parametrize(
    "prefix", ["", " ", " model", "model ", "a\nb", "../up", "sub/dir", "a:b", "a#b", "~m"]
)
async def test_a_prefix_that_is_no_plain_file_name_is_refused(tmp_path: Path, prefix: str) -> None:
    """Before anything is written: such a prefix gave a hidden index (""), names with a newline,
    a write that failed into a missing folder, or shards the index reader refuses."""
    with pytest.raises(stream_st.UsageError, match="prefix must be a plain file name"):
        open_sharded_writer(tmp_path / "ckpt", max_shard_size=100, prefix=prefix)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize(
    "prefix", [".0123abcd.partial.model", ".0123abcd.partial", "..89abcdef.partial.m"]
)
async def test_a_prefix_making_held_names_is_refused(tmp_path: Path, prefix: str) -> None:
    """Before anything is written: its shards and index had the names a writer holds until its
    commit (.<8 hex digits>.partial.<name>), and the next writer in the folder removed the
    committed checkpoint as a killed writer's leftovers. A prefix near it is taken and kept."""
    with pytest.raises(stream_st.UsageError, match="a writer holds until its commit"):
        open_sharded_writer(tmp_path, max_shard_size=100, prefix=prefix)
    assert list(tmp_path.iterdir()) == []
    near = ".0123ABCD.partial.model"  # not hexadecimal as a writer writes it: never swept
    async with open_sharded_writer(tmp_path, max_shard_size=100, prefix=near) as w:
        await w.write("a", np.ones(4))
        await w.write("b", np.ones(40))
    committed = sorted(p.name for p in tmp_path.iterdir())
    async with open_sharded_writer(tmp_path, max_shard_size=MB, prefix="other") as w:
        await w.write("c", np.ones(4))
    kept = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(near))
    assert len(committed) == 3 and kept == committed


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"prefix": None}, stream_st.ArgumentTypeError, "prefix must be a string, got NoneType"),
        ({"metadata": 5}, stream_st.UsageError, "metadata must be a mapping of strings"),
        ({"metadata": {"k": 1}}, stream_st.HeaderError, "to strings; got 'k': int"),
        # a key not a string was shown as if its value's type were wrong ("got 1: str")
        ({"metadata": {1: "v"}}, stream_st.HeaderError, "to strings; got a key of type int, 1"),
    ],
)
async def test_a_sharded_writer_checks_its_arguments_first(
    tmp_path: Path, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    """prefix=None committed None.safetensors and its index, then failed with a bare TypeError;
    metadata that is no mapping was a bare TypeError, as save does not raise for it."""
    with pytest.raises(error, match=message):
        async with open_sharded_writer(tmp_path / "ckpt", max_shard_size=100, **options) as w:
            await w.write("x", np.zeros(3, np.float32))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("value", ["no", 0, None])
async def test_generate_index_takes_a_bool_alone(tmp_path: Path, value: object) -> None:
    """As fsync= does: "no" was taken by its truth value and wrote _tensor_index.parquet."""
    with pytest.raises(stream_st.ArgumentTypeError, match="generate_index must be True or False"):
        open_dataset_writer(tmp_path / "data", generate_index=value)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


async def test_writers_closed_with_nothing_written(tmp_path: Path) -> None:
    """Into a directory that does not exist yet, as when tensors are written: a checkpoint of
    no tensor, a dataset of one empty shard (the layout's manifest lists at least one)."""
    async with open_sharded_writer(tmp_path / "ckpt", max_shard_size=1000):
        pass
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    assert json.loads(index.read_text())["weight_map"] == {}
    assert [item async for item in stream_st.open_stream(index)] == []
    async with open_dataset_writer(tmp_path / "a" / "data", generate_index=True):
        pass
    manifest = json.loads((tmp_path / "a" / "data" / "dataset_manifest.json").read_text())
    assert manifest["total_samples"] == 0 and len(manifest["shards"]) == 1
    shard = tmp_path / "a" / "data" / manifest["shards"][0]["shard_path"]
    assert reference_numpy.load_file(str(shard)) == {}
    assert (tmp_path / "a" / "data" / "_tensor_index.parquet").is_dir()


async def test_a_failed_dataset_write_keeps_the_old_index(tmp_path: Path) -> None:
    data = tmp_path / "data"
    async with open_dataset_writer(data, generate_index=True) as old:
        await old.write_batch({"x": np.zeros((2, 3), np.float32)}, samples=2)
    index = data / "_tensor_index.parquet"
    before = {p.name: p.read_bytes() for p in index.iterdir()}
    with pytest.raises(ZeroDivisionError):
        async with open_dataset_writer(data, generate_index=True) as new:
            await new.write_batch({"x": np.ones((4, 3), np.float32)}, samples=4)
            1 / 0  # noqa: B018
    assert {p.name: p.read_bytes() for p in index.iterdir()} == before
    async with open_dataset_writer(data, generate_index=True) as new:
        await new.write_batch({"x": np.ones((4, 3), np.float32)}, samples=4)
    assert {p.name for p in index.iterdir()} != set(before)
    assert sorted(p.name for p in data.iterdir() if p.name.startswith(".")) == []


async def test_writers_take_arrays_as_save_does(tmp_path: Path) -> None:
    """A torch tensor of any dtype (BF16, F8) and a Parameter are written as ``save`` writes
    them; what numpy cannot make an array of (a ragged list) is a UsageError naming it."""
    torch = pytest.importorskip("torch")
    given = {
        "bf16": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16),
        "f8": torch.ones(2, 3).to(torch.float8_e4m3fn),
        "param": torch.nn.Parameter(torch.ones(2, 3)),
    }
    async with open_sharded_writer(tmp_path / "ckpt", max_shard_size=MB) as w:
        for name, value in given.items():
            await w.write(name, value)
        with pytest.raises(stream_st.UsageError, match="'ragged'"):
            await w.write("ragged", [[1, 2], [3]])
    columns = {name: value for name, value in given.items() if name != "f8"}  # see below
    async with open_dataset_writer(tmp_path / "data", target_shard_size=MB) as d:
        await d.write_batch(columns, samples=2)
        with pytest.raises(stream_st.UsageError, match="'ragged'"):
            await d.write_batch({"ragged": [[1, 2], [3]]}, samples=2)
    for index, written in (
        ("ckpt/model.safetensors.index.json", given),
        ("data/dataset_manifest.json", columns),
    ):
        got: dict[str, Any] = await read_all(tmp_path / index, framework="pt")
        for name, value in written.items():
            assert got[name].dtype == value.dtype
            assert torch.equal(got[name].float(), value.detach().float())


async def test_a_float4_tensor_is_written_as_f4_as_save_writes_it(tmp_path: Path) -> None:
    """A torch ``float4_e2m1fn_x2`` tensor, whose array holds its packed bytes, was recorded as
    U8 of the packed shape in the shard and taken as a U8 column by the dataset writer: it is F4
    with the last dimension doubled, as ``save`` and the reference write it, and F4 is not a
    dtype the manifest's schema records."""
    torch = pytest.importorskip("torch")
    packed = torch.tensor([[0x12, 0x34], [0x56, 0x78]], dtype=torch.uint8)
    value = packed.view(torch.float4_e2m1fn_x2)
    await stream_st.save(tmp_path / "single.safetensors", {"w": value})
    async with open_sharded_writer(tmp_path / "ckpt", max_shard_size=MB) as w:
        await w.write("w", value)
        with pytest.raises(stream_st.UsageError, match="0-d"):
            await w.write("scalar", torch.zeros((), dtype=torch.uint8).view(value.dtype))
    for path in ("single.safetensors", "ckpt/model.safetensors"):
        header = await stream_st.read_header(tmp_path / path)
        assert (header["w"].dtype, header["w"].shape) == ("F4", (2, 4))
    index = json.loads((tmp_path / "ckpt/model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 4
    got: dict[str, Any] = await read_all(
        tmp_path / "ckpt/model.safetensors.index.json", framework="pt"
    )
    assert got["w"].dtype == value.dtype
    assert torch.equal(got["w"].view(torch.uint8), packed)
    async with open_dataset_writer(tmp_path / "data") as d:
        with pytest.raises(stream_st.DtypeError, match="'x' is F4"):
            await d.write_batch({"x": value}, samples=2)
        await d.write_batch({"x": packed}, samples=2)
    manifest = json.loads((tmp_path / "data/dataset_manifest.json").read_text())
    assert manifest["schema"] == {"x": {"dtype": "U8", "shape": [2, 2]}}


async def test_the_dataset_writer_refuses_dtypes_its_manifest_cannot_record(
    tmp_path: Path,
) -> None:
    """BOOL and F8 columns were recorded in dataset_manifest.json's schema, whose dtypes the
    layout's manifest schema (``tests/uses/dataset_manifest.schema.json``) does not allow."""
    torch = pytest.importorskip("torch")
    layout = json.loads(Path(__file__).parents[1].joinpath(LAYOUT).read_text())
    entry = layout["properties"]["schema"]["additionalProperties"]
    assert list(MANIFEST_DTYPES) == entry["properties"]["dtype"]["enum"]
    async with open_dataset_writer(tmp_path) as d:
        for code, value in (
            ("BOOL", np.ones((2, 3), bool)),
            ("F8_E4M3", torch.ones(2, 3).to(torch.float8_e4m3fn)),
        ):
            with pytest.raises(stream_st.DtypeError, match=rf"'{code}' is {code}.*U8"):
                await d.write_batch({"x": np.zeros(2, np.uint8), code: value}, samples=2)
        await d.write_batch({"x": np.ones(2, np.uint8)}, samples=2)
    manifest = json.loads((tmp_path / "dataset_manifest.json").read_text())
    assert manifest["schema"] == {"x": {"dtype": "U8", "shape": [2]}}


async def test_a_refused_batch_records_nothing_in_the_schema(tmp_path: Path) -> None:
    """A batch refused for any column (here its second) adds none of its columns to the
    manifest's schema; a batch of samples but no tensor is refused (its shard would count
    samples it does not hold)."""
    async with open_dataset_writer(tmp_path, target_shard_size=MB) as d:
        with pytest.raises(stream_st.DtypeError):
            await d.write_batch({"a": np.zeros(2, np.int64), "b": np.array(["x", "y"])}, 2)
        with pytest.raises(stream_st.UsageError, match="no tensor"):
            await d.write_batch({}, 5)
        await d.write_batch({}, 0)
        await d.write_batch({"b": np.arange(2, dtype=np.int64)}, 2)
    manifest = json.loads((tmp_path / "dataset_manifest.json").read_text())
    assert manifest["schema"] == {"b": {"dtype": "I64", "shape": [2]}}
    assert manifest["total_samples"] == 2


async def test_every_batch_of_a_dataset_holds_the_same_columns(tmp_path: Path) -> None:
    """A batch of other columns joined the shard of the one before: the manifest counted 8
    samples in a shard of 4 rows. It is refused, as a batch after KV rows and KV rows after a
    batch are; nothing of it is written and the writer goes on."""
    async with open_dataset_writer(tmp_path / "batches") as d:
        await d.write_batch({"image": np.zeros((4, 2), np.float32)}, 4)
        for other, samples in (({"label": np.arange(4)}, 4), ({"label": np.arange(1)}, 1)):
            with pytest.raises(
                stream_st.UsageError, match=r"columns \(\['label'\]\) are not .*'image'"
            ):
                await d.write_batch(other, samples)
        await d.write_batch({"image": np.ones((3, 2), np.float32)}, 3)
    manifest = json.loads((tmp_path / "batches" / "dataset_manifest.json").read_text())
    assert [s["samples_count"] for s in manifest["shards"]] == [4, 3]
    assert list(manifest["schema"]) == ["image"]
    async with open_dataset_writer(tmp_path / "kv") as d:
        await d.write_batch({"a__x": np.zeros(3)}, 1)
        await d.write_batch({"b__x": np.zeros(2)}, 1)  # KV rows: a name's tensors a group
        with pytest.raises(stream_st.UsageError, match="after KV-mode rows"):
            await d.write_batch({"a__x": np.zeros((4, 3))}, 4)
    manifest = json.loads((tmp_path / "kv" / "dataset_manifest.json").read_text())
    assert manifest["total_samples"] == 2


async def test_every_batch_of_a_column_holds_rows_of_one_dtype_and_shape(
    tmp_path: Path,
) -> None:
    """A batch whose column was of another dtype or row shape than the first batch's was
    written: the manifest's schema said F32 [4, 2] of a shard holding I64 [3, 5], and readers
    refused the dataset. It is refused, nothing of it written (a last batch of one sample
    included); a batch of other rows alike is taken, and so are KV rows of any shape."""
    async with open_dataset_writer(tmp_path / "batches") as d:
        await d.write_batch({"x": np.ones((4, 2), np.float32), "y": np.zeros(4, np.int64)}, 4)
        for x, samples, why in (
            (np.ones((3, 2), np.int64), 3, r"'x' is I64 rows of shape \[2\], .*F32 rows"),
            (np.ones((3, 5), np.float32), 3, r"'x' is F32 rows of shape \[5\], .*shape \[2\]"),
            (np.ones((1, 2, 1), np.float32), 1, r"'x' is F32 rows of shape \[2, 1\]"),
        ):
            with pytest.raises(stream_st.UsageError, match=why):
                await d.write_batch({"x": x, "y": np.zeros(samples, np.int64)}, samples)
        await d.write_batch({"x": np.ones((3, 2), np.float32), "y": np.zeros(3, np.int64)}, 3)
    manifest = json.loads((tmp_path / "batches" / "dataset_manifest.json").read_text())
    assert manifest["schema"] == {
        "x": {"dtype": "F32", "shape": [4, 2]},
        "y": {"dtype": "I64", "shape": [4]},
    }
    assert [s["samples_count"] for s in manifest["shards"]] == [4, 3]
    assert not (await describe_dataset(tmp_path / "batches")).kv
    async with open_dataset_writer(tmp_path / "kv") as d:
        await d.write_batch({"a__x": np.zeros(3, np.float32)}, 1)
        await d.write_batch({"b__x": np.zeros((2, 2), np.int64)}, 1)
    assert (await describe_dataset(tmp_path / "kv")).kv


async def test_a_last_batch_of_one_sample_is_a_batch(tmp_path: Path) -> None:
    """Once batches of a dataset's columns were taken, a group of them with 1 sample (or as
    many as its columns) is a batch too, its rows checked: one of 7 rows for 2 samples was
    taken as KV rows, and the dataset was then read as KV rows."""
    async with open_dataset_writer(tmp_path) as d:
        await d.write_batch({"x": np.zeros((4, 3)), "y": np.zeros(4)}, 4)
        for rows, samples in ((7, 2), (5, 1)):
            with pytest.raises(stream_st.UsageError, match="'y'"):
                await d.write_batch({"x": np.zeros((samples, 3)), "y": np.zeros(rows)}, samples)
        await d.write_batch({"x": np.zeros((1, 3)), "y": np.zeros(1)}, 1)
    manifest = json.loads((tmp_path / "dataset_manifest.json").read_text())
    assert manifest["total_samples"] == 5
    assert not (await describe_dataset(tmp_path)).kv


async def test_a_dataset_written_again_leaves_no_earlier_shard(tmp_path: Path) -> None:
    """The earlier dataset's shards stayed beside the new manifest; other files stay."""
    (tmp_path / "notes.txt").write_text("kept")
    for rows in (3, 5):
        async with open_dataset_writer(tmp_path, target_shard_size=1) as d:
            for _ in range(rows - 2):
                await d.write_batch({"x": np.arange(rows)}, rows)
    manifest = json.loads((tmp_path / "dataset_manifest.json").read_text())
    listed = [s["shard_path"] for s in manifest["shards"]]
    assert len(listed) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*listed, "dataset_manifest.json", "notes.txt"]
    )


async def test_a_shards_padded_header_stays_within_the_readers_limit(tmp_path: Path) -> None:
    """The room left for a shard's header (twice its first group's) was never capped: metadata
    of 60 MB, which save writes, gave a shard whose padded header (120 MB) no reader takes, and
    the writer reported success."""
    metadata = {"notes": "x" * 60_000_000}
    async with open_sharded_writer(tmp_path / "ok", metadata=metadata) as w:
        await w.write("a", np.ones(2, np.float32))
    shard = tmp_path / "ok" / "model.safetensors"
    header = await stream_st.read_header(shard)
    assert header.data_start <= 8 + DEFAULT_MAX_HEADER_SIZE
    assert reference_numpy.load_file(str(shard))["a"].tolist() == [1.0, 1.0]


async def test_an_index_readers_refuse_is_not_written(tmp_path: Path) -> None:
    """An index over the MAX_INDEX_SIZE bytes readers take was committed (readers then refused
    the checkpoint): metadata that alone passes it is refused when the writer is made, an index
    that passes it with its weight map at the close, nothing left either way."""
    with pytest.raises(stream_st.WriterError, match=r"model\.safetensors\.index\.json would be"):
        open_sharded_writer(tmp_path / "ckpt", metadata={"notes": "x" * MAX_INDEX_SIZE})
    metadata = {"notes": "x" * (MAX_INDEX_SIZE - 1000)}
    with pytest.raises(stream_st.WriterError, match=f"over the {MAX_INDEX_SIZE} bytes"):
        async with open_sharded_writer(tmp_path / "ckpt", metadata=metadata) as w:
            await w.write("t" * 2000, np.ones(2, np.float32))
    assert not (tmp_path / "ckpt").exists()


async def test_a_digest_record_in_metadata_is_left_out_without_checksums(tmp_path: Path) -> None:
    """Metadata copied from a checksummed file carries its digests: the sharded writer kept
    them (in every shard and the index) where save leaves them out, and the new checkpoint then
    failed its own integrity check when loaded. Other keys stay."""
    source = tmp_path / "base.safetensors"
    await stream_st.save(source, {"w": np.ones(4, np.float32)}, metadata={"k": "v"}, checksums=True)
    metadata = dict((await stream_st.read_header(source)).metadata)
    metadata["stream_st.digestion"] = "mine"  # not the writer's own: kept
    assert "stream_st.digest:w" in metadata
    async with open_sharded_writer(tmp_path / "ckpt", metadata=metadata) as w:
        await w.write("w", np.full(4, 2, np.float32))
    kept = {"k": "v", "stream_st.digestion": "mine"}
    assert (await stream_st.read_header(tmp_path / "ckpt" / "model.safetensors")).metadata == {
        "format": "pt",
        **kept,
    }
    index = tmp_path / "ckpt" / "model.safetensors.index.json"
    assert json.loads(index.read_text())["metadata"] == {"total_size": 16, **kept}
    assert (await stream_st.load(index))["w"].tolist() == [2.0] * 4


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
@pytest.mark.parametrize(
    ("folder", "message"),
    [
        ("{tmp}/a\0b", r"invalid path '.*a\\x00b': embedded null byte"),
        ("file://{tmp}/a%00b", r"invalid path '.*a\\x00b': embedded null byte"),
        ("", "the folder is an empty path"),
    ],
    ids=["nul", "nul-url", "empty"],
)
async def test_a_folder_no_file_system_takes_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, folder: str, message: str
) -> None:
    """A NUL in the folder let a bare ValueError escape at the first write (and from the
    clean-up after it); an empty path wrote into the current directory, where save("") is
    refused. Both are a UsageError, as save gives, before anything is written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(stream_st.UsageError, match=message):
        async with _writer(kind, folder.format(tmp=tmp_path)) as writer:
            await _add(writer, "a", np.ones(2, np.float32))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["checkpoint", "dataset"])
@pytest.mark.parametrize("given", ["of zeros", "of another name", "no values"])
async def test_checksums_takes_no_digests_to_check(tmp_path: Path, kind: str, given: str) -> None:
    """checksums=Digests(...), whose values open_writer and save check the bytes written
    against, was taken for its algorithm alone: ones were committed under digests of zeros, or
    of a tensor never written. It is refused, saying what to give, before anything is written;
    another wrong value no longer offers a Digests either."""
    ones = np.ones(4, np.float32)
    digests = {
        "of zeros": stream_st.Digests.compute({"w": np.zeros(4, np.float32)}),
        "of another name": stream_st.Digests.compute({"not_written": ones}),
        "no values": stream_st.Digests("sha256"),
    }[given]
    opened = open_sharded_writer if kind == "checkpoint" else open_dataset_writer
    wrong: Any = digests
    with pytest.raises(stream_st.ArgumentTypeError, match=r"give checksums=True or an algorithm"):
        async with opened(tmp_path / "out", checksums=wrong) as writer:
            await _add(writer, "w", ones.reshape(1, 4))
    wrong = 1
    with pytest.raises(
        stream_st.UsageError,
        match=r"^checksums must be True, False, or an algorithm name, got int$",
    ):
        opened(tmp_path / "out", checksums=wrong)
    assert list(tmp_path.iterdir()) == []
