"""The one place that picks a transport: a path, URL or object -> its :class:`~.base.Source` or
:class:`~.base.Sink`.

URL schemes are one table, :data:`SCHEMES`: each row names, as ``"module:function"`` under this
package, the factory of that medium's source and of its sink, imported only when a URL of that
scheme is opened (so ``import stream_st`` loads no HTTP, S3 or Hub code). Every factory takes the
URL and the operation's :class:`~.options.Clock` (a sink's also ``fsync``). Adding a medium is one
module with those factories plus one row here. Objects that are not URLs (bytes, streams, chunk
iterators, ``readinto`` producers) are matched by type below.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import inspect
import os
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any, NamedTuple, cast

from anyio.abc import ByteReceiveStream, ByteSendStream

from ..core.shards import scheme_of
from ..errors import UnsupportedSinkError, UnsupportedSourceError, UsageError
from .base import AsyncReadInto, Sink, Source
from .file.sink import open_file_sink
from .file.source import open_file_source, path_from_url
from .inmemory import BytesSource, ChunkIteratorSource, aiohttp_source, refuse_path_bytes
from .options import UNLIMITED, Clock

__all__ = [
    "SCHEMES",
    "AsyncReadInto",
    "Scheme",
    "Sink",
    "SinkLender",
    "SinkLike",
    "Source",
    "SourceLike",
    "open_sink",
    "open_source",
    "path_from_url",
    "read_object",
    "scheme_of",
]


class Scheme(NamedTuple):
    """One medium's row: ``"module:function"`` of its source and sink factories (None: that
    direction is not offered)."""

    source: str | None
    sink: str | None


SCHEMES: dict[str, Scheme] = {
    "file": Scheme("file.source:source_for", "file.sink:sink_for"),
    "tcp": Scheme("tcp:source_for", "tcp:sink_for"),
    "http": Scheme("http.source:source_for", "http.sink:sink_for"),
    "https": Scheme("http.source:source_for", "http.sink:sink_for"),
    "s3": Scheme("s3.source:source_for", "s3.sink:sink_for"),
    "hf": Scheme("hub:source_for", None),
}
"""URL scheme -> the medium that serves it."""

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


class SinkLender(abc.ABC):
    """A destination that lends a sink of its own to each message written to it: a
    :class:`~stream_st.Connection`, whose socket carries one message after another."""

    @abc.abstractmethod
    def lend_sink(self) -> Sink:
        """The sink of the next message, with the lender's clock (its limits) and its turn."""


SinkLike = str | os.PathLike[str] | ByteSendStream | asyncio.StreamWriter | Sink | SinkLender
"""Everything :func:`open_sink` accepts."""


def _factory(spec: str) -> Callable[..., Awaitable[Any]]:
    module, _, name = spec.partition(":")
    return cast(
        "Callable[..., Awaitable[Any]]",
        getattr(importlib.import_module(f"{__package__}.{module}"), name),
    )


async def open_source(obj: SourceLike, clock: Clock = UNLIMITED) -> Source:
    """Open the transport for ``obj``: a path or URL, bytes, a byte stream or chunk iterator.

    ``clock`` (the operation's limits, see :mod:`stream_st.transports.options`) bounds connecting
    and every wait for data; its ``headers`` and ``ssl_context`` go to an HTTP or S3 source. A
    :class:`Source` given as it is keeps its own clock unless ``clock`` sets a limit, and its own
    headers and TLS context unless ``clock`` brings others (given headers go on top of its own).
    FIFOs and pipes are waited on within the clock's limits too.
    """
    if isinstance(obj, Source):
        source = obj
        source.claim()
        if clock.limited:
            source.clock = clock
    else:
        source = await _new_source(obj, clock)
        source.clock = clock
    source.add_transport(clock.transport)
    return source


async def _new_source(obj: SourceLike, clock: Clock) -> Source:
    """The transport for ``obj``; a ``tcp://`` peer is connected within ``clock``'s limits."""
    scheme = scheme_of(obj)
    if scheme is not None:
        row = SCHEMES.get(scheme)
        if row is None or row.source is None:
            raise UnsupportedSourceError(f"unknown URL scheme {scheme!r} in {obj!r}")
        return cast(Source, await _factory(row.source)(obj, clock))
    if isinstance(obj, str | os.PathLike):
        return open_file_source(obj, clock)
    if isinstance(obj, bytes | bytearray | memoryview):
        refuse_path_bytes(obj)
        return BytesSource(obj)
    if isinstance(obj, asyncio.StreamReader):
        from .streams import AsyncioStreamSource  # here: TLS and stapled streams, 5 ms

        return AsyncioStreamSource(obj)
    if isinstance(obj, ByteReceiveStream):
        from .streams import AnyioStreamSource

        return AnyioStreamSource(obj)
    if inspect.iscoroutinefunction(getattr(obj, "readinto", None)):  # not a blocking file's
        from .streams import ReadIntoSource

        return ReadIntoSource(cast(AsyncReadInto, obj))
    chunks = getattr(obj, "iter_any", None)
    if callable(chunks) and inspect.iscoroutinefunction(getattr(obj, "readany", None)):
        return aiohttp_source(obj)  # aiohttp's StreamReader: iterated, it gives lines
    refusal = getattr(type(obj), "not_a_source", None)  # a type that says how it is read
    if isinstance(refusal, str):
        raise UnsupportedSourceError(
            f"cannot read safetensors from a {type(obj).__name__}: {refusal}"
        )
    if isinstance(obj, AsyncIterable):
        return ChunkIteratorSource(obj)
    raise UnsupportedSourceError(
        f"cannot read safetensors from {type(obj).__name__}: expected a path, URL, bytes, "
        "an async iterable of bytes, an object with 'async def readinto(buffer)', an anyio "
        "ByteReceiveStream or an asyncio StreamReader"
    )


