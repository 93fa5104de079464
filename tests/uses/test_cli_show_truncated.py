"""``stream-st show`` of a local file truncated while it runs (a training job saving a checkpoint
in place truncates it first): an error, never death by SIGBUS; and what it prints is copied out
of the file alone, the slice or a summary's edges, not the whole tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.cli import commands, main
from stream_st.transports.file.source import FileSource

from ._cli import start

TRUNCATED_AS_READ = """
import os, sys
from stream_st.cli import main
from stream_st.transports.file.mmap import FileMap

path, start, view, preadv = sys.argv[1], int(sys.argv[2]), FileMap.view, os.preadv

async def viewed(self, info, base):
    array = await view(self, info, base)
    os.truncate(path, start)
    return array

def truncating(fd, buffers, offset, *flags):
    if offset >= start and sum(map(len, buffers)) > 1:  # one byte: is it cached? (the mapping's)
        os.truncate(path, start)
    return preadv(fd, buffers, offset, *flags)

FileMap.view, os.preadv = viewed, truncating
sys.exit(main(sys.argv[3:]))
"""
"""The command, the file ``argv[1]`` truncated to its header (its data start at ``argv[2]``) as
the first tensor's bytes are read, or once its view of the file's mapping is made: before
anything is printed, every time. A writer saving a checkpoint in place truncates it so."""


@pytest.fixture
def big(tmp_path: Path) -> Path:
    """A file of one 16 MiB tensor, ``w``, float32 [2048, 2048], as the reference writes it."""
    path = tmp_path / "m.safetensors"
    values = np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)
    reference_numpy.save_file({"w": values}, str(path))
    return path


@pytest.mark.parametrize("kind", ["file", "index", "checksummed"])
@pytest.mark.parametrize("flags", [[], ["--json"], ["--slice", "1:3,5"]], ids=" ".join)
def test_show_of_a_file_truncated_under_it_is_an_error(
    big: Path, flags: list[str], kind: str
) -> None:
    """show read the values it printed through the file's mapping, and a checksummed file's
    tensor to check it: the file truncated under it killed it with SIGBUS (exit -7, nothing
    said). Now the values printed are read from the file with positioned reads, a checksummed
    tensor is read so as it is checked, and the truncation is an error (exit 2, one line). A
    sharded checkpoint's shard too."""
    source = big
    if kind == "index":
        source = big.with_name("m.safetensors.index.json")
        source.write_text(json.dumps({"metadata": {}, "weight_map": {"w": big.name}}))
    elif kind == "checksummed":
        assert main(["cp", "-q", "--checksums", str(big), str(big.with_name("c.safetensors"))]) == 0
        os.replace(big.with_name("c.safetensors"), big)
    start = 8 + int.from_bytes(big.read_bytes()[:8], "little")
    shown = [str(source), "w"]
    result = subprocess.run(
        [sys.executable, "-c", TRUNCATED_AS_READ, str(big), str(start), "show", *flags, *shown],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith("stream-st: error: ") and "stream ended" in line, line
    assert str(big) in line and "'w'" in line, line


def test_show_json_of_a_file_truncated_as_it_prints(big: Path) -> None:
    """The attacker's case: the file truncated while show --json writes the values into a pipe
    nobody reads yet. The values it prints were copied before the first was written: it ends
    as if nothing happened; never killed by a signal."""
    expected = np.arange(2048 * 2048, dtype=np.float32).reshape(2048, 2048)
    process = start("show", "--json", str(big), "w")
    assert process.stdout is not None and process.stderr is not None
    head = process.stdout.read(100_000)  # the command is printing
    os.truncate(big, 1000)
    rest = process.stdout.read()
    error = process.stderr.read()
    assert process.wait(timeout=120) == 0, (process.returncode, error)
    assert error == ""
    assert json.loads(head + rest)["values"] == expected.tolist()


def _bytes_read(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the reads of local files from now on."""
    sizes: list[int] = []
    read = FileSource.read_into_at

    async def counted(self: FileSource, offset: int, buffer: memoryview) -> int:
        sizes.append(len(buffer))
        return await read(self, offset, buffer)

    monkeypatch.setattr(FileSource, "read_into_at", counted)
    return sizes


@pytest.mark.parametrize(
    ("flags", "most"),
    [([], 1 << 17), (["--slice", "0:3"], 1 << 16), (["--slice", ":,7", "--json"], 1 << 16)],
    ids=lambda given: " ".join(given) if isinstance(given, list) else str(given),
)
def test_show_reads_what_it_prints(
    big: Path,
    flags: list[str],
    most: int,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A summary of the 16 MiB tensor reads its edges alone (four blocks of 3 x 3 values, each
    in one read of the rows it spans), a summarized slice of three rows the edges of those, a
    column its values one by one: never the whole tensor."""
    sizes = _bytes_read(monkeypatch)
    assert main(["show", "-q", *flags, str(big), "w"]) == 0
    assert capsys.readouterr().out
    assert sum(sizes) <= most, sizes


def _raw(path: Path, name: str, dtype: str, shape: list[int], data: bytes) -> None:
    """A file of one tensor of ``dtype`` (a code numpy has no type for) and ``shape``."""
    header = json.dumps({name: {"dtype": dtype, "shape": shape, "data_offsets": [0, len(data)]}})
    path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + data)


NOISE = np.random.default_rng(7).integers(0, 256, 12_000, dtype=np.uint8).tobytes()
"""Bytes for the tensors of dtypes numpy lacks."""

VECTOR = np.arange(5000, dtype=np.float32)
MATRIX = np.arange(3 * 40_000, dtype=np.int16).reshape(3, 40_000)
CUBE = np.linspace(-1, 1, 4 * 9 * 700).reshape(4, 9, 700)
SMALL = np.arange(150, dtype=np.uint64).reshape(10, 15)

CASES: list[tuple[str, Any, list[str]]] = [
    ("a", VECTOR, []),
    ("a", VECTOR, ["--slice", "::-7"]),
    ("a", VECTOR, ["--slice", "4999"]),
    ("b", MATRIX, []),
    ("b", MATRIX, ["--slice", ":,::-1000"]),
    ("b", MATRIX, ["--json", "--slice", ":,5"]),
    ("c", CUBE, []),
    ("c", CUBE, ["--slice", "...,3:9"]),
    ("c", CUBE, ["--slice", "1,2,3"]),
    ("c", CUBE, ["--slice", "2:1"]),
    ("c", CUBE, ["--json", "--slice", "0,::3"]),
    ("d", np.float32(7.5), []),
    ("e", np.zeros((0, 4), np.uint8), []),
    ("f", SMALL, []),
    ("f", SMALL, ["--slice", "20"]),
    ("f", SMALL, ["--slice", "1,2,3"]),
    ("g", ("BF16", [60, 100]), []),
    ("g", ("BF16", [60, 100]), ["--slice", "7,::9"]),
    ("h", ("F4", [40, 300]), []),
    ("h", ("F4", [40, 300]), ["--slice", "1:3,-5:"]),
    ("i", ("F6_E2M3", [100, 40]), []),
    ("i", ("F6_E2M3", [100, 40]), ["--json"]),
    ("i", ("F6_E2M3", [100, 40]), ["--slice", "0"]),
]
"""Tensors (an array, or a dtype and shape numpy has no type for) and what is shown of them."""


@pytest.mark.parametrize(
    ("name", "values", "flags"), CASES, ids=[f"{n}:{' '.join(f) or '-'}" for n, _, f in CASES]
)
def test_show_prints_the_same_as_from_fresh_memory(
    tmp_path: Path,
    name: str,
    values: Any,
    flags: list[str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """What show copies of a local file prints as the whole tensor read into fresh memory does
    (as from any other source): a summary's edges are the values numpy prints of it."""
    path = tmp_path / "m.safetensors"
    if isinstance(values, tuple):
        dtype, shape = values
        bits = {"BF16": 16, "F4": 4, "F6_E2M3": 6}[dtype]
        _raw(path, name, dtype, shape, NOISE[: int(np.prod(shape)) * bits // 8])
    else:
        reference_numpy.save_file({name: np.asarray(values)}, str(path))
    args = ["show", "-q", *flags, str(path), name]
    status = main(args)
    shown = capsys.readouterr()

    def copied(*given: Any, **options: Any) -> Any:  # every array in fresh memory
        return stream_st.open_stream(*given, **{**options, "copy": True})

    monkeypatch.setattr(commands, "open_stream", copied)
    assert main(args) == status
    assert capsys.readouterr() == shown
    assert shown.out or shown.err


async def test_a_checksummed_dataset_folder_is_read_whole_to_check(tmp_path: Path) -> None:
    """A dataset given as its folder was taken for no checksummed file, so show checked its
    tensor's digest on the mapping (a truncation meanwhile: SIGBUS); it reads it whole."""
    folder = tmp_path / "ds"
    async with stream_st.open_dataset_writer(folder, checksums=True) as writer:
        await writer.write_batch({"x": np.zeros((4, 2), np.float32)}, 4)
    assert await commands._checksummed(str(folder), {})
    plain = tmp_path / "plain"
    async with stream_st.open_dataset_writer(plain) as writer:
        await writer.write_batch({"x": np.zeros((4, 2), np.float32)}, 4)
    assert not await commands._checksummed(str(plain), {})
