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
from stream_st.errors import redact
from stream_st.transports.http.redirect import basic_authorization

from ..conftest import StartSender
from ..servers.http_server import RangeHTTPServer
from ..transports.test_http_faults import Serve, raw_server, read_request, wait_for_close

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


def echo_request_in_an_error(connection: socket.socket) -> None:
    """Answer 401 with a body quoting the request's headers, as debugging pages, some proxies
    and echo services do."""
    headers, _ = read_request(connection)
    body = "; ".join(f"{name}: {value}" for name, value in headers.items()).encode()
    head = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: %d\r\n\r\n" % len(body)
    connection.sendall(head + body)
    wait_for_close(connection)


@pytest.mark.parametrize(
    ("user", "headers"),
    [("", {"Authorization": "Bearer hf_TokenOfTheUser"}), ("alice:pass1word@", {})],
)
async def test_credentials_echoed_by_an_error_page_are_masked(
    raw_server: Serve, user: str, headers: dict[str, str]
) -> None:
    """The error's one-line excerpt of the body showed the token, or the URL's password as the
    Basic credential the request carried."""
    url = raw_server(echo_request_in_an_error).replace("//", f"//{user}") + "/m.safetensors"
    with pytest.raises(stream_st.HTTPStatusError, match=r"authorization: (Bearer|Basic) ") as info:
        await load(url, headers=headers)
    assert "TokenOfTheUser" not in str(info.value)
    assert basic_authorization("alice", "pass1word").split()[1] not in str(info.value)


AWS = "AWS4-HMAC-SHA256 Credential=AKID/x, SignedHeaders=host, Signature=0a9f"
CHALLENGE = 'WWW-Authenticate: Bearer realm="x", error="invalid_token"'


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("authorization: Bearer hf_abcDEF123", "authorization: Bearer ***"),
        ("Basic YWxpY2U6cGFzc3dvcmQ=;", "Basic ***;"),  # alice:password
        (AWS, "AWS4-HMAC-SHA256 ***"),
        ("Basic authentication failed", "Basic authentication failed"),
        (CHALLENGE, CHALLENGE),
    ],
)
def test_redact_masks_authorization_values(text: str, shown: str) -> None:
    assert redact(text) == shown
    assert redact(shown) == shown
