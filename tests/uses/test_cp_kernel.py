"""``cp`` of a local file to a local file, tensors as they are: the kernel copies the data
(``copy_file_range``), none of it through the process; the bytes, the read's figures, the
progress and the failures are those of the copy that reads and writes them."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import TruncatedStreamError
from stream_st.core.layout import TensorSpec
from stream_st.reader.caps import Caps, using_caps
from stream_st.tools.cp import cp, mirror
from stream_st.transports.file import sink

Array = np.ndarray[Any, Any]


def tensors() -> dict[str, Array]:
    rng = np.random.default_rng(5)
    return {
        "a": rng.standard_normal((300, 70)).astype(np.float32),
        "b": np.arange(10_001, dtype=np.int16),
        "c": rng.standard_normal(5).astype(np.float16),
        "empty": np.zeros((0, 3), np.float32),
    }


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "in.safetensors"
    reference_numpy.save_file(tensors(), str(path), metadata={"k": "v"})
    return path


@pytest.fixture
def kernel_copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte count of every ``copy_file_range`` call (each still made)."""
    seen: list[int] = []
    real = os.copy_file_range

    def copy_file_range(src: int, dst: int, count: int, *args: Any) -> int:
        seen.append(count)
        return real(src, dst, count, *args)

    monkeypatch.setattr(os, "copy_file_range", copy_file_range)
    return seen


async def test_a_local_copy_goes_through_the_kernel(
    source: Path, tmp_path: Path, kernel_copies: list[int]
) -> None:
    target = tmp_path / "out.safetensors"
    progress: list[tuple[int, int]] = []
    copy = await cp(source, target, progress=lambda done, count: progress.append((done, count)))
    assert target.read_bytes() == source.read_bytes()
    header = await stream_st.read_header(source)
    assert sum(kernel_copies) == header.data_size  # every data byte, by the kernel
    assert copy.converted == 0 and copy.load.tensors == 4
    assert copy.load.bytes_read == source.stat().st_size  # the header and every tensor
    assert progress[-1] == (header.data_size, 4) and len(progress) == 4


async def test_include_copies_only_the_tensors_chosen(
    source: Path, tmp_path: Path, kernel_copies: list[int]
) -> None:
    by_kernel, by_reading = tmp_path / "k.safetensors", tmp_path / "r.safetensors"
    await cp(source, by_kernel, include=["c", "a"])
    assert kernel_copies
    await cp(source.read_bytes(), by_reading, include=["c", "a"])  # read and written
    assert by_kernel.read_bytes() == by_reading.read_bytes()
    assert sorted(reference_numpy.load_file(str(by_kernel))) == ["a", "c"]


