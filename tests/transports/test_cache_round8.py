"""``cache=`` under the eighth attack: cancellation, a second handle, hostile ``hf://`` names,
unusable cache folders, presigned versions, damaged records, full disks, sizes.

Real servers on 127.0.0.1 (the Python test server, the fake Hub, moto's S3)."""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from pathlib import Path
from typing import Any

import pytest

import stream_st
import stream_st.transports.cache.resolve as resolve_module

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from .test_cache import ARRAYS, DATA, files_under, read


def lock_free(root: Path) -> bool:
    (lock,) = root.rglob("lock")
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["with", "iterate"])
def test_a_read_cancelled_right_after_the_cache_resolved_lets_go_of_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A cancel landing between the cache's answer ("fetch": the entry locked, the copy begun)
    and the stream's open left the lock held and the growing copy named: every later read
    waited 30 s as a follower and kept no copy."""
    original = resolve_module.resolve
    cancelled: list[bool] = []

    async def resolve_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        resolved = await original(*args, **kwargs)
        if resolved.state == "fetch" and not cancelled:
            cancelled.append(True)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # a timeout firing at this moment
        return resolved

    monkeypatch.setattr(resolve_module, "resolve", resolve_then_cancelled)
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")

        async def first() -> None:
            stream = stream_st.open_stream(url, cache=tmp_path)
            if how == "with":
                async with stream:
                    pytest.fail("opened")
            async for _ in stream:
                pytest.fail("iterated")

        with pytest.raises(asyncio.CancelledError):
            asyncio.run(first())
        assert cancelled and lock_free(tmp_path)
        assert [p.name for p in files_under(tmp_path)] == ["lock"]
        started = time.monotonic()
        arrays, state = asyncio.run(read(url, cache=tmp_path))
        assert state == "fetch" and time.monotonic() - started < 10
        assert_same_arrays(arrays, ARRAYS)
        assert asyncio.run(read(url, cache=tmp_path))[1] == "hit"
