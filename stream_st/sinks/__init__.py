"""Transports that bytes go out through, and the one place that picks one for an object or URL.

Each kind of sink lives in its own module and meets the :class:`~.base.Sink` interface.
"""

from __future__ import annotations

import asyncio
import os

from anyio.abc import ByteSendStream

from .._http import ClientUser
from .._limits import UNLIMITED, Clock
from ..errors import UnsupportedSinkError
from ..sources import path_from_url
from ..sources.tcp import connect_socket, parse_tcp_url, tcp_url
from .base import Sink
from .file import open_file_sink
from .http import HttpSink
from .s3 import S3Sink
from .streams import AnyioStreamSink, AsyncioStreamSink
from .tcp import SocketSink

__all__ = ["Sink", "SinkLike", "open_sink"]

SinkLike = str | os.PathLike[str] | ByteSendStream | asyncio.StreamWriter | Sink
"""Everything :func:`open_sink` accepts."""


async def open_sink(dst: SinkLike, *, fsync: bool = False, clock: Clock = UNLIMITED) -> Sink:
    """Pick the transport for ``dst``: a path or URL, an anyio byte stream, an asyncio writer.

    URLs: ``file://``, ``tcp://host:port`` (connects), ``http(s)://`` (a PUT upload) and
    ``s3://bucket/key`` (a multipart upload). ``fsync`` applies to files: flush to stable storage
    before the file is moved into place. ``clock`` (the operation's limits, see
    ``stream_st._limits``) bounds connecting and every wait; its ``headers`` and ``ssl_context``
    go to an HTTP or S3 sink. A :class:`Sink` given as it is keeps its own clock unless ``clock``
    sets a limit, and its own headers and TLS context unless ``clock`` brings others (as for a
    source, see :func:`~stream_st.sources.open_source`). A path that exists and is not a regular
    file (a FIFO, ``/dev/null``) is written through in place, never replaced.
    """
    if isinstance(dst, Sink):
        sink = dst
        if clock.limited:
            sink.clock = clock
    else:
        sink = await _new_sink(dst, fsync, clock)
        sink.clock = clock
    if isinstance(sink, ClientUser):
        sink.add_transport(clock.transport)
    return sink


async def _new_sink(dst: SinkLike, fsync: bool, clock: Clock) -> Sink:
    """The transport for ``dst``; a ``tcp://`` peer is connected within ``clock``'s limits."""
    if isinstance(dst, str):
        scheme = dst.split("://", 1)[0].lower() if "://" in dst else ""
        if scheme == "tcp":
            host, port = parse_tcp_url(dst)
            return SocketSink(await connect_socket(host, port, clock), tcp_url(host, port))
        if scheme in ("http", "https"):
            return HttpSink(dst)
        if scheme == "s3":
            return S3Sink(dst)
    if isinstance(dst, str) and "://" in dst:
        path = path_from_url(dst, UnsupportedSinkError)
        return await open_file_sink(path, fsync=fsync, clock=clock)
    if isinstance(dst, str | os.PathLike):
        return await open_file_sink(dst, fsync=fsync, clock=clock)
    if isinstance(dst, asyncio.StreamWriter):
        return AsyncioStreamSink(dst)
    if isinstance(dst, ByteSendStream):
        return AnyioStreamSink(dst)
    raise UnsupportedSinkError(
        f"cannot write safetensors to {type(dst).__name__}: expected a path, a file:// URL, "
        "an anyio ByteSendStream or an asyncio StreamWriter"
    )