@pytest.mark.parametrize("failure", ["exdev", "missing"])
async def test_without_the_kernel_copy_the_bytes_are_read_and_written(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    """Another file system on an old kernel (EXDEV), or a platform without the call."""
    if failure == "missing":
        monkeypatch.delattr(os, "copy_file_range")
    else:

        def refuse(*args: Any) -> int:
            raise OSError(errno.EXDEV, "Invalid cross-device link")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    monkeypatch.setattr(sink, "COPY_CALL", 4096)  # several reads and writes a tensor
    target = tmp_path / "out.safetensors"
    await cp(source, target)
    assert target.read_bytes() == source.read_bytes()


async def test_converted_and_checksummed_copies_read_the_bytes(
    source: Path, tmp_path: Path, kernel_copies: list[int]
) -> None:
    """A tensor converted, digests asked for, or a source's digests to verify: the bytes are
    needed in the process, so nothing goes by the kernel."""
    await cp(source, tmp_path / "half.safetensors", dtype="f16")
    await cp(source, tmp_path / "summed.safetensors", checksums=True)
    await cp(tmp_path / "summed.safetensors", tmp_path / "verified.safetensors")
    assert kernel_copies == []
    got = reference_numpy.load_file(str(tmp_path / "verified.safetensors"))
    for name, array in tensors().items():
        assert np.array_equal(got[name], array)


async def test_a_source_shorter_than_its_header_says_leaves_nothing(
    source: Path, tmp_path: Path
) -> None:
    target = tmp_path / "out.safetensors"
    fd = os.open(source, os.O_RDONLY)
    try:
        spec = TensorSpec("x", "F32", (1000,))
        writer = stream_st.open_writer(target, [spec])
        with pytest.raises(TruncatedStreamError, match="while reading tensor 'x'"):
            async with writer:
                at = source.stat().st_size - 100  # 100 of the 4,000 bytes there
                await writer.copy_from_file("x", fd, at, str(source))
    finally:
        os.close(fd)
    assert not target.exists() and os.listdir(tmp_path) == ["in.safetensors"]


async def test_a_destination_not_a_local_file_is_written_from_the_stream(
    source: Path, tmp_path: Path, kernel_copies: list[int]
) -> None:
    """A FIFO: ``copy_from_file`` declines (nothing done) and cp reads and writes the bytes."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    try:
        copy = await cp(source, str(fifo))
    finally:
        reader.join(timeout=30)
    assert got == [source.read_bytes()] and kernel_copies == []
    assert copy.load.tensors == 4


async def test_include_of_a_tensor_the_source_lacks_is_refused_before_any_copy(
    source: Path, tmp_path: Path, kernel_copies: list[int]
) -> None:
    target = tmp_path / "out.safetensors"
    with pytest.raises(stream_st.TensorNotFoundError, match=r"include= names tensors not in"):
        await cp(source, target, include=["a", "nope"])
    assert kernel_copies == [] and not target.exists()


async def test_caps_refuse_as_the_reading_way_does(source: Path, tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    with (
        using_caps(Caps.of(1024, None)),  # as the command's --max-tensor-bytes
        pytest.raises(stream_st.SafetensorsError, match="max_tensor_bytes"),
    ):
        await cp(source, target)
    assert not target.exists()


async def test_a_damaged_digest_record_is_an_error_not_copied_away(tmp_path: Path) -> None:
    """Tensor digests without the algorithm's key: the reading way says so."""
    source, target = tmp_path / "in.safetensors", tmp_path / "out.safetensors"
    reference_numpy.save_file(tensors(), str(source), metadata={"stream_st.digest:a": "00" * 16})
    with pytest.raises(stream_st.IntegrityError, match=r"no 'stream_st\.digest' key"):
        await cp(source, target)
    assert not target.exists()


@pytest.mark.parametrize(
    ("fd", "at", "error"),
    [
        ("5", 0, stream_st.ArgumentTypeError),
        (None, 0, stream_st.ArgumentTypeError),
        (0, "80", stream_st.ArgumentTypeError),
        (0, 80.0, stream_st.ArgumentTypeError),
        (0, -4, stream_st.UsageError),
    ],
)
async def test_copy_from_file_refuses_bad_arguments(
    tmp_path: Path, fd: Any, at: Any, error: type[Exception]
) -> None:
    target = tmp_path / "out.safetensors"
    writer = stream_st.open_writer(target, [TensorSpec("x", "F32", (4,))])
    with pytest.raises(error):
        async with writer:
            await writer.copy_from_file("x", fd, at)
    assert os.listdir(tmp_path) == []


async def test_copy_from_file_refuses_the_writers_own_file(source: Path, tmp_path: Path) -> None:
    """A descriptor its owner closed, its number then taken by the writer's own file: copied
    onto itself the file kept its zeros and the copy said True. Refused, nothing left."""
    target = tmp_path / "out.safetensors"
    fd = os.open(source, os.O_RDONLY)
    os.close(fd)  # the caller's bug: the number is free again
    writer = stream_st.open_writer(target, [TensorSpec("x", "F32", (4,))])
    with pytest.raises(stream_st.UsageError, match="it is the file being written"):
        async with writer:
            assert os.path.sameopenfile(fd, writer._sink._fd)  # type: ignore[union-attr]
            await writer.copy_from_file("x", fd, 0)
    assert os.listdir(tmp_path) == ["in.safetensors"]


async def test_copy_from_file_refuses_what_is_not_a_regular_file(tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    read, write = os.pipe()
    folder = os.open(tmp_path, os.O_RDONLY)
    closed = os.dup2(read, 900)  # a number no file the writer opens takes (the lowest free)
    os.close(closed)
    try:
        os.write(write, b"\0" * 16)
        for fd, why in (
            (read, "not a regular file"),
            (folder, "not a regular file"),
            (closed, "not an open file"),
        ):
            writer = stream_st.open_writer(target, [TensorSpec("x", "F32", (4,))])
            with pytest.raises(stream_st.UsageError, match=f"descriptor {fd}: .*{why}"):
                async with writer:
                    await writer.copy_from_file("x", fd, 0)
    finally:
        for fd in (read, write, folder):
            os.close(fd)
    assert os.listdir(tmp_path) == []


async def test_a_file_system_whose_kernel_copy_says_0_is_read_instead(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "copy_file_range", lambda *args: 0)
    target = tmp_path / "out.safetensors"
    await cp(source, target)
    assert target.read_bytes() == source.read_bytes()


async def test_a_sharded_checkpoint_mirrored_locally_goes_through_the_kernel(
    tmp_path: Path, kernel_copies: list[int]
) -> None:
    """Every shard held until all are written (the mirror's all-or-nothing), each copied by the
    kernel all the same."""
    source, into = tmp_path / "src", tmp_path / "dst"
    async with stream_st.open_sharded_writer(source, max_shard_size=50_000) as writer:
        for name, array in tensors().items():
            await writer.write(name, array)
    index = source / "model.safetensors.index.json"
    shards = sorted(source.glob("*.safetensors"))
    assert len(shards) >= 2
    written = await mirror(str(index), str(into))
    assert len(written) == len(shards) + 1
    for shard in shards:  # the same tensors (the shard writer pads its headers, cp does not)
        got, expected = (reference_numpy.load_file(str(p)) for p in (into / shard.name, shard))
        assert got.keys() == expected.keys()
        assert all(np.array_equal(got[name], expected[name]) for name in got)
    data = [(await stream_st.read_header(shard)).data_size for shard in shards]
    assert sum(kernel_copies) == sum(data)


async def test_a_deadline_passing_during_a_kernel_copy_stops_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deadline is checked between the copy's turns, not only before each tensor: a file of
    one tensor whose copy outlasts it fails, and leaves nothing."""
    source = tmp_path / "in.safetensors"
    reference_numpy.save_file({"a": tensors()["a"]}, str(source))
    real = os.copy_file_range

    def slow(*args: Any) -> int:
        time.sleep(0.01)
        return real(*args)

    monkeypatch.setattr(os, "copy_file_range", slow)
    monkeypatch.setattr(sink, "COPY_TURN", 4096)  # tensor "a", 84,000 bytes: 21 turns
    monkeypatch.setattr(sink, "COPY_CALL", 4096)
    target = tmp_path / "out.safetensors"
    with pytest.raises(stream_st.ReadTimeoutError, match="deadline"):
        await cp(source, target, deadline=0.1)  # 21 turns of 10 ms or more
    assert os.listdir(tmp_path) == ["in.safetensors"]


async def test_copy_from_file_refuses_offsets_no_file_has(tmp_path: Path) -> None:
    target = tmp_path / "out.safetensors"
    for fd, at in ((0, 2**63), (0, 2**64), (2**40, 0)):
        writer = stream_st.open_writer(target, [TensorSpec("x", "F32", (4,))])
        with pytest.raises(stream_st.UsageError, match="no file has descriptor"):
            async with writer:
                await writer.copy_from_file("x", fd, at)
    assert os.listdir(tmp_path) == []


async def test_a_sharded_source_merged_into_one_file_is_read(
    tmp_path: Path, kernel_copies: list[int]
) -> None:
    """An index of one shard or several, merged: a sharded stream has no one file to copy
    from (it said "the stream is not open")."""
    for limit in (50_000, 10**9):  # several shards, one shard
        source = tmp_path / f"src{limit}"
        async with stream_st.open_sharded_writer(source, max_shard_size=limit) as writer:
            for name, array in tensors().items():
                await writer.write(name, array)
        target = tmp_path / f"merged{limit}.safetensors"
        await cp(str(source / "model.safetensors.index.json"), target)
        got = reference_numpy.load_file(str(target))
        assert all(np.array_equal(got[name], array) for name, array in tensors().items())
    assert kernel_copies == []


async def test_tensors_lying_together_are_copied_in_one_call(
    tmp_path: Path, kernel_copies: list[int]
) -> None:
    """Many small tensors: a run lying with no gap in the source and the copy goes in one
    kernel call (one per tensor cost a thread's round trip each); a tensor left out by
    include= breaks the run. The bytes and the progress are the reading way's."""
    source = tmp_path / "many.safetensors"
    reference_numpy.save_file({f"t{i}": np.full(3, i, np.float32) for i in range(6)}, str(source))
    chosen = ["t0", "t1", "t3", "t4", "t5"]  # t2 left out: a gap in the source
    by_kernel, by_reading = tmp_path / "k.safetensors", tmp_path / "r.safetensors"
    progress: list[tuple[int, int]] = []
    await cp(source, by_kernel, include=chosen, progress=lambda *p: progress.append(p))
    await cp(source.read_bytes(), by_reading, include=chosen)
    assert by_kernel.read_bytes() == by_reading.read_bytes()
    assert kernel_copies == [2 * 12, 3 * 12]
    assert progress == [(12 * n, n) for n in range(1, 6)]
    await cp(source, tmp_path / "all.safetensors")
    assert (tmp_path / "all.safetensors").read_bytes() == source.read_bytes()
    assert kernel_copies[2:] == [6 * 12]


async def test_a_run_copied_from_a_short_source_names_the_tensor_cut(
    tmp_path: Path,
) -> None:
    source = tmp_path / "in.bin"
    source.write_bytes(b"\0" * 20)  # x's 16 bytes and 4 of y's
    target = tmp_path / "out.safetensors"
    specs = [TensorSpec(n, "F32", (4,)) for n in ("x", "y", "z")]
    fd = os.open(source, os.O_RDONLY)
    try:
        writer = stream_st.open_writer(target, specs)
        with pytest.raises(TruncatedStreamError, match="tensor 'y'"):
            async with writer:
                await writer.copy_from_file("x", fd, 0, str(source), then=["y", "z"])
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == ["in.bin"]


@pytest.mark.parametrize(
    ("then", "error", "match"),
    [
        (["z"], stream_st.UsageError, "tensor 'z' does not follow 'x'"),
        (["y", "y"], stream_st.UsageError, "tensor 'y' does not follow 'y'"),
        ("y", stream_st.ArgumentTypeError, "then= takes a sequence of names"),
    ],
)
async def test_copy_from_file_refuses_a_run_with_a_gap(
    source: Path, tmp_path: Path, then: Any, error: type[Exception], match: str
) -> None:
    target = tmp_path / "out.safetensors"
    specs = [TensorSpec(n, "F32", (4,)) for n in ("x", "y", "z")]
    fd = os.open(source, os.O_RDONLY)
    try:
        writer = stream_st.open_writer(target, specs)
        with pytest.raises(error, match=match):
            async with writer:
                await writer.copy_from_file("x", fd, 0, then=then)
    finally:
        os.close(fd)
    assert os.listdir(tmp_path) == ["in.safetensors"]
