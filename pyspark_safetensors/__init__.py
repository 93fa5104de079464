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

import itertools
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cached_property
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
from stream_st.core.dtypes import DTYPES, dtype_from_code
from stream_st.core.header import Header
from stream_st.errors import HeaderError, UsageError
from stream_st.integrations.dataset import (
    KV_RECORD,
    DatasetInfo,
    KvRows,
    Piece,
    Spec,
    check_alike,
    describe_dataset,
    kv_rows,
    plan_pieces,
    read_kv_batches,
    read_piece,
    read_shard_rows,
)

from ._arrow import arrow_row_bytes, row_bytes, tensor_column, typed_column
from ._kv import LAYOUT_KEY, RowLayout, checked_header, read_laid_out
from ._types import (
    TENSOR_COLUMN,
    TENSOR_STRUCT,
    Column,
    column_of,
    inferred_type,
    parse_type,
    type_text,
    without_nulls,
)
from ._write import SafetensorsWriter, WriteOptions, _flag, _positive

__all__ = ["TENSOR_STRUCT", "DefaultSource", "SafetensorsDataSource", "register"]

Array = np.ndarray[Any, Any]

Described = tuple[DatasetInfo, KvRows | None]
"""A dataset as a read describes it: the dataset, and in KV mode read as rows its rows."""

BATCH_BYTES = 32 << 20
"""A read hands Spark Arrow batches of about this many bytes (at least one row each)."""

SMALLEST_SHARE = 4 << 20
"""KV mode: shards share a partition up to at least this many bytes (Spark's
``openCostInBytes``)."""


@dataclass(frozen=True)
class ShardRows:
    """What a task reads of a KV-mode dataset whose rows are whole: rows ``start:stop`` of the
    shard at ``address``, of ``size`` bytes and ``samples`` rows as the manifest says, and
    where they lie as its writer recorded it, if it did."""

    address: str
    size: int
    samples: int
    start: int
    stop: int
    layout: RowLayout | None = None


def _describe(options: Any) -> Described:
    """The dataset at option ``path``. In KV mode read as rows: where its rows are whole
    (:func:`~stream_st.integrations.dataset.whole_rows`), its manifest alone (each task reads
    its shards' headers); else its rows too, told from every header (the headers are not needed
    any more then, and are left out: a read's data source is sent from the process planning it
    to the one making its reader)."""
    path = options.get("path")
    if not path:
        raise UsageError("give the dataset's location: .load(path)")
    if _flag(options, "filter_pushdown"):
        raise UsageError(
            "option filter_pushdown is refused: Spark reuses the partitions a filtered query "
            "planned for the DataFrame's later queries that push no filter (a count() after a "
            "where), which would miss the rows of the shards the filter skipped; Spark filters "
            "every row read without it"
        )
    kv = None if options.get("name_col") is None else True
    raw = _flag(options, "raw")
    dataset = anyio.run(lambda: describe_dataset(str(path), kv=kv, from_manifest=not raw))
    record = _kv_record(dataset, options)
    if len(dataset.headers) < len(dataset.shards):  # described from the manifest
        if record is not None:
            return dataset, None
        dataset = anyio.run(lambda: describe_dataset(str(path), kv=kv))  # read as tensors
    if record is None:
        return dataset, None
    rows = kv_rows(dataset, list(dataset.manifest["schema"]), record["separator"])
    return replace(dataset, headers=()), rows


def _column_types(dataset: DatasetInfo, names: list[str], raw: bool) -> dict[str, Column]:
    """The types of columns ``names``: as the manifest records them (``spark_type``), else as
    told from the dtype and shape of the tensor of that name in the first shard holding it
    (batch mode); every one the tensor struct with ``raw``."""
    schema = dataset.manifest.get("schema")
    entries = schema if isinstance(schema, dict) else {}
    out = {}
    for name in names:
        entry = entries.get(name)
        recorded = entry.get("spark_type") if isinstance(entry, dict) else None
        kind: DataType
        if raw:
            kind = TENSOR_STRUCT
        elif isinstance(recorded, str):
            kind = parse_type(recorded)
        else:  # told from the first shard holding it (a shard may hold no tensor)
            info = next(header[name] for header in dataset.headers if name in header)
            kind = inferred_type(info.dtype, len(info.shape) - 1)
        column = column_of(kind)
        if column is None:
            raise UsageError(f"column {name!r}: the manifest's type {recorded!r} holds no tensor")
        out[name] = column
    return out


