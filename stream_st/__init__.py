"""stream_st: read and write safetensors files as asyncio streams.

>>> import stream_st
>>> async def main(path):
...     async with stream_st.open_stream(path) as stream:
...         print(stream.header.metadata)
...         async for name, array in stream:
...             print(name, array.shape)
"""

from __future__ import annotations

from ._limits import LimitOptions, TransportOptions
from ._s3 import S3Config
from .connection import Connection, Listener, connect, listen
from .convenience import load, save
from .dtypes import DTYPES, DType, dtype_for
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
    ReadTimeoutError,
    SafetensorsError,
    SourceChangedError,
    SourceNotFoundError,
    TensorNotFoundError,
    TrailingDataError,
    TransportError,
    TruncatedStreamError,
    UnsupportedSinkError,
    UnsupportedSourceError,
    UsageError,
    WriterError,
)
from .header import Header, TensorInfo, TensorSpec, build_header, parse_header, plan_order
from .integrity import Digests
from .kv import KVLayout, KVReceiver, receive_kv, send_kv
from .reader import TensorStream, open_stream, read_header
from .shard_writer import DatasetWriter, ShardedWriter, open_dataset_writer, open_sharded_writer
from .sharded import ShardedStream
from .sinks.http import HttpSink
from .sinks.s3 import S3Sink
from .sources.base import AsyncReadInto
from .sources.http import HttpSource
from .sources.s3 import S3Source
from .writer import TensorParts, TensorWriter, open_writer

# isort: split
# The HTTP client after the transports: it uses the TCP connect of the sources package.
from ._http import HTTPClient
from .hub import HubSource


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
    "ReadTimeoutError",
    "S3Config",
    "S3Sink",
    "S3Source",
    "SafetensorsError",
    "ShardedStream",
    "ShardedWriter",
    "SourceChangedError",
    "SourceNotFoundError",
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
