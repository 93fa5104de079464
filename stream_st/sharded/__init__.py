"""Checkpoints and datasets in several files: reading a ``*.safetensors.index.json`` or a
``dataset_manifest.json`` as one stream (:mod:`.reader`), and writing sharded checkpoints and
datasets (:mod:`.writer`). Each is imported when one of its names is first asked for: a read
loads nothing of the writers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ..core.shards import INDEX_SUFFIX, MANIFEST_NAME, is_index, shard_address

if TYPE_CHECKING:
    from .reader import ShardedStream, ShardIndex, shard_headers
    from .writer import DatasetWriter, ShardedWriter, open_dataset_writer, open_sharded_writer

_LAZY = {
    "ShardedStream": "reader",
    "ShardIndex": "reader",
    "shard_headers": "reader",
    "DatasetWriter": "writer",
    "ShardedWriter": "writer",
    "open_dataset_writer": "writer",
    "open_sharded_writer": "writer",
}


if not TYPE_CHECKING:  # checkers see the names above, not Any for every name (a misspelt one)

    def __getattr__(name: str) -> Any:
        """Import the module of a name of :data:`_LAZY` when it is first asked for."""
        if name not in _LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value


__all__ = [
    "INDEX_SUFFIX",
    "MANIFEST_NAME",
    "DatasetWriter",
    "ShardIndex",
    "ShardedStream",
    "ShardedWriter",
    "is_index",
    "open_dataset_writer",
    "open_sharded_writer",
    "shard_address",
    "shard_headers",
]