def _kv_record(dataset: DatasetInfo, options: Any) -> dict[str, Any] | None:
    """KV mode: how the rows were named, where the write recorded it and every column's type
    (the dataset is then read as rows, a name and a column per written column), unless
    ``raw=true``; None: read as one row per tensor."""
    record = dataset.manifest.get(KV_RECORD)
    schema = dataset.manifest.get("schema")
    if not dataset.kv or _flag(options, "raw") or not isinstance(record, dict):
        return None
    if not isinstance(schema, dict) or not all(
        isinstance(entry, dict) and "spark_type" in entry for entry in schema.values()
    ):
        return None
    if not all(isinstance(record.get(k), str) for k in ("name_col", "spark_type", "separator")):
        raise UsageError(f"the manifest's {KV_RECORD!r} record is not one this source wrote")
    if record["name_col"] in schema:  # a row cannot hold two columns of one name
        raise UsageError(
            f"the manifest's {KV_RECORD!r} record names the rows by {record['name_col']!r}, a "
            "column of its schema too (read it with option raw=true)"
        )
    return record


def _kv_fields_checked(schema: StructType, record: dict[str, Any], columns: list[str]) -> None:
    """KV mode read as rows, with a schema given (``spark.read.schema(...)``): refuses, before
    any task runs, a field that is no column of the dataset's, or a name column of a type its
    recorded names cannot be read as."""
    name_col, recorded = record["name_col"], record["spark_type"]
    missing = [f.name for f in schema.fields if f.name != name_col and f.name not in columns]
    if missing:
        raise UsageError(
            f"the dataset has no column {missing[0]!r} (it has {columns}, and the names in "
            f"{name_col!r})"
        )
    if name_col in schema.names:  # read as their text, or an integer type holding them all
        given = type_text(schema[name_col].dataType)
        if given not in {recorded, "string", *(("bigint",) if recorded == "int" else ())}:
            raise UsageError(
                f"the names in {name_col!r} were written as {recorded}: they cannot be read as "
                f"{given}"
            )


def _selected(available: list[str], options: Any) -> list[str]:
    """The columns option ``columns`` names, in its order, each once (default: all of
    ``available``)."""
    wanted = options.get("columns")
    if not wanted:
        return available
    columns = [c.strip() for c in str(wanted).split(",") if c.strip()]
    missing = [c for c in columns if c not in available]
    if missing:
        raise UsageError(f"the dataset has no column {missing[0]!r} (it has {available})")
    repeated = [c for i, c in enumerate(columns) if c in columns[:i]]
    if repeated:  # a row holds each column once
        raise UsageError(f"option columns names {repeated[0]!r} twice ({wanted!r})")
    return columns


def _fields(described: Described, options: Any) -> list[StructField]:
    """The fields a read gives (see :meth:`SafetensorsDataSource.schema`)."""
    dataset, rows = described
    record = _kv_record(dataset, options)
    if dataset.kv and record is None:
        kinds: list[tuple[str, DataType]] = [
            ("tensor_key", StringType()),
            ("tensor", TENSOR_STRUCT),
        ]
        return [StructField(name, kind, False) for name, kind in kinds]
    if record is None:
        types = _column_types(dataset, dataset.columns, _flag(options, "raw"))
        columns = _selected(list(types), options)
        return [StructField(c, without_nulls(types[c].spark), False) for c in columns]
    columns = _selected(list(dataset.manifest["schema"]), options)
    types = _column_types(dataset, columns, raw=False)
    fields = [StructField(record["name_col"], parse_type(record["spark_type"]), False)]
    for column in columns:  # a column some name was written without is nullable
        every = rows is None or bool((rows.columns[column].shard >= 0).all())
        fields.append(StructField(column, without_nulls(types[column].spark), not every))
    return fields


class SafetensorsDataSource(DataSource):
    """Reads and writes the safetensors-spark dataset layout (see the module docstring)."""

    @classmethod
    def name(cls) -> str:
        return "safetensors"

    def schema(self) -> StructType:
        """Batch mode: a column per tensor (``columns=`` picks some) of the type it was written
        with (``raw=true``: the tensor struct). KV mode, as written by this source: the name
        column and a column per written column (``columns=`` picks some), a row per name; else
        (another writer's, or ``raw=true``) ``tensor_key`` and ``tensor``, a row per tensor.
        No array element or struct field is nullable, nor is a column but a KV-mode one some
        name was written without: a tensor holds no null (and Spark converts columns it knows
        hold none faster)."""
        return StructType(_fields(self._described, self.options))

    @cached_property
    def _described(self) -> Described:
        """The dataset, described once for the schema and the reader."""
        return _describe(self.options)

    def reader(self, schema: StructType) -> DataSourceReader:
        return SafetensorsReader(self.options, schema, self._described)

    def writer(self, schema: StructType, overwrite: bool) -> SafetensorsWriter:
        return SafetensorsWriter(WriteOptions.parse(self.options, schema), overwrite)


