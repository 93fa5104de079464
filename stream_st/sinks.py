"""Sinks (moved): :mod:`stream_st.transports.registry` picks them; each medium lives in
:mod:`stream_st.transports`. This path re-exports them for the 0.1 series."""

from __future__ import annotations

from .transports.file.sink import FileSink
from .transports.http.sink import HttpSink
from .transports.registry import Sink, SinkLike, open_sink
from .transports.s3.sink import S3Sink
from .transports.streams import AnyioStreamSink, AsyncioStreamSink
from .transports.tcp import SocketSink

__all__ = [
    "AnyioStreamSink",
    "AsyncioStreamSink",
    "FileSink",
    "HttpSink",
    "S3Sink",
    "Sink",
    "SinkLike",
    "SocketSink",
    "open_sink",
]
