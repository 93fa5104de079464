"""stream_st: read and write safetensors files as asyncio streams.

>>> import stream_st
>>> async def main(path):
...     async with stream_st.open_stream(path) as stream:
...         print(stream.header.metadata)
...         async for name, array in stream:
...             print(name, array.shape)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._api import load, open_stream, read_header, save
from .connection import Connection, Listener, connect, listen
from .core.digests import Digests
from .core.dtypes import DTYPES, DType, dtype_for
from .core.header import Header, TensorInfo, TensorSpec, build_header, parse_header, plan_order
from .errors import (
    AllocationError,
    CertificateError,
    CredentialsError,
    DtypeError,
    HeaderError,
    HeaderTooLargeError,
    HTTPNotFoundError,
    HTTPProtocolError,
    HTTPStatusError,
    IntegrityError,
    OutcomeUnknownError,
    RangeIgnoredWarning,
    ReadTimeoutError,
    SafetensorsError,
    SourceChangedError,
    SourceNotFoundError,
    StreamStWarning,
    TensorNotFoundError,
    TrailingDataError,
    TransportError,
    TruncatedStreamError,
    UnsupportedSinkError,
    UnsupportedSourceError,
    UsageError,
    WriterError,
)
from .kv import KVLayout, KVReceiver, receive_kv, send_kv
from .reader import TensorStream
from .sharded.reader import ShardedStream
from .sharded.writer import DatasetWriter, ShardedWriter, open_dataset_writer, open_sharded_writer
from .transports.base import AsyncReadInto
from .transports.options import LimitOptions, TransportOptions
from .writer import TensorParts, TensorWriter, open_writer

if TYPE_CHECKING:
    from .transports.http import HTTPClient
    from .transports.http.sink import HttpSink
    from .transports.http.source import HttpSource
    from .transports.hub import HubSource
    from .transports.s3.config import S3Config
    from .transports.s3.sink import S3Sink
    from .transports.s3.source import S3Source

_LAZY = {
    "HttpSink": ".transports.http.sink",
    "HttpSource": ".transports.http.source",
    "S3Config": ".transports.s3.config",
    "S3Sink": ".transports.s3.sink",
    "S3Source": ".transports.s3.source",
    "HTTPClient": ".transports.http",
    "HubSource": ".transports.hub",
}
"""Public names whose transports are imported on first use, so ``import stream_st`` stays light."""

_MOVED = frozenset(
    {"bert", "codecs", "dataset", "hub", "integrity", "llm", "sinks", "sources", "torch_dataset"}
)
"""Old module paths, re-exported for the 0.1 series and imported on first use."""


def __getattr__(name: str) -> Any:
    """Import a transport's public class, or a moved module, when it is first asked for."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _MOVED:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _version() -> str:
    """The installed distribution's version (pyproject.toml is the one place it is written);
    ``0+unknown`` for a source tree on ``sys.path`` that was never installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stream-st")
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()

__all__ = [
    "DTYPES",
    "AllocationError",
    "AsyncReadInto",
    "CertificateError",
    "Connection",
    "CredentialsError",
    "DType",
    "DatasetWriter",
    "Digests",
    "DtypeError",
    "HTTPClient",
    "HTTPNotFoundError",
    "HTTPProtocolError",
    "HTTPStatusError",
    "Header",
    "HeaderError",
    "HeaderTooLargeError",
    "HttpSink",
    "HttpSource",
    "HubSource",
    "IntegrityError",
    "KVLayout",
    "KVReceiver",
    "LimitOptions",
    "Listener",
    "OutcomeUnknownError",
    "RangeIgnoredWarning",
    "ReadTimeoutError",
    "S3Config",
    "S3Sink",
    "S3Source",
    "SafetensorsError",
    "ShardedStream",
    "ShardedWriter",
    "SourceChangedError",
    "SourceNotFoundError",
    "StreamStWarning",
    "TensorInfo",
    "TensorNotFoundError",
    "TensorParts",
    "TensorSpec",
    "TensorStream",
    "TensorWriter",
    "TrailingDataError",
    "TransportError",
    "TransportOptions",
    "TruncatedStreamError",
    "UnsupportedSinkError",
    "UnsupportedSourceError",
    "UsageError",
    "WriterError",
    "__version__",
    "build_header",
    "connect",
    "dtype_for",
    "listen",
    "load",
    "open_dataset_writer",
    "open_sharded_writer",
    "open_stream",
    "open_writer",
    "parse_header",
    "plan_order",
    "read_header",
    "receive_kv",
    "save",
    "send_kv",
]
