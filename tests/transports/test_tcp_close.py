"""How a ``tcp://`` sink ends its connection, over real loopback sockets: a message written in
full ends gracefully (the peer gets every byte even when it sent bytes the writer never read),
within a bounded grace; a message cut short still closes at once. And a host that is no valid
name is a UsageError, not an idna error."""

from __future__ import annotations

import functools
import re
import select
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
import trio

import stream_st
from stream_st import TensorSpec, UsageError
from stream_st.transports import tcp
from stream_st.transports.tcp import SocketSink, connect_socket

from .._util import assert_same_arrays

Arrays = dict[str, np.ndarray[Any, Any]]

TENSORS: Arrays = {f"w{i}": np.random.default_rng(i).random(300_000) for i in range(3)}  # 7.2 MB
"""More than the kernel's socket buffers hold: the message's end is still queued when the
writer's last send returns."""
PLAN = [TensorSpec(name, array.dtype, array.shape) for name, array in TENSORS.items()]
GREETING = b"hello"
PROMPT = 1.0
"""Seconds within which a close that does not wait for the peer returns (CLOSE_GRACE is set far
above it where that is checked)."""


@dataclass
class Received:
    """What the peer got: its bytes, and how the connection ended ("EOF" or "reset")."""

    data: bytearray = field(default_factory=bytearray)
    ending: str = ""
    release: threading.Event = field(default_factory=threading.Event)


def serve_one(server: socket.socket, got: Received) -> None:
    """Accept one connection, send a greeting nobody reads, receive until the end, and close
    only once ``got.release`` is set."""
    conn, _ = server.accept()
    with conn:
        conn.sendall(GREETING)
        try:
            while chunk := conn.recv(1 << 16):
                got.data += chunk
            got.ending = "EOF"
        except ConnectionResetError:
            got.ending = "reset"
        got.release.wait(10)


@asynccontextmanager
async def greeting_peer(*, closes_at_end: bool) -> AsyncIterator[tuple[str, Received]]:
    """A blocking peer in a thread (see :func:`serve_one`): its URL, and what it receives once
    the block is left. ``closes_at_end``: it closes as soon as it sees the end, else it keeps
    its side open until the block is left."""
    got = Received()
    if closes_at_end:
        got.release.set()
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    thread = threading.Thread(target=serve_one, args=(server, got), daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{server.getsockname()[1]}", got
    finally:
        got.release.set()
        await anyio.to_thread.run_sync(thread.join, 10)
        server.close()


def arrays_of(data: bytearray) -> Arrays:
    arrays: Arrays = reference_numpy.load(bytes(data))
    return arrays


# ---------------------------------------------------------------- a message written in full


async def complete_write_to_a_greeting_peer() -> None:
    for _ in range(3):  # the reset lost the end most times, not always
        async with greeting_peer(closes_at_end=True) as (url, got):
            with anyio.fail_after(10):
                await stream_st.save(url, TENSORS)
        assert got.ending == "EOF"
        assert_same_arrays(arrays_of(got.data), TENSORS)


async def test_a_complete_write_reaches_a_peer_whose_greeting_was_never_read() -> None:
    await complete_write_to_a_greeting_peer()


def test_a_complete_write_reaches_a_peer_whose_greeting_was_never_read_on_trio() -> None:
    trio.run(complete_write_to_a_greeting_peer)


async def test_a_peer_that_keeps_its_side_open_costs_the_grace_at_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 0.3)
    async with greeting_peer(closes_at_end=False) as (url, got):
        began = time.monotonic()
        with anyio.fail_after(10):
            async with stream_st.open_writer(url, PLAN) as writer:
                for name, array in TENSORS.items():
                    await writer.write(name, array)
        took = time.monotonic() - began
    assert 0.3 <= took < 0.3 + PROMPT
    assert got.ending == "EOF"  # the writer's FIN, before the peer closed
    assert_same_arrays(arrays_of(got.data), TENSORS)


def read_some_and_close(server: socket.socket, seen: threading.Event) -> None:
    """Accept one connection, read its first bytes, and close once the rest has arrived unread
    (a reset)."""
    conn, _ = server.accept()
    with conn:
        conn.recv(100)
        seen.set()
        # The writer has sent its last byte and waits for the close: its FIN came, behind the
        # bytes left unread (not a fixed wait, which a loaded machine outlasts).
        ended = select.poll()
        ended.register(conn, select.POLLRDHUP)
        ended.poll(10_000)


