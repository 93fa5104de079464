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

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: most of the package's
# own import time, and the window where Ctrl-C at the command's start would show a traceback
if TYPE_CHECKING:
    from typing import Any

    # The submodules of _SUBMODULES, for checkers (imported on first use as attributes).
    from . import bert as bert
    from . import codecs as codecs
    from . import connection as connection
    from . import dataset as dataset
    from . import dtypes as dtypes
    from . import errors as errors
    from . import header as header
    from . import hub as hub
    from . import integrity as integrity
    from . import kv as kv
    from . import llm as llm
    from . import reader as reader
    from . import sharded as sharded
    from . import sinks as sinks
    from . import sources as sources
    from . import torch_dataset as torch_dataset
    from . import writer as writer
    from ._api import load, open_stream, read_header, save
    from .connection import Connection, Listener, connect, listen
    from .core.digests import Digests
    from .core.dtypes import DTYPES, DType, dtype_for
    from .core.header import Header, TensorInfo, parse_header
    from .core.layout import TensorSpec, build_header, plan_order
    from .core.stats import LoadStats, last_stats
    from .errors import (
        AllocationError,
        ArgumentTypeError,
        CacheMissError,
        CacheWarning,
        CertificateError,
        CodecError,
        CredentialsError,
        DeviceError,
        DistributedError,
        DtypeError,
        HeaderError,
        HeaderTooLargeError,
        HTTPNotFoundError,
        HTTPProtocolError,
        HTTPStatusError,
        IntegrityError,
        ModelError,
        OutcomeUnknownError,
        RangeIgnoredWarning,
        RankFailedError,
        RankLostError,
        ReadTimeoutError,
        SafetensorsError,
        SourceChangedError,
        SourceNotFoundError,
        StreamStWarning,
        TensorNotFoundError,
        TrailingDataError,
        TransportError,
        TruncatedStreamError,
        UnknownDtypeError,
        UnsupportedDeviceError,
        UnsupportedFrameworkError,
        UnsupportedSinkError,
        UnsupportedSourceError,
        UsageError,
        WriterError,
    )
    from .kv import KVLayout, KVReceiver, receive_kv, send_kv
    from .reader import TensorStream
    from .server import Server, serve, serving
    from .sharded.reader import ShardedStream
    from .sharded.writer import (
        DatasetWriter,
        ShardedWriter,
        open_dataset_writer,
        open_sharded_writer,
    )
    from .transports.base import AsyncReadInto
    from .transports.cache import Cache
    from .transports.http import HTTPClient
    from .transports.http.sink import HttpSink
    from .transports.http.source import HttpSource
    from .transports.hub import HubSource
    from .transports.options import LimitOptions, TransportOptions
    from .transports.s3.config import S3Config
    from .transports.s3.sink import S3Sink
    from .transports.s3.source import S3Source
    from .writer import TensorParts, TensorWriter, open_writer

__version__: str
"""The installed distribution's version (read on first use)."""

