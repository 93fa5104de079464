"""KV-cache transfer over real loopback TCP: pipelining, codecs, integrity, faults, sessions."""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import socket
import ssl
import struct
import time
import warnings
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import trio

import stream_st
import stream_st.transports.base
import stream_st.transports.tcp
from stream_st import TransportError
from stream_st.core.codecs import error_stats
from stream_st.errors import CodecError
from stream_st.kv import IntegrityError, KVLayout, SendReport, receive_kv, send_kv

from ..servers.http_server import RangeHTTPServer

Array = np.ndarray[Any, Any]
SHAPE = (1, 4, 64, 64)


def kv(layer: int, shape: tuple[int, ...] = SHAPE) -> tuple[Array, Array]:
    rng = np.random.default_rng(layer)
    return (
        rng.standard_normal(shape).astype(np.float16),
        rng.standard_normal(shape).astype(np.float16),
    )


async def produce(
    layers: int, shape: tuple[int, ...] = SHAPE
) -> AsyncIterator[tuple[int, Array, Array]]:
    for layer in range(layers):
        key, value = kv(layer, shape)
        yield layer, key, value


class CountedLayers:
    """The same key and value as every layer of ``layout``; counts the layers the sender pulled."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.pulled = 0

    async def __aiter__(self) -> AsyncIterator[tuple[int, Array, Array]]:
        key, value = kv(0, self.layout.shape)
        for layer in range(self.layout.num_layers):
            self.pulled += 1
            yield layer, key, value


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
async def test_transfer_over_tcp_with_each_codec(codec: str) -> None:
    layout = KVLayout(num_layers=4, shape=SHAPE, dtype="F16", codec=codec)
    got: dict[int, tuple[Array, Array]] = {}
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receiver() -> None:
            async with await listener.accept() as connection, receive_kv(connection) as kv_in:
                assert kv_in.layout == layout
                async for layer, key, value in kv_in:
                    got[layer] = (key, value)

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            report = await send_kv(listener.url, layout, produce(4))
    assert sorted(got) == [0, 1, 2, 3]
    assert report.wire_bytes > 4 * layout.layer_bytes
    for layer, (key, value) in got.items():
        expected_key, expected_value = kv(layer)
        assert key.dtype == np.float16 and key.shape == SHAPE
        if codec == "none":
            assert np.array_equal(key, expected_key) and np.array_equal(value, expected_value)
        else:
            snr = error_stats(expected_key, key)["snr_db"]
            assert snr > (35 if codec == "int8" else 15)


async def test_a_receiver_keeping_the_connection_open_costs_the_grace_uncancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As docs/kv.md says: send_kv to a tcp:// URL waits for the receiver to close, up to
    CLOSE_GRACE, and a cancellation does not cut that wait short."""
    monkeypatch.setattr(stream_st.transports.tcp, "CLOSE_GRACE", 1.0)
    layout = KVLayout(num_layers=1, shape=SHAPE)
    layers: list[int] = []
    sending = anyio.CancelScope()
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receiver() -> None:
            async with await listener.accept() as connection:
                async with receive_kv(connection) as kv_in:
                    layers.extend([layer async for layer, _, _ in kv_in])
                await anyio.sleep(0.2)  # the message read, the connection kept open...
                sending.cancel()  # ...and the sender, waiting for its close, cancelled
                await anyio.sleep(5)

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            began = time.monotonic()
            with sending:
                report = await send_kv(listener.url, layout, produce(1))
            took = time.monotonic() - began
            group.cancel_scope.cancel()
    assert layers == [0] and report.wire_bytes > layout.layer_bytes
    assert 1.0 <= took < 3


def test_kv_transfer_on_trio() -> None:
    layout = KVLayout(num_layers=3, shape=(1, 4, 1024, 64), codec="int8")  # parts hashed in threads

    async def main() -> list[int]:
        got = []
        async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

            async def receiver() -> None:
                async with await listener.accept() as connection, receive_kv(connection) as kv_in:
                    async for layer, key, _ in kv_in:
                        assert error_stats(kv(layer, layout.shape)[0], key)["snr_db"] > 35
                        got.append(layer)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receiver)
                await send_kv(listener.url, layout, produce(3, layout.shape))
        return got

    assert trio.run(main) == [0, 1, 2]


async def test_header_first_and_layer_zero_before_the_last_is_produced() -> None:
    layout = KVLayout(num_layers=6, shape=SHAPE)
    header_seen = anyio.Event()
    layer0_used = anyio.Event()

    async def producer() -> AsyncIterator[tuple[int, Array, Array]]:
        with anyio.fail_after(10):
            await header_seen.wait()  # the receiver has the header before layer 0 exists
        for layer in range(6):
            if layer == 5:
                with anyio.fail_after(10):
                    await layer0_used.wait()  # layer 0 is in use before the last is computed
            key, value = kv(layer)
            yield layer, key, value

    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receiver() -> None:
            async with await listener.accept() as connection, receive_kv(connection) as kv_in:
                header_seen.set()
                key, _ = await kv_in.wait_for_layer(0)
                assert np.array_equal(key, kv(0)[0])
                layer0_used.set()
                key, _ = await kv_in.wait_for_layer(5)
                assert np.array_equal(key, kv(5)[0])

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            await send_kv(listener.url, layout, producer())


