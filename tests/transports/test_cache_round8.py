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

import numpy as np
import pytest

import stream_st
import stream_st.compat as compat
import stream_st.transports.cache.resolve as resolve_module
from stream_st.errors import UnsupportedSourceError

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from ..servers.hub_server import FakeHub
from .test_cache import ARRAYS, DATA, files_under, read

HUB_ADDRESS = "hf://org/model/model.safetensors"


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


@pytest.mark.parametrize("scheme", ["http", "hf"])
def test_a_second_handle_in_the_process_reads_at_once_without_the_cache(
    tmp_path: Path, scheme: str, hub: FakeHub
) -> None:
    """Two safe_open handles on one address in one thread: the second waited for the first's
    lock, which is held until the first closes (hf://: for ever; http: 30 s as a follower of a
    copy that did not grow). It now reads the object itself within a second."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        hub.push("org/model", {"model.safetensors": DATA})
        address = server.url("/m.safetensors") if scheme == "http" else HUB_ADDRESS
        started = time.monotonic()
        with compat.safe_open(address, "np", cache=tmp_path) as first:
            assert np.array_equal(first.get_slice("t0")[:2], ARRAYS["t0"][:2])
            with compat.safe_open(address, "np", cache=tmp_path) as second:
                assert np.array_equal(second.get_tensor("t1"), ARRAYS["t1"])
            assert np.array_equal(first.get_tensor("t2"), ARRAYS["t2"])
        assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "address",
    [
        "hf://org/model@..%2F..%2F..%2Fescaped/model.safetensors",
        "hf://org/model/../../../../escaped.safetensors",
        "hf://org/model/a//model.safetensors",
        "hf://org/../model.safetensors",
        "hf://org/model@./model.safetensors",
    ],
)
def test_an_hf_address_that_climbs_out_is_refused(
    tmp_path: Path, hub: FakeHub, address: str
) -> None:
    """A revision or path with '..' parts wrote a ref file and a link outside the cache."""
    hub.push("org/model", {"model.safetensors": DATA})
    with pytest.raises(UnsupportedSourceError, match=r"an empty, '\.' or '\.\.' part"):
        asyncio.run(read(address, cache=True))
    outside = [p for p in files_under(tmp_path) if "hub-cache" not in p.parts]
    assert not any("escaped" in p.name for p in outside)
