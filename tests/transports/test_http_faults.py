"""The HTTP client and source against broken servers: garbage answers, resets, stalls, ignored
ranges, dropped TLS connections, and bad URLs. Every failure must be a SafetensorsError.

The misbehaving servers are raw sockets on 127.0.0.1 (one thread per connection) that answer
exactly the bytes each test scripts; well-behaved ones are tests/servers/http_server.py's.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import (
    ReadTimeoutError,
    SourceChangedError,
    TransportError,
    TruncatedStreamError,
    UsageError,
)
from stream_st.transports.http import HTTPClient, HTTPProtocolError, HTTPStatusError, Target
from stream_st.transports.http.framing import request_head
from stream_st.transports.http.sink import HttpSink
from stream_st.transports.http.source import FIRST_RANGE, HttpSource
from stream_st.transports.http.wire import StreamWire
from stream_st.transports.hub import HubSource
from stream_st.transports.options import UNLIMITED, Clock, Limits

from .._util import assert_same_arrays, sample_file, sample_tensors
from ..servers.http_server import RangeHTTPServer

Handler = Callable[[socket.socket], None]
Serve = Callable[..., str]

SMALL = sample_file()
# ``b`` sits after 100 kB of zeros: beyond the first 64 KiB answer, so reading it alone needs a
# ranged request from the middle of the object.
SPLIT = {"a": np.zeros(100_000, np.uint8), "b": np.full(1000, 7, np.uint8)}
SPLIT_FILE: bytes = reference_numpy.save(SPLIT)
# The same layout with other values: a replacement only the validators can tell apart.
OTHER_FILE: bytes = reference_numpy.save({"a": np.ones(100_000, np.uint8), "b": SPLIT["b"]})


@pytest.fixture
def raw_server() -> Iterator[Serve]:
    """``serve(handler, tls=None) -> base URL``: a server on 127.0.0.1 running ``handler`` on
    each connection (wrapped in TLS with the ``tls`` server context), then closing it."""
    listeners: list[socket.socket] = []
    threads: list[threading.Thread] = []

    def run(connection: socket.socket, handler: Handler, tls: ssl.SSLContext | None) -> None:
        connection.settimeout(5)
        try:
            if tls is not None:
                connection = tls.wrap_socket(connection, server_side=True)
            handler(connection)
        except OSError:
            pass  # the client gave up first: what the test is about
        finally:
            connection.close()

    def accept(listener: socket.socket, handler: Handler, tls: ssl.SSLContext | None) -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=run, args=(connection, handler, tls), daemon=True)
            thread.start()
            threads.append(thread)

    def serve(handler: Handler, tls: ssl.SSLContext | None = None) -> str:
        listener = socket.create_server(("127.0.0.1", 0))
        listeners.append(listener)
        thread = threading.Thread(target=accept, args=(listener, handler, tls), daemon=True)
        thread.start()
        threads.append(thread)
        scheme = "http" if tls is None else "https"
        return f"{scheme}://127.0.0.1:{listener.getsockname()[1]}"

    yield serve
    for listener in listeners:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
    for thread in threads:
        thread.join(timeout=5)


def read_request(connection: socket.socket) -> tuple[dict[str, str], bytes]:
    """One request's headers (lower-case names) and its body (by ``Content-Length``)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = connection.recv(65536)
        if not more:
            raise ConnectionError("the client closed before a whole request")
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    headers = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        body += connection.recv(65536)
    return headers, body


def wait_for_close(connection: socket.socket) -> None:
    """Keep the connection open until the client closes it (or the 5 s socket timeout)."""
    while connection.recv(65536):
        pass


def reset(connection: socket.socket) -> None:
    """Close with a TCP reset instead of an orderly close."""
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


def answer(raw: bytes, then: Handler = wait_for_close) -> Handler:
    """A handler reading one request, sending ``raw`` and then doing ``then``."""

    def handle(connection: socket.socket) -> None:
        read_request(connection)
        connection.sendall(raw)
        then(connection)

    return handle


def ranges_from_zero_only(data: bytes, *, start_shown: int | None = None) -> Handler:
    """Keep-alive GETs of ``data``: a range from byte 0 is honoured (206), any other range gets
    the whole body (200); or, with ``start_shown``, a 206 claiming the range starts there."""

    def handle(connection: socket.socket) -> None:
        while True:
            headers, _ = read_request(connection)
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", headers.get("range", ""))
            assert match is not None
            first = int(match[1])
            end = min(int(match[2]) + 1, len(data)) if match[2] else len(data)
            if first == 0 or start_shown is not None:
                shown = first if start_shown is None else start_shown
                head = (
                    f"HTTP/1.1 206 Partial Content\r\nContent-Length: {end - first}\r\n"
                    f"Content-Range: bytes {shown}-{shown + end - first - 1}/{len(data)}\r\n\r\n"
                )
                connection.sendall(head.encode() + data[first:end])
            else:
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(data)}\r\n\r\n"
                connection.sendall(head.encode() + data)

    return handle


async def load(source: Any, **kwargs: Any) -> dict[str, np.ndarray[Any, Any]]:
    with anyio.fail_after(10):
        return await stream_st.load(source, **kwargs)


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"