DefaultSource = SafetensorsDataSource
"""What Spark's automatic discovery of ``pyspark_*`` modules looks for."""


class SafetensorsReader(DataSourceReader):
    """Partitions of at most ``max_partition_mb`` (default 128) of selected data: a shard
    larger than that is cut into pieces (row ranges in batch mode, groups of tensors in KV
    mode), and consecutive small pieces share a partition (as Spark packs small parquet files);
    only the schema's columns are read."""

    def __init__(self, options: Any, schema: StructType, described: Described) -> None:
        dataset, rows = described
        self.kv = dataset.kv
        self.record = _kv_record(dataset, options)
        self.arrow = to_arrow_schema(schema)  # what Spark checks each batch against
        if self.record is not None:
            _kv_fields_checked(schema, self.record, list(dataset.manifest["schema"]))
        self.kinds: dict[str, Column] = {}
        for f in schema.fields:
            kind = column_of(f.dataType)
            if self.record is not None and f.name == self.record["name_col"]:
                continue
            if kind is None and (not dataset.kv or self.record is not None):
                raise UsageError(
                    f"column {f.name!r} of {f.dataType.simpleString()} holds no tensor"
                )
            if kind is not None:
                self.kinds[f.name] = kind
        limit = _positive(options, "max_partition_mb", 128) or 128
        if limit > 1024:
            raise UsageError("option max_partition_mb must be at most 1024")
        self.shards = dataset.shards
        self.groups: list[list[Any]] = []
        if rows is not None:
            self._plan_rows(rows, limit << 20)
            return
        if self.record is not None:
            self.columns = list(dataset.manifest["schema"])
            self._plan_shards(dataset, limit << 20)
            return
        names = None if dataset.kv else [f.name for f in schema.fields]
        if names is not None:  # a column read as numbers is cast from the one dtype it has
            numbers = [name for name, kind in self.kinds.items() if not kind.tensor]
            check_alike(dataset, numbers, shapes=False)
        pieces = plan_pieces(dataset, names, max_bytes=limit << 20)
        headers = dict(zip(dataset.shards, dataset.headers, strict=True))
        self.rows = {  # a shard of no tensor holds no row
            address: header[names[0]].shape[0] if names and len(header) else 0
            for address, header in headers.items()
        }
        self.steps = {
            piece: self._rows_per_batch(piece, headers[piece.address]) for piece in pieces
        }
        self.packed: dict[tuple[str, str], Spec] = {  # sub-byte ones: their arrays are bytes
            (address, info.name): (info.dtype, info.shape if dataset.kv else info.shape[1:])
            for address, header in headers.items()
            for info in header.tensors
            if dtype_from_code(info.dtype).packed and (names is None or info.name in names)
        }
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

    def _plan_rows(self, rows: KvRows, limit: int) -> None:
        """KV mode, read as rows: partitions of consecutive rows of at most ``limit`` bytes of
        the selected columns (at least one row), and the rows one Arrow batch holds; refuses,
        before any task runs, a value Spark's Arrow batches cannot carry."""
        sizes = np.zeros(len(rows.names), np.int64)
        for column in self.kinds:
            sizes += rows.columns[column].nbytes()
        ends = np.cumsum(sizes)
        start = 0
        while start < len(sizes):
            before = int(ends[start - 1]) if start else 0
            stop = max(start + 1, int(np.searchsorted(ends, before + limit, side="right")))
            self.groups.append([rows.part(start, stop, self.kinds)])
            start = stop
        self.step = self._rows_per_arrow_batch(rows)

    def _rows_per_arrow_batch(self, rows: KvRows) -> int:
        """KV mode, read as rows: the rows of ``rows`` one Arrow batch holds (see
        :meth:`_rows_per_batch_of`)."""
        specs = {}
        for column in self.kinds:
            where = rows.columns[column]
            used = np.flatnonzero(np.bincount(where.spec[where.shard >= 0])).tolist()
            specs[column] = [where.specs[spec] for spec in used]
        return self._rows_per_batch_of(specs)

    def _rows_per_batch_of(self, specs: dict[str, list[tuple[str, tuple[int, ...]]]]) -> int:
        """KV mode, read as rows: the rows one Arrow batch holds (about :data:`BATCH_BYTES`, at
        least one) where each column holds tensors of the dtypes and shapes ``specs`` gives it;
        refuses a value Spark's Arrow batches cannot carry, and a sub-byte tensor (F4, F6: this
        source writes none, and one arrives as its packed bytes, which are read raw only)."""
        widest = 1
        for column, kind in self.kinds.items():
            for code, shape in specs[column]:
                dtype = dtype_from_code(code)
                if dtype.packed:
                    raise UsageError(
                        f"column {column!r} holds {code} tensors, which this source does not "
                        "write: read the dataset with option raw=true"
                    )
                widest = max(widest, arrow_row_bytes(column, 1, shape, dtype, kind))
        return max(1, BATCH_BYTES // (widest * max(1, len(self.kinds))))

    def _plan_shards(self, dataset: DatasetInfo, limit: int) -> None:
        """KV mode, read as rows whole (each shard's rows its own): partitions planned from the
        manifest alone, a task reading its shards' headers. A shard of more than ``limit``
        bytes is cut into ranges of rows (by count); consecutive smaller ones share a
        partition up to ``limit`` and their share of the dataset's bytes per core of this
        machine (at least :data:`SMALLEST_SHARE`), as Spark spreads files over its cores.
        Refuses, before any task runs, a column whose recorded shape Spark's Arrow batches
        cannot carry."""
        schema = dataset.manifest["schema"]
        for column, kind in self.kinds.items():
            code, shape = schema[column].get("dtype"), schema[column].get("shape")
            if code in DTYPES and isinstance(shape, list) and all(type(d) is int for d in shape):
                arrow_row_bytes(column, 1, tuple(shape), DTYPES[code], kind)
        entries = dataset.manifest["shards"]
        total = sum(entry["bytes"] for entry in entries)
        share = min(limit, max(SMALLEST_SHARE, total // (os.cpu_count() or 1)))
        size = 0
        for address, entry in zip(dataset.shards, entries, strict=True):
            nbytes, samples = entry["bytes"], entry["samples_count"]
            layout = RowLayout.parse(entry.get(LAYOUT_KEY), self.columns, samples, nbytes)
            cuts = min(max(1, samples), -(-nbytes // limit))
            bounds = [samples * cut // cuts for cut in range(cuts + 1)]
            for start, stop in itertools.pairwise(bounds):
                share_of = nbytes * (stop - start) // max(1, samples)
                if cuts > 1 or not self.groups or size + share_of > share:
                    self.groups.append([])
                    size = 0
                self.groups[-1].append(ShardRows(address, nbytes, samples, start, stop, layout))
                size += share_of

    def _rows_per_batch(self, piece: Piece, header: Header) -> int:
        """The rows of ``piece`` one Arrow batch holds (about :data:`BATCH_BYTES`, at least
        one); refuses, before any task runs, a piece Spark's Arrow batches cannot carry."""
        cost = 0
        for name in piece.names:
            info = header[name]
            dtype = dtype_from_code(info.dtype)
            if self.kv:
                arrow_row_bytes(name, 1, info.shape, dtype, self.kinds.get("tensor", TENSOR_COLUMN))
            else:
                rows, sample = piece.stop - piece.start, info.shape[1:]
                cost += arrow_row_bytes(name, rows, sample, dtype, self.kinds[name])
        return max(1, BATCH_BYTES // max(1, cost))

    def __getstate__(self) -> dict[str, Any]:
        """What is sent to every task: not the partitions (each gets its own)."""
        return {name: value for name, value in self.__dict__.items() if name != "groups"}

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
            if self.record is not None:
                for rows in partition.value:
                    if isinstance(rows, ShardRows):
                        yield from self._shard_batches(rows, portal)
                    else:
                        yield from self._row_batches(rows, self.step, portal)
                return
            for piece in partition.value:
                yield from self._batches(piece, portal.call(self._read, piece))

    def _batches(self, piece: Piece, arrays: dict[str, Array]) -> Iterator[pa.RecordBatch]:
        """The Arrow batches of ``piece``'s ``arrays``: in KV mode one, a row per tensor; in
        batch mode batches of rows. A sub-byte tensor (F4, F6: :attr:`packed`) arrives as its
        packed bytes, in rows only where its last dimension allows it: its rows are given as
        ``[rows, row bytes]`` (whole bytes, as :meth:`_rows_per_batch` checked) with the dtype
        and shape its header says."""
        rows = 1 if self.kv else piece.stop - piece.start
        if self.kv:  # each tensor a row
            arrays = {key: array[None] for key, array in arrays.items()}
        specs = {name: self.packed.get((piece.address, name)) for name in arrays}
        for name, spec in specs.items():
            if spec is not None:
                arrays[name] = arrays[name].reshape(rows, row_bytes(*spec))
        if self.kv:
            kind = self.kinds.get("tensor", TENSOR_COLUMN)
            tensors = [tensor_column(arrays[key], key, kind, specs[key]) for key in arrays]
            yield pa.RecordBatch.from_arrays(
                [pa.array(list(arrays), pa.string()), pa.concat_arrays(tensors)],
                schema=self.arrow,
            )
            return
        step = self.steps[piece]
        for start in range(0, rows, step):
            part = {name: array[start : start + step] for name, array in arrays.items()}
            yield pa.RecordBatch.from_arrays(  # in the schema's order
                [
                    typed_column(part[name], kind, name, specs[name])
                    for name, kind in self.kinds.items()
                ],
                schema=self.arrow,
            )

    def _shard_batches(self, part: ShardRows, portal: Any) -> Iterator[pa.RecordBatch]:
        """KV mode, read as rows whole: rows ``part.start:part.stop`` of a shard, found where
        its writer recorded them if its header is still the one recorded
        (:func:`~._kv.read_laid_out`), else told from its parsed header, which must hold as
        many names as the manifest says, each with every column."""
        assert self.record is not None
        separator = self.record["separator"]
        layout = part.layout
        text = None
        if layout is not None:
            text = portal.call(checked_header, part.address, layout, part.size)
        if layout is not None and text is not None:  # only now is the layout trusted
            step = self._rows_per_batch_of({c: layout.column_specs(c) for c in self.kinds})
            wanted = range(part.start, part.stop)
            laid = portal.call(
                read_laid_out,
                part.address,
                layout,
                text,
                separator,
                wanted,
                list(self.kinds),
                step,
            )
            if laid is not None:
                for names, values in laid:
                    yield self._record_batch(names, values)
                return
        rows = portal.call(
            lambda: read_shard_rows(part.address, self.columns, separator, size=part.size)
        )
        if len(rows.names) != part.samples or any(
            (where.shard < 0).any() for where in rows.columns.values()
        ):
            raise HeaderError(
                f"{part.address}: the manifest says its {part.samples} rows are whole; the "
                f"shard holds {len(rows.names)} names, not each with every column"
            )
        step = self._rows_per_arrow_batch(rows)
        yield from self._row_batches(rows.part(part.start, part.stop, self.kinds), step, portal)

    def _row_batches(self, rows: KvRows, step: int, portal: Any) -> Iterator[pa.RecordBatch]:
        """KV mode, read as rows: the tensors of ``rows`` (each shard's bytes read at once),
        then Arrow batches of ``step`` rows."""
        for start, stop, values in portal.call(read_kv_batches, rows, step):
            yield self._record_batch(pa.array(rows.names[start:stop], pa.string()), values)

    def _record_batch(
        self, names: pa.Array, values: dict[str, Array | list[Array | None]]
    ) -> pa.RecordBatch:
        """KV mode, read as rows: the Arrow batch of rows ``names`` (text) and their
        ``values``, in the schema's order of columns (the names where the schema holds the name
        column)."""
        assert self.record is not None
        name_col = self.record["name_col"]
        columns: dict[str, pa.Array] = {}
        if name_col in self.arrow.names:
            columns[name_col] = names.cast(self.arrow.field(name_col).type)
        for column, kind in self.kinds.items():
            part = values[column]
            columns[column] = (
                typed_column(part, kind, column)
                if isinstance(part, np.ndarray)
                else _values_column(part, kind, column)
            )
        return pa.RecordBatch.from_arrays([columns[f.name] for f in self.arrow], schema=self.arrow)


def _values_column(values: list[Array | None], kind: Column, name: str) -> pa.Array:
    """One value per row (None: a null) as an Arrow column of ``kind``: built at once where
    the values share a shape and dtype, else value by value."""
    present = [v for v in values if v is not None]
    if len(present) == len(values) and len({(v.shape, v.dtype) for v in present}) == 1:
        return typed_column(np.stack(present), kind, name)
    return pa.concat_arrays(
        [
            pa.nulls(1, kind.arrow) if v is None else typed_column(v[None], kind, name)
            for v in values
        ]
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
