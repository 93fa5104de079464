"""Moved to :mod:`stream_st.integrations.dataset`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .core.shards import (
    FORMAT_VERSION,
    INDEX_NAME,
    SAFETENSORS_VERSION,
    SHARD_NAME,
    ShardEntry,
    manifest_document,
    shard_file_name,
    shard_position,
)
from .integrations.dataset import *  # noqa: F403
from .integrations.dataset import __all__ as _dataset

__all__ = [
    *_dataset,
    "FORMAT_VERSION",
    "INDEX_NAME",
    "SAFETENSORS_VERSION",
    "SHARD_NAME",
    "ShardEntry",
    "manifest_document",
    "shard_file_name",
    "shard_position",
]