GARBAGE = {
    "length not a number": (
        b"HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n" + SMALL,
        "Content-Length 'abc'",
    ),
    "negative length": (
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n" + SMALL,
        "Content-Length '-5'",
    ),
    "superscript length": (
        "HTTP/1.1 200 OK\r\nContent-Length: 1\xb2\r\n\r\n".encode("latin-1") + SMALL,
        "Content-Length '1\xb2'",
    ),
    "length past int's digits": (  # more than int() reads: a ValueError
        b"HTTP/1.1 200 OK\r\nContent-Length: %s\r\n\r\n" % (b"9" * 5000) + SMALL,
        "malformed Content-Length '9999",
    ),
    "chunk size not hex": (CHUNKED_HEAD + b"zz\r\nabc\r\n", "chunk size line b'zz'"),
    "chunk size with 0x": (CHUNKED_HEAD + b"0x8\r\n" + SMALL[:8], "chunk size line b'0x8'"),
    "chunk without line end": (
        CHUNKED_HEAD + b"8\r\n" + SMALL[:8] + b"XX\r\n",
        "no line end after a chunk",
    ),
    "superscript status": (
        "HTTP/1.1 \xb2 OK\r\nContent-Length: 0\r\n\r\n".encode("latin-1"),
        "status line",
    ),
    "two-digit status": (b"HTTP/1.1 20 OK\r\nContent-Length: 0\r\n\r\n", "status line"),
    "not HTTP": (b"SSH-2.0-OpenSSH_9.6\r\n\r\n", "status line"),
    "endless 100 Continue": (b"HTTP/1.1 100 Continue\r\n\r\n" * 2000, "interim"),
    "range end past int's digits": (
        b"HTTP/1.1 206 Partial\r\nContent-Range: bytes 0-%s/%d\r\nContent-Length: %d\r\n\r\n"
        % (b"9" * 5000, len(SMALL), len(SMALL))
        + SMALL,
        "unusable Content-Range",
    ),
    "range end past the size": (
        b"HTTP/1.1 206 Partial\r\nContent-Range: bytes 0-99999/%d\r\nContent-Length: %d\r\n\r\n"
        % (len(SMALL), len(SMALL))
        + SMALL,
        "Content-Range",
    ),
    "204 to a GET": (b"HTTP/1.1 204 No Content\r\n\r\n", "unexpected answer HTTP 204"),
}


@pytest.mark.parametrize(("raw", "message"), GARBAGE.values(), ids=GARBAGE.keys())
async def test_garbage_answers_are_protocol_errors(
    raw_server: Serve, raw: bytes, message: str
) -> None:
    connections = 0

    def handle(connection: socket.socket) -> None:
        nonlocal connections
        connections += 1
        answer(raw)(connection)

    url = raw_server(handle) + "/f.safetensors"
    with pytest.raises(HTTPProtocolError, match=re.escape(message)) as info:
        await load(url)
    assert info.value.url == url
    assert connections == 1  # not retried: the answer would be as garbled


@pytest.mark.parametrize("size", ["\xb2", "0", "abc"])
async def test_a_416_to_the_first_bytes_naming_no_size_is_an_empty_object(
    raw_server: Serve, size: str
) -> None:
    """``bytes */²``: ``'²'.isdigit()`` holds but ``int('²')`` raised a bare ValueError; a size
    that is no number of ASCII digits is no size, as ``abc`` is."""
    head = f"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{size}\r\n"
    url = raw_server(answer((head + "Content-Length: 0\r\n\r\n").encode("latin-1")))
    with pytest.raises(stream_st.HeaderError, match="got only 0 bytes"):
        await stream_st.read_header(url + "/f.safetensors", timeout=5)


async def test_interim_answers_are_skipped(raw_server: Serve) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
    final = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SMALL)
    url = raw_server(answer(interim + final + SMALL)) + "/f.safetensors"
    assert_same_arrays(await load(url), sample_tensors())


async def test_chunked_body_reset_in_a_size_line(raw_server: Serve) -> None:
    raw = CHUNKED_HEAD + b"8\r\n" + SMALL[:8] + b"\r\n4"
    url = raw_server(answer(raw, then=reset)) + "/f.safetensors"
    with pytest.raises(TruncatedStreamError, match=re.escape(url)):
        await load(url)


async def test_chunked_body_stalled_in_a_size_line(raw_server: Serve) -> None:
    url = raw_server(answer(CHUNKED_HEAD + b"8\r\n" + SMALL[:8] + b"\r\n4")) + "/f.safetensors"
    with pytest.raises(ReadTimeoutError) as info:
        await load(url, timeout=0.2)
    assert info.value.url == url


