"""The eleventh attack, remote side: an S3 write cancelled after its commit went out, an HTTP
upload's method, the names a server takes from a file, and how long a server takes to stop.
Each test failed before its mend."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.cli import main
from stream_st.transports.http.sink import HttpSink

from ..servers.lossy_proxy import LossyProxy, _read_message
from ..servers.s3_server import MotoS3Server
from ..transports.test_upload_faults import (
    COMPLETE,
    TWO_PARTS,
    Arrays,
    pending,
    s3_sink,
    stored,
    write,
)

BUCKET = "round11"
SMALL: Arrays = {"a": np.arange(12, dtype=np.float32)}
PUT = ("PUT", "^$")
LATE = 0.5  # seconds an answer is held back after the store gave it


# ---------------------------------------------------------------- S3: cancelled at the commit


class LateProxy(LossyProxy):
    """Passes every request on to the store; the answer to the requests ``method`` whose query
    has ``query`` is held :data:`LATE` seconds after the store gave it (the request is logged
    in ``requests`` at once, so a test can cancel while the answer is on its way)."""

    def __init__(self, upstream_port: int, method: str, query: str) -> None:
        self.late = (method, re.compile(query))
        super().__init__(upstream_port)

    def handle(self, connection: socket.socket) -> None:
        request = _read_message(connection, answer=False)
        if not request:
            return
        method, target, _ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        answer = self._forward(request)
        with self._logged:
            self.requests.append((method, target, "pass"))
            self._logged.notify_all()
        if method == self.late[0] and self.late[1].search(target.partition("?")[2]):
            time.sleep(LATE)
        connection.sendall(answer)


@pytest.fixture(scope="module")
def store(moto_s3: MotoS3Server) -> MotoS3Server:
    moto_s3.client().create_bucket(Bucket=BUCKET)
    return moto_s3


@pytest.fixture(autouse=True)
def no_metadata_service(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.mark.parametrize(
    ("arrays", "request_"), [(TWO_PARTS, COMPLETE), (SMALL, PUT)], ids=["complete", "put"]
)
async def test_a_write_cancelled_once_its_commit_went_out_succeeds(
    store: MotoS3Server, key: str, arrays: Arrays, request_: tuple[str, str]
) -> None:
    """Cancelled while the store's answer to CompleteMultipartUpload (or the single PUT) was on
    its way, the writer gave the request up: it is now seen through and, under a cancel scope,
    reports success (the object stored whole, nothing pending), the scope cancelling the next
    checkpoint."""
    with LateProxy(store.port, *request_) as proxy:
        written = False

        async def cancel_when_seen(scope: anyio.CancelScope) -> None:
            await anyio.to_thread.run_sync(proxy.wait_for, *request_)
            scope.cancel()

        with anyio.fail_after(30), anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(cancel_when_seen, scope)
                await write(s3_sink(proxy, key, BUCKET), arrays)
                written = True
                await anyio.sleep_forever()
    assert written and scope.cancelled_caught
    assert stored(store, key, BUCKET) == reference_numpy.save(arrays)
    assert pending(store, key, BUCKET) == []


async def test_a_save_task_cancelled_once_its_commit_went_out_stays_cancelled(
    store: MotoS3Server, key: str
) -> None:
    """The attack's case: asyncio's ``Task.cancel()`` (which goes through anyio's shields) while
    the completion's answer was on its way: the object stored whole, and the cancellation (which
    asyncio delivers once: its timeouts and task groups count on it) not swallowed."""
    with LateProxy(store.port, *COMPLETE) as proxy:
        task = asyncio.create_task(stream_st.save(s3_sink(proxy, key, BUCKET), TWO_PARTS))
        await anyio.to_thread.run_sync(proxy.wait_for, *COMPLETE)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
    assert stored(store, key, BUCKET) == reference_numpy.save(TWO_PARTS)
    assert pending(store, key, BUCKET) == []


async def test_a_save_task_cancelled_with_its_commit_stalled_gives_up(
    store: MotoS3Server, key: str
) -> None:
    """The completion is seen through only :attr:`S3Sink.abort_timeout` seconds once cancelled:
    an answer that never comes leaves a cancellation and no pending upload."""
    with LossyProxy(store.port, hold=5.0) as proxy:
        proxy.lose(*COMPLETE, "stall")
        task = asyncio.create_task(stream_st.save(s3_sink(proxy, key, BUCKET), TWO_PARTS))
        await anyio.to_thread.run_sync(proxy.wait_for, *COMPLETE)
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 30)
        assert time.monotonic() - started < 4
    assert pending(store, key, BUCKET) == []


# ---------------------------------------------------------------- HttpSink's method


@pytest.mark.parametrize(
    ("method", "error"),
    [
        ("PUT /evil HTTP/1.1\r\nX-Injected: yes\r\nFoo:", stream_st.UsageError),
        ("GET", stream_st.UsageError),
        ("", stream_st.UsageError),
        ("put", stream_st.UsageError),
        (5, stream_st.ArgumentTypeError),
        (None, stream_st.ArgumentTypeError),
    ],
    ids=["crlf", "get", "empty", "lower-case", "int", "none"],
)
def test_http_sink_takes_only_put_or_post(method: Any, error: type[Exception]) -> None:
    """Any method went on the request line as given: a CRLF in it injected headers."""
    with pytest.raises(error, match="PUT' or 'POST"):
        HttpSink("http://127.0.0.1:9/x.safetensors", method=method)
    for method in ("PUT", "POST"):
        assert HttpSink("http://127.0.0.1:9/x.safetensors", method=method)._method == method


# ---------------------------------------------------------------- names a server takes


def saved(directory: Path, file_name: bytes) -> str:
    path = os.fsdecode(os.path.join(os.fsencode(directory), file_name))
    reference_numpy.save_file(SMALL, path)
    return path


@pytest.mark.parametrize(
    "file_name", [b"bad\xff.safetensors", b"new\nline.safetensors"], ids=["not-utf8", "newline"]
)
async def test_a_file_name_that_cannot_be_a_name_is_refused(
    tmp_path: Path, file_name: bytes
) -> None:
    """Not UTF-8, ``Server.url`` raised UnicodeEncodeError; with a newline, the URL answered
    404. Either is refused as name= would be, saying to give one; given one, it is served."""
    path = saved(tmp_path, file_name)
    with pytest.raises(stream_st.UsageError, match="name="):
        async with stream_st.serving(path) as server:
            server.url  # noqa: B018  # it raised UnicodeEncodeError
            await stream_st.load(server.url)
    async with stream_st.serving(path, name="renamed") as server:
        assert server.url.endswith("/renamed.safetensors")
        loaded = await stream_st.load(server.url)
    np.testing.assert_array_equal(loaded["a"], SMALL["a"])


def test_the_command_refuses_a_file_name_that_is_not_utf8(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stream-st serve`` exited 3, "internal error", on a UnicodeEncodeError."""
    path = saved(tmp_path, b"bad\xff.safetensors")
    assert main(["serve", "--port", "0", path]) == 2
    assert "--name" in capsys.readouterr().err


