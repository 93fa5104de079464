"""``cache=``: a reader that finds the copy being written by another reader reads it as it grows
(stream_st.transports.cache.follow); one whose writer stops first reads the rest itself."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.cache.follow import PUBLISH_STEP

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from .test_cache import reader

ROOT = Path(__file__).resolve().parents[2]
ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    f"t{i}": np.random.default_rng(i).random(PUBLISH_STEP // 8) for i in range(6)
}
DATA = reference_numpy.save(ARRAYS)
RATE = 12e6  # bytes per second: the object takes about half a second

READER = """
import asyncio, json, sys
import stream_st

async def main():
    async with stream_st.open_stream(sys.argv[1], cache=sys.argv[2]) as stream:
        print(stream.cache_state, flush=True)
        sums = {name: float(array.sum()) async for name, array in stream}
        print(stream.cache_state, flush=True)
    print(json.dumps(sums), flush=True)

asyncio.run(main())
"""


def start_reader(url: str, cache: Path) -> subprocess.Popen[str]:
    return reader(url, cache, READER)


def written(cache: Path) -> int:
    """What the writer published as written (-1: nothing published)."""
    for growing in cache.rglob(".growing"):
        try:
            return int(json.loads(growing.read_text())["written"])
        except (OSError, ValueError, KeyError):
            pass
    return -1


async def published(cache: Path) -> None:
    """Wait until a writer publishes its progress."""
    with anyio.fail_after(30):
        while True:
            if written(cache) >= 0:
                return
            await anyio.sleep(0.01)


def wait_until(condition: Any, what: str) -> None:
    give_up = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.01)


def finish(process: subprocess.Popen[str]) -> tuple[str, dict[str, float]]:
    """A reader's ``cache_state`` once it read every tensor, and the tensors' sums."""
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    state, sums = out.splitlines()[-2:]
    result: dict[str, float] = json.loads(sums)
    return state, result


SUMS = {name: float(array.sum()) for name, array in ARRAYS.items()}


async def read(url: str, cache: Path) -> tuple[dict[str, Any], str | None]:
    stream = stream_st.open_stream(url, cache=cache)
    arrays = {name: array async for name, array in stream}
    return arrays, getattr(stream, "cache_state", None)


def served(running: RangeHTTPServer) -> int:
    running.settle()
    return sum(sent for _, _, _, sent in running.requests)


async def test_two_reads_at_once_fetch_the_object_once(tmp_path: Path) -> None:
    """The second read (here in the same process) reads the copy the first is writing."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong", rate=RATE) as running:
        url = running.url("/m.safetensors")
        results: list[tuple[dict[str, Any], str | None]] = []

        async def follow() -> None:
            await published(tmp_path)
            results.append(await read(url, tmp_path))

        async with anyio.create_task_group() as group:
            group.start_soon(follow)
            results.append(await read(url, tmp_path))
        assert sorted(str(state) for _, state in results) == ["fetch", "shared"]
        for arrays, _ in results:
            assert_same_arrays(arrays, ARRAYS)
        assert served(running) < len(DATA) + (128 << 10)  # fetched once
    assert not list(tmp_path.rglob(".growing"))
    (copy,) = tmp_path.rglob("*.safetensors")
    assert copy.read_bytes() == DATA


def test_a_follower_whose_writer_is_killed_reads_the_rest_itself(tmp_path: Path) -> None:
    """Processes: the writer's answer stalls part way, a second reader follows its copy, the
    writer is killed; the follower reads the rest from the server (its ``cache_state`` then
    ``"uncached"``), removes the leftovers."""
    objects = {"/m.safetensors": DATA}
    stall = 5 * PUBLISH_STEP  # the writer's answer stops there; the follower's rest is shorter
    with RangeHTTPServer(objects=objects, etag="strong", stall_after=stall) as running:
        url = running.url("/m.safetensors")
        writer = start_reader(url, tmp_path)
        wait_until(lambda: written(tmp_path) >= 0, "the writer publishes its progress")
        follower = start_reader(url, tmp_path)
        assert follower.stdout is not None
        assert follower.stdout.readline().strip() == "shared"
        wait_until(lambda: written(tmp_path) >= 4 * PUBLISH_STEP, "the writer gets part way")
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
        assert finish(follower) == ("uncached", SUMS)
        # the follower took the lock and removed the dead writer's leftovers; it kept no copy
        assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["lock"]
        running.stall_after = None
        arrays, state = anyio.run(read, url, tmp_path)
        assert state == "fetch"
        assert_same_arrays(arrays, ARRAYS)


