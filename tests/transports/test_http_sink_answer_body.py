"""The body of the answer to an HTTP upload: once the server answered 2xx to the complete body,
the upload is committed, whatever that answer's body then does (stall, never end, break its
framing); an error answer still says what its body says.

A raw server on 127.0.0.1 stores each PUT's whole body, then sends a chosen answer and, for the
stalling ones, goes silent until the test ends.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.http import HTTPClient, HTTPStatusError
from stream_st.transports.http.sink import HttpSink

from ..servers._loopback import LoopbackServer

pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]

TENSORS = {"a": np.arange(1000, dtype=np.float64)}
STORED = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nstored"
STALLS = {  # a 2xx head, then part of its body (or garbage), then silence
    "length": b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\nstored",
    "chunked": b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n6\r\nstored\r\n",
    "until-close": b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nstored",
    "garbled": b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\nqq\r\n",
}
FAILED = b"HTTP/1.1 507 Insufficient Storage\r\nContent-Length: 9\r\n\r\ndisk full"
LIMIT = 10.0  # seconds any one save may take here: far more than a committed one needs


class UploadServer(LoopbackServer):
    """Answers every PUT with ``answer`` once its whole body is in (kept in ``stored``); with
    ``stall`` it then sends nothing more until :meth:`stop`, else it serves the connection's
    next request. ``connections`` counts the connections accepted."""

    def __init__(self, answer: bytes, *, stall: bool) -> None:
        self.answer = answer
        self.stall = stall
        self.stored: list[bytes] = []
        self.connections = 0
        self._released = threading.Event()
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}/m.safetensors"

    def handle(self, connection: socket.socket) -> None:
        self.connections += 1
        buffer = b""
        while True:
            while b"\r\n\r\n" not in buffer:
                more = connection.recv(65536)
                if not more:
                    return
                buffer += more
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            length = next(
                int(line.partition(b":")[2])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            while len(buffer) < length:
                more = connection.recv(1 << 20)
                if not more:
                    return
                buffer += more
            self.stored.append(buffer[:length])
            buffer = buffer[length:]
            connection.sendall(self.answer)
            if self.stall:
                self._released.wait()
                return

    def stop(self) -> None:
        """Let the stalled answers end, then stop as a :class:`LoopbackServer` does."""
        self._released.set()
        super().stop()


def serve(answer: bytes, *, stall: bool) -> Iterator[UploadServer]:
    """An :class:`UploadServer`, stopped afterwards."""
    server = UploadServer(answer, stall=stall)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(params=sorted(STALLS))
def stalling(request: pytest.FixtureRequest) -> Iterator[UploadServer]:
    """A server whose 2xx answers stall in their body (each way of delimiting one), or garble
    it."""
    yield from serve(STALLS[request.param], stall=True)


@pytest.fixture
def storing() -> Iterator[UploadServer]:
    """A server answering each upload with a short, whole 200 on a kept-alive connection."""
    yield from serve(STORED, stall=False)


@pytest.fixture
def failing() -> Iterator[UploadServer]:
    """A server answering each upload with a 507 that says why."""
    yield from serve(FAILED, stall=False)


def payload() -> bytes:
    """The bytes a save of ``TENSORS`` uploads: the reference writer's."""
    return reference_numpy.save(TENSORS)


@pytest.mark.parametrize("timeout", [None, 2.0])
async def test_stalled_body_of_a_2xx_answer_still_commits(
    stalling: UploadServer, timeout: float | None
) -> None:
    """The server stored the message and said so: the save succeeds, with or without a read
    timeout, where it raised a read timeout at the body's 6th byte or waited forever."""
    with anyio.fail_after(LIMIT):
        await stream_st.save(stalling.url, TENSORS, timeout=timeout)
    assert stalling.stored == [payload()]


async def test_unread_answer_never_returns_to_a_shared_pool(stalling: UploadServer) -> None:
    """A shared client's next upload after a stalled answer goes out on a fresh connection and
    commits: the stalled one, its body unread, was dropped."""
    async with HTTPClient() as client:
        for _ in range(2):
            with anyio.fail_after(LIMIT):
                await stream_st.save(HttpSink(stalling.url, client=client), TENSORS)
    assert stalling.stored == [payload()] * 2
    assert stalling.connections == 2


async def test_short_whole_answer_keeps_its_connection(storing: UploadServer) -> None:
    """A short 2xx answer that arrives whole is read, so a shared client reuses its
    connection for the next upload."""
    async with HTTPClient() as client:
        for _ in range(2):
            with anyio.fail_after(LIMIT):
                await stream_st.save(HttpSink(storing.url, client=client), TENSORS)
    assert storing.stored == [payload()] * 2
    assert storing.connections == 1


async def test_error_answer_still_reports_its_body(failing: UploadServer) -> None:
    """An error answer is no commit: the save raises the status with what its body says."""
    with anyio.fail_after(LIMIT), pytest.raises(HTTPStatusError, match="disk full") as caught:
        await stream_st.save(failing.url, TENSORS, timeout=2.0)
    assert caught.value.status == 507