async def test_a_name_that_is_not_a_string_is_an_argument_type_error() -> None:
    """name=5 raised a bare TypeError ("argument of type 'int' is not iterable")."""
    with pytest.raises(stream_st.ArgumentTypeError, match="name must be a string"):
        async with stream_st.serving(SMALL, name=5):  # type: ignore[arg-type]
            pass


# ---------------------------------------------------------------- stopping a server


def stalled(port: int, path: str) -> socket.socket:
    """A client that asks for the whole object, takes its first bytes and reads no more."""
    client = socket.create_connection(("127.0.0.1", port))
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
    client.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    client.recv(1000)
    return client


@pytest.fixture
def big() -> Iterator[Arrays]:
    yield {"m": np.zeros(64 << 20, dtype=np.uint8)}


async def test_stopping_with_stalled_clients_takes_the_grace_once(big: Arrays) -> None:
    """aiohttp's shutdown_timeout was spent twice: answers to stalled clients held the server
    4 s, where two are documented."""
    clients = []
    async with stream_st.serving(big, checksums=False) as server:
        for _ in range(2):
            clients.append(await anyio.to_thread.run_sync(stalled, server.port, server.path))
        started = time.monotonic()
    took = time.monotonic() - started
    for client in clients:
        client.close()
    assert 1.5 < took < 3.0, took