@pytest.mark.parametrize("option", [{"checksums": True}, {"fsync": True}, {"metadata": {}}])
async def test_send_kv_refuses_a_keyword_that_is_no_time_limit(
    tmp_path: Path, option: dict[str, Any]
) -> None:
    """Every keyword went on to open_writer: ``checksums=True`` or ``fsync=True`` was taken
    silently (or clashed with the layout's own metadata deep inside); nothing is written."""
    path = tmp_path / "kv.safetensors"
    with pytest.raises(stream_st.ArgumentTypeError, match="unknown option"):
        await send_kv(path, KVLayout(num_layers=4, shape=SHAPE), produce(4), **option)
    assert not path.exists()
    await send_kv(path, KVLayout(num_layers=4, shape=SHAPE), produce(4), timeout=10)


async def test_kv_takes_a_urls_transport_options_and_no_other_keyword() -> None:
    """``headers`` and ``ssl_context`` reach open_writer and open_stream for a URL, where the
    refusal of what is no time limit refused them too; ``checksums=`` and ``verify=`` stay
    refused, and a Connection (a socket: no HTTP request) takes no transport options."""
    layout = KVLayout(num_layers=2, shape=SHAPE)
    token = {"Authorization": "Bearer s3cret"}
    transport: dict[str, Any] = {"headers": token, "ssl_context": ssl.create_default_context()}
    with RangeHTTPServer() as server:
        url = server.url("/kv.safetensors")
        await send_kv(url, layout, produce(2), **transport)
        async with receive_kv(url, **transport) as kv_in:
            key, _ = await kv_in.wait_for_layer(1)
        assert np.array_equal(key, kv(1)[0])
        assert [seen["authorization"] for _, _, seen in server.headers_seen] == [
            token["Authorization"]
        ] * len(server.headers_seen)
        with pytest.raises(stream_st.ArgumentTypeError, match="headers, ssl_context and"):
            await send_kv(url, layout, produce(2), checksums=True)  # type: ignore[call-arg]
        with pytest.raises(stream_st.ArgumentTypeError, match="headers, ssl_context and"):
            async with receive_kv(url, verify=False):  # type: ignore[call-arg]
                pass
    async with (
        stream_st.listen("127.0.0.1", 0, timeout=10) as listener,
        await stream_st.connect(listener.url) as connection,
    ):
        with pytest.raises(stream_st.ArgumentTypeError, match=r"unknown option.*'headers'"):
            await send_kv(connection, layout, produce(2), headers=token)
        with pytest.raises(stream_st.ArgumentTypeError, match=r"unknown option.*'headers'"):
            async with receive_kv(connection, headers=token):
                pass


async def test_flipped_byte_is_detected_and_the_layer_withheld(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=4, shape=SHAPE)
    path = tmp_path / "kv.safetensors"
    await send_kv(path, layout, produce(4))
    header = await stream_st.read_header(path)
    data = bytearray(path.read_bytes())
    data[header.data_start + header["layer_2_value"].start + 1000] ^= 0x10
    delivered = []
    with pytest.raises(IntegrityError) as info:
        async with receive_kv(bytes(data)) as kv_in:
            async for layer, key, _ in kv_in:
                assert np.array_equal(key, kv(layer)[0])
                delivered.append(layer)
    assert delivered == [0, 1] and info.value.layer == 2


async def test_sender_dies_mid_layer() -> None:
    layout = KVLayout(num_layers=5, shape=SHAPE)
    message = bytearray()

    class Collect(stream_st.transports.base.Sink):
        async def send(self, buffer: memoryview) -> None:
            message.extend(buffer)

        async def aclose(self) -> None:
            pass

        async def abort(self) -> None:
            pass

    await send_kv(Collect(), layout, produce(5))
    header = await stream_st.read_header(bytes(message))
    cut = header.data_start + header["layer_3_key"].start + 5000  # inside layer 3
    delivered: list[int] = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]

        async def dying_sender() -> None:
            conn, _ = await anyio.to_thread.run_sync(server.accept)
            with conn:
                conn.sendall(message[:cut])  # ... and the process dies

        async with anyio.create_task_group() as group:
            group.start_soon(dying_sender)
            with pytest.raises(stream_st.TruncatedStreamError):
                async with receive_kv(f"tcp://127.0.0.1:{port}", timeout=5) as kv_in:
                    async for layer, key, _ in kv_in:
                        assert np.array_equal(key, kv(layer)[0])
                        delivered.append(layer)
    assert delivered == [0, 1, 2]


@pytest.mark.parametrize("pause", [0.0, 0.05])  # failing at once, or while the sender waits
async def test_producer_failure_ends_the_transfer_with_its_error(
    tmp_path: Path, pause: float
) -> None:
    layout = KVLayout(num_layers=4, shape=SHAPE)

    async def producer() -> AsyncIterator[tuple[int, Array, Array]]:
        async for item in produce(2):
            yield item
        await anyio.sleep(pause)
        raise RuntimeError("the model failed at layer 2")

    path = tmp_path / "kv.safetensors"
    with pytest.raises(RuntimeError, match="layer 2"):
        await send_kv(path, layout, producer())
    assert list(tmp_path.iterdir()) == []  # the aborted message left nothing behind


