"""Sources (moved): :mod:`stream_st.transports.registry` picks them; each medium lives in
:mod:`stream_st.transports`. This path re-exports them for the 0.1 series."""

from __future__ import annotations

from .transports.file.source import FileSource
from .transports.http.source import HttpSource
from .transports.hub import HubSource
from .transports.inmemory import BytesSource, ChunkIteratorSource
from .transports.registry import (
    AsyncReadInto,
    Source,
    SourceLike,
    open_source,
    path_from_url,
    read_object,
)
from .transports.s3.source import S3Source
from .transports.streams import AnyioStreamSource, AsyncioStreamSource, ReadIntoSource
from .transports.tcp import SocketSource

__all__ = [
    "AnyioStreamSource",
    "AsyncReadInto",
    "AsyncioStreamSource",
    "BytesSource",
    "ChunkIteratorSource",
    "FileSource",
    "HttpSource",
    "HubSource",
    "ReadIntoSource",
    "S3Source",
    "SocketSource",
    "Source",
    "SourceLike",
    "open_source",
    "path_from_url",
    "read_object",
]
