"""TCP peers over real loopback sockets: tcp:// URLs, connections with many messages, faults."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy
import trio

import stream_st
from stream_st import ReadTimeoutError, TransportError, TruncatedStreamError, UnsupportedSourceError

from ._util import assert_same_arrays, sample_file, sample_tensors
from .conftest import StartSender

Arrays = dict[str, np.ndarray[Any, Any]]


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
