"""The sharded and dataset writers write in the folder they made (or found) and hold: one removed
or moved away while they write fails the next shard, or the commit, with
:class:`~stream_st.SourceNotFoundError`, as a single file's write whose directory was moved away
fails. They used to make the folder (and its parents) again, link the shards written into the
new one and commit the checkpoint there, and a failure after that left the folders made again.
Nothing of the write is left, the folder moved away is left as it was, with nameless
(``O_TMPFILE``) and hidden named temporaries alike."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stream_st import SourceNotFoundError
from stream_st.sharded.writer import (
    DatasetWriter,
    ShardedWriter,
    open_dataset_writer,
    open_sharded_writer,
)
from stream_st.transports.file import atomic

from .._util import nameless_works

ROWS = np.arange(64, dtype=np.float32).reshape(16, 4)
"""A tensor of 256 bytes: a shard of its own in either writer (a batch of 16 samples)."""

NOTES = "a user's notes"


@pytest.fixture(params=["nameless", "named"])
def temporaries(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Each way the writers make their shards' temporary files: nameless (``O_TMPFILE``) and
    hidden."""
    if request.param == "nameless" and not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(atomic, "USE_TMPFILE", request.param == "nameless")
        yield request.param


def _writer(kind: str, directory: Path) -> ShardedWriter | DatasetWriter:
    """A writer of ``kind`` into ``directory`` that starts a new shard with each write."""
    if kind == "sharded":
        return open_sharded_writer(directory, max_shard_size=ROWS.nbytes)
    return open_dataset_writer(directory, target_shard_size=ROWS.nbytes)


async def _write(writer: ShardedWriter | DatasetWriter, number: int) -> None:
    """Write one tensor (a batch, to a dataset writer): a shard of its own."""
    if isinstance(writer, ShardedWriter):
        await writer.write(f"t{number}", ROWS)
    else:
        await writer.write_batch({"x": ROWS}, len(ROWS))


def _tree(root: Path) -> list[str]:
    """Every folder and file under ``root`` (hidden ones too), relative to it."""
    return sorted(
        os.path.relpath(os.path.join(top, name), root)
        for top, folders, files in os.walk(root)
        for name in folders + files
    )


def _move(how: str, root: Path, made: bool) -> list[str]:
    """Take ``root/sub`` (which holds the writer's folder, ``sub/ck``, ``made`` by the writer or
    holding a file of the user's) away as ``how`` says; what the tree is to hold once the
    writer is done: the folder moved away as it was, nothing of the writer's."""
    if how == "removed":
        shutil.rmtree(root / "sub")
        return []
    (root / "sub").rename(root / "moved")
    left = ["moved", "moved/ck"] + ([] if made else ["moved/ck/notes.txt"])
    if how == "replaced":  # another folder, someone else's, now at the writer's path
        (root / "sub" / "ck").mkdir(parents=True)
        (root / "sub" / "ck" / "theirs.txt").write_text(NOTES)
        left += ["sub", "sub/ck", "sub/ck/theirs.txt"]
    return sorted(left)


@pytest.mark.parametrize("kind", ["sharded", "dataset"])
@pytest.mark.parametrize("how", ["removed", "renamed", "replaced"])
@pytest.mark.parametrize("after", ["write", "write, then raise", "close", "raise"])
@pytest.mark.parametrize("made", [True, False], ids=["made", "found"])
async def test_a_folder_taken_away_mid_write_fails_and_nothing_is_left(
    tmp_path: Path, temporaries: str, kind: str, how: str, after: str, made: bool
) -> None:
    """Two shards written, the folder taken away (``how``), then (``after``) a third shard, a
    third shard and the body's own failure, the commit, or the body's own failure: the writer
    is aborted (:class:`~stream_st.SourceNotFoundError` naming the folder, or the body's own
    error), and nothing of it is left, nor any folder made again."""
    directory = tmp_path / "sub" / "ck"
    if not made:  # a folder of the user's, with a file of theirs
        directory.mkdir(parents=True)
        (directory / "notes.txt").write_text(NOTES)
    own = RuntimeError("the body's own failure")
    with pytest.raises((SourceNotFoundError, RuntimeError)) as raised:
        async with _writer(kind, directory) as writer:
            await _write(writer, 0)
            await _write(writer, 1)
            left = _move(how, tmp_path, made)
            if after.startswith("write"):
                try:
                    await _write(writer, 2)
                except SourceNotFoundError:
                    if "raise" not in after:
                        raise
                else:
                    pytest.fail("a shard was written where the folder was taken away")
            if "raise" in after:
                raise own
    if "raise" in after:
        assert raised.value is own
    else:
        assert type(raised.value) is SourceNotFoundError
        assert "moved away" in str(raised.value) and str(directory) in str(raised.value)
    assert _tree(tmp_path) == left
    for notes in [*tmp_path.glob("*/ck/notes.txt"), *tmp_path.glob("*/ck/theirs.txt")]:
        assert notes.read_text() == NOTES