async def open_sink(dst: SinkLike, *, fsync: bool = False, clock: Clock = UNLIMITED) -> Sink:
    """Pick the transport for ``dst``: a path or URL, an anyio byte stream, an asyncio writer,
    a :class:`~stream_st.Connection` (a :class:`SinkLender`).

    URLs: ``file://``, ``tcp://host:port`` (connects), ``http(s)://`` (a PUT upload) and
    ``s3://bucket/key`` (a multipart upload). ``fsync`` applies to files: flush to stable storage
    before the file is moved into place. ``clock`` (the operation's limits) bounds connecting and
    every wait; its ``headers`` and ``ssl_context`` go to an HTTP or S3 sink. A :class:`Sink`
    given as it is keeps its own clock unless ``clock`` sets a limit, and its own headers and TLS
    context unless ``clock`` brings others (as for a source, see :func:`open_source`); so does the
    sink a :class:`SinkLender` lends (a connection's socket, under the connection's limits and
    turn). A :class:`Sink` given as it is that commits one object (a file, an upload) takes one
    message (:meth:`~.base.Sink.claim`: a second is a :class:`~stream_st.UsageError`); a stream's
    sink takes message after message, one at a time. A path that exists and is not a regular
    file (a FIFO, ``/dev/null``) is written through in place, never replaced.
    """
    if isinstance(dst, SinkLender):
        dst = dst.lend_sink()  # one for this message
    elif isinstance(dst, Sink):
        dst.claim()
    if isinstance(dst, Sink):
        sink = dst
        if clock.limited:
            sink.clock = clock
    else:
        sink = await _new_sink(dst, fsync, clock)
        sink.clock = clock
    sink.add_transport(clock.transport)
    return sink


async def _new_sink(dst: SinkLike, fsync: bool, clock: Clock) -> Sink:
    """The transport for ``dst``; a ``tcp://`` peer is connected within ``clock``'s limits."""
    scheme = scheme_of(dst)
    if scheme is not None:
        row = SCHEMES.get(scheme)
        if row is None or row.sink is None:
            raise UnsupportedSinkError(f"cannot write to a {scheme!r} URL: {dst!r}")
        return cast(Sink, await _factory(row.sink)(dst, clock, fsync))
    if isinstance(dst, str | os.PathLike):
        return await open_file_sink(dst, fsync=fsync, clock=clock)
    if isinstance(dst, asyncio.StreamWriter):
        from .streams import AsyncioStreamSink

        return AsyncioStreamSink(dst)
    if isinstance(dst, ByteSendStream):
        from .streams import AnyioStreamSink

        return AnyioStreamSink(dst)
    raise UnsupportedSinkError(
        f"cannot write safetensors to {type(dst).__name__}: expected a path, a URL, "
        "a Connection, an anyio ByteSendStream or an asyncio StreamWriter"
    )


async def read_object(
    address: str | os.PathLike[str] | Source, clock: Clock = UNLIMITED, *, limit: int = 64 << 20
) -> tuple[bytes, str]:
    """The whole of a small object (an index, a manifest) at a path or URL, or of a source;
    at most ``limit``. ``clock`` bounds its waits and brings its headers (see
    :func:`open_source`).

    Also returns the address of what was read, for finding the objects next to it: the source's
    :attr:`~.base.Source.home` (for ``hf://`` the address pinned to the commit the Hub served),
    else ``address``.
    """
    source = await open_source(address, clock)
    try:
        await source.start(read_all=True)
        out = bytearray()
        chunk = memoryview(bytearray(1 << 20))
        while len(out) <= limit:
            got = await source.receive_into(chunk)
            if got == 0:
                home = address.name if isinstance(address, Source) else os.fspath(address)
                return bytes(out), source.home or home
            out += chunk[:got]
    finally:
        await source.aclose()
    raise UsageError(f"{source.name} is larger than {limit} bytes")
