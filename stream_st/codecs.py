"""Moved to :mod:`stream_st.core.codecs`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .core.codecs import (
    CODECS,
    Codec,
    CodecError,
    ErrorStats,
    Int4Codec,
    Int8Codec,
    NoneCodec,
    codec_from_metadata,
    error_stats,
    get_codec,
    to_bfloat16,
)

__all__ = [
    "CODECS",
    "Codec",
    "CodecError",
    "ErrorStats",
    "Int4Codec",
    "Int8Codec",
    "NoneCodec",
    "codec_from_metadata",
    "error_stats",
    "get_codec",
    "to_bfloat16",
]
