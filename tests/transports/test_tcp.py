"""TCP peers over real loopback sockets: tcp:// URLs, connections with many messages, faults."""

from __future__ import annotations

import asyncio
import gc
import re
import socket
import struct
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
import trio

import stream_st
from stream_st import (
    ReadTimeoutError,
    TensorSpec,
    TransportError,
    TruncatedStreamError,
    UnsupportedSourceError,
    UsageError,
)
from stream_st.kv import receive_kv

from .._util import assert_same_arrays, sample_file, sample_tensors
from ..conftest import StartSender

Arrays = dict[str, np.ndarray[Any, Any]]

SMALL: Arrays = {"x": np.arange(4, dtype=np.uint8)}
BIG = np.zeros(16 << 20, dtype=np.uint8)  # more than a peer with a small buffer takes in
SMALL_RECEIVE_BUFFER = 64 << 10


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


async def test_tcp_url(tcp_sender: StartSender) -> None:
    port = await tcp_sender(sample_file())
    assert_same_arrays(await read_all(f"tcp://127.0.0.1:{port}"), sample_tensors())


async def test_large_tensors_arrive_whole(tcp_sender: StartSender) -> None:
    tensors = {f"t{i}": np.random.default_rng(i).random(1 << 20) for i in range(3)}  # 8 MiB each
    port = await tcp_sender(reference_numpy.save(tensors))
    assert_same_arrays(
        await read_all(f"tcp://localhost:{port}", include=["t0", "t2"]),
        {k: tensors[k] for k in ("t0", "t2")},
    )


async def test_bad_tcp_urls_and_refused_connection() -> None:
    for url in ("tcp://127.0.0.1", "tcp://:80", "tcp://127.0.0.1:80/path"):
        with pytest.raises(UnsupportedSourceError):
            await read_all(url)
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with pytest.raises(TransportError, match=f"tcp://127.0.0.1:{port}"):
        await read_all(f"tcp://127.0.0.1:{port}")


async def test_peer_that_stops_sending_times_out() -> None:
    data = sample_file()
    stalled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(data[: len(data) // 2])
        await writer.drain()
        await stalled.wait()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ReadTimeoutError) as info:
            await read_all(f"tcp://127.0.0.1:{port}", timeout=0.2)
        assert info.value.position == len(data) // 2
    finally:
        stalled.set()
        server.close()
        await server.wait_closed()


async def test_a_tensor_that_trickles_in_counts_for_the_speed_guard() -> None:
    """A tensor filled by many small sends with pauses between: the bytes received before each
    wait count for the speed guard and the position, though a tensor is filled in one loop; the
    guard passes while they come and fails once they stop."""
    data = reference_numpy.save({"t": np.arange(20_000, dtype=np.uint8)})
    stalled = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for at in range(0, len(data) - 1000, 1000):
            writer.write(data[at : at + 1000])
            await writer.drain()
            await asyncio.sleep(0.01)
        await stalled.wait()  # the last bytes never come
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ReadTimeoutError, match="speed_limit") as info:  # at the stall only
            await read_all(f"tcp://127.0.0.1:{port}", speed_limit=2000, speed_time=0.1)
        assert info.value.position == len(range(0, len(data) - 1000, 1000)) * 1000
    finally:
        stalled.set()
        server.close()
        await server.wait_closed()


async def test_peer_that_closes_mid_tensor(tcp_sender: StartSender) -> None:
    data = sample_file()
    port = await tcp_sender(data[:-2])
    with pytest.raises(TruncatedStreamError) as info:
        await read_all(f"tcp://127.0.0.1:{port}")
    assert info.value.offset == len(data) - 2
    assert f"tcp://127.0.0.1:{port}" in str(info.value)


async def test_listener_and_connection_session() -> None:
    messages: list[Arrays] = [
        {"a": np.arange(i + 1, dtype=np.float32), "b": np.full((2, i), i, dtype=np.int16)}
        for i in range(5)
    ]
    received: list[Arrays] = []
    async with stream_st.listen("127.0.0.1", 0, timeout=5) as listener:

        async def sender() -> None:
            async with await anyio.connect_tcp("127.0.0.1", listener.port) as stream:
                for message in messages:
                    await stream.send(reference_numpy.save(message))

        async with anyio.create_task_group() as group:
            group.start_soon(sender)
            async with await listener.accept() as connection:
                async for stream in connection.messages():
                    received.append({name: array async for name, array in stream})
    assert len(received) == len(messages)
    for got, expected in zip(received, messages, strict=True):
        assert_same_arrays(got, expected)


