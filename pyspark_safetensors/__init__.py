"""A Spark data source for safetensors datasets: ``format("safetensors")``.

Spark (pyspark >= 4.0) finds it by itself: a top-level module named ``pyspark_*`` exposing
``DefaultSource`` is registered when the session first looks up a Python data source. Or register
it explicitly::

    import pyspark_safetensors
    pyspark_safetensors.register(spark)

    df.write.format("safetensors").option("batch_size", 1000).mode("overwrite").save(path)
    spark.read.format("safetensors").load(path)

Spark is the engine; stream_st does the bytes (local paths and ``s3://`` for writing, those and
``http(s)://`` for reading). See ``stream_st.dataset`` for the layout, ``_write`` for the write
protocol, and docs/spark.md for the options.
"""

from __future__ import annotations

from typing import Any

import anyio
import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    StringType,
    StructField,
    StructType,
)

from stream_st.errors import UsageError
from stream_st.integrations.dataset import (
    DatasetInfo,
    Piece,
    describe_dataset,
    plan_pieces,
    read_piece,
)

from ._arrow import tensor_column
from ._write import SafetensorsWriter, WriteOptions, _positive

__all__ = ["TENSOR_STRUCT", "DefaultSource", "SafetensorsDataSource", "register"]

TENSOR_STRUCT = StructType(
    [
        StructField("data", BinaryType()),
        StructField("shape", ArrayType(IntegerType())),
        StructField("dtype", StringType()),
    ]
)
"""A tensor column's type: ``struct<data: binary, shape: array<int>, dtype: string>``."""


def _describe(options: Any) -> DatasetInfo:
    path = options.get("path")
    if not path:
        raise UsageError("give the dataset's location: .load(path)")
    kv = None if options.get("name_col") is None else True
    return anyio.run(lambda: describe_dataset(str(path), kv=kv))


class SafetensorsDataSource(DataSource):
    """Reads and writes the safetensors-spark dataset layout (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "safetensors"

    def schema(self) -> StructType:
        """Batch mode: a tensor column per tensor (``columns=`` picks some); KV mode:
        ``tensor_key`` and ``tensor``."""
        dataset = _describe(self.options)
        if dataset.kv:
            return StructType(
                [StructField("tensor_key", StringType()), StructField("tensor", TENSOR_STRUCT)]
            )
        wanted = self.options.get("columns")
        columns = dataset.columns
        if wanted:
            columns = [c.strip() for c in str(wanted).split(",") if c.strip()]
        return StructType([StructField(column, TENSOR_STRUCT) for column in columns])

    def reader(self, schema: StructType) -> DataSourceReader:
        return SafetensorsReader(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> SafetensorsWriter:
        return SafetensorsWriter(WriteOptions.parse(self.options), overwrite)


DefaultSource = SafetensorsDataSource
"""What Spark's automatic discovery of ``pyspark_*`` modules looks for."""


class SafetensorsReader(DataSourceReader):
    """One partition per piece of a shard (at most ``max_partition_mb``, default 128): a row
    range in batch mode, a group of tensors in KV mode; only the schema's columns are read."""

    def __init__(self, options: Any, schema: StructType) -> None:
        dataset = _describe(options)
        self.kv = dataset.kv
        names = None if dataset.kv else [f.name for f in schema.fields]
        limit = _positive(options, "max_partition_mb", 128) or 128
        if limit > 1024:
            raise UsageError("option max_partition_mb must be at most 1024")
        self.pieces = plan_pieces(dataset, names, max_bytes=limit << 20)

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(piece) for piece in self.pieces] or [InputPartition(None)]

    def read(self, partition: InputPartition) -> Any:
        piece: Piece | None = partition.value
        if piece is None:
            return
        arrays = anyio.run(read_piece, piece)
        if self.kv:
            keys = list(arrays)
            tensors = [tensor_column(arrays[key][None]) for key in keys]
            yield pa.RecordBatch.from_arrays(
                [pa.array(keys, pa.string()), pa.concat_arrays(tensors) if tensors else None],
                names=["tensor_key", "tensor"],
            )
        else:
            yield pa.RecordBatch.from_arrays(
                [tensor_column(arrays[name]) for name in piece.names], names=list(piece.names)
            )


def register(spark: SparkSession) -> None:
    """Register the data source with ``spark`` as format ``"safetensors"``."""
    spark.dataSource.register(SafetensorsDataSource)