async def test_trailers_are_skipped_and_their_size_capped(raw_server: Serve) -> None:
    """Trailer fields after the last chunk are skipped; a section without end (bytes keep
    coming, so no timeout fires) is refused past a response head's size, where the read of
    every tensor already received never returned."""
    body = CHUNKED_HEAD + b"%x\r\n%s\r\n0\r\n" % (len(SMALL), SMALL)
    url = raw_server(answer(body + b"X-Trailer: x\r\nY: y\r\n\r\n")) + "/f.safetensors"
    assert_same_arrays(await load(url, timeout=5), sample_tensors())

    def endless(connection: socket.socket) -> None:
        while True:  # until the client closes
            connection.sendall(b"X-Trailer: x\r\n" * 1000)

    url = raw_server(answer(body, then=endless)) + "/f.safetensors"
    with pytest.raises(HTTPProtocolError, match="response trailers too large") as info:
        await load(url, timeout=5)
    assert info.value.url == url


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_whole_body_for_a_range_from_the_middle(raw_server: Serve, concurrency: int) -> None:
    """Taking that body as the range asked for would return the file's first bytes as ``b``."""
    url = raw_server(ranges_from_zero_only(SPLIT_FILE)) + "/m.safetensors"
    source = HttpSource(url, concurrency=concurrency, part_size=4096)
    with pytest.raises(HTTPProtocolError, match="ignored the Range header") as info:
        await load(source, include=["b"])
    assert info.value.url == url
    assert info.value.position is not None and info.value.position > 65536


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_range_starting_elsewhere(raw_server: Serve, concurrency: int) -> None:
    url = raw_server(ranges_from_zero_only(SPLIT_FILE, start_shown=0)) + "/m.safetensors"
    source = HttpSource(url, concurrency=concurrency, part_size=4096)
    with pytest.raises(HTTPProtocolError, match="Content-Range 'bytes 0-"):
        await load(source, include=["b"])


async def test_whole_body_from_byte_zero_is_still_used(raw_server: Serve) -> None:
    url = raw_server(ranges_from_zero_only(SPLIT_FILE)) + "/m.safetensors"
    assert_same_arrays(await load(url), SPLIT)


Answer = Callable[[int], tuple[bytes, str, int | None]]
"""The n-th request's answer (counted over every connection): the object, extra header lines
(each ending in CRLF), and how many body bytes are sent before the connection is closed (None:
the whole range)."""


def ranged(answer_for: Answer, *, length: bool = True, chunked: bool = False) -> Handler:
    """Keep-alive ranged GETs answered as ``answer_for`` says; ``length``: with a
    ``Content-Length`` (else the body ends as the connection closes, as HTTP/1.0 has it);
    ``chunked``: in one chunk and the last, a cut body ended cleanly, the connection kept."""
    count = iter(range(1 << 30))  # next() on it is atomic: connections run in threads

    def handle(connection: socket.socket) -> None:
        while True:
            headers, _ = read_request(connection)
            data, extra, cut = answer_for(next(count))
            match = re.fullmatch(r"bytes=(\d+)-(\d*)", headers["range"])
            assert match is not None
            first = int(match[1])
            end = min(int(match[2]) + 1, len(data)) if match[2] else len(data)
            body = data[first:end][:cut]
            if chunked:
                extra += "Transfer-Encoding: chunked\r\n"
                body = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            sized = f"Content-Length: {end - first}\r\n" if length and not chunked else ""
            head = (
                f"HTTP/1.1 206 Partial Content\r\n{sized}{extra}"
                f"Content-Range: bytes {first}-{end - 1}/{len(data)}\r\n\r\n"
            )
            connection.sendall(head.encode() + body)
            if not chunked and (cut is not None or not length):
                return

    return handle


LAST_MODIFIED = "Last-Modified: Mon, 01 Jan 2024 00:00:00 GMT\r\n"


@pytest.mark.parametrize("read", ["resumed", "include", "parallel"])
async def test_a_version_pinned_by_last_modified_must_come_again(
    raw_server: Serve, read: str
) -> None:
    """A weak ETag does not vouch for bytes: the first answer's Last-Modified pinned the version
    (If-Unmodified-Since). A later answer that drops it, whatever weak ETag it keeps, could be
    any version (here another): a change, never a tensor of both."""

    def answer_for(n: int) -> tuple[bytes, str, int | None]:
        if n == 0:
            cut = len(SPLIT_FILE) // 2 if read == "resumed" else None
            return SPLIT_FILE, 'ETag: W/"same"\r\n' + LAST_MODIFIED, cut
        return OTHER_FILE, 'ETag: W/"same"\r\n', None

    url = raw_server(ranged(answer_for)) + "/m.safetensors"
    options: dict[str, Any] = {"include": ["b"]} if read == "include" else {}
    concurrency = 2 if read == "parallel" else None
    source = HttpSource(url, concurrency=concurrency, part_size=16384, backoff=0.01)
    with pytest.raises(SourceChangedError, match=r"Last-Modified '.*', then none"):
        await load(source, **options)


