"""A sharded checkpoint (or a dataset) written over an earlier one whose commit fails part way
leaves the earlier one whole. The commit removed the earlier index, renamed the new shard 1 over
the earlier shard 1, failed to rename shard 2 (an immutable file: ``EPERM``; on a network file
system ``EBUSY``, ``EIO``, ``ESTALE``), then the abort removed the new shard 1 under its final
name: the folder held neither checkpoint, no index and no shard 1. A dataset's commit removed
its earlier ``_tensor_index.parquet`` and left the new one, naming shards removed, where the
manifest then failed to take its place. Now every earlier file the commit replaces or removes
is first moved aside under a hidden name, put back where the commit fails, removed once it is
done."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
from stream_st import TransportError
from stream_st.core.shards import INDEX_NAME, MANIFEST_NAME
from stream_st.sharded.writer import open_dataset_writer, open_sharded_writer

INDEX = "model.safetensors.index.json"
SHARDS = [f"model-{number:05d}-of-00003.safetensors" for number in (1, 2, 3)]


async def _checkpoint(directory: Path, value: float) -> None:
    """Three tensors of ``value``, a shard each: ``SHARDS`` and ``INDEX``."""
    async with open_sharded_writer(directory, max_shard_size=4000) as writer:
        for number in range(3):
            await writer.write(f"t{number}", np.full(1000, value, np.float32))


async def _dataset(directory: Path, value: float, generate_index: bool) -> None:
    """Three batches of ``value``, a shard each, and the manifest (with ``generate_index``, a
    ``_tensor_index.parquet`` too)."""
    async with open_dataset_writer(
        directory, target_shard_size=4000, generate_index=generate_index
    ) as writer:
        for _ in range(3):
            await writer.write_batch({"x": np.full((10, 100), value, np.float32)}, samples=10)


def _tree(directory: Path) -> dict[str, bytes | dict[str, Any]]:
    """Every entry of ``directory`` (hidden ones too) and what it holds (a folder's, in turn)."""
    return {
        entry.name: _tree(Path(entry.path)) if entry.is_dir() else Path(entry.path).read_bytes()
        for entry in os.scandir(directory)
    }


def _failing(
    monkeypatch: pytest.MonkeyPatch, call: str, fails: Callable[[str, str], bool], code: int
) -> None:
    """``os.<call>`` (``link``, ``rename`` or ``replace``) failing with ``code`` for the source
    and destination names ``fails`` picks, as a file system refusing it would: the fault a
    rename meets on a network file system, or a file system without hard links, that a local
    folder cannot be made to give."""
    real = getattr(os, call)

    def faulty(source: Any, destination: Any, *args: Any, **kwargs: Any) -> None:
        if fails(os.fsdecode(source), os.fsdecode(destination)):
            raise OSError(code, os.strerror(code))
        real(source, destination, *args, **kwargs)

    monkeypatch.setattr(os, call, faulty)


def _new(name: str) -> Callable[[str, str], bool]:
    """Whether a rename puts a new file at ``name`` (not an earlier one back there)."""
    return lambda source, destination: destination == name and ".aside." not in source


def _aside(name: str) -> Callable[[str, str], bool]:
    """Whether a rename puts ``name``, set aside under a hidden name, back."""
    return lambda source, destination: destination == name and ".aside." in source


FAULTS: dict[str, list[tuple[str, Callable[[str, str], bool], int]]] = {
    # the rename over the earlier shard 2 refused by a network file system
    "busy": [("replace", _new(SHARDS[1]), errno.EBUSY)],
    # a file system without hard links (the earlier shards are moved aside), an immutable shard 2
    "no-links": [
        ("link", lambda source, _: source in SHARDS, errno.EPERM),
        ("rename", lambda source, _: source == SHARDS[1], errno.EPERM),
    ],
    # every shard in place, then the index refused
    "index": [("replace", _new(INDEX), errno.ESTALE)],
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_a_commit_that_fails_part_way_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    """The commit fails after the new shard 1 took the earlier one's name: the earlier
    checkpoint is there as it was, every file of it, and nothing else."""
    await _checkpoint(tmp_path, 1.0)
    before = _tree(tmp_path)
    assert sorted(before) == sorted([INDEX, *SHARDS])
    with monkeypatch.context() as patch:
        for call, fails, code in FAULTS[fault]:
            _failing(patch, call, fails, code)
        with pytest.raises(TransportError, match=os.strerror(FAULTS[fault][-1][2])):
            await _checkpoint(tmp_path, 2.0)
    assert _tree(tmp_path) == before
    loaded = await stream_st.load(tmp_path / INDEX)
    assert sorted(loaded) == ["t0", "t1", "t2"] and all((a == 1.0).all() for a in loaded.values())
    await _checkpoint(tmp_path, 2.0)  # a later commit: the new checkpoint, nothing set aside left
    assert sorted(os.listdir(tmp_path)) == sorted([INDEX, *SHARDS])
    loaded = await stream_st.load(tmp_path / INDEX)
    assert all((array == 2.0).all() for array in loaded.values())


@pytest.fixture
def immutable() -> Iterator[Callable[[Path], None]]:
    """Makes a file immutable (``chattr +i``: root, on a file system that has the flag), made
    mutable again afterwards; the test is skipped where it cannot be."""
    made: list[Path] = []

    def make(path: Path) -> None:
        chattr = shutil.which("chattr")
        if chattr is None or os.geteuid() != 0:
            pytest.skip("making a file immutable needs chattr, as root")
        if subprocess.run([chattr, "+i", path], capture_output=True, check=False).returncode:
            pytest.skip("no immutable files on this file system")
        made.append(path)

    yield make
    for path in made:
        subprocess.run(["chattr", "-i", path], check=True)


async def test_an_immutable_shard_keeps_the_previous_checkpoint(
    tmp_path: Path, immutable: Callable[[Path], None]
) -> None:
    """The earlier shard 2 immutable, as a real fault: the rename over it fails once the new
    shard 1 took the earlier one's place. The earlier checkpoint is there as it was."""
    await _checkpoint(tmp_path, 1.0)
    before = _tree(tmp_path)
    immutable(tmp_path / SHARDS[1])
    with pytest.raises(TransportError, match=os.strerror(errno.EPERM)):
        await _checkpoint(tmp_path, 2.0)
    assert _tree(tmp_path) == before
    loaded = await stream_st.load(tmp_path / INDEX)
    assert all((array == 1.0).all() for array in loaded.values())


async def test_a_checkpoint_that_cannot_be_put_back_leaves_no_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit fails, and so does putting back the earlier shard 1: the earlier index is not
    put back (it would name a new shard 1, or none), nor is a new shard left: no index, the
    state a process killed in the commit may leave, never an index naming a mix."""
    await _checkpoint(tmp_path, 1.0)
    before = _tree(tmp_path)
    with monkeypatch.context() as patch:
        _failing(patch, "replace", _new(SHARDS[1]), errno.EIO)
        _failing(patch, "replace", _aside(SHARDS[0]), errno.EIO)
        with pytest.raises(TransportError, match=os.strerror(errno.EIO)) as raised:
            await _checkpoint(tmp_path, 2.0)
    assert f"putting the earlier {SHARDS[0]} back failed too" in "".join(raised.value.__notes__)
    after = _tree(tmp_path)
    assert INDEX not in after
    for name in SHARDS:  # each earlier shard where it was, or kept aside; no new one
        assert name not in after or after[name] == before[name]
        assert before[name] in after.values()
    await _checkpoint(tmp_path, 2.0)  # a later commit: the new checkpoint, nothing else left
    assert sorted(os.listdir(tmp_path)) == sorted([INDEX, *SHARDS])


@pytest.mark.parametrize("earlier_index", [True, False], ids=["index-before", "no-index-before"])
async def test_a_dataset_whose_manifest_fails_keeps_the_previous_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, earlier_index: bool
) -> None:
    """The manifest refused once the new ``_tensor_index.parquet`` took the earlier one's place
    (or a place where none was): the earlier dataset is there as it was, its tensor index
    with it, and nothing of the new one."""
    pytest.importorskip("pyarrow")
    await _dataset(tmp_path, 1.0, earlier_index)
    before = _tree(tmp_path)
    assert (INDEX_NAME in before) == earlier_index
    with monkeypatch.context() as patch:
        _failing(patch, "replace", _new(MANIFEST_NAME), errno.EIO)
        with pytest.raises(TransportError, match=os.strerror(errno.EIO)):
            await _dataset(tmp_path, 2.0, True)
    assert _tree(tmp_path) == before
    manifest = json.loads((tmp_path / MANIFEST_NAME).read_text())
    assert sorted(shard["shard_path"] for shard in manifest["shards"]) == sorted(
        name for name in before if name.endswith(".safetensors")
    )


@pytest.mark.parametrize("kind", ["sharded", "dataset"])
@pytest.mark.parametrize("too_long", ["name", "path"])
def test_a_folder_whose_path_cannot_be_looked_at_is_a_transport_error(
    tmp_path: Path, kind: str, too_long: str
) -> None:
    """A folder of a name over 255 bytes (``ENAMETOOLONG``), or a path over ``PATH_MAX``: the
    writer's constructor raised a bare ``OSError`` looking for the folders to make, where
    :func:`~stream_st.save` raises a :class:`~stream_st.TransportError` for the same path."""
    if too_long == "name":
        folder = tmp_path / ("n" * 256) / "ck"
    else:
        folder = tmp_path.joinpath(*["d" * 200] * 25, "ck")
    opener = open_sharded_writer if kind == "sharded" else open_dataset_writer
    with pytest.raises(TransportError, match="cannot look at") as raised:
        opener(folder)
    assert os.strerror(errno.ENAMETOOLONG) in str(raised.value)
    assert os.listdir(tmp_path) == []
