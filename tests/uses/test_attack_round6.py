"""Defects a demanding user met on the remote paths (servers that lie, peers that misbehave),
a sixth round: each test failed before its fix. Every server is a real one on 127.0.0.1."""

from __future__ import annotations

import re
import socket
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st

from ..conftest import StartSender
from ..servers.http_server import RangeHTTPServer
from ..transports.test_http_faults import Serve, raw_server, read_request

__all__ = ["raw_server"]  # the fixture, used here by name

Array = np.ndarray[Any, Any]

# ``b`` runs past the first 64 KiB a read that is not of everything asks for first.
TENSORS = {"a": np.arange(100, dtype=np.float32), "b": np.full(50_000, 3, np.int32)}
FILE: bytes = reference_numpy.save(TENSORS)


async def load(source: Any, **kwargs: Any) -> dict[str, Array]:
    with anyio.fail_after(10):
        return await stream_st.load(source, **kwargs)


def ranged_chunked_with_extra(connection: socket.socket) -> None:
    """Keep-alive ranged GETs of :data:`FILE`, each answered 206 with the right Content-Range
    but a chunked body holding 5000 bytes more than that range (bytes of no object)."""
    while True:
        headers, _ = read_request(connection)
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", headers["range"])
        assert match is not None
        first, last = int(match[1]), int(match[2] or len(FILE) - 1)
        body = FILE[first : last + 1] + b"\xee" * 5000
        head = (
            f"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n"
            f"Content-Range: bytes {first}-{last}/{len(FILE)}\r\n\r\n"
        )
        connection.sendall(head.encode() + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")


async def test_a_chunked_range_longer_than_its_content_range_is_not_taken(
    raw_server: Serve,
) -> None:
    """A selection's first request asks for 64 KiB; ``b`` went on reading that answer past the
    range its Content-Range named: 1250 of its values were the server's extra bytes."""
    url = raw_server(ranged_chunked_with_extra) + "/m.safetensors"
    got = await load(url, include=["a", "b"])
    np.testing.assert_array_equal(got["b"], TENSORS["b"])
    np.testing.assert_array_equal(got["a"], TENSORS["a"])


NOT_SAFETENSORS = {
    "empty": b"",
    "3 bytes": b"\x10\x00\x00",
    "an HTML page": b"<!doctype html><html><body>Sign in</body></html>",
    "bad JSON": b"\x07\x00\x00\x00\x00\x00\x00\x00{'a':1}",
}


@pytest.mark.parametrize("body", NOT_SAFETENSORS.values(), ids=NOT_SAFETENSORS.keys())
async def test_a_url_that_is_not_safetensors_is_named(body: bytes) -> None:
    """A header error said what was wrong but not where: of a list of URLs, or an index's
    shards read one by one, the user could not tell which one was not a safetensors file."""
    with RangeHTTPServer() as server:
        server.objects["/m.safetensors"] = body
        url = server.url("/m.safetensors") + "?token=hf_secret"
        for read in (load, stream_st.read_header):
            with anyio.fail_after(10), pytest.raises(stream_st.HeaderError) as info:
                await read(url)
            assert server.url("/m.safetensors?token=***") in str(info.value)
            assert "hf_secret" not in str(info.value)


async def test_a_tcp_peer_sending_garbage_is_named(tcp_sender: StartSender) -> None:
    """A peer that is not a stream_st sender (here an HTTP client) or that closes at once."""
    for payload in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b""):
        url = f"tcp://127.0.0.1:{await tcp_sender(payload)}"
        with pytest.raises(stream_st.HeaderError, match=re.escape(url)):
            await load(url)
