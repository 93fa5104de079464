"""The sharded and dataset writers commit into, and clean up, the folder they made (or found) and
hold, never another one put at its path. Their commit looked at the folder, then linked the
files in and renamed them into place by its path: a folder put there in between took the
checkpoint. An abort after the folder was moved away removed the empty folders put at its path,
which were not the writer's. Now the renames and removals go through a descriptor of the folder
held, and a folder is removed only where it is still the one the writer made, and empty."""

from __future__ import annotations

import gc
import json
import os
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from stream_st import SourceNotFoundError, open_sharded_writer
from stream_st.core.shards import MANIFEST_NAME
from stream_st.sharded.writer import DatasetWriter, ShardedWriter

from .test_shard_writer_folder import NOTES, _move, _tree, _write, _writer
from .test_shard_writer_folder import temporaries as temporaries


def _swapping(root: Path, step: Any, left: list[str]) -> Any:
    """``step`` (a bound method of the writer) after putting another folder, someone else's, at
    the writer's path ``root/sub/ck`` (:func:`_move`), what the tree then holds in ``left``."""

    def swapped(*args: Any) -> Any:
        left.extend(_move("replaced", root, made=True))
        return step(*args)

    return swapped


def _committed(folder: Path) -> list[str]:
    """The files of the checkpoint or dataset whose index or manifest is in ``folder``, that
    one included, checked to be there."""
    names = sorted(os.listdir(folder))
    index = next(name for name in names if name.endswith(".index.json") or name == MANIFEST_NAME)
    document = json.loads((folder / index).read_text())
    if index == MANIFEST_NAME:
        shards = {shard["shard_path"] for shard in document["shards"]}
    else:
        shards = set(document["weight_map"].values())
    assert len(shards) == 2 and names == sorted([*shards, index])
    return names


@pytest.mark.usefixtures("temporaries")
@pytest.mark.parametrize("kind", ["sharded", "dataset"])
async def test_a_folder_put_in_place_after_the_close_looked_receives_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The folder moved away and another put at its path once the close found it still there,
    before the commit links the files in (as the index is written): the commit fails
    (:class:`~stream_st.SourceNotFoundError`), and neither folder holds anything of the
    writer's. The checkpoint was committed into the other folder."""
    writer = _writer(kind, tmp_path / "sub" / "ck")
    left: list[str] = []
    with pytest.raises(SourceNotFoundError, match="another directory"):
        async with writer:
            await _write(writer, 0)
            await _write(writer, 1)
            monkeypatch.setattr(writer, "_index", _swapping(tmp_path, writer._index, left))
    assert _tree(tmp_path) == left
    assert (tmp_path / "sub" / "ck" / "theirs.txt").read_text() == NOTES


@pytest.mark.usefixtures("temporaries")
@pytest.mark.parametrize("kind", ["sharded", "dataset"])
async def test_a_folder_put_in_place_as_the_commit_renames_receives_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The folder moved away and another put at its path once the commit found it still there,
    just before the shards are renamed to their final names: the renames go through the folder
    held, so the checkpoint is committed whole there, where it was moved, and the other folder
    holds nothing of it. The renames went by the path, found no shard, and the commit failed,
    leaving the shards linked in under their hidden names in the folder moved away."""
    writer = _writer(kind, tmp_path / "sub" / "ck")
    left: list[str] = []
    async with writer:
        await _write(writer, 0)
        await _write(writer, 1)
        rename = writer._rename_sealed
        monkeypatch.setattr(writer, "_rename_sealed", _swapping(tmp_path, rename, left))
    names = _committed(tmp_path / "moved" / "ck")
    assert _tree(tmp_path) == sorted(left + [f"moved/ck/{name}" for name in names])
    assert (tmp_path / "sub" / "ck" / "theirs.txt").read_text() == NOTES


async def _end(writer: ShardedWriter | DatasetWriter, how: str) -> None:
    """Abort ``writer`` as ``how`` says: its :meth:`abort`, a write that fails (the folder at its
    path is not the one it holds), or a write cancelled."""
    if how == "abort()":
        await writer.abort()
    elif how == "failure":
        with pytest.raises(SourceNotFoundError):
            await _write(writer, 1)
    else:
        with anyio.CancelScope() as scope:
            scope.cancel()
            await _write(writer, 1)
        assert scope.cancelled_caught


@pytest.mark.usefixtures("temporaries")
@pytest.mark.parametrize("kind", ["sharded", "dataset"])
@pytest.mark.parametrize("moved", ["sub", "sub/ck"])
@pytest.mark.parametrize("how", ["abort()", "failure", "cancellation", "dropped"])
async def test_an_abort_leaves_the_empty_folders_put_in_place_of_the_moved_ones(
    tmp_path: Path, kind: str, moved: str, how: str
) -> None:
    """The writer made ``sub/ck``; once it wrote a shard, ``moved`` (its folder, or the one
    above it) was moved away and empty folders, someone else's, made at ``sub/ck``. The abort
    (``how``, or the writer dropped unclosed) leaves them, and the folder moved away as it was:
    it removed the empty folders at the writer's path as its own."""
    writer = _writer(kind, tmp_path / "sub" / "ck")
    await _write(writer, 0)
    (tmp_path / moved).rename(tmp_path / "gone")
    (tmp_path / "sub" / "ck").mkdir(parents=True, exist_ok=True)
    if how == "dropped":
        with warnings.catch_warnings():  # a named shard's, let go of unclosed: not what is tested
            warnings.simplefilter("ignore", ResourceWarning)
            del writer
            gc.collect()
    else:
        await _end(writer, how)
    gone = ["gone", "gone/ck"] if moved == "sub" else ["gone"]
    assert _tree(tmp_path) == sorted([*gone, "sub", "sub/ck"])


async def test_an_aborted_write_through_dot_dot_removes_every_folder_it_made(
    tmp_path: Path,
) -> None:
    """A failed write into ``x/../y/z`` (none there) left ``x``: the folders to make and remove
    were listed with ``x/..`` among them, which is not one made, and the removal stopped there."""
    with pytest.raises(RuntimeError, match="the program fails"):
        async with open_sharded_writer(tmp_path / "x/../y/z") as writer:
            await writer.write("t", np.zeros(200, np.float32))
            raise RuntimeError("the program fails")
    assert sorted(os.listdir(tmp_path)) == []