_PUBLIC = {
    "AllocationError": ".errors",
    "ArgumentTypeError": ".errors",
    "AsyncReadInto": ".transports.base",
    "build_header": ".core.layout",
    "CertificateError": ".errors",
    "CacheMissError": ".errors",
    "CacheWarning": ".errors",
    "Cache": ".transports.cache",
    "CodecError": ".errors",
    "connect": ".connection",
    "Connection": ".connection",
    "CredentialsError": ".errors",
    "DatasetWriter": ".sharded.writer",
    "DeviceError": ".errors",
    "Digests": ".core.digests",
    "DType": ".core.dtypes",
    "dtype_for": ".core.dtypes",
    "DtypeError": ".errors",
    "UnknownDtypeError": ".errors",
    "RankLostError": ".errors",
    "RankFailedError": ".errors",
    "DistributedError": ".errors",
    "DTYPES": ".core.dtypes",
    "Header": ".core.header",
    "HeaderError": ".errors",
    "HeaderTooLargeError": ".errors",
    "HTTPClient": ".transports.http",
    "HTTPNotFoundError": ".errors",
    "HTTPProtocolError": ".errors",
    "HttpSink": ".transports.http.sink",
    "HttpSource": ".transports.http.source",
    "HTTPStatusError": ".errors",
    "HubSource": ".transports.hub",
    "IntegrityError": ".errors",
    "ModelError": ".errors",
    "KVLayout": ".kv",
    "KVReceiver": ".kv",
    "LimitOptions": ".transports.options",
    "listen": ".connection",
    "Listener": ".connection",
    "LoadStats": ".core.stats",
    "last_stats": ".core.stats",
    "load": "._api",
    "open_dataset_writer": ".sharded.writer",
    "open_sharded_writer": ".sharded.writer",
    "open_stream": "._api",
    "open_writer": ".writer",
    "OutcomeUnknownError": ".errors",
    "parse_header": ".core.header",
    "plan_order": ".core.layout",
    "RangeIgnoredWarning": ".errors",
    "read_header": "._api",
    "ReadTimeoutError": ".errors",
    "receive_kv": ".kv",
    "S3Config": ".transports.s3.config",
    "S3Sink": ".transports.s3.sink",
    "S3Source": ".transports.s3.source",
    "SafetensorsError": ".errors",
    "save": "._api",
    "send_kv": ".kv",
    "serve": ".server",
    "Server": ".server",
    "serving": ".server",
    "ShardedStream": ".sharded.reader",
    "ShardedWriter": ".sharded.writer",
    "SourceChangedError": ".errors",
    "SourceNotFoundError": ".errors",
    "StreamStWarning": ".errors",
    "TensorInfo": ".core.header",
    "TensorNotFoundError": ".errors",
    "TensorParts": ".writer",
    "TensorSpec": ".core.layout",
    "TensorStream": ".reader",
    "TensorWriter": ".writer",
    "TrailingDataError": ".errors",
    "TransportError": ".errors",
    "TransportOptions": ".transports.options",
    "TruncatedStreamError": ".errors",
    "UnsupportedDeviceError": ".errors",
    "UnsupportedFrameworkError": ".errors",
    "UnsupportedSinkError": ".errors",
    "UnsupportedSourceError": ".errors",
    "UsageError": ".errors",
    "WriterError": ".errors",
}
"""Each public name and the module that defines it, imported when the name is first used: ``import
stream_st`` runs no module of the package but this one, so ``import stream_st.core`` loads no
transport and a program that only writes files never loads HTTP, S3 or torch code."""

_SUBMODULES = frozenset(
    {
        # moved paths, re-exported for the 0.1 series
        "bert",
        "codecs",
        "dataset",
        "dtypes",
        "header",
        "hub",
        "integrity",
        "llm",
        "sinks",
        "sources",
        "torch_dataset",
        # modules earlier releases imported with the package
        "connection",
        "errors",
        "kv",
        "reader",
        "sharded",
        "writer",
    }
)
"""Submodules reachable as attributes of the package (``stream_st.kv``), imported on first use
as earlier releases, which imported them with the package, allowed."""


if not TYPE_CHECKING:  # checkers see the names above, not Any for every name (a misspelt one)

    def __getattr__(name: str) -> Any:
        """Import a public name's module, or a moved module, when it is first asked for."""
        if name == "__version__":
            from ._util import package_version  # imports anyio: not for every import stream_st

            value: Any = package_version()
        elif name in _PUBLIC:
            value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        elif name in _SUBMODULES:
            value = importlib.import_module(f".{name}", __name__)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "DTYPES",
    "AllocationError",
    "ArgumentTypeError",
    "AsyncReadInto",
    "Cache",
    "CacheMissError",
    "CacheWarning",
    "CertificateError",
    "CodecError",
    "Connection",
    "CredentialsError",
    "DType",
    "DatasetWriter",
    "DeviceError",
    "Digests",
    "DistributedError",
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
    "LoadStats",
    "ModelError",
    "OutcomeUnknownError",
    "RangeIgnoredWarning",
    "RankFailedError",
    "RankLostError",
    "ReadTimeoutError",
    "S3Config",
    "S3Sink",
    "S3Source",
    "SafetensorsError",
    "Server",
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
    "UnknownDtypeError",
    "UnsupportedDeviceError",
    "UnsupportedFrameworkError",
    "UnsupportedSinkError",
    "UnsupportedSourceError",
    "UsageError",
    "WriterError",
    "__version__",
    "build_header",
    "connect",
    "dtype_for",
    "last_stats",
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
    "serve",
    "serving",
]
