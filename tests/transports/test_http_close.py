"""An ``http(s)://`` stream closed from another task while it waits for the server: the wait ends
at once, and the waiting step fails with TransportError ("closed on this side"), as a local
file's does (docs/guarantees.md), on asyncio and trio, through one connection or a window of
parallel parts, during open or mid-iteration, plain or TLS. Every wait is bounded
(``anyio.fail_after``): a regression fails instead of hanging the suite."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import HttpSource, TransportError, UsageError
from stream_st.transports.http import HTTPClient

from ..servers.daemon import running
from ..servers.http_server import RangeHTTPServer
from ..servers.nginx_server import NginxServer

DATA = reference_numpy.save({f"t{i}": np.ones(250_000, np.float32) for i in range(3)})  # 3 MB

BACKENDS = ["asyncio", "trio"]


@pytest.fixture
def stalled() -> Iterator[RangeHTTPServer]:
    """``/m``: every answer stops after 100 kB of its body and keeps its connection open."""
    with RangeHTTPServer(objects={"/m": DATA}, stall_after=100_000) as server:
        yield server


async def _closed_during(
    stream: stream_st.TensorStream, work: Callable[[], Awaitable[object]]
) -> None:
    """Run ``work`` with ``stream`` closed from another task after 0.3 s: it ends at once with
    a TransportError saying so."""

    async def close_soon() -> None:
        await anyio.sleep(0.3)
        await stream.aclose()

    async with anyio.create_task_group() as group:
        group.start_soon(close_soon)
        with anyio.fail_after(10), pytest.raises(TransportError, match="closed on this side"):
            await work()


async def _closed_while_iterating(stream: stream_st.TensorStream) -> list[str]:
    """Iterate ``stream``, closed from another task after 0.3 s; the names it handed out."""
    got: list[str] = []

    async def iterate() -> None:
        async for name, _ in stream:
            got.append(name)

    await _closed_during(stream, iterate)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("concurrency", [1, 4])
def test_closed_from_another_task_while_the_loop_waits(
    stalled: RangeHTTPServer, backend: str, concurrency: int
) -> None:
    async def main() -> None:
        source = HttpSource(stalled.url("/m"), concurrency=concurrency, part_size=1 << 20)
        async with stream_st.open_stream(source) as stream:
            assert await _closed_while_iterating(stream) == []

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_closed_from_another_task_during_open(backend: str) -> None:
    """The header never comes (4 bytes of it, then nothing): open ends with the close, and
    opening the closed stream again is a UsageError, not the header."""

    async def main(url: str) -> None:
        stream = stream_st.open_stream(url)
        await _closed_during(stream, stream.open)
        with pytest.raises(UsageError, match="the stream is closed"):
            await stream.open()

    with RangeHTTPServer(objects={"/m": DATA}, stall_after=4) as server:
        anyio.run(main, server.url("/m"), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_response_closed_from_another_task_wakes_its_reader(
    stalled: RangeHTTPServer, backend: str
) -> None:
    """The client alone (no source around it): the socket closed under a waiting receive."""

    async def main() -> None:
        client = HTTPClient()
        response = await client.request("GET", stalled.url("/m"))
        buffer = memoryview(bytearray(len(DATA)))
        got = 0
        async with anyio.create_task_group() as group:
            with anyio.fail_after(10):
                while got < 100_000:
                    got += await response.receive_into(buffer[got:])
                group.start_soon(response.aclose)
                with pytest.raises(TransportError, match="the connection is closed"):
                    await response.receive_into(buffer[got:])
        await client.aclose()

    anyio.run(main, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_tls_stream_closed_from_another_task(tmp_path: Path, backend: str) -> None:
    """nginx's /trickle/ over TLS: a byte a second after its first bytes."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "m.safetensors").write_bytes(DATA)

    async def main(nginx: NginxServer) -> None:
        url = nginx.url("m.safetensors", location="/trickle/", tls=True)
        async with stream_st.open_stream(url, ssl_context=nginx.client_context()) as stream:
            await _closed_while_iterating(stream)

    (tmp_path / "nginx").mkdir()
    with running(NginxServer(root, tmp_path / "nginx")) as nginx:
        anyio.run(main, nginx, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_read_begun_after_the_close_is_refused_as_closed(backend: str) -> None:
    """A source read after its close (by a caller that kept it) fails at once saying so, never
    with what a closed connection pool happens to raise."""

    async def main() -> None:
        with RangeHTTPServer(objects={"/m": DATA}) as server:
            source = HttpSource(server.url("/m"))
            await source.start()
            await source.aclose()
            buffer = memoryview(bytearray(16))
            for read in (source.fill(buffer), source.read_into_at(100, buffer)):
                with (
                    anyio.fail_after(10),
                    pytest.raises(TransportError, match="closed on this side"),
                ):
                    await read

    anyio.run(main, backend=backend)
