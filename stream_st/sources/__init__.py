"""Transports that bytes come in through, and the one place that picks one for an object or URL.

Each kind of source lives in its own module and meets the :class:`~.base.Source` interface.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import AsyncIterable
from typing import Any, cast
from urllib.parse import unquote, urlsplit

from anyio.abc import ByteReceiveStream

from .._http import ClientUser
from .._limits import UNLIMITED, Clock
from ..errors import SafetensorsError, UnsupportedSourceError, UsageError
from ..hub import HubSource
from .base import AsyncReadInto, Source
from .file import open_file_source
from .http import HttpSource
from .memory import BytesSource, ChunkIteratorSource
from .s3 import S3Source
from .streams import AnyioStreamSource, AsyncioStreamSource, ReadIntoSource
from .tcp import SocketSource, connect_socket, parse_tcp_url, tcp_url

__all__ = [
    "AsyncReadInto",
    "ReadIntoSource",
    "Source",
    "SourceLike",
    "open_source",
    "path_from_url",
    "read_object",
]

SourceLike = (
    str
    | os.PathLike[str]
    | bytes
    | bytearray
    | memoryview
    | AsyncIterable[Any]
    | ByteReceiveStream
    | asyncio.StreamReader
    | AsyncReadInto
    | Source
)
"""Everything :func:`open_source` accepts."""


def path_from_url(url: str, unsupported: type[SafetensorsError] = UnsupportedSourceError) -> str:
    """The local path of a ``file://`` URL; ``unsupported`` is raised for any other URL."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise unsupported(f"file URL with a remote host is not supported: {url}")
        return unquote(parts.path)
    raise unsupported(f"unknown URL scheme {scheme!r} in {url!r}")


async def open_source(obj: SourceLike, clock: Clock = UNLIMITED) -> Source:
    """Open the transport for ``obj``: a path or URL, bytes, a byte stream or chunk iterator.

    ``clock`` (the operation's limits, see ``stream_st._limits``) bounds connecting and every
    wait for data; its ``headers`` and ``ssl_context`` go to an HTTP or S3 source. A
    :class:`Source` given as it is keeps its own clock unless ``clock`` sets a limit, and its own
    headers and TLS context unless ``clock`` brings others (given headers go on top of its own).
    FIFOs and pipes are waited on within the clock's limits too.
    """
    if isinstance(obj, Source):
        source = obj
        if clock.limited:
            source.clock = clock
    else:
        source = await _new_source(obj, clock)
        source.clock = clock
    if isinstance(source, ClientUser):
        source.add_transport(clock.transport)
    return source


async def _new_source(obj: SourceLike, clock: Clock) -> Source:
    """The transport for ``obj``; a ``tcp://`` peer is connected within ``clock``'s limits."""
    if isinstance(obj, str) and obj.lower().startswith("tcp://"):
        host, port = parse_tcp_url(obj)
        return SocketSource(await connect_socket(host, port, clock), tcp_url(host, port))
    if isinstance(obj, str) and obj.lower().startswith(("http://", "https://")):
        return HttpSource(obj)
    if isinstance(obj, str) and obj.lower().startswith("s3://"):
        return S3Source(obj)
    if isinstance(obj, str) and obj.lower().startswith("hf://"):
        return HubSource(obj)
    if isinstance(obj, str) and "://" in obj:
        return open_file_source(path_from_url(obj), clock)
    if isinstance(obj, str | os.PathLike):
        return open_file_source(obj, clock)
    if isinstance(obj, bytes | bytearray | memoryview):
        return BytesSource(obj)
    if isinstance(obj, asyncio.StreamReader):
        return AsyncioStreamSource(obj)
    if isinstance(obj, ByteReceiveStream):
        return AnyioStreamSource(obj)
    if inspect.iscoroutinefunction(getattr(obj, "readinto", None)):  # not a blocking file's
        return ReadIntoSource(cast(AsyncReadInto, obj))
    if isinstance(obj, AsyncIterable):
        return ChunkIteratorSource(obj)
    raise UnsupportedSourceError(
        f"cannot read safetensors from {type(obj).__name__}: expected a path, URL, bytes, "
        "an async iterable of bytes, an object with 'async def readinto(buffer)', an anyio "
        "ByteReceiveStream or an asyncio StreamReader"
    )


async def read_object(
    address: str | os.PathLike[str], clock: Clock = UNLIMITED, *, limit: int = 64 << 20
) -> tuple[bytes, str]:
    """The whole of a small object (an index, a manifest) at a path or URL; at most ``limit``.
    ``clock`` bounds its waits and brings its headers (see :func:`open_source`).

    Also returns the address of what was read, for finding the objects next to it: for ``hf://``
    the address pinned to the commit the Hub served (:attr:`HubSource.pinned`), else ``address``.
    """
    source = await open_source(address, clock)
    try:
        await source.start(read_all=True)
        out = bytearray()
        chunk = memoryview(bytearray(1 << 20))
        while len(out) <= limit:
            got = await source.receive_into(chunk)
            if got == 0:
                home = source.pinned if isinstance(source, HubSource) else os.fspath(address)
                return bytes(out), home
            out += chunk[:got]
    finally:
        await source.aclose()
    raise UsageError(f"{source.name} is larger than {limit} bytes")