async def test_connect_reads_messages_in_turn(tcp_sender: StartSender) -> None:
    first: Arrays = {"x": np.arange(3, dtype=np.uint8)}
    second: Arrays = {"y": np.ones(4, dtype=np.float64)}
    port = await tcp_sender(reference_numpy.save(first) + reference_numpy.save(second))
    async with await stream_st.connect(f"tcp://127.0.0.1:{port}") as connection:
        async with connection.open_stream() as stream:
            assert_same_arrays({n: a async for n, a in stream}, first)
        async with connection.open_stream() as stream:
            assert stream.header.names() == ["y"]
            assert_same_arrays({n: a async for n, a in stream}, second)
        assert [s async for s in connection.messages()] == []  # the peer closed cleanly


async def test_a_message_asked_for_once_the_peer_closed_says_so(tcp_sender: StartSender) -> None:
    """open_stream() and receive_kv() on a connection whose peer had closed it cleanly after
    its last message failed with a HeaderError: 'a safetensors file starts with an 8-byte
    header length; got only 0 bytes'."""
    port = await tcp_sender(reference_numpy.save(SMALL))
    async with await stream_st.connect(f"tcp://127.0.0.1:{port}", timeout=5) as connection:
        async with connection.open_stream() as stream:
            assert_same_arrays({n: a async for n, a in stream}, SMALL)
        said = r"^tcp://127\.0\.0\.1:\d+: the peer closed the connection before the next message$"
        with pytest.raises(TruncatedStreamError, match=said):
            async with connection.open_stream():
                pass
        with pytest.raises(TruncatedStreamError, match=said):
            async with receive_kv(connection):
                pass


async def test_leaving_messages_after_a_read_message_frees_the_connection(
    tcp_sender: StartSender,
) -> None:
    first: Arrays = {"x": np.arange(3, dtype=np.uint8)}
    second: Arrays = {"y": np.ones(4, dtype=np.float64)}
    port = await tcp_sender(reference_numpy.save(first) + reference_numpy.save(second))
    async with await stream_st.connect(f"tcp://127.0.0.1:{port}") as connection:
        async for stream in connection.messages():
            assert_same_arrays({n: a async for n, a in stream}, first)
            break  # the generator stays suspended until collected: it must not hold the turn
        async with connection.open_stream() as stream:
            assert_same_arrays({n: a async for n, a in stream}, second)


def test_leaving_the_iterations_early_on_trio_leaves_nothing_to_the_collector() -> None:
    """A ``break`` out of ``async for connection in listener`` or ``async for stream in
    connection.messages()`` on trio, inside ``async with listen()`` and ``async with
    connection``, gave a ResourceWarning: each iteration was an async generator, collected
    unfinished."""
    first: Arrays = {"x": np.arange(3, dtype=np.uint8)}
    second: Arrays = {"y": np.ones(4, dtype=np.float64)}

    async def main() -> list[Arrays]:
        got: list[Arrays] = []
        async with (
            stream_st.listen("127.0.0.1", 0, timeout=5) as listener,
            anyio.create_task_group() as group,
        ):

            async def send() -> None:
                async with await stream_st.connect(listener.url, timeout=5) as connection:
                    for message in (first, second):
                        await stream_st.save(connection, message)

            group.start_soon(send)
            async for connection in listener:
                async with connection:
                    async for stream in connection.messages():
                        got.append({n: a async for n, a in stream})
                        break
                    async with connection.open_stream() as stream:
                        got.append({n: a async for n, a in stream})
                break
        return got

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = anyio.run(main, backend="trio")
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert len(got) == 2
    assert_same_arrays(got[0], first)
    assert_same_arrays(got[1], second)


async def test_closing_the_messages_iteration_closes_its_stream(tcp_sender: StartSender) -> None:
    """``async with connection.messages()`` closes the stream handed out last, as ``aclose()``
    does: one left part way then makes the next read say so; the iteration ends there."""
    port = await tcp_sender(reference_numpy.save(sample_tensors()) * 2)
    async with await stream_st.connect(f"tcp://127.0.0.1:{port}", timeout=5) as connection:
        async with connection.messages() as messages:
            async for stream in messages:
                async for _ in stream:
                    break
                break
        assert [s async for s in messages] == []
        with pytest.raises(UsageError, match="the previous message was left at its byte"):
            async with connection.open_stream():
                pass