async def test_receiver_dies_and_the_sender_stops_pulling() -> None:
    layout = KVLayout(num_layers=50, shape=(1, 8, 512, 64))  # 1 MiB per tensor
    layers = CountedLayers(layout)

    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receiver() -> None:
            async with await listener.accept() as connection, receive_kv(connection) as kv_in:
                await kv_in.wait_for_layer(1)
            # leaving closes the connection: the receiver is gone

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(receiver)
                with pytest.raises(stream_st.TransportError):
                    await send_kv(listener.url, layout, layers)
    assert layers.pulled < 50


async def test_a_receiver_that_leaves_with_layers_unread_fails_the_send() -> None:
    """The whole message fits in the socket buffers: its last byte went out before the receiver
    gave up, and the reset that followed was taken for a delivery (send_kv returned a report)."""
    layout = KVLayout(num_layers=3, shape=(1, 2, 16, 64))  # 4 KiB tensors
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receiver() -> None:
            # leaving closes the connection with layers 1 and 2 unread
            async with (
                await listener.accept() as connection,
                receive_kv(connection, max_ahead=0) as kv_in,
            ):
                await kv_in.wait_for_layer(0)
                await anyio.sleep(0.3)  # the rest lies in the socket, unread

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(receiver)
                with pytest.raises(TransportError, match="may not have read it in full"):
                    await send_kv(listener.url, layout, CountedLayers(layout))


async def test_backpressure_bounds_the_producer() -> None:
    layout = KVLayout(num_layers=40, shape=(1, 8, 512, 64))  # 2 MiB per layer
    layers = CountedLayers(layout)
    release = anyio.Event()

    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receiver() -> None:
            async with await listener.accept() as connection:
                await release.wait()  # a stalled consumer: reads nothing for a while
                async with receive_kv(connection) as kv_in:
                    async for _ in kv_in:
                        pass

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            group.start_soon(functools.partial(send_kv, listener.url, layout, layers, queue=2))
            await anyio.sleep(0.5)
            stalled_at = layers.pulled
            release.set()
    assert stalled_at < 40  # held back by the receiver, not run to the end
    assert layers.pulled == 40


async def test_session_of_transfers_and_many_at_once() -> None:
    layout = KVLayout(num_layers=3, shape=(1, 2, 16, 8))
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:
        results: list[int] = []

        async def serve() -> None:
            async with anyio.create_task_group() as group:
                for _ in range(8):
                    connection = await listener.accept()
                    group.start_soon(handle, connection)

        async def handle(connection: stream_st.Connection) -> None:
            async with connection:
                for _ in range(3):  # three transfers back to back on one connection
                    async with receive_kv(connection) as kv_in:
                        count = 0
                        async for _layer, _key, _value in kv_in:
                            count += 1
                        results.append(count)

        async def client() -> None:
            async with await stream_st.connect(listener.url, timeout=10) as connection:
                for _ in range(3):
                    await send_kv(connection, layout, produce(3, layout.shape))

        async with anyio.create_task_group() as group:
            group.start_soon(serve)
            for _ in range(8):
                group.start_soon(client)
    assert results == [3] * 24


def test_layout_checks() -> None:
    with pytest.raises(stream_st.UsageError):
        KVLayout(num_layers=0, shape=SHAPE)
    with pytest.raises(stream_st.UsageError):
        KVLayout(num_layers=2, shape=(4, 64))
    layout = KVLayout(num_layers=2, shape=SHAPE, codec="int4")
    assert [s.name for s in layout.layer_specs(1)] == [
        "layer_1_key",
        "layer_1_key.scales",
        "layer_1_value",
        "layer_1_value.scales",
        "layer_1_digest",
    ]
    assert layout.metadata()["compression"] == "INT4"


def test_a_send_report_of_many_layers_has_a_short_repr() -> None:
    """asyncio.run formats a task's result: send_kv's report printed both times of every layer
    (675,744 characters for 20,000 layers, seconds to format)."""
    layers = 100_000
    report = SendReport([1.0 + i for i in range(layers)], [2.0 + i for i in range(layers)], 9, 0.5)
    for shown in (repr(report), str(report)):
        assert len(shown) < 2000, len(shown)
        assert shown == (
            "SendReport(layers=100000, wire_bytes=9, header_sent_at=0.5, "
            "produced_at=[1.0, ..., 100000.0], sent_at=[2.0, ..., 100001.0])"
        )
    assert report.produced_at[-1] == 100000.0 and len(report.sent_at) == layers  # all kept
    assert repr(SendReport([1.0, 2.0], [3.0, 4.0], 9, 0.5)) == (
        "SendReport(layers=2, wire_bytes=9, header_sent_at=0.5, produced_at=[1.0, 2.0], "
        "sent_at=[3.0, 4.0])"
    )
    assert repr(SendReport()) == (
        "SendReport(layers=0, wire_bytes=0, header_sent_at=0.0, produced_at=[], sent_at=[])"
    )


