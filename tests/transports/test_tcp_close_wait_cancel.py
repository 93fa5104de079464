"""A ``tcp://`` sink's wait for the peer to close, after its whole message went out, is seen
through whatever cancellation comes, asyncio's own included (``Task.cancel``,
``asyncio.timeout``), which goes through anyio's shields: the cancellation takes effect once
the wait is over, and the peer gets every byte. Cut short, the sink closed its socket with the
peer's acknowledgements unread in it, and the kernel's reset dropped the message's end. And a
reset after the last byte went out does not claim the peer left the message unread: TCP does
not tell."""

from __future__ import annotations

import asyncio
import select
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
import trio

import stream_st
from stream_st import TransportError
from stream_st.transports import tcp

from .._util import assert_same_arrays

TENSORS = {"x": np.random.default_rng(0).random(131_072)}  # 1 MiB
"""Far more than the peer's small receive buffer holds: the message's end is still queued in the
writer's socket when its last send returns."""
PAUSE = 0.3
"""Seconds the peer stops reading once the writer waits for its close: the cancellation comes
meanwhile."""


@dataclass
class Peer:
    """What the peer got (its bytes, and how the connection ended: "EOF" or "reset"), and when
    the writer began to wait for its close (:attr:`waiting`, set by :func:`watch_the_wait`)."""

    data: bytearray = field(default_factory=bytearray)
    ending: str = ""
    waiting: threading.Event = field(default_factory=threading.Event)


def acknowledge_and_read(server: socket.socket, peer: Peer) -> None:
    """Accept one connection and read it slowly; once the writer waits for the close, send an
    acknowledgement the writer has not read, pause, then read to the end and close."""
    conn, _ = server.accept()
    with conn:
        while not peer.waiting.is_set():
            if select.select([conn], [], [], 0.01)[0]:
                peer.data += conn.recv(4096)
                time.sleep(0.001)  # slower than the writer: its socket stays full
        conn.sendall(b"ack")
        time.sleep(PAUSE)
        try:
            while chunk := conn.recv(1 << 16):
                peer.data += chunk
            peer.ending = "EOF"
        except ConnectionResetError:
            peer.ending = "reset"


@asynccontextmanager
async def slow_peer() -> AsyncIterator[tuple[str, Peer]]:
    """A blocking peer with a small receive buffer in a thread (see
    :func:`acknowledge_and_read`): its URL, and what it got once the block is left."""
    peer = Peer()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)  # the connection inherits
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(10)
    thread = threading.Thread(target=acknowledge_and_read, args=(server, peer), daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.getsockname()[1]}", peer
    finally:
        peer.waiting.set()
        await anyio.to_thread.run_sync(thread.join, 10)
        server.close()


def watch_the_wait(monkeypatch: pytest.MonkeyPatch, peer: Peer, began: anyio.Event) -> None:
    """Have the sink's wait for the close set ``began`` and tell ``peer`` as it starts."""
    finish = tcp.SocketSink._finish

    async def watched(self: tcp.SocketSink) -> None:
        began.set()
        peer.waiting.set()
        await finish(self)

    monkeypatch.setattr(tcp.SocketSink, "_finish", watched)


def assert_whole(peer: Peer) -> None:
    """The peer got the whole message and the writer's clean close."""
    assert peer.ending == "EOF"
    assert_same_arrays(reference_numpy.load(bytes(peer.data)), TENSORS)


async def task_cancelled(url: str, began: anyio.Event) -> None:
    """``Task.cancel`` of the task that writes, once the wait began."""
    write = asyncio.create_task(stream_st.save(url, TENSORS))
    await began.wait()
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write


async def task_cancelled_twice(url: str, began: anyio.Event) -> None:
    """``Task.cancel`` twice during the wait: raised once, at its end."""
    write = asyncio.create_task(stream_st.save(url, TENSORS))
    await began.wait()
    write.cancel()
    await asyncio.sleep(0.05)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write


async def timed_out(url: str, began: anyio.Event) -> None:
    """An ``asyncio.timeout`` around the write that expires during the wait: a TimeoutError,
    the timeout taking back the cancellation it made (it counts on that being raised once)."""
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(None) as timeout:

            async def expire() -> None:
                await began.wait()
                timeout.reschedule(asyncio.get_running_loop().time())

            expiry = asyncio.create_task(expire())
            await stream_st.save(url, TENSORS)
    await expiry
    assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]


@pytest.mark.parametrize("cancel", [task_cancelled, task_cancelled_twice, timed_out])
async def test_an_asyncio_cancellation_during_the_close_wait_takes_effect_once_it_is_over(
    monkeypatch: pytest.MonkeyPatch, cancel: Callable[[str, anyio.Event], Awaitable[None]]
) -> None:
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 5.0)
    async with slow_peer() as (url, peer):
        began = anyio.Event()
        watch_the_wait(monkeypatch, peer, began)
        with anyio.fail_after(10):
            await cancel(url, began)
    assert_whole(peer)


async def scope_cancelled_during_the_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """An anyio scope cancelled during the wait: the wait is over before the scope is left."""
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 5.0)
    async with slow_peer() as (url, peer):
        began = anyio.Event()
        watch_the_wait(monkeypatch, peer, began)
        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:

                async def write() -> None:
                    with anyio.CancelScope() as scope:
                        group.start_soon(cancel_once_waiting, scope)
                        await stream_st.save(url, TENSORS)

                async def cancel_once_waiting(scope: anyio.CancelScope) -> None:
                    await began.wait()
                    scope.cancel()

                group.start_soon(write)
    assert_whole(peer)


async def test_an_anyio_cancellation_during_the_close_wait_takes_effect_once_it_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    await scope_cancelled_during_the_wait(monkeypatch)


def test_an_anyio_cancellation_during_the_close_wait_takes_effect_once_it_is_over_on_trio(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trio.run(scope_cancelled_during_the_wait, monkeypatch)


# ---------------------------------------------------------------- a reset after the last byte


def read_all_and_reset(server: socket.socket) -> None:
    """Accept one connection, read every byte up to the writer's end, then close with a reset
    (``SO_LINGER`` 0)."""
    conn, _ = server.accept()
    with conn:
        while conn.recv(1 << 16):
            pass
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


async def test_a_reset_after_the_whole_message_was_read_claims_no_unread_bytes() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    thread = threading.Thread(target=read_all_and_reset, args=(server,), daemon=True)
    thread.start()
    try:
        with pytest.raises(TransportError) as caught, anyio.fail_after(10):
            await stream_st.save(f"tcp://127.0.0.1:{server.getsockname()[1]}", TENSORS)
    finally:
        await anyio.to_thread.run_sync(thread.join, 10)
        server.close()
    message = str(caught.value)
    assert "may not have read it in full" in message
    assert "before reading" not in message
