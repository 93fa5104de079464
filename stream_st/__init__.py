"""stream_st: read and write safetensors files as asyncio streams.

>>> import stream_st
>>> async def main(path):
...     async with stream_st.open_stream(path) as stream:
...         print(stream.header.metadata)
...         async for name, array in stream:
...             print(name, array.shape)
"""

from __future__ import annotations

from .dtypes import DTYPES, DType, dtype_for
from .errors import (
    AllocationError,
    DtypeError,
    HeaderError,
    HeaderTooLargeError,
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
    "DType",
    "DtypeError",
    "Header",
    "HeaderError",
    "HeaderTooLargeError",
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
    "dtype_for",
    "open_stream",
    "parse_header",
    "read_header",
]
