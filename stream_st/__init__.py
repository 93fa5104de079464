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
from .convenience import load, save
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
    UnsupportedSinkError,
    UnsupportedSourceError,
    UsageError,
    WriterError,
)
from .header import Header, TensorInfo, TensorSpec, build_header, parse_header, plan_order
from .reader import TensorStream, open_stream, read_header
from .writer import TensorParts, TensorWriter, open_writer

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
    "TensorParts",
    "TensorSpec",
    "TensorStream",
    "TensorWriter",
    "TrailingDataError",
    "TransportError",
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
    "open_stream",
    "open_writer",
    "parse_header",
    "plan_order",
    "read_header",
    "save",
]