async def test_a_codec_named_in_capitals_keeps_its_group_size(tmp_path: Path) -> None:
    shape = (1, 1, 2, 32)  # 32 values a row: the asked group divides it, the default 64 not
    layout = KVLayout(num_layers=1, shape=shape, codec="INT4", group_size=16)
    assert layout.codec == "int4" and layout.layer_specs(0)[1].shape == (1, 1, 2, 2)  # 2 groups
    assert layout == KVLayout(num_layers=1, shape=shape, codec="int4", group_size=16)
    path = tmp_path / "kv.safetensors"
    await send_kv(path, layout, [(0, *kv(0, shape))])
    async with receive_kv(path) as received:
        assert received.layout == layout and received.layout.group_size == 16


async def test_a_layout_whose_tensors_travel_in_another_dtype_is_not_sent(tmp_path: Path) -> None:
    """wire_dtype (a seed-style cache's, as received) was sent: its F32 tensors went out under
    metadata announcing F16 (kv_dtype, original_dtype), and receive_kv refused the transfer."""
    path = tmp_path / "kv.safetensors"
    layout = KVLayout(num_layers=1, shape=SHAPE, dtype="F16", wire_dtype="F32")
    key, value = kv(0)
    f32 = [(0, key.astype(np.float32), value.astype(np.float32))]
    with pytest.raises(stream_st.UsageError, match="wire_dtype F32: wire_dtype describes"):
        await send_kv(path, layout, f32)
    assert list(tmp_path.iterdir()) == []
    plain = dataclasses.replace(layout, wire_dtype=None)
    assert KVLayout(num_layers=1, shape=SHAPE, dtype="F16", wire_dtype="F16") == plain
    await send_kv(path, plain, [(0, *kv(0))])
    async with receive_kv(path) as received:
        assert received.layout == plain


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_codec_without_groups_keeps_the_default_group_size(
    tmp_path: Path, codec: str
) -> None:
    """The group size of a codec that has none was kept as given (never checked, never sent),
    and the layout received, with the default, did not compare equal to the one sent."""
    layout = KVLayout(num_layers=1, shape=SHAPE, codec=codec, group_size=32)
    assert layout.group_size == 64 and layout == KVLayout(num_layers=1, shape=SHAPE, codec=codec)
    path = tmp_path / "kv.safetensors"
    await send_kv(path, layout, [(0, *kv(0))])
    async with receive_kv(path) as received:
        assert received.layout == layout


@pytest.mark.parametrize("group_size", [-64, -5, 0, 3, True, 32.0])
def test_a_group_size_int4_cannot_group_by_is_refused(group_size: Any) -> None:
    with pytest.raises(CodecError, match="group_size must be a positive even integer"):
        KVLayout(num_layers=1, shape=SHAPE, codec="int4", group_size=group_size)


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("group_size", [-64, 0, 3, True, "x"])
def test_a_codec_without_groups_ignores_any_group_size(codec: str, group_size: Any) -> None:
    """The docstring says a codec without groups holds the default whatever was given, but a
    size INT4 cannot group by was refused with a CodecError about INT4 for "none" and "int8"."""
    layout = KVLayout(num_layers=1, shape=SHAPE, codec=codec, group_size=group_size)
    assert layout.group_size == 64 and layout == KVLayout(num_layers=1, shape=SHAPE, codec=codec)


NOT_DECIMAL_2 = ["+2", " 2", "2 ", "0_2", "02", "\uff12"]
"""Spellings of 2 that Python's int() takes and a decimal in KV metadata is not."""


async def test_bad_kv_metadata_is_a_header_error(tmp_path: Path) -> None:
    path = tmp_path / "kv.safetensors"
    await send_kv(path, KVLayout(num_layers=2, shape=SHAPE), produce(2))
    header = await stream_st.read_header(path)
    data = path.read_bytes()
    for key, value, message in [
        ("kv_shape", "[1e400, 4, 64, 64]", "bad or missing KV metadata"),  # not an integer
        ("kv_layers", "300000", "announces 300000 KV layers"),  # refused before any plan
        ("kv_shape", "[1, 4, 64]", "KV layout needs"),
        ("kv_dtype", "I8", "KV dtype must be"),
        ("kv_digest", "sha1", "'kv_digest' must be 'sha256' or 'none', not 'sha1'"),
        ("compression", "INT8", r"2 KV layers of 5 tensors \(codec int8, a digest\)"),
        # the numbers are decimals as str() writes them, as layer numbers in names are
        *[("kv_layers", text, "'kv_layers' must be a decimal") for text in NOT_DECIMAL_2],
        ("group_size", "6_4", "'group_size' must be a decimal integer, not '6_4'"),
        ("group_size", "064", "'group_size' must be a decimal integer, not '064'"),
    ]:
        meta = {**header.metadata, key: value}
        with pytest.raises(stream_st.HeaderError, match=message):
            async with receive_kv(rewritten(data, header, header.tensors, meta)):
                pass


