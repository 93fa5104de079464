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

from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pyarrow as pa
from anyio.from_thread import start_blocking_portal
from pyspark.sql import SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import DataType, StringType, StructField, StructType

from stream_st._api import load
from stream_st.core.dtypes import dtype_from_code
from stream_st.core.header import Header
from stream_st.errors import UsageError
from stream_st.integrations.dataset import (
    DatasetInfo,
    Piece,
    describe_dataset,
    plan_pieces,
    read_piece,
)

from ._arrow import arrow_row_bytes, tensor_column, typed_column
from ._types import (
    TENSOR_COLUMN,
    TENSOR_STRUCT,
    Column,
    column_of,
    inferred_type,
    parse_type,
    without_nulls,
)
from ._write import SafetensorsWriter, WriteOptions, _flag, _positive

__all__ = ["TENSOR_STRUCT", "DefaultSource", "SafetensorsDataSource", "register"]

Array = np.ndarray[Any, Any]

BATCH_BYTES = 32 << 20
"""A read hands Spark Arrow batches of about this many bytes (at least one row each)."""


def _describe(options: Any) -> DatasetInfo:
    path = options.get("path")
    if not path:
        raise UsageError("give the dataset's location: .load(path)")
    kv = None if options.get("name_col") is None else True
    return anyio.run(lambda: describe_dataset(str(path), kv=kv))


def _column_types(dataset: DatasetInfo, raw: bool) -> dict[str, Column]:
    """Batch mode: each column's type as the manifest records it (``spark_type``), else as told
    from its dtype and shape; every one the tensor struct with ``raw``."""
    schema = dataset.manifest.get("schema")
    entries = schema if isinstance(schema, dict) else {}
    out = {}
    for name in dataset.columns:
        entry = entries.get(name)
        recorded = entry.get("spark_type") if isinstance(entry, dict) else None
        kind: DataType
        if raw:
            kind = TENSOR_STRUCT
        elif isinstance(recorded, str):
            kind = parse_type(recorded)
        else:
            info = dataset.headers[0][name]
            kind = inferred_type(info.dtype, len(info.shape) - 1)
        column = column_of(kind)
        if column is None:
            raise UsageError(f"column {name!r}: the manifest's type {recorded!r} holds no tensor")
        out[name] = column
    return out


class SafetensorsDataSource(DataSource):
    """Reads and writes the safetensors-spark dataset layout (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "safetensors"

    def schema(self) -> StructType:
        """Batch mode: a column per tensor (``columns=`` picks some) of the type it was written
        with (``raw=true``: the tensor struct); KV mode: ``tensor_key`` and ``tensor``. No
        column, array element or struct field is nullable: a tensor holds no null (and Spark
        converts columns it knows hold none faster)."""
        dataset = _describe(self.options)
        fields: list[tuple[str, DataType]]
        if dataset.kv:
            fields = [("tensor_key", StringType()), ("tensor", TENSOR_STRUCT)]
        else:
            types = _column_types(dataset, _flag(self.options, "raw"))
            wanted = self.options.get("columns")
            columns = list(types)
            if wanted:
                columns = [c.strip() for c in str(wanted).split(",") if c.strip()]
                missing = [c for c in columns if c not in types]
                if missing:
                    raise UsageError(
                        f"the dataset has no column {missing[0]!r} (it has {list(types)})"
                    )
            fields = [(column, types[column].spark) for column in columns]
        return StructType([StructField(name, without_nulls(kind), False) for name, kind in fields])

    def reader(self, schema: StructType) -> DataSourceReader:
        return SafetensorsReader(self.options, schema)

    def writer(self, schema: StructType, overwrite: bool) -> SafetensorsWriter:
        return SafetensorsWriter(WriteOptions.parse(self.options, schema), overwrite)


DefaultSource = SafetensorsDataSource
"""What Spark's automatic discovery of ``pyspark_*`` modules looks for."""


