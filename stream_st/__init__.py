"""stream_st: read and write safetensors files as asyncio streams.

>>> import stream_st
>>> async def main(path):
...     async with stream_st.open_stream(path) as stream:
...         print(stream.header.metadata)
...         async for name, array in stream:
...             print(name, array.shape)
"""

from __future__ import annotations

from .connection import Connection, Listener, connect, listen
from .dtypes import DTYPES, DType, dtype_for
from .errors import (
    AllocationError,
    DtypeError,
    HeaderError,
    HeaderTooLargeError,
    ReadTimeoutError,
    SafetensorsError,
    SourceNotFoundError,
    TensorNotFoundError,
    TrailingDataError,
    TransportError,
    TruncatedStreamError,
    UnsupportedSourceError,
    UsageError,
)
from .header import Header, TensorInfo, TensorSpec, build_header, parse_header
from .reader import TensorStream, open_stream, read_header

__version__ = "0.1.0"

__all__ = [
    "DTYPES",
    "AllocationError",
    "Connection",
    "DType",
    "DtypeError",
    "Header",
    "HeaderError",
    "HeaderTooLargeError",
    "Listener",
    "ReadTimeoutError",
    "SafetensorsError",
    "SourceNotFoundError",
    "TensorInfo",
    "TensorNotFoundError",
    "TensorSpec",
    "TensorStream",
    "TrailingDataError",
    "TransportError",
    "TruncatedStreamError",
    "UnsupportedSourceError",
    "UsageError",
    "__version__",
    "build_header",
    "connect",
    "dtype_for",
    "listen",
    "open_stream",
    "parse_header",
    "read_header",
]