def rewritten(
    data: bytes,
    header: stream_st.Header,
    tensors: Any,
    metadata: dict[str, str] | None = None,
) -> bytes:
    """The transfer ``data`` (whose header is ``header``) with a header listing ``tensors``
    (:class:`~stream_st.TensorInfo`, in that JSON order, at their offsets) and ``metadata``
    (``header``'s by default)."""
    entries = {
        t.name: {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [t.start, t.end]}
        for t in tensors
    }
    meta = header.metadata if metadata is None else metadata
    blob = json.dumps({"__metadata__": meta, **entries}).encode()
    return struct.pack("<Q", len(blob)) + blob + data[header.data_start :]


EMPTY = (1, 2, 0, 8)
"""An empty prompt's cache: no position, so every key and value is empty."""


async def sent_empty(path: Path, layout: KVLayout) -> tuple[stream_st.Header, bytes]:
    """The header and bytes of ``layout``'s transfer of empty layers (of :data:`EMPTY`, F32),
    as :func:`send_kv` writes it to ``path``."""
    empty = np.zeros(EMPTY, np.float32)
    await send_kv(path, layout, [(layer, empty, empty) for layer in range(layout.num_layers)])
    return await stream_st.read_header(path), path.read_bytes()


@pytest.mark.parametrize(
    ("codec", "digest"), [("none", True), ("int4", True), ("int8", True), ("none", False)]
)
async def test_an_empty_transfer_is_read_whatever_the_order_of_its_json_keys(
    tmp_path: Path, codec: str, digest: bool
) -> None:
    """Was: send_kv's own transfer of an empty cache, its JSON keys in another order (same
    entries, same bytes), was refused ("the tensors do not follow the KV layout their metadata
    announces"): its empty tensors start where the next tensor does, so their order in the data
    section is the JSON's, which the format leaves free."""
    layout = KVLayout(
        num_layers=2, shape=EMPTY, dtype="F32", codec=codec, group_size=8, digest=digest
    )
    header, data = await sent_empty(tmp_path / "kv.safetensors", layout)
    for tensors in (header.tensors, header.tensors[::-1]):
        async with receive_kv(rewritten(data, header, tensors)) as kv_in:
            assert kv_in.layout == layout
            got = [(layer, key.shape, value.shape) async for layer, key, value in kv_in]
        assert got == [(0, EMPTY, EMPTY), (1, EMPTY, EMPTY)]


async def test_tensors_out_of_the_layouts_order_are_refused(tmp_path: Path) -> None:
    """Whatever the JSON order, the data section's order is the layout's: a layer's value before
    its key is refused, and so is an empty tensor that lies before a tensor planned ahead of it
    (layer 1's key at 0, before layer 0's digest)."""
    path = tmp_path / "kv.safetensors"
    await send_kv(path, KVLayout(num_layers=2, shape=SHAPE), produce(2))
    header = await stream_st.read_header(path)
    key, value, *rest = header.tensors
    swapped = [
        key._replace(start=value.start, end=value.end),
        value._replace(start=key.start, end=key.end),
    ]
    empty = tmp_path / "empty.safetensors"
    empty_header, empty_data = await sent_empty(
        empty, KVLayout(num_layers=2, shape=EMPTY, dtype="F32")
    )
    early = [t._replace(start=0, end=0) if t.name == "layer_1_key" else t for t in empty_header]
    for message, names in (
        (
            rewritten(path.read_bytes(), header, [*swapped, *rest]),
            "'layer_0_value' lies before 'layer_0_key'",
        ),
        (
            rewritten(empty_data, empty_header, early),
            "'layer_1_key' lies before 'layer_0_digest'",
        ),
    ):
        with pytest.raises(stream_st.HeaderError, match=f"do not follow the KV layout .*: {names}"):
            async with receive_kv(message):
                pass


@pytest.mark.parametrize(
    "item",
    [(0, [1.0], [1.0]), (0, kv(0)[0]), "layer", (0.0, *kv(0)), (True, *kv(0)), (False, *kv(0))],
    ids=["lists", "no value", "not a tuple", "float layer", "True layer", "False layer"],
)
async def test_producer_yielding_the_wrong_thing_is_a_usage_error(
    tmp_path: Path, item: object
) -> None:
    """A bool was taken for a layer number ((True, key, value) for layer 1), where
    wait_for_layer(True) is refused."""

    async def producer() -> AsyncIterator[Any]:
        yield item

    with pytest.raises(stream_st.ArgumentTypeError, match=r"\(layer: int, key: ndarray"):
        await send_kv(tmp_path / "kv.safetensors", KVLayout(num_layers=1, shape=SHAPE), producer())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("codec", ["none", "int8", "int4"])