@pytest.mark.parametrize("changed", [False, True])
@pytest.mark.parametrize(
    "validator", ['ETag: "a\x00{}"\r\n', 'ETag: W/"w"\r\nLast-Modified: Mon,\x00{}\r\n']
)
async def test_a_validator_no_request_can_carry_is_compared_not_sent(
    raw_server: Serve, validator: str, changed: bool
) -> None:
    """A server's ETag (or Last-Modified) holding a NUL was sent back in If-Match and the read
    refused as a UsageError, blaming the caller for a request header. It is not sent; later
    answers are still compared with it."""

    def answer_for(n: int) -> tuple[bytes, str, int | None]:
        return SPLIT_FILE, validator.format("b" if n == 0 or not changed else "c"), None

    url = raw_server(ranged(answer_for)) + "/m.safetensors"
    if changed:
        with pytest.raises(SourceChangedError, match=r", then '\"?(a|Mon,)\\x00c"):
            await load(url, include=["b"])
    else:
        assert_same_arrays(await load(url, include=["b"]), {"b": SPLIT["b"]})


def _first_then(status: str, headers: str, body: bytes, first: bytes, end: str) -> Handler:
    """A server answering a read's first request with ``first`` (the file's first bytes, ETag
    "v1"; the header block ended by ``end``), and every later one with ``status`` and
    ``headers`` (no ETag: they speak of the server or the request, not of the object)."""
    count = iter(range(1 << 30))

    def handle(connection: socket.socket) -> None:
        read_request(connection)
        if next(count):
            head = f"HTTP/1.1 {status}\r\n{headers}Content-Length: {len(body)}\r\n"
            connection.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)
            return
        head = (
            f'HTTP/1.1 206 Partial Content\r\nETag: "v1"\r\nContent-Length: {len(first)}'
            f"\r\nContent-Range: bytes 0-{len(first) - 1}/{len(SPLIT_FILE)}\r\n{end}"
        )
        connection.sendall(head.encode() + first)

    return handle


