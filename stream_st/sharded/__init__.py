"""Checkpoints and datasets in several files: reading a ``*.safetensors.index.json`` or a
``dataset_manifest.json`` as one stream (:mod:`.reader`), and writing sharded checkpoints and
datasets (:mod:`.writer`)."""

from ..core.shards import INDEX_SUFFIX, MANIFEST_NAME, is_index, shard_address
from .reader import ShardedStream, ShardIndex, shard_headers
from .writer import DatasetWriter, ShardedWriter, open_dataset_writer, open_sharded_writer

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