async def test_arrays_of_another_dtype_than_the_layout_are_refused(
    tmp_path: Path, codec: str
) -> None:
    """With the int8 and int4 codecs only the shape was checked: float32 keys beyond float16's
    range went out under an F16 layout and the receiver handed out inf."""
    layout = KVLayout(num_layers=1, shape=(1, 1, 2, 64), dtype="F16", codec=codec)
    key = np.full(layout.shape, 100_000.0, np.float32)
    path = tmp_path / "kv.safetensors"
    with pytest.raises(stream_st.UsageError, match=r"layer 0 key has dtype float32, the layout"):
        await send_kv(path, layout, [(0, key, key)])
    assert list(tmp_path.iterdir()) == []
    swapped = kv(0, layout.shape)[0].astype(">f2")  # the layout's dtype in another byte order
    await send_kv(path, layout, [(0, swapped, swapped)])
    async with receive_kv(path) as received:
        got, _ = await received.wait_for_layer(0)
    assert got.dtype == np.float16


@pytest.mark.parametrize("queue", [1, 2])
async def test_a_producer_reusing_its_buffers_is_caught_by_the_sender(queue: int) -> None:
    """A producer that refilled one key and one value buffer for every layer changed a layer
    while it was being sent and hashed: the receiver failed it as corrupted on the wire."""
    layout = KVLayout(num_layers=6, shape=(1, 8, 1024, 128), dtype="F32")  # 4 MiB tensors

    def refilled() -> Any:
        key, value = np.empty(layout.shape, np.float32), np.empty(layout.shape, np.float32)
        for layer in range(layout.num_layers):
            key.fill(layer)
            value.fill(-layer)
            yield layer, key, value

    received: list[BaseException] = []
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:

        async def receiver() -> None:
            async with await listener.accept() as connection:
                try:
                    async with receive_kv(connection) as kv_in:
                        async for _ in kv_in:
                            pass
                except stream_st.SafetensorsError as exc:
                    received.append(exc)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as group:
                group.start_soon(receiver)
                with pytest.raises(stream_st.UsageError, match="reuse its buffers"):
                    await send_kv(listener.url, layout, refilled(), queue=queue)
    assert not [exc for exc in received if isinstance(exc, IntegrityError)]


async def closed_after_a_failed_send(path: Path) -> list[str]:
    """What a failed send_kv left of an async and of a plain generator producer, at once."""
    layout = KVLayout(num_layers=4, shape=(1, 1, 2, 8), dtype="F32")
    events: list[str] = []

    def layer(number: int) -> tuple[int, Array, Array]:
        shape = layout.shape if number != 1 else (1, 1, 2, 9)  # layer 1 misshapen
        return number, np.zeros(shape, np.float32), np.zeros(shape, np.float32)

    async def async_producer() -> AsyncIterator[tuple[int, Array, Array]]:
        try:
            for number in range(4):
                yield layer(number)
        finally:
            events.append("async producer closed")

    def plain_producer() -> Any:
        try:
            for number in range(4):
                yield layer(number)
        finally:
            events.append("plain producer closed")

    for producer in (async_producer(), plain_producer()):
        with pytest.raises(stream_st.UsageError, match="layer 1 key has shape"):
            await send_kv(path, layout, producer)
    return events


async def test_a_failed_send_closes_the_producer(tmp_path: Path) -> None:
    """Neither send_kv's own wrapper nor the producer was closed: the producer's cleanup ran
    whenever it was collected, on trio with a ResourceWarning for stream_st's generator."""
    events = await closed_after_a_failed_send(tmp_path / "kv.safetensors")
    assert events == ["async producer closed", "plain producer closed"]


