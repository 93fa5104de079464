"""Shared fixtures: real loopback TCP servers that send given bytes to each client."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import numpy as reference_numpy

from .servers.daemon import running
from .servers.hub_server import FakeHub
from .servers.nginx_server import NginxServer
from .servers.proxy_server import ForwardProxy
from .servers.s3_server import MotoS3Server

StartSender = Callable[[bytes], Awaitable[int]]

# Settings the library reads from the environment that would change what a test sees: a machine
# with HF_HUB_OFFLINE=1 (or a cache cap, or a Hub mirror) must run the same suite as one without.
# Tests that exercise them set them with monkeypatch.
AMBIENT = (
    "HF_HUB_OFFLINE",
    "HF_ENDPOINT",
    "STREAM_ST_CACHE_MAX",
    "STREAM_ST_DIRECT_IO",
)


@pytest.fixture(autouse=True)
def hermetic_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test starts without the ambient settings of ``AMBIENT``."""
    for name in AMBIENT:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
async def tcp_sender() -> AsyncIterator[StartSender]:
    """``await start(payload) -> port``: a TCP server on 127.0.0.1 sending ``payload`` to each
    client, then closing. Every server stops when the test ends."""
    servers: list[asyncio.Server] = []

    async def start(payload: bytes) -> int:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(payload)
            await writer.drain()
            writer.close()
            await writer.wait_closed()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        port: int = server.sockets[0].getsockname()[1]
        return port

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture(scope="session")
def moto_s3() -> Iterator[MotoS3Server]:
    """One S3-compatible server (moto, in a child process) for the whole test run."""
    with MotoS3Server() as server:
        yield server


@pytest.fixture(scope="session")
def forward_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForwardProxy]:
    """A forward proxy (tinyproxy, in a child process) for the whole test run; the test is
    skipped where tinyproxy is not installed."""
    with running(ForwardProxy(tmp_path_factory.mktemp("proxy"))) as proxy:
        yield proxy


@pytest.fixture(scope="session")
def small_nginx(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NginxServer]:
    """nginx (http and https, certificates from its own CA) serving ``m.safetensors``, two small
    tensors by the reference writer (read them from ``root``), for the whole test run; the test
    is skipped where nginx is not installed."""
    root = tmp_path_factory.mktemp("served")
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(10, dtype=np.float32),
        "b": np.ones((3, 4), dtype=np.int16),
    }
    reference_numpy.save_file(arrays, str(root / "m.safetensors"))
    with running(NginxServer(root, tmp_path_factory.mktemp("nginx"))) as server:
        yield server


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """An object key of the test's own (its name, made a safe key)."""
    return re.sub(r"[^\w.-]+", "-", request.node.name) + ".safetensors"


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A test Hub, named by ``HF_ENDPOINT`` and ``HF_TOKEN``, with every cache place (``HF_HOME``,
    ``HF_HUB_CACHE``, ``STREAM_ST_CACHE``) under the test's own directory."""
    with FakeHub() as running:
        monkeypatch.setenv("HF_ENDPOINT", running.endpoint)
        monkeypatch.setenv("HF_TOKEN", running.token)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub-cache"))
        monkeypatch.setenv("STREAM_ST_CACHE", str(tmp_path / "st-cache"))
        yield running
