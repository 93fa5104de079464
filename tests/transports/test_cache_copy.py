"""``cache=``: how the copy is written while the read goes on (stream_st.transports.cache.tee).

A read is passed to the remote source whole, and the bytes are handed to the copy's own thread
in pieces (:data:`~stream_st.transports.cache.tee.PIECE`) as the source tells they have landed;
a copy whose writes fail (a file size limit set in a child process) is given up with a warning
while the read goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
import xxhash

import stream_st
from stream_st.transports.cache import Cache
from stream_st.transports.cache.manage import entries
from stream_st.transports.cache.tee import PIECE

from .._util import assert_same_arrays
from ..ctrl_c import run_script
from ..servers.http_server import RangeHTTPServer
from .test_cache_ahead import opened

ROOT = Path(__file__).resolve().parents[2]
BIG: dict[str, np.ndarray[Any, Any]] = {
    "small": np.arange(10, dtype=np.int16),  # the next tensor starts off any block boundary
    "big": np.random.default_rng(0).random((3 * PIECE + 1000) // 8),
    "after": np.arange(5000, dtype=np.float32),
}
BIG_DATA = reference_numpy.save(BIG)


@pytest.mark.parametrize("concurrency", [None, 3], ids=["adaptive", "parts"])
async def test_a_tensor_of_many_pieces_is_copied_byte_for_byte(
    tmp_path: Path, concurrency: int | None
) -> None:
    with RangeHTTPServer(objects={"/m.safetensors": BIG_DATA}, etag="strong") as running:
        url = running.url("/m.safetensors")
        stream = stream_st.open_stream(url, cache=tmp_path, concurrency=concurrency)
        arrays = {name: array async for name, array in stream}
        assert getattr(stream, "cache_state", None) == "fetch"
        assert_same_arrays(arrays, BIG)
        (copy,) = (tmp_path / "objects").rglob("*.safetensors")
        assert copy.read_bytes() == BIG_DATA
        record = json.loads(copy.with_suffix(".json").read_text())
        assert record["digest"] == xxhash.xxh3_128(BIG_DATA).hexdigest()
        assert not list(tmp_path.rglob("*.part"))
        stream = stream_st.open_stream(url, cache=tmp_path)
        arrays = {name: array async for name, array in stream}
        assert getattr(stream, "cache_state", None) == "hit"
        assert_same_arrays(arrays, BIG)


CHILD = """
import asyncio, json, resource, signal, sys, warnings
import stream_st

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[3]), resource.RLIM_INFINITY))