async def test_a_follower_in_the_same_process_and_a_writer_that_stops_early(
    tmp_path: Path,
) -> None:
    """Two reads at once in one process: the second follows the first's copy; the first stops
    after two tensors (no copy is kept), the second reads the rest from the server itself: its
    ``cache_state``, ``"shared"`` until then, is ``"uncached"``."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong", rate=RATE) as running:
        url = running.url("/m.safetensors")
        writer = stream_st.open_stream(url, cache=tmp_path)
        follower = stream_st.open_stream(url, cache=tmp_path)
        got: dict[str, Any] = {}
        async with anyio.create_task_group() as group:

            async def write() -> None:
                count = 0
                async for _ in writer:
                    count += 1
                    if count == 2:
                        break

            async def follow() -> None:
                await published(tmp_path)
                async with follower:
                    assert getattr(follower, "cache_state", None) == "shared"
                    got.update({name: array async for name, array in follower})

            group.start_soon(write)
            group.start_soon(follow)
        assert getattr(writer, "cache_state", None) == "fetch"
        assert getattr(follower, "cache_state", None) == "uncached"
        assert_same_arrays(got, ARRAYS)
    assert not list((tmp_path / "objects").rglob("*.safetensors"))
    assert not list(tmp_path.rglob(".growing"))


async def test_a_follower_whose_writer_stalls_tells_it_read_without_the_cache(
    tmp_path: Path,
) -> None:
    """Two reads at once in one process: the first's answer stalls part way, the second follows
    its copy, then reads the rest from the server itself once the writer wrote nothing for
    :data:`~stream_st.transports.cache.follow.HERE_STALL`: its ``cache_state`` is
    ``"uncached"``, no longer ``"shared"``."""
    stall = 5 * PUBLISH_STEP  # the writer's answer stops there; the follower's rest is shorter
    with RangeHTTPServer(
        objects={"/m.safetensors": DATA}, etag="strong", stall_after=stall
    ) as running:
        url = running.url("/m.safetensors")
        follower = stream_st.open_stream(url, cache=tmp_path)
        got: dict[str, Any] = {}
        states: list[str | None] = []
        async with anyio.create_task_group() as group:

            async def write() -> None:
                async for _ in stream_st.open_stream(url, cache=tmp_path):
                    pass

            group.start_soon(write)
            await published(tmp_path)
            async with follower:
                states.append(getattr(follower, "cache_state", None))
                got.update({name: array async for name, array in follower})
                states.append(getattr(follower, "cache_state", None))
            group.cancel_scope.cancel()  # the writer, still waiting on its stalled answer
        assert states == ["shared", "uncached"]
        assert_same_arrays(got, ARRAYS)
    assert not list(tmp_path.rglob(".growing"))


SLOW_LAYOUTS: dict[str, dict[str, np.ndarray[Any, Any]]] = {
    # each tensor's read takes a twentieth of a second: the writer's writes show its progress
    "small tensors": {f"s{i:02}": np.arange(i, i + 4096, dtype=np.float32) for i in range(40)},
    # the writer's one read of the tensor takes two seconds: its bytes are written as they land
    "one big tensor": {"big": np.random.default_rng(0).random(80 << 10)},
}


@pytest.mark.parametrize("layout", SLOW_LAYOUTS)
async def test_followers_of_a_slow_writer_fetch_nothing(tmp_path: Path, layout: str) -> None:
    """A link slower than :data:`PUBLISH_STEP` per second (over a second between two steps):
    three reads in the writer's own process follow its copy to the end, the server sends the
    object (640 KiB, two seconds) once."""
    arrays = SLOW_LAYOUTS[layout]
    data = reference_numpy.save(arrays)
    with RangeHTTPServer(
        objects={"/m.safetensors": data}, etag="strong", rate=len(data) / 2
    ) as running:
        url = running.url("/m.safetensors")
        results: list[tuple[dict[str, Any], str | None]] = []

        async def one() -> None:
            results.append(await read(url, tmp_path))

        async with anyio.create_task_group() as group:
            for _ in range(4):
                group.start_soon(one)
        assert sorted(str(state) for _, state in results) == ["fetch"] + ["shared"] * 3
        for got, _ in results:
            assert_same_arrays(got, arrays)
        assert served(running) < len(data) + (128 << 10)  # fetched once