class SafetensorsReader(DataSourceReader):
    """Partitions of at most ``max_partition_mb`` (default 128) of selected data: a shard
    larger than that is cut into pieces (row ranges in batch mode, groups of tensors in KV
    mode), and consecutive small pieces share a partition (as Spark packs small parquet files);
    only the schema's columns are read."""

    def __init__(self, options: Any, schema: StructType) -> None:
        dataset = _describe(options)
        self.kv = dataset.kv
        self.arrow = to_arrow_schema(schema)  # what Spark checks each batch against
        names = None if dataset.kv else [f.name for f in schema.fields]
        self.kinds: dict[str, Column] = {}
        for f in schema.fields:
            kind = column_of(f.dataType)
            if kind is None and not dataset.kv:
                raise UsageError(
                    f"column {f.name!r} of {f.dataType.simpleString()} holds no tensor"
                )
            if kind is not None:
                self.kinds[f.name] = kind
        limit = _positive(options, "max_partition_mb", 128) or 128
        if limit > 1024:
            raise UsageError("option max_partition_mb must be at most 1024")
        pieces = plan_pieces(dataset, names, max_bytes=limit << 20)
        headers = dict(zip(dataset.shards, dataset.headers, strict=True))
        self.rows = {
            address: header[names[0]].shape[0] if names else 0
            for address, header in headers.items()
        }
        self.steps = {
            piece: self._rows_per_batch(piece, headers[piece.address]) for piece in pieces
        }
        self.groups: list[list[Piece]] = []
        size = limit << 20
        for piece in pieces:
            header = headers[piece.address]
            nbytes = sum(header[name].nbytes for name in piece.names)
            if piece.rows:
                nbytes = nbytes * (piece.stop - piece.start) // max(1, self.rows[piece.address])
            if not self.groups or size + nbytes > limit << 20:
                self.groups.append([])
                size = 0
            self.groups[-1].append(piece)
            size += nbytes

    def _rows_per_batch(self, piece: Piece, header: Header) -> int:
        """The rows of ``piece`` one Arrow batch holds (about :data:`BATCH_BYTES`, at least
        one); refuses, before any task runs, a piece Spark's Arrow batches cannot carry."""
        cost = 0
        for name in piece.names:
            info = header[name]
            itemsize = dtype_from_code(info.dtype).numpy.itemsize
            if self.kv:
                arrow_row_bytes(
                    name, 1, info.shape, itemsize, self.kinds.get("tensor", TENSOR_COLUMN)
                )
            else:
                rows, sample = piece.stop - piece.start, info.shape[1:]
                cost += arrow_row_bytes(name, rows, sample, itemsize, self.kinds[name])
        return max(1, BATCH_BYTES // max(1, cost))

    def partitions(self) -> list[InputPartition]:
        return [InputPartition(group) for group in self.groups] or [InputPartition([])]

    async def _read(self, piece: Piece) -> dict[str, Array]:
        """A local shard read whole is mapped (its digests checked); the rest is read with
        ranged requests (:func:`~stream_st.integrations.dataset.read_piece`)."""
        local = "://" not in piece.address or piece.address.startswith("file://")
        if local and not self.kv and (piece.start, piece.stop) == (0, self.rows[piece.address]):
            return await load(piece.address, include=list(piece.names), copy=False)
        return await read_piece(piece)

    def read(self, partition: InputPartition) -> Any:
        with start_blocking_portal() as portal:  # one event loop for the partition's reads
            for piece in partition.value:
                yield from self._batches(piece, portal.call(self._read, piece))

    def _batches(self, piece: Piece, arrays: dict[str, Array]) -> Iterator[pa.RecordBatch]:
        if self.kv:
            keys = list(arrays)
            kind = self.kinds.get("tensor", TENSOR_COLUMN)
            tensors = [tensor_column(arrays[key][None], key, kind) for key in keys]
            yield pa.RecordBatch.from_arrays(
                [pa.array(keys, pa.string()), pa.concat_arrays(tensors)], schema=self.arrow
            )
            return
        step = self.steps[piece]
        for start in range(0, piece.stop - piece.start, step):
            part = {name: array[start : start + step] for name, array in arrays.items()}
            yield pa.RecordBatch.from_arrays(  # in the schema's order
                [typed_column(part[name], kind, name) for name, kind in self.kinds.items()],
                schema=self.arrow,
            )


def register(spark: SparkSession | None = None, *, name: str = "safetensors") -> None:
    """Register the data source with ``spark`` (by default the active session) as format
    ``name``.

    Spark finds the source by itself only where its scan of top-level ``pyspark_*`` modules
    sees this package: an installed wheel, or a checkout on the path. An editable install
    (``pip install -e``) puts it behind an import hook that scan cannot see; registering
    explicitly works with every install. Spark refuses a Python source under the name of a JVM
    one: beside the Scala connector (format ``"safetensors"`` too), register this one under
    another ``name``, such as ``"stream_st"``.
    """
    session = spark if spark is not None else SparkSession.getActiveSession()
    if session is None:
        raise UsageError("no active Spark session to register the safetensors source with")
    source: type[SafetensorsDataSource] = SafetensorsDataSource
    if name != SafetensorsDataSource.name():
        source = type(  # Spark names a Python source by its class's name()
            "NamedSafetensorsDataSource",
            (SafetensorsDataSource,),
            {"name": classmethod(lambda cls: name), "__module__": __name__},
        )
    session.dataSource.register(source)