async def test_a_server_still_busy_after_the_retries_is_its_status(raw_server: Serve) -> None:
    """A 503 (Retry-After, no ETag: it speaks of the server, not of the object) to every
    request after the first, until the retries are spent: its status, an HTTPStatusError,
    where the missing ETag read as the object changed (SourceChangedError)."""
    whole = SPLIT_FILE[: len(SPLIT_FILE) // 2]  # said whole, then cut
    handle = _first_then("503 Busy", "Retry-After: 0\r\n", b"busy\n", whole, "\r\n")
    url = raw_server(handle) + "/m.safetensors"
    with pytest.raises(HTTPStatusError) as busy:
        await load(HttpSource(url, retries=2, backoff=0.01))
    assert busy.value.status == 503


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_an_error_status_to_a_later_request_is_its_status(
    raw_server: Serve, status: int
) -> None:
    """A later request of a read refused (a token or signature that expired, the object
    deleted) with no ETag, as S3 and CloudFront answer: its status, an HTTPStatusError, where
    the missing ETag read as the object changed (SourceChangedError)."""
    first = SPLIT_FILE[:FIRST_RANGE]
    handle = _first_then(f"{status} Refused", "", b"refused\n", first, "Connection: close\r\n\r\n")
    url = raw_server(handle) + "/m.safetensors"
    with pytest.raises(HTTPStatusError) as refused:
        await load(url, include=["b"])
    assert refused.value.status == status


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_a_206_without_length_that_breaks_is_resumed(
    raw_server: Serve, concurrency: int
) -> None:
    """A 206 delimited by the connection closing: its Content-Range says how many bytes are due,
    so one that ends before them broke, and is resumed as one with a Content-Length is: the
    first answer ends after 30 kB, the next before its first byte."""

    def answer_for(n: int) -> tuple[bytes, str, int | None]:
        return SPLIT_FILE, "", {0: 30_000, 1: 0}.get(n)

    url = raw_server(ranged(answer_for, length=False)) + "/m.safetensors"
    source = HttpSource(url, concurrency=concurrency, part_size=40_000, backoff=0.01)
    assert_same_arrays(await load(source), SPLIT)


@pytest.mark.parametrize("concurrency", [1, 2])
async def test_a_chunked_206_ending_early_is_resumed(raw_server: Serve, concurrency: int) -> None:
    """A chunked 206 whose last chunk comes before the bytes its Content-Range names ended early
    though cleanly: resumed from the byte reached, as a body cut short is, where one stream
    (concurrency 1) took it for the object's end and called the file truncated. Concurrency 2
    is the control: its parted reads resumed it before."""

    def answer_for(n: int) -> tuple[bytes, str, int | None]:
        return SPLIT_FILE, 'ETag: "v1"\r\n', 30_000 if n == 0 else None

    url = raw_server(ranged(answer_for, chunked=True)) + "/m.safetensors"
    source = HttpSource(url, concurrency=concurrency, part_size=40_000, backoff=0.01)
    assert_same_arrays(await load(source), SPLIT)


BARE_LF = {
    "bare LF": b"HTTP/1.1 200 OK\nContent-Length: %d\nContent-Type: x\n\n",
    "CRLF, then a bare LF": b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\n",
    "bare LF, then CRLF": b"HTTP/1.1 200 OK\nContent-Length: %d\n\r\n",
    "status line alone": b"HTTP/1.1 200 OK\n\n",
    "chunked": b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n",
}


@pytest.mark.parametrize("head", BARE_LF.values(), ids=BARE_LF.keys())
async def test_lines_ending_in_a_bare_lf_are_read(raw_server: Serve, head: bytes) -> None:
    """RFC 9112 2.2: a recipient may take a bare LF for a line end, an empty line ending the
    head too (it waited for a CRLF CRLF that never came)."""
    if b"chunked" in head:
        body = b"%x\n%s\n0\n\n" % (len(SMALL), SMALL)
    elif b"%d" in head:
        head, body = head % len(SMALL), SMALL
    else:  # no length: the body ends as the connection closes
        body = SMALL
    url = raw_server(answer(head + body, then=lambda _: None)) + "/f.safetensors"
    assert_same_arrays(await load(url, timeout=5), sample_tensors())


def upload_then(action: Handler) -> Handler:
    """A handler taking a whole upload, then doing ``action`` instead of a proper answer."""

    def handle(connection: socket.socket) -> None:
        read_request(connection)
        action(connection)

    return handle


def send_and_wait(raw: bytes) -> Handler:
    def handle(connection: socket.socket) -> None:
        connection.sendall(raw)
        wait_for_close(connection)

    return handle


@pytest.mark.parametrize(
    ("action", "error", "message"),
    [
        (reset, TransportError, "receive failed"),
        (
            send_and_wait(b"HTTP/1.1 201 Created\r\nContent-Length: x\r\n\r\n"),
            HTTPProtocolError,
            "Content-Length 'x'",
        ),
    ],
)
async def test_upload_answered_badly(
    raw_server: Serve, action: Handler, error: type[Exception], message: str
) -> None:
    url = raw_server(upload_then(action)) + "/up.safetensors"
    with anyio.fail_after(10), pytest.raises(error, match=message) as info:
        await stream_st.save(url, {"a": np.arange(1000, dtype=np.float32)})
    assert isinstance(info.value, TransportError) and info.value.url == url


OK_ANSWER = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def keep_alive(methods: list[bytes], then: Callable[[socket.socket, bytes], bool]) -> Handler:
    """Requests on one connection, each method recorded in ``methods`` (across connections):
    a GET is answered ``ok`` unless ``then(connection, method)``, which may answer it itself,
    returns true to end the connection."""

    def handle(connection: socket.socket) -> None:
        while True:
            method = connection.recv(8, socket.MSG_PEEK).partition(b" ")[0]
            read_request(connection)
            methods.append(method)
            if then(connection, method):
                return
            connection.sendall(OK_ANSWER)

    return handle


async def _get(client: HTTPClient, url: str) -> bytes:
    async with await client.request("GET", url) as response:
        return await response.read_all()


@pytest.mark.parametrize("end", [socket.socket.close, reset], ids=["closed", "reset"])
async def test_a_keep_alive_connection_the_server_ended_is_replaced(
    raw_server: Serve, end: Handler
) -> None:
    """The connection closed or reset after an answer: the next read goes on a new one."""
    methods: list[bytes] = []

    def answer_once(connection: socket.socket, method: bytes) -> bool:
        connection.sendall(OK_ANSWER)
        end(connection)
        return True

    url = raw_server(keep_alive(methods, answer_once)) + "/m"
    client = HTTPClient()
    with anyio.fail_after(10):
        assert await _get(client, url) == b"ok"
        await anyio.sleep(0.1)  # the close arrives
        assert await _get(client, url) == b"ok"
    await client.aclose()
    assert methods == [b"GET", b"GET"]


@pytest.mark.parametrize("method", ["GET", "PUT"])
async def test_a_timeout_on_a_reused_connection_is_not_retried(
    raw_server: Serve, method: str
) -> None:
    """The answer held past ``timeout`` on a pooled connection: the request fails after the
    timeout, sent once; never sent again on a new connection."""
    methods: list[bytes] = []

    def hold_the_second(connection: socket.socket, method: bytes) -> bool:
        if len(methods) == 1:
            return False
        wait_for_close(connection)
        return True

    url = raw_server(keep_alive(methods, hold_the_second)) + "/m"
    client = HTTPClient(clock=Clock(Limits(timeout=0.5)))
    with anyio.fail_after(10):
        assert await _get(client, url) == b"ok"
        began = time.monotonic()
        with pytest.raises(ReadTimeoutError, match="timeout"):
            await client.request(method, url, body=b"x" if method == "PUT" else None)
    await client.aclose()
    # Ended by the timeout, not by the server giving up on the held request after 5 s; sent once
    # (a second try would be a third request). Generous: a loaded machine may be slow.
    assert time.monotonic() - began < 4
    assert methods == [b"GET", method.encode()]


async def test_a_post_is_never_sent_twice(raw_server: Serve) -> None:
    """A POST goes on a new connection (closed after its answer), not the pooled one: one the
    server ends after taking it is not a stale keep-alive connection to send it again on."""
    methods: list[bytes] = []

    def drop_posts(connection: socket.socket, method: bytes) -> bool:
        return method == b"POST"  # taken, and no answer: the connection ends

    url = raw_server(keep_alive(methods, drop_posts)) + "/m"
    client = HTTPClient()
    with anyio.fail_after(10):
        assert await _get(client, url) == b"ok"
        with pytest.raises(TransportError, match="closed before a response"):
            await client.request("POST", url, body=b"x")
    await client.aclose()
    assert methods == [b"GET", b"POST"]


async def test_a_post_after_the_pooled_connection_went_stale(raw_server: Serve) -> None:
    """The pooled connection closed by the server is no concern of a POST, which goes on a new
    connection and asks for it to be closed after its answer."""
    methods: list[bytes] = []
    heads: list[bytes] = []

    def close_after_a_get(connection: socket.socket, method: bytes) -> bool:
        connection.sendall(OK_ANSWER)
        return method == b"GET"

    def handle(connection: socket.socket) -> None:
        heads.append(connection.recv(65536, socket.MSG_PEEK))
        keep_alive(methods, close_after_a_get)(connection)

    url = raw_server(handle) + "/m"
    client = HTTPClient()
    with anyio.fail_after(10):
        assert await _get(client, url) == b"ok"
        await anyio.sleep(0.1)  # the close arrives
        async with await client.request("POST", url, body=b"x") as response:
            assert await response.read_all() == b"ok"
    await client.aclose()
    assert methods == [b"GET", b"POST"]
    assert b"\r\nConnection: close\r\n" in heads[1]


async def test_a_post_connection_is_not_pooled_after_its_answer(raw_server: Serve) -> None:
    """A POST asks for its connection to be closed after the answer: it is, even where the
    server keeps it open (no ``Connection: close`` in the answer), so the next GET goes on a new
    connection, never on one the server may be closing."""
    methods: list[bytes] = []
    connections: list[socket.socket] = []

    def handle(connection: socket.socket) -> None:
        connections.append(connection)
        keep_alive(methods, lambda connection, method: False)(connection)

    url = raw_server(handle) + "/m"
    client = HTTPClient()
    with anyio.fail_after(10):
        async with await client.request("POST", url, body=b"x") as response:
            assert await response.read_all() == b"ok"
        assert await _get(client, url) == b"ok"
    await client.aclose()
    assert methods == [b"POST", b"GET"]
    assert len(connections) == 2


@pytest.mark.parametrize("late", [False, True], ids=["with the answer", "after it"])
async def test_bytes_past_an_answer_are_never_taken_for_the_next(
    raw_server: Serve, late: bool
) -> None:
    """A server sending bytes past an answer's Content-Length: the next request on that
    connection took them for its status line, a malformed one, and failed. A connection that
    came with such bytes is not pooled; one they reach later is, and the answer to the next
    request on it, unreadable, has that request sent again on a new connection, once."""
    requests: list[int] = []  # per request, the number of the connection it came on
    connections = iter(range(1 << 30))
    excess = b"GARBAGE!" * 4

    def handle(connection: socket.socket) -> None:
        number = next(connections)
        for served in range(1 << 30):
            read_request(connection)
            requests.append(number)
            if not late:
                connection.sendall(OK_ANSWER + excess)
            elif served:  # sent once the connection was taken from the pool: ahead of its answer
                connection.sendall(excess + OK_ANSWER)
            else:
                connection.sendall(OK_ANSWER)

    url = raw_server(handle) + "/m"
    client = HTTPClient()
    with anyio.fail_after(10):
        assert await _get(client, url) == b"ok"
        assert await _get(client, url) == b"ok"
    await client.aclose()
    # The second GET goes on a new connection, or goes twice: on the first, answered
    # GARBAGE!...HTTP/1.1 200 OK, then on a new one.
    assert requests == ([0, 0, 1] if late else [0, 1])


@pytest.mark.parametrize("idle", ["stray bytes", "closed"])
async def test_a_connection_stirred_while_pooled_is_not_taken(raw_server: Serve, idle: str) -> None:
    """A pooled connection to which bytes (a server's, past its last answer) or its end came
    while it sat idle was taken for the next request: an upload, never sent twice, took those
    bytes for its answer's status line ('malformed status line') or lost its connection. Such a
    connection is closed when taken from the pool, and the upload goes on a new one."""
    requests: list[tuple[int, bytes]] = []  # per request, its connection's number and method
    connections = iter(range(1 << 30))
    pooled, stirred = threading.Event(), threading.Event()

    def handle(connection: socket.socket) -> None:
        number = next(connections)
        while True:
            method = connection.recv(8, socket.MSG_PEEK).partition(b" ")[0]
            read_request(connection)
            requests.append((number, method))
            if method == b"PUT":
                connection.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")
            else:
                connection.sendall(OK_ANSWER)
            if number == 0:
                pooled.wait(5)
                if idle == "closed":
                    connection.close()
                else:
                    connection.sendall(b"GARBAGE!" * 4)
                stirred.set()

    url = raw_server(handle) + "/m"
    client = HTTPClient()
    with anyio.fail_after(10):
        assert await _get(client, url) == b"ok"
        pooled.set()
        await anyio.to_thread.run_sync(stirred.wait, 5)
        upload = await client.upload("PUT", url, content_length=1)
        await upload.send(memoryview(b"x"))
        async with await upload.finish() as response:
            assert response.status == 201
    await client.aclose()
    assert requests == [(0, b"GET"), (1, b"PUT")]


def test_the_test_server_cuts_one_answer_only_with_close_once() -> None:
    """``close_once`` cut every answer that began before the first cut one ended (each read
    ``close_after`` before that one reset it): of two answers sent at once, one only is cut."""
    with RangeHTTPServer(close_after=16384, close_once=True, rate=100_000) as server:
        server.objects["/o"] = bytes(65536)
        connections = [socket.create_connection((server.host, server.port), 5) for _ in range(2)]
        for connection in connections:  # both asked before either answer is done (0.16 s)
            connection.sendall(b"GET /o HTTP/1.1\r\nHost: test\r\n\r\n")
            connection.shutdown(socket.SHUT_WR)  # closed by the server after its answer
        for connection in connections:
            with connection:
                while connection.recv(65536):
                    pass
        assert sorted(sent for *_, sent in server.requests) == [16384, 65536]


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A self-signed certificate for 127.0.0.1: (server context, client context trusting it)."""
    x509: Any = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "127.0.0.1")])
    now = dt.datetime.now(dt.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    folder = tmp_path_factory.mktemp("tls")
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_file, key_file)
    return server, ssl.create_default_context(cafile=str(cert_file))


async def test_https_works(raw_server: Serve, tls: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SMALL) + SMALL
    url = raw_server(answer(raw), tls=tls[0]) + "/f.safetensors"
    async with HTTPClient(ssl_context=tls[1]) as client:
        assert_same_arrays(await load(HttpSource(url, client=client)), sample_tensors())


async def test_https_to_http_redirect_is_refused(
    raw_server: Serve, tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """The request (credentials and all) would go out, and the answer come back, in clear text."""
    with RangeHTTPServer() as plain:
        plain.objects["/f.safetensors"] = SMALL
        raw = b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % (
            plain.url("/f.safetensors").encode()
        )
        url = raw_server(answer(raw), tls=tls[0]) + "/f.safetensors"
        source = HttpSource(url, client=HTTPClient(ssl_context=tls[1]), headers={"Cookie": "c"})
        with pytest.raises(HTTPProtocolError, match="from https to plain http refused") as info:
            await load(source)
        assert info.value.url == url
        assert plain.requests == []


async def test_a_hub_redirect_from_https_to_http_is_refused(
    raw_server: Serve, tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """An hf:// resolution is a redirect like any other: the signed URL would go out in clear."""
    with RangeHTTPServer() as plain:
        plain.objects["/f.safetensors"] = SMALL
        cdn = plain.url("/f.safetensors") + "?sig=secret"
        raw = b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % cdn.encode()
        endpoint = raw_server(answer(raw), tls=tls[0])
        source = HubSource("hf://org/repo/f.safetensors", endpoint=endpoint, token="hf_t")
        source._client._ssl_context = tls[1]  # trust the test's certificate
        with pytest.raises(HTTPProtocolError, match="from https to plain http refused") as info:
            await load(source)
        assert info.value.url == "hf://org/repo/f.safetensors"
        assert "secret" not in str(info.value)
        assert plain.requests == []


async def test_upload_answered_with_a_redirect_is_not_stored(raw_server: Serve) -> None:
    """A 3xx to a PUT means the body was not stored where it was sent."""
    raw = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /elsewhere\r\nContent-Length: 0\r\n\r\n"
    url = raw_server(upload_then(send_and_wait(raw))) + "/up.safetensors"
    with (
        anyio.fail_after(10),
        pytest.raises(HTTPStatusError, match=r"307.*redirected to /elsewhere"),
    ):
        await stream_st.save(url, {"a": np.arange(10, dtype=np.float32)})


async def test_a_redirects_long_password_is_masked_before_it_is_cut(raw_server: Serve) -> None:
    """The Location a refused redirect names is cut to 200 characters after its password is
    masked: cut first, a long password (a token) lost the '@' that ends it and was shown."""
    secret = "eyJhbGciOiJIUzI1NiJ9" * 15
    location = f"https://user:{secret}@elsewhere.example/obj".encode()
    raw = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: %s\r\nContent-Length: 0\r\n\r\n" % location
    url = raw_server(upload_then(send_and_wait(raw))) + "/up.safetensors"
    with anyio.fail_after(10), pytest.raises(HTTPStatusError) as info:
        await stream_st.save(url, {"a": np.arange(10, dtype=np.float32)})
    assert "redirected to https://user:***@elsewhere.example/obj" in str(info.value)
    assert secret[:8] not in str(info.value)


async def test_https_upload_reset_mid_body(
    raw_server: Serve, tls: tuple[ssl.SSLContext, ssl.SSLContext]
) -> None:
    """The body (32 MiB) is more than the socket buffers hold: a send meets the reset."""

    def take_head_then_reset(connection: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += connection.recv(65536)
        reset(connection)

    url = raw_server(take_head_then_reset, tls=tls[0]) + "/up.safetensors"
    sink = HttpSink(url, client=HTTPClient(ssl_context=tls[1]))
    plan = [stream_st.TensorSpec("a", "U8", (32 << 20,))]
    with anyio.fail_after(10), pytest.raises(TransportError) as info:
        async with stream_st.open_writer(sink, plan) as writer:
            await writer.write("a", np.zeros(32 << 20, np.uint8))
    assert info.value.url == url


@pytest.mark.parametrize("handshake", [True, False])
async def test_https_reset_before_an_answer(
    raw_server: Serve, tls: tuple[ssl.SSLContext, ssl.SSLContext], handshake: bool
) -> None:
    """Reset right after the TLS handshake, or instead of it."""
    url = raw_server(reset, tls=tls[0] if handshake else None).replace("http:", "https:")
    source = HttpSource(url + "/m.safetensors", client=HTTPClient(ssl_context=tls[1]), retries=0)
    with pytest.raises(TransportError) as info:
        await load(source)
    assert info.value.url == url + "/m.safetensors"


async def test_closed_stream_wire_raises_os_errors(raw_server: Serve) -> None:
    """Like a closed socket: every caller translates OSError (anyio raises its own errors)."""
    port = int(raw_server(wait_for_close).rsplit(":", 1)[1])
    stream = await anyio.connect_tcp("127.0.0.1", port)
    wire = StreamWire(stream, UNLIMITED)
    await wire.aclose()
    with pytest.raises(OSError):
        await wire.send(b"GET / HTTP/1.1\r\n\r\n")
    with pytest.raises(OSError):
        await wire.recv_into(memoryview(bytearray(10)))


@pytest.mark.parametrize(
    "url",
    ["http://h:99999/x", "http://h:abc/x", "http://[::1/x", "http://h/\udcff"],
)
async def test_invalid_urls_are_usage_errors(url: str) -> None:
    with pytest.raises(UsageError, match="invalid URL") as info:
        await load(HttpSource(url))
    assert repr(url) in str(info.value)


async def test_url_is_percent_encoded() -> None:
    """Spaces and non-ASCII characters cannot go on the request line as they are."""
    with RangeHTTPServer() as server:
        server.objects["/%E6%A8%A1%E5%9E%8B%20v1.safetensors"] = SMALL
        url = server.url("/模型 v1.safetensors?rev=é")
        assert_same_arrays(await load(url), sample_tensors())


async def test_request_headers_must_be_latin_1(raw_server: Serve) -> None:
    """Refused as the source is made, the value not shown (it may be a token)."""
    url = raw_server(wait_for_close) + "/f.safetensors"
    with pytest.raises(UsageError, match="'Authorization' holds characters beyond Latin-1") as info:
        await load(HttpSource(url, headers={"Authorization": "Bearer €"}))
    assert "€" not in str(info.value)


@pytest.mark.parametrize("value", ["tok\r\nX-Injected: yes", "tok\nX-Injected: yes", "t\0k"])
def test_no_request_goes_out_with_a_header_of_a_value_s_choosing(value: str) -> None:
    """A value with a line break (a session token wrapped over two lines in a credentials
    file) would end its header line and start one of its own: refused, naming the header and
    never showing the value, whatever put it there."""
    target = Target.parse("http://127.0.0.1/f.safetensors")
    with pytest.raises(UsageError, match="X-Amz-Security-Token") as info:
        request_head("GET", target, {"X-Amz-Security-Token": value}, [])
    assert "tok" not in str(info.value) and "Injected" not in str(info.value)


@pytest.mark.parametrize("options", [{"concurrency": 0}, {"part_size": 0}, {"retries": -1}])
def test_source_options_are_checked(options: dict[str, Any]) -> None:
    with pytest.raises(UsageError, match="HttpSource"):
        HttpSource("http://127.0.0.1/x", **options)


async def test_an_unasked_not_modified_is_named_so(raw_server: Serve) -> None:
    """A 304 to a request that was not conditional: an error that says what came, not a
    redirect "to nowhere"."""
    raw = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 0\r\n\r\n"
    url = raw_server(answer(raw)) + "/f.safetensors"
    with anyio.fail_after(10), pytest.raises(HTTPStatusError) as info:
        await stream_st.load(url)
    assert info.value.status == 304
    assert "not modified" in str(info.value) and "nowhere" not in str(info.value)


async def test_a_not_modified_to_a_later_request_says_what_a_304_answers(
    raw_server: Serve,
) -> None:
    """A 304 to a later ranged GET, which carries If-Match: the error said it answered "a
    conditional request this request was not", where this one was; it says which preconditions
    a 304 answers."""
    first = SPLIT_FILE[:FIRST_RANGE]
    handle = _first_then("304 Not Modified", "", b"", first, "Connection: close\r\n\r\n")
    url = raw_server(handle) + "/m.safetensors"
    with pytest.raises(HTTPStatusError) as info:
        await load(url, include=["b"])
    assert info.value.status == 304
    assert "only to If-None-Match or If-Modified-Since (never to If-Match" in str(info.value)


async def test_a_refused_connection_says_why() -> None:
    """The one-line error of a failed connect keeps its cause (refused, a limit passed), where
    it said only "cannot connect to HOST:PORT" and left the reason to the chained error."""
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
    with pytest.raises(stream_st.TransportError) as caught:
        await load(HttpSource(f"http://127.0.0.1:{port}/m.safetensors", retries=0))
    assert f"cannot connect to 127.0.0.1:{port}: Connection refused" in str(caught.value)