async def peer_that_reads_part(
    write: Callable[[str], Awaitable[object]],
) -> None:
    """``write(url)`` to a peer that resets the connection with most of the message unread,
    after the message's last byte went out, is a TransportError saying so."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    seen = threading.Event()
    thread = threading.Thread(target=read_some_and_close, args=(server, seen), daemon=True)
    thread.start()
    try:
        with (
            pytest.raises(stream_st.TransportError, match="reset the connection after the message"),
            anyio.fail_after(10),
        ):
            await write(f"tcp://127.0.0.1:{server.getsockname()[1]}")
    finally:
        await anyio.to_thread.run_sync(thread.join, 10)
        server.close()
    assert seen.is_set()


SMALL = {"x": np.arange(8000, dtype=np.float64)}  # 64 kB: within the socket buffers


async def test_a_peer_that_resets_with_the_message_unread_is_no_delivery() -> None:
    await peer_that_reads_part(functools.partial(stream_st.save, tensors=SMALL))


def test_a_peer_that_resets_with_the_message_unread_is_no_delivery_on_trio() -> None:
    trio.run(peer_that_reads_part, functools.partial(stream_st.save, tensors=SMALL))


# ---------------------------------------------------------------- a message cut short


async def aborted_write_closes_at_once() -> None:
    async with greeting_peer(closes_at_end=False) as (url, got):
        writer = stream_st.open_writer(url, PLAN)
        size = (await writer.open()).file_size
        await writer.write("w0", TENSORS["w0"])
        began = time.monotonic()
        await writer.abort()
        assert time.monotonic() - began < PROMPT  # no wait for a peer that stays open
    assert got.ending in ("EOF", "reset")
    assert len(got.data) < size


async def test_an_aborted_write_closes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 5.0)
    await aborted_write_closes_at_once()


async def cancelled_write_closes_at_once() -> None:
    async with greeting_peer(closes_at_end=False) as (url, got):
        began = time.monotonic()
        with anyio.CancelScope() as scope:
            async with stream_st.open_writer(url, PLAN) as writer:
                await writer.write("w0", TENSORS["w0"])
                scope.cancel()
                await writer.write("w1", TENSORS["w1"])
        assert scope.cancelled_caught
        assert time.monotonic() - began < PROMPT
        size = writer.header.file_size
    assert got.ending in ("EOF", "reset")
    assert len(got.data) < size


async def test_a_cancelled_write_closes_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 5.0)
    await cancelled_write_closes_at_once()


def test_a_cancelled_write_closes_at_once_on_trio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 5.0)
    trio.run(cancelled_write_closes_at_once)


async def test_a_sink_closed_short_of_its_announced_length_closes_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tcp, "CLOSE_GRACE", 5.0)
    async with greeting_peer(closes_at_end=False) as (url, got):
        port = int(url.rsplit(":", 1)[1])
        sink = SocketSink(await connect_socket("127.0.0.1", port), url)
        await sink.allocate(100)
        await sink.send(memoryview(b"x" * 10))
        began = time.monotonic()
        await sink.aclose()
        assert time.monotonic() - began < PROMPT
    assert got.data == b"x" * 10


# ---------------------------------------------------------------- hosts that are no name

BAD_HOSTS = ["\udcff", "a\u3002\u3002b", "b\u00fc\u200db"]  # a lone surrogate, empty labels, ZWJ


@pytest.mark.parametrize("host", BAD_HOSTS)
async def test_a_host_that_is_no_valid_name_is_a_usage_error(host: str) -> None:
    url = f"tcp://{host}:1"
    names_url = re.escape(repr(url)) + ".*not a valid host name"
    with pytest.raises(UsageError, match=names_url):
        await stream_st.save(url, {"x": np.zeros(1)}, timeout=2)
    with pytest.raises(UsageError, match=names_url):
        async with stream_st.open_stream(url, timeout=2):
            pass
    with pytest.raises(UsageError, match=names_url):
        await stream_st.connect(url, timeout=2)


def test_a_host_that_is_no_valid_name_is_a_usage_error_on_trio() -> None:
    async def main() -> None:
        with pytest.raises(UsageError, match="not a valid host name"):
            await stream_st.save(f"tcp://{BAD_HOSTS[0]}:1", {"x": np.zeros(1)}, timeout=2)

    trio.run(main)