def test_tcp_on_trio() -> None:
    data = sample_file()

    async def main() -> Arrays:
        async with stream_st.listen("127.0.0.1", 0) as listener, trio.open_nursery() as nursery:

            async def send() -> None:
                stream = await trio.open_tcp_stream("127.0.0.1", listener.port)
                async with stream:
                    await stream.send_all(data)

            nursery.start_soon(send)
            connection = await listener.accept()
            async with connection, connection.open_stream() as stream:
                return {name: array async for name, array in stream}

    assert_same_arrays(trio.run(main), sample_tensors())


# ---------------------------------------------------------------- misuse and faults


def small_buffer_socket() -> socket.socket:
    """A TCP socket that takes in little before its sender blocks (no receive autotuning)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_RECEIVE_BUFFER)
    return sock


def reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset instead of a clean close."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@asynccontextmanager
async def connected() -> AsyncIterator[tuple[socket.socket, stream_st.Connection]]:
    """A plain (blocking) peer socket, and the Connection accepted from it (no timeout)."""
    async with stream_st.listen("127.0.0.1", 0) as listener:
        with small_buffer_socket() as peer:
            peer.connect(("127.0.0.1", listener.port))
            async with await listener.accept() as connection:
                yield peer, connection


def received(peer: socket.socket) -> Arrays:
    """Everything the peer receives until the connection closes, as one safetensors file."""
    data = b"".join(iter(lambda: peer.recv(1 << 16), b""))
    arrays: Arrays = reference_numpy.load(data)
    return arrays


@pytest.mark.parametrize("url", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:abc"])
async def test_bad_port_in_a_tcp_url_is_a_usage_error(url: str) -> None:
    names_url = re.escape(repr(url))
    with pytest.raises(UsageError, match=names_url):
        await read_all(url)
    with pytest.raises(UsageError, match=names_url):
        await stream_st.connect(url)
    with pytest.raises(UsageError, match=names_url):
        await stream_st.save(url, SMALL)
    for broken in (stream_st.connect, stream_st.load):  # load looks for an index name first
        with pytest.raises(UsageError, match="Invalid IPv6 URL"):
            await broken("tcp://[::1:80")


async def test_listen_failures() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        with pytest.raises(TransportError, match="in use") as info:
            async with stream_st.listen("127.0.0.1", port):
                pass
    assert isinstance(info.value, OSError)
    assert info.value.url == f"tcp://127.0.0.1:{port}"
    with pytest.raises(TransportError, match=r"no-such-host\.invalid"):
        async with stream_st.listen("no-such-host.invalid", 0):
            pass
    with pytest.raises(UsageError, match="65536"):
        async with stream_st.listen("127.0.0.1", 65536):
            pass


async def test_accept_after_the_listener_closed() -> None:
    async with stream_st.listen("127.0.0.1", 0) as listener:
        pass
    with pytest.raises(UsageError, match="the listener is closed"):
        await listener.accept()


async def test_leaving_listen_wakes_the_tasks_accepting() -> None:
    """A task waiting in accept gets a TransportError, as one waiting on a connection does (it
    was a UsageError, where the manual promised a TransportError)."""

    async def accept_until_closed(listener: stream_st.Listener) -> None:
        with pytest.raises(TransportError, match="accept failed: the listener was closed"):
            await listener.accept()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group, stream_st.listen() as listener:
            group.start_soon(accept_until_closed, listener)  # waits on the socket
            group.start_soon(accept_until_closed, listener)  # waits for its turn
            await anyio.wait_all_tasks_blocked()


async def test_a_connection_given_as_a_source_says_how_it_is_read() -> None:
    """save(connection) writes its next message, but load(connection) fell to the generic
    refusal ("expected a path, URL, bytes, ..."), naming nothing a connection has."""
    with anyio.fail_after(5):
        async with connected() as (_, connection):
            given: Any = connection  # what the types refuse, as a caller without them passes it
            for read in (stream_st.load, read_all):
                with pytest.raises(UnsupportedSourceError, match=r"connection\.open_stream\(\)"):
                    await read(given)


async def test_a_listener_is_no_source() -> None:
    """A Listener iterates connections: taken for an async iterable of byte chunks, reading it
    waited for a peer and then failed on its connection (or waited for ever without one)."""
    with anyio.fail_after(5):
        async with stream_st.listen("127.0.0.1", 0) as listener:
            with pytest.raises(UnsupportedSourceError, match="accept a connection first"):
                await read_all(listener)
            with pytest.raises(UnsupportedSourceError, match="accept a connection first"):
                async with receive_kv(listener):
                    pass


async def test_tasks_accept_at_once() -> None:
    names: list[str] = []
    async with stream_st.listen("127.0.0.1", 0) as listener:

        async def accept_one() -> None:
            async with await listener.accept() as connection:
                names.append(connection.name)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(accept_one)
                group.start_soon(accept_one)
                await anyio.wait_all_tasks_blocked()
                async with (
                    await anyio.connect_tcp("127.0.0.1", listener.port),
                    await anyio.connect_tcp("127.0.0.1", listener.port),
                ):
                    pass
    assert len(set(names)) == 2


@pytest.mark.parametrize("host", ["::1", "[::1]"])  # the second as a tcp:// URL writes it
async def test_ipv6_listener_url(host: str) -> None:
    async with stream_st.listen(host, 0) as listener:
        assert listener.url == f"tcp://[::1]:{listener.port}"
        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(stream_st.save, listener.url, SMALL)
                async with await listener.accept() as connection:
                    assert connection.name.startswith("tcp://[::1]:")
                    async with connection.open_stream() as stream:
                        assert_same_arrays({n: a async for n, a in stream}, SMALL)


async def test_peer_reset_between_messages_is_a_transport_error() -> None:
    got: list[Arrays] = []
    async with connected() as (peer, connection):
        peer.sendall(reference_numpy.save(SMALL))
        with anyio.fail_after(5), pytest.raises(TransportError, match="reset") as info:
            async for stream in connection.messages():
                got.append({n: a async for n, a in stream})
                reset(peer)  # a clean close would end the messages: test_connect_reads_...
    assert not isinstance(info.value, ReadTimeoutError)
    assert len(got) == 1
    assert_same_arrays(got[0], SMALL)


async def test_one_message_read_at_a_time() -> None:
    got: list[Arrays] = []
    async with connected() as (peer, connection):

        async def read_one() -> None:
            async with connection.open_stream() as stream:
                got.append({n: a async for n, a in stream})

        with anyio.fail_after(5):
            async with anyio.create_task_group() as group:
                group.start_soon(read_one)
                await anyio.wait_all_tasks_blocked()  # the first reader waits for its header
                with pytest.raises(UsageError, match="one message at a time on a connection"):
                    async with connection.open_stream():
                        pass
                peer.sendall(reference_numpy.save(SMALL) * 2)
            async with connection.open_stream() as first:  # the refused stream took no byte
                with pytest.raises(UsageError, match="not closed yet"):  # nor does this one
                    async with connection.open_stream():
                        pass
                got.append({n: a async for n, a in first})
    assert len(got) == 2
    for arrays in got:
        assert_same_arrays(arrays, SMALL)


async def test_one_message_written_at_a_time() -> None:
    plan = [TensorSpec("x", "U8", (4,))]
    async with connected() as (peer, connection):
        async with connection.open_writer(plan) as writer:
            with pytest.raises(UsageError, match="one message at a time on a connection"):
                async with connection.open_writer(plan):
                    pass
            await writer.write("x", SMALL["x"])  # the refused writer neither wrote nor closed
        await connection.aclose()
        assert_same_arrays(received(peer), SMALL)


async def test_a_connection_is_a_destination_of_open_writer_and_save() -> None:
    arrays: Arrays = {"x": np.arange(3, dtype=np.float32), "y": np.ones((2, 2), np.int16)}
    plan = [TensorSpec(name, array.dtype, array.shape) for name, array in arrays.items()]
    got: list[tuple[Arrays, dict[str, str]]] = []
    async with stream_st.listen("127.0.0.1", 0) as listener:

        async def receive() -> None:
            async with await listener.accept() as connection:
                async for stream in connection.messages():  # digests checked as it reads
                    got.append(({n: a async for n, a in stream}, dict(stream.header.metadata)))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(receive)
                async with await stream_st.connect(listener.url) as connection:
                    async with stream_st.open_writer(connection, plan) as writer:
                        await writer.write_many(arrays)
                    await stream_st.save(connection, arrays, checksums=True)
                    digests = stream_st.Digests.compute(arrays)
                    async with connection.open_writer(plan, checksums=digests) as writer:
                        await writer.write_many(arrays)
                    with pytest.raises(UsageError, match="give them up front"):
                        async with connection.open_writer(plan, checksums=True):
                            pass
                    async with connection.open_writer(plan) as writer:  # the refusal sent nothing
                        await writer.write_many(arrays)
    assert len(got) == 4
    for message, _ in got:
        assert_same_arrays(message, arrays)
    assert [metadata.get("stream_st.digest") for _, metadata in got] == [
        None,
        "xxh3-128",
        "xxh3-128",
        None,
    ]


async def test_a_connection_given_to_save_keeps_its_limits() -> None:
    async with stream_st.listen("127.0.0.1", 0, timeout=0.3) as listener:
        with small_buffer_socket() as peer:  # connects, never reads
            peer.connect(("127.0.0.1", listener.port))
            async with await listener.accept() as connection:
                with anyio.fail_after(5), pytest.raises(ReadTimeoutError):
                    await stream_st.save(connection, {"big": BIG})
                with pytest.raises(UsageError, match="the connection is closed"):
                    await stream_st.save(connection, SMALL)  # the failed message closed it


async def until_blocked_then(close: Callable[[], Awaitable[None]], blocked: Awaitable[Any]) -> None:
    """Run ``blocked`` (no timeout of its own) and ``close`` from another task once it waits;
    ``blocked`` must fail promptly with a TransportError."""

    async def close_when_blocked() -> None:
        await anyio.wait_all_tasks_blocked()
        await close()

    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            group.start_soon(close_when_blocked)
            with pytest.raises(TransportError, match="closed on this side"):
                await blocked


async def read_header_of(stream: stream_st.TensorStream) -> None:
    async with stream:
        pass


async def close_wakes_reader() -> None:
    async with connected() as (_, connection):
        await until_blocked_then(connection.aclose, read_header_of(connection.open_stream()))


async def test_closing_a_connection_wakes_its_reader() -> None:
    await close_wakes_reader()


def test_closing_a_connection_wakes_its_reader_on_trio() -> None:
    trio.run(close_wakes_reader)


async def test_closing_a_connection_wakes_its_writer() -> None:
    async def write_big(connection: stream_st.Connection) -> None:
        async with connection.open_writer([TensorSpec("big", "U8", BIG.shape)]) as writer:
            await writer.write("big", BIG)

    async with connected() as (_, connection):  # the peer reads nothing
        await until_blocked_then(connection.aclose, write_big(connection))


async def test_closing_a_tcp_stream_wakes_its_reader() -> None:
    async with stream_st.listen("127.0.0.1", 0) as listener:  # accepts, never sends
        stream = stream_st.open_stream(listener.url)
        await until_blocked_then(stream.aclose, read_header_of(stream))


async def close_wakes_a_callers_stream_reader(kind: str, sent: int) -> None:
    """A stream over the caller's connection (``kind``: an anyio stream, an asyncio reader),
    closed from another task while its loop waits for a peer that sent ``sent`` bytes and then
    nothing: the loop fails at once, as over a tcp:// URL. It waited for the peer's next bytes
    (for ever), then failed with "the stream is not open" where the close came during the
    header."""
    data = sample_file()
    done = anyio.Event()

    async def serve(client: anyio.abc.SocketStream) -> None:
        async with client:
            await client.send(data[:sent])
            await done.wait()

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        if kind == "anyio":
            async with await anyio.connect_tcp("127.0.0.1", port) as connection:
                stream = stream_st.open_stream(connection)
                await until_blocked_then(stream.aclose, read_all_of(stream))
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            stream = stream_st.open_stream(reader)
            await until_blocked_then(stream.aclose, read_all_of(stream))
            writer.close()
        done.set()
        group.cancel_scope.cancel()


async def read_all_of(stream: stream_st.TensorStream) -> None:
    async for _ in stream:
        pass


@pytest.mark.parametrize("sent", [4, 20, len(sample_file()) - 1])  # prefix, header, a tensor
@pytest.mark.parametrize("kind", ["anyio", "asyncio"])
async def test_closing_a_stream_over_a_callers_connection_wakes_its_loop(
    kind: str, sent: int
) -> None:
    await close_wakes_a_callers_stream_reader(kind, sent)


def test_closing_a_stream_over_an_anyio_connection_wakes_its_loop_on_trio() -> None:
    for sent in (4, 20, len(sample_file()) - 1):
        trio.run(close_wakes_a_callers_stream_reader, "anyio", sent)


async def test_aborting_a_tcp_writer_wakes_its_sender() -> None:
    with small_buffer_socket() as server:  # accepts (backlog), never reads
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"tcp://127.0.0.1:{server.getsockname()[1]}"
        writer = stream_st.open_writer(url, [TensorSpec("big", "U8", BIG.shape)])
        await writer.open()
        await until_blocked_then(writer.abort, writer.write("big", BIG))
