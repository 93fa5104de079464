"""Streams closed from another task while their loop waits: the loop hands out no array after
the close and fails with a TransportError ("closed on this side"), whatever it waited for. Each
close lands where the test chooses (a turn at every checkpoint: ``TURN_EVERY`` 0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import TransportError
from stream_st.reader.ahead import READ_AHEAD_FROM
from stream_st.reader.stream import TensorStream
from stream_st.sharded.reader import ShardedStream, ShardIndex
from stream_st.transports.file.readahead import ReadAhead

SHARDS = [f"model-0000{n}-of-00003.safetensors" for n in (1, 2, 3)]


def _checkpoint(tmp_path: Path) -> Path:
    """An index of three shards of ten small tensors each."""
    weight_map = {}
    for n, shard in enumerate(SHARDS):
        arrays = {f"t{n}.{i}": np.full(3, i, np.float32) for i in range(10)}
        reference_numpy.save_file(arrays, str(tmp_path / shard))
        weight_map.update(dict.fromkeys(arrays, shard))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize(
    ("concurrency", "closing", "held"),
    [(None, 0, False), (None, 2, False), (2, 0, False), (2, 1, True)],
    ids=["first", "last", "first-with-next-ahead", "ahead-after-first-tensor"],
)
def test_a_sharded_stream_closed_while_a_shard_opens(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    backend: str,
    concurrency: int | None,
    closing: int,
    held: bool,
) -> None:
    """Closed while shard ``closing`` was being opened (``aclose()`` found no shard to close),
    the loop handed out that whole shard's arrays after the close, and ended normally where it
    was the last: the close was seen only at the start of the next shard. ``held``: the shard
    opened ahead, once the loop holds the first tensor of the shard before and waits for that
    open, which handed out that tensor after the close. Every shard opened is closed."""
    monkeypatch.setattr(stream_st.transports.base, "TURN_EVERY", 0.0)
    index = _checkpoint(tmp_path)
    opened: list[TensorStream[Any]] = []
    opening = anyio.Event()
    open_checked = ShardedStream._open_checked

    async def open_and_tell(
        self: ShardedStream[Any], index: ShardIndex, shard: str, selected: Any
    ) -> TensorStream[Any]:
        if shard == SHARDS[closing]:
            if held:
                await anyio.wait_all_tasks_blocked()  # the loop: the first tensor read
            opening.set()  # the close runs at the open's first turn
        stream = await open_checked(self, index, shard, selected)
        opened.append(stream)
        return stream

    monkeypatch.setattr(ShardedStream, "_open_checked", open_and_tell)

    async def main() -> None:
        stream = ShardedStream[Any](index, concurrency=concurrency)
        closed = False
        after: list[str] = []

        async def close() -> None:
            nonlocal closed
            await opening.wait()
            await stream.aclose()
            closed = True

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(close)
                with pytest.raises(TransportError, match="closed on this side before its end"):
                    async for name, _ in stream:
                        if closed:
                            after.append(name)
        assert after == []
        assert len(opened) == closing + 1  # up to the one being opened, which is closed too
        assert all(shard._source is None for shard in opened)

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_big_file_closed_while_the_loop_waits_for_its_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """A local file read by the read-ahead threads, closed while the loop waited for a tensor's
    read, failed with "read stopped: the file was closed", where every other close gives
    "closed on this side"."""
    path = tmp_path / "big.safetensors"
    arrays = {"a": np.zeros(READ_AHEAD_FROM // 4, np.float32), "b": np.ones(4, np.float32)}
    reference_numpy.save_file(arrays, str(path))
    waiting, closed = anyio.Event(), anyio.Event()
    wait = ReadAhead.wait

    async def wait_for_the_close(self: ReadAhead, job: int) -> int:
        waiting.set()
        await closed.wait()
        return await wait(self, job)

    monkeypatch.setattr(ReadAhead, "wait", wait_for_the_close)

    async def main() -> None:
        stream = stream_st.open_stream(path)

        async def close() -> None:
            await waiting.wait()
            await stream.aclose()
            closed.set()

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(close)
                with pytest.raises(TransportError, match="closed on this side"):
                    async for _ in stream:
                        pass

    anyio.run(main, backend=backend)