def test_a_failed_send_closes_the_producer_on_trio(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        events = trio.run(closed_after_a_failed_send, tmp_path / "kv.safetensors")
        gc.collect()
    assert events == ["async producer closed", "plain producer closed"]
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


async def test_a_layout_that_is_not_one_and_a_digest_wish_that_is_not_a_bool_are_refused(
    tmp_path: Path,
) -> None:
    """A dict or None for the layout was a bare AttributeError; ``require_digests="no"`` was
    taken as true."""
    for layout in (None, {"num_layers": 1, "shape": SHAPE}):
        with pytest.raises(stream_st.ArgumentTypeError, match="layout must be a KVLayout"):
            await send_kv(tmp_path / "kv.safetensors", layout, [])  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    path = tmp_path / "kv.safetensors"
    await send_kv(path, KVLayout(num_layers=1, shape=SHAPE, digest=False), produce(1))
    with pytest.raises(stream_st.ArgumentTypeError, match="require_digests must be True or"):
        async with receive_kv(path, require_digests="no"):  # type: ignore[arg-type]
            pass
    async with receive_kv(path, require_digests=np.bool_(False)) as received:  # type: ignore[arg-type]
        assert [layer async for layer, _, _ in received] == [0]


async def test_demo_runs_and_measures() -> None:
    from stream_st.cli.demo import run_demo

    results = await run_demo(layers=3, seq=128)
    assert [r.codec for r in results] == ["none", "int8", "int4"]
    for r in results:
        assert len(r.verified) == len(r.consumed) == 3
        assert r.produced == sorted(r.produced)
        assert all(p <= v <= c for p, v, c in zip(r.produced, r.verified, r.consumed, strict=True))
        assert 0.0 <= r.overlap_efficiency <= 1.0
    assert results[0].errors == {}
    assert results[1].errors["snr_db"] > results[2].errors["snr_db"] > 10
    assert results[0].wire_bytes > results[1].wire_bytes > results[2].wire_bytes


async def test_slow_consumer_slows_the_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = KVLayout(num_layers=30, shape=(1, 8, 512, 64))  # 1 MiB a layer (F16 key and value)
    layers = CountedLayers(layout)
    gaps: list[int] = []
    queue, max_ahead = 2, 1
    # Socket buffers of a fixed size: left to the kernel, they grow with the traffic (up to
    # tcp_rmem's maximum, 32 MiB on some systems), each MiB one more layer sent and not yet
    # received, as many as a loaded machine lets pile up. Set, they stay as set, and getsockopt
    # tells their size (the kernel's doubling included).
    buffers: list[int] = []
    connect = stream_st.transports.tcp.connect_socket

    async def connect_small(*args: Any) -> socket.socket:
        sock = await connect(*args)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        buffers.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF))
        return sock

    monkeypatch.setattr(stream_st.transports.tcp, "connect_socket", connect_small)

    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:
        listener._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)  # inherited
        buffers.append(listener._sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))

        async def receiver() -> None:
            connection = await listener.accept()
            async with connection, receive_kv(connection, max_ahead=max_ahead) as kv_in:
                async for layer, _, _ in kv_in:
                    await anyio.sleep(0.03)  # a consumer slower than the link
                    gaps.append(layers.pulled - (layer + 1))
                    kv_in.release(layer)

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            await send_kv(listener.url, layout, layers, queue=queue)
    # Pulled but not yet handed to the consumer: the one the producer waits to queue, the queue,
    # the one being sent, what the two socket buffers hold, the receiver's read-ahead and the
    # one it reads. Without read-ahead bounds the sender would run ~all 30 layers ahead at once.
    on_the_wire = -(-sum(buffers) // layout.layer_bytes)
    assert len(buffers) == 2 and max(gaps) <= 1 + queue + 1 + on_the_wire + max_ahead + 1, gaps


async def test_a_send_that_cannot_connect_leaves_no_open_channel() -> None:
    """The layer channel is closed on every way out, a failed connect included."""
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # nothing listens there
    layout = KVLayout(num_layers=2, shape=(1, 1, 4, 4), dtype="F32")

    async def layers() -> AsyncIterator[tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
        for layer in range(2):
            yield layer, np.zeros(layout.shape, np.float32), np.zeros(layout.shape, np.float32)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(TransportError):
            await send_kv(f"tcp://127.0.0.1:{port}", layout, layers(), timeout=5)
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


class ClosableProducer:
    """An async producer of ``layout``'s layers with an ``aclose()`` (one that holds buffers
    until closed, say); counts its closes."""

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.closes = 0
        self.layer = 0

    def __aiter__(self) -> ClosableProducer:
        return self

    async def __anext__(self) -> tuple[int, Array, Array]:
        if self.layer == self.layout.num_layers:
            raise StopAsyncIteration
        self.layer += 1
        zeros = np.zeros(self.layout.shape, np.float32)
        return self.layer - 1, zeros, zeros.copy()

    async def aclose(self) -> None:
        self.closes += 1


async def test_a_send_that_cannot_start_closes_the_producer_once(tmp_path: Path) -> None:
    """A destination that could not be opened (nothing listening, a missing directory, a closed
    connection or one still writing another message), a refused argument or a send cancelled
    before the first layer left the producer unclosed, where the docstring says it is closed
    whichever way the transfer ends."""
    layout = KVLayout(num_layers=2, shape=(1, 1, 4, 4), dtype="F32")

    async def closes(dst: Any, error: type[Exception], **options: Any) -> int:
        producer = ClosableProducer(layout)
        with pytest.raises(error):
            await send_kv(dst, layout, producer, **options)
        assert producer.layer == 0, dst  # nothing was pulled
        return producer.closes

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]  # nothing listens there
    assert await closes(f"tcp://127.0.0.1:{port}", TransportError, timeout=5) == 1
    missing = tmp_path / "no" / "such" / "kv.safetensors"
    assert await closes(missing, stream_st.SourceNotFoundError) == 1
    assert await closes(tmp_path / "kv.safetensors", stream_st.UsageError, queue=0) == 1
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:
        connection = await stream_st.connect(listener.url, timeout=10)
        async with connection, connection.open_writer([]):  # the writing turn is taken
            assert await closes(connection, stream_st.UsageError) == 1
        assert await closes(connection, stream_st.UsageError) == 1  # closed

    class Stalled(stream_st.transports.base.Sink):
        async def send(self, buffer: memoryview) -> None:
            await anyio.sleep_forever()  # the header never goes out

        async def aclose(self) -> None:
            pass

        async def abort(self) -> None:
            pass

    producer = ClosableProducer(layout)
    with anyio.move_on_after(0.1):
        await send_kv(Stalled(), layout, producer)
    assert producer.closes == 1 and producer.layer == 0
    producer = ClosableProducer(layout)
    await send_kv(tmp_path / "kv.safetensors", layout, producer)  # the normal way: once too
    assert producer.closes == 1 and producer.layer == 2


def producers(gives_async: Callable[[], object], gives_plain: Callable[[], object]) -> list[Any]:
    """An async producer whose ``__aiter__`` returns ``gives_async()`` and a plain one whose
    ``__iter__`` returns ``gives_plain()``."""

    class AsyncProducer:
        def __aiter__(self) -> object:
            return gives_async()

    class PlainProducer:
        def __iter__(self) -> object:
            return gives_plain()

    return [AsyncProducer(), PlainProducer()]


async def test_a_producer_whose_iterator_is_bare_is_sent_and_closed(tmp_path: Path) -> None:
    """A producer whose ``__aiter__`` hands out an object with ``__anext__`` and ``aclose()`` but
    no ``__aiter__`` of its own (``async for`` takes it) was walked as a plain iterable: a bare
    TypeError ("not iterable"), and its ``aclose()`` never called. A plain producer whose
    ``__iter__`` hands out an object with ``__next__`` and ``close()`` alone (``for`` takes it)
    failed the same way."""
    layout = KVLayout(num_layers=2, shape=(1, 1, 4, 4), dtype="F32")
    closed: list[str] = []

    class Layers:
        """``layout``'s layers by ``__next__`` alone, closed by ``close()``."""

        def __init__(self) -> None:
            self.numbers = iter(range(layout.num_layers))

        def __next__(self) -> tuple[int, Array, Array]:
            number = next(self.numbers)
            zeros = np.zeros(layout.shape, np.float32)
            return number, zeros + number, zeros

        def close(self) -> None:
            closed.append("plain")

    class AsyncLayers:
        """The same by ``__anext__`` alone, closed by ``aclose()``."""

        def __init__(self) -> None:
            self.layers = Layers()

        async def __anext__(self) -> tuple[int, Array, Array]:
            try:
                return next(self.layers)
            except StopIteration:
                raise StopAsyncIteration from None

        async def aclose(self) -> None:
            closed.append("async")

    for producer in producers(AsyncLayers, Layers):
        path = tmp_path / f"{type(producer).__name__}.safetensors"
        await send_kv(path, layout, producer)
        async with receive_kv(path) as received:
            assert [float(key.flat[0]) async for _, key, _ in received] == [0.0, 1.0]
    assert closed == ["async", "plain"]


async def test_iterating_a_receiver_holds_one_layer_at_a_time(tmp_path: Path) -> None:
    """``async for layer, key, value in kv`` kept every layer handed out until the block was
    left: memory grew with the whole cache, where kv.md says it stays bounded."""
    path = tmp_path / "kv.safetensors"
    await send_kv(path, KVLayout(num_layers=5, shape=SHAPE), produce(5))
    handed: list[weakref.ref[Array]] = []
    async with receive_kv(path, max_ahead=0) as kv_in:
        async for layer, key, value in kv_in:
            assert np.array_equal(key, kv(layer)[0]) and np.array_equal(value, kv(layer)[1])
            handed.append(weakref.ref(key))
            del key, value
            gc.collect()
            assert [ref() is None for ref in handed] == [True] * layer + [False]
        with pytest.raises(stream_st.UsageError, match="layer 4 was released"):
            await kv_in.wait_for_layer(4)
    async with receive_kv(path) as kv_in:  # wait_for_layer's layers stay until released
        key, _ = await kv_in.wait_for_layer(0)
        assert (await kv_in.wait_for_layer(0))[0] is key
        kept = [key async for _, key, _ in kv_in]  # what the loop keeps, it has
    assert [np.array_equal(key, kv(layer)[0]) for layer, key in enumerate(kept)] == [True] * 5


async def test_the_layers_a_receiver_holds_are_let_go_at_the_blocks_end(tmp_path: Path) -> None:
    """kv.md says a layer wait_for_layer hands out stays until release or the block's end, but
    every layer not released was still held after the block, and wait_for_layer handed it out."""
    path = tmp_path / "kv.safetensors"
    await send_kv(path, KVLayout(num_layers=3, shape=SHAPE), produce(3))
    async with receive_kv(path) as kv_in:
        held = [weakref.ref((await kv_in.wait_for_layer(layer))[0]) for layer in range(3)]
        kv_in.release(0)
    gc.collect()
    assert [ref() is None for ref in held] == [True] * 3
    with pytest.raises(stream_st.UsageError, match="layer 0 was released"):
        await kv_in.wait_for_layer(0)
    with pytest.raises(stream_st.UsageError, match="layer 2 was let go when the receive_kv block"):
        await kv_in.wait_for_layer(2)


async def test_a_producer_that_gives_no_iterator_is_an_argument_error(tmp_path: Path) -> None:
    """A producer whose ``__aiter__`` (``__iter__``) returns no iterator raised Python's bare
    ``TypeError``; it is an :class:`~stream_st.ArgumentTypeError`, a ``TypeError`` too."""

    layout = KVLayout(num_layers=1, shape=SHAPE)
    for producer in producers(object, object):
        with pytest.raises(stream_st.ArgumentTypeError, match="gave no iterator of layers"):
            await send_kv(tmp_path / "c.safetensors", layout, producer)
        assert not (tmp_path / "c.safetensors").exists()