async def main():
    stream = stream_st.open_stream(sys.argv[1], cache=sys.argv[2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sums = {name: float(array.sum()) async for name, array in stream}
    print(json.dumps({"sums": sums, "warnings": [str(w.message) for w in caught]}))

asyncio.run(main())
"""


def test_a_copy_that_cannot_be_written_is_given_up_and_the_read_goes_on(tmp_path: Path) -> None:
    # no ranges, chunked: a body of unknown length, so nothing is reserved up front and the
    # copy's thread meets the limit part way through the big tensor
    served = RangeHTTPServer(objects={"/m.safetensors": BIG_DATA}, no_range=True, chunked=True)
    with served as running:
        url = running.url("/m.safetensors")
        done = subprocess.run(
            [sys.executable, "-c", CHILD, url, str(tmp_path / "cache"), str(PIECE + 4096)],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONPATH": str(ROOT), "PATH": ""},
            timeout=60,
        )
    result = json.loads(done.stdout)
    assert result["sums"] == {name: float(array.sum()) for name, array in BIG.items()}
    (warning,) = [w for w in result["warnings"] if "copy" in w]
    assert "not keeping a copy: writing the copy failed" in warning
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.suffix in (".safetensors", ".part")]


async def test_a_read_cancelled_mid_tensor_leaves_a_copy_that_completes_right(
    tmp_path: Path,
) -> None:
    """A read cancelled while the copy's thread still has pieces of a tensor to write returns
    only once the thread is done with that memory (the arrays are recycled at once); the next
    read completes the copy, which holds exactly the object's bytes."""
    objects = {"/m.safetensors": BIG_DATA}
    with (
        anyio.fail_after(120),
        RangeHTTPServer(objects=objects, etag="strong", rate=8e6) as running,
    ):
        url = running.url("/m.safetensors")
        for delay in (0.05, 0.15, 0.3):
            with anyio.move_on_after(delay):
                async for _, array in stream_st.open_stream(url, cache=tmp_path):
                    array.fill(0xFF)  # the caller's memory, reused at once
        assert not list((tmp_path / "objects").rglob("*.safetensors"))  # none complete yet
        running.rate = None
        stream = stream_st.open_stream(url, cache=tmp_path)
        assert_same_arrays({name: array async for name, array in stream}, BIG)
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    assert copy.read_bytes() == BIG_DATA


async def test_a_read_cancelled_by_a_cancel_scope_closes_and_records_its_partial_copy(
    tmp_path: Path,
) -> None:
    """A cancel scope cancels every await of a read it stops, its close's too: the flush of the
    partial copy was cut short, the copy's file left open in the process and its preallocated
    blocks with no ranges recorded (a killed writer's leftover in ``cache ls``)."""
    with (
        anyio.fail_after(120),
        RangeHTTPServer(objects={"/m.safetensors": BIG_DATA}, etag="strong", rate=8e6) as running,
    ):
        url = running.url("/m.safetensors")
        for delay in (0.05, 0.15, 0.3):
            with anyio.move_on_after(delay) as scope:
                await stream_st.load(url, cache=tmp_path)
            assert scope.cancelled_caught
            assert opened(str(tmp_path)) == []
            for part in (tmp_path / "objects").rglob("*.part"):
                assert part.with_name(f"{part.name}.json").exists()
            assert not [entry for entry in entries(Cache.at(tmp_path)) if entry.leftover]


async def test_an_adaptive_window_lands_its_parts_in_the_tensor_as_without_a_cache(
    tmp_path: Path,
) -> None:
    """The default concurrency over a link of 200 MB/s per connection: the first 8 MiB part is
    one stream, then a window of parts; a cached read is passed on whole, so it makes the same
    parts, keeps them byte for byte and holds no more memory than the same read without a
    cache."""
    tensors = {"w": np.random.default_rng(1).random((12 << 20) // 8)}
    data = reference_numpy.save(tensors)

    async def peak(url: str, cache: Path | None) -> int:
        tracemalloc.start()
        try:
            stream = stream_st.open_stream(url, cache=cache)
            arrays = {name: array async for name, array in stream}
            assert_same_arrays(arrays, tensors)
            del arrays
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    served = RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong", rate=200e6)
    with served as running:
        url = running.url("/m.safetensors")
        without = await peak(url, None)
        parts = len([r for r in running.requests if r[0] == "GET"])
        assert parts > 2  # the window opened
        cached = await peak(url, tmp_path)
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    assert copy.read_bytes() == data
    assert cached < without + (1 << 20), (cached, without)


CTRL_C_EVERYWHERE = """
import sys, anyio, stream_st
from stream_st.transports.cache import tee
from tests.ctrl_c import assert_threads_end, everywhere

url, cache = sys.argv[1:]

async def read(at):
    async with stream_st.open_stream(url, cache=f"{cache}/{at}") as stream:
        async for name, array in stream:
            pass

print(anyio.run(everywhere, read, tee.__file__, backend="trio"))
assert_threads_end("stream_st cache copy")
"""


CTRL_C_RESOLVING = """
import sys, anyio, stream_st, stream_st._api
from tests.ctrl_c import everywhere

url, cache = sys.argv[1:]

async def read(at):
    async with stream_st.open_stream(url, cache=cache) as stream:  # a hit: resolved, read ahead
        async for name, array in stream:
            pass

anyio.run(read, 0)  # the copy
print(anyio.run(lambda: everywhere(read, stream_st._api.__file__, bare=True), backend="trio"))
"""


def test_ctrl_c_while_a_cached_read_resolves_is_a_keyboard_interrupt(tmp_path: Path) -> None:
    """Ctrl-C under trio anywhere in a cached read's own code (the copy read ahead while the
    request that checks it is in flight) comes out as ``KeyboardInterrupt``, as
    ``except KeyboardInterrupt`` catches it, never in an exception group."""
    with RangeHTTPServer(objects={"/m.safetensors": BIG_DATA}, etag="strong") as running:
        tried = run_script(CTRL_C_RESOLVING, running.url("/m.safetensors"), str(tmp_path))
    assert tried >= 20  # the trace reached the read


def test_ctrl_c_anywhere_in_the_copy_under_trio_never_hangs(tmp_path: Path) -> None:
    """Ctrl-C under trio raises KeyboardInterrupt wherever the event loop's thread runs, in
    Python code too: a cached read, interrupted at each place of the copy's code in turn, ends
    every time, and the copy's thread with it. Raised in ``threading.Condition.__enter__``
    after the acquire, the lock stayed held: the copy's thread blocked on it and the close
    waited for the thread for ever."""
    with RangeHTTPServer(objects={"/m.safetensors": BIG_DATA}, etag="strong") as running:
        tried = run_script(CTRL_C_EVERYWHERE, running.url("/m.safetensors"), str(tmp_path))
    assert tried >= 20  # the trace reached the copy


async def test_a_copy_that_cannot_be_moved_into_place_prunes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy's commit fails (a full disk, say): the read goes on with a warning, and the
    cache's pruning, which keeps the new copy, is not run for a copy that is not there."""
    from stream_st.transports.cache import resolve, tee

    pruned: list[object] = []
    monkeypatch.setattr(resolve, "_pruner", lambda cache, keep: lambda: pruned.append(keep))
    made = tee.CopyWriter.__init__

    def failing_commit(self: Any, destination: Any, *args: Any) -> None:
        def commit(part: Any, record: Any) -> None:
            raise OSError(28, "No space left on device")

        destination.commit = commit
        made(self, destination, *args)

    monkeypatch.setattr(tee.CopyWriter, "__init__", failing_commit)
    data = reference_numpy.save({"a": np.arange(10_000, dtype=np.float32)})
    with RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong") as server:
        cache = Cache(tmp_path / "cache", tmp_path / "hub", max_size=10**9)
        with pytest.warns(stream_st.CacheWarning, match="keeping the copy failed"):
            got = await stream_st.load(server.url("/m.safetensors"), cache=cache)
    assert np.array_equal(got["a"], np.arange(10_000, dtype=np.float32))
    assert pruned == []
