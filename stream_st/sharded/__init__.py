"""Checkpoints and datasets in several files: reading a ``*.safetensors.index.json`` or a
``dataset_manifest.json`` as one stream (:mod:`.reader`), and writing sharded checkpoints and
datasets (:mod:`.writer`)."""

from .reader import ShardedStream
from .writer import DatasetWriter, ShardedWriter, open_dataset_writer, open_sharded_writer

__all__ = [
    "DatasetWriter",
    "ShardedStream",
    "ShardedWriter",
    "open_dataset_writer",
    "open_sharded_writer",
]
