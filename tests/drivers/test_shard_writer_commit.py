"""The sharded writer commits last: its shards take the names of a previous checkpoint only once
the new index is written whole, so a failure before leaves the previous shards as they were."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stream_st import TransportError
from stream_st.sharded.writer import open_sharded_writer

INDEX = "model.safetensors.index.json"


async def _write(directory: Path, value: float) -> None:
    async with open_sharded_writer(directory, max_shard_size=16) as writer:
        for name in ("a", "b"):
            await writer.write(name, np.full(4, value, np.float32))


async def test_an_index_that_cannot_be_written_replaces_no_previous_shard(tmp_path: Path) -> None:
    """The shards were moved over the previous ones before the index was written, then removed
    when it failed: the previous checkpoint lost its shards."""
    await _write(tmp_path, 1.0)
    previous = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != INDEX}
    assert len(previous) == 2
    (tmp_path / INDEX).unlink()
    (tmp_path / INDEX).mkdir()  # where the index goes: writing it fails
    with pytest.raises(TransportError, match="directory"):
        await _write(tmp_path, 2.0)
    after = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != INDEX}
    assert after == previous
