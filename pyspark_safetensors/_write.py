"""Writing a DataFrame as a safetensors dataset: options, the task's writer, commit and abort.

Each task writes its shards (through stream_st: a file, or an S3 upload) under the job's staging
prefix ``{path}/_temporary/{job}/`` and returns their descriptions. The driver's ``commit`` moves
the shards named by the successful attempts into place, writes ``_tensor_index.parquet`` (when
asked), then ``dataset_manifest.json`` last: the commit point. Then it removes the staging prefix
(with whatever failed or speculative attempts left there) and the shards the new manifest no
longer lists (when overwriting, the previous dataset's). ``abort`` removes the staging prefix. A
task that fails removes its own shards at once.

In KV mode a committed dataset holds every key once, as the layout's shards hold every key once:
with ``duplicatesStrategy=lastWin`` a key written again (by a later task, or by a job appending to
the dataset) supersedes the earlier copy, and the commit rewrites each shard holding superseded
keys without them (a copy under a new name, staged like the tasks' shards; a shard left with no
key is dropped), so the manifest, the index and a listing of the shards all agree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, cast

import anyio
import numpy as np
import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import ArrayType, DataType, IntegerType, LongType, StringType, StructType

from stream_st._api import read_header, save
from stream_st.core.digests import algorithm_named
from stream_st.core.dtypes import dtype_for, dtype_from_code
from stream_st.core.header import Header
from stream_st.core.shards import (
    INDEX_NAME,
    SHARD_NAME,
    ShardEntry,
    manifest_document,
    shard_file_name,
    shard_position,
)
from stream_st.errors import UnsupportedSinkError, UsageError, WriterError
from stream_st.integrations.dataset import (
    KV_RECORD,
    MANIFEST_NAME,
    WHOLE_ROWS,
    split_key,
    whole_rows,
)
from stream_st.sharded.reader import ShardIndex
from stream_st.sharded.writer import (
    _local_folder,
    make_folders,
    missing_folders,
    remove_new_folders,
    tensor_index_table,
)
from stream_st.tools import cp
from stream_st.transports import store as _store
from stream_st.transports.options import Clock

from ._arrow import stack_rows
from ._kv import LAYOUT_KEY, Block, KvShard, Specs, shard_file
from ._types import SEED_DTYPES, Column, column_of, type_text

__all__ = ["SafetensorsWriter", "WriteOptions"]

Array = np.ndarray[Any, Any]

TAIL_STRATEGIES = ("drop", "pad", "write")
DUPLICATES_STRATEGIES = ("fail", "lastWin")
F16_ROUNDINGS = ("nearest", "truncate")
SHARD_SIZE_MB = (50, 1000)
"""``target_shard_size_mb``: the bounds the Scala connector enforces (300 by default)."""


def _flag(options: Mapping[str, str], name: str) -> bool:
    value = str(options.get(name, "false")).lower()
    if value not in ("true", "false"):
        raise UsageError(f"option {name} must be true or false, got {value!r}")
    return value == "true"


def _positive(options: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = options.get(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise UsageError(f"option {name} must be a positive integer, got {value!r}")
    return number


def _choice(options: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    """The value of option ``name`` among ``choices``, matched case-insensitively (as the
    connector does), in its canonical spelling."""
    value = str(options.get(name, default))
    for choice in choices:
        if choice.lower() == value.lower():
            return choice
    raise UsageError(f"option {name} must be one of {', '.join(choices)}, got {value!r}")


def _shard_size(options: Mapping[str, str]) -> int:
    value = options.get("target_shard_size_mb", "300")
    low, high = SHARD_SIZE_MB
    try:
        number = int(value)
    except ValueError:
        number = 0
    if not low <= number <= high:
        raise UsageError(
            f"option target_shard_size_mb must be between {low} and {high}, got {value!r}"
        )
    return number << 20


def _checksums(options: Mapping[str, str]) -> bool | str:
    """``checksums``: ``false`` (the default), ``true`` (xxh3-128) or an algorithm's name (in
    any case, as every option value)."""
    value = str(options.get("checksums", "false")).lower()
    if value in ("true", "false"):
        return value == "true"
    return algorithm_named(value).name


def _dtypes(text: str | None) -> dict[str, str]:
    """``"F16"`` (every column) or ``"image:F16,label:I64"`` -> ``{column or "": code}`` (a
    code in any case, as every option value)."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        column, _, code = item.rpartition(":")
        code = code.strip().upper()
        if code not in SEED_DTYPES:
            raise UsageError(
                f"option dtype: {code!r} is not a dtype of the dataset layout "
                f"({', '.join(SEED_DTYPES)})"
            )
        out[column.strip()] = code
    return out


def _names(text: str | None) -> list[str] | None:
    """``columns``: a comma-separated list of names, or None."""
    if text is None:
        return None
    return [name.strip() for name in str(text).split(",") if name.strip()]


def _shapes(text: str | None) -> dict[str, tuple[int, ...]]:
    """``shapes``: a JSON object, column -> the shape of each of its samples."""
    if not text:
        return {}
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise UsageError(f"option shapes must be a JSON object, got {text!r}") from exc
    if not isinstance(document, dict):
        raise UsageError(f"option shapes must be a JSON object, got {text!r}")
    out = {}
    for column, shape in document.items():
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise UsageError(f"option shapes: {column!r} needs a list of dimensions, got {shape!r}")
        out[column] = tuple(shape)
    return out


@dataclass(frozen=True)
class WriteOptions:
    """The write options and the columns to write, checked on the driver before any task
    runs (against the DataFrame's schema, when given)."""

    path: str
    batch_size: int | None
    name_col: str | None
    tail_strategy: str
    kv_separator: str
    target_shard_size: int
    duplicates: str
    generate_index: bool
    checksums: bool | str = False
    dtypes: dict[str, str] = field(default_factory=dict)
    f16_rounding: str = "nearest"
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    columns: dict[str, Column] = field(default_factory=dict)
    """The columns to write, in order, and how (empty until checked against a schema)."""
    name_type: str | None = None
    """KV mode: the Spark type of ``name_col`` (None until checked against a schema)."""

    @classmethod
    def parse(cls, options: Mapping[str, str], schema: StructType | None = None) -> WriteOptions:
        """The options as given; with ``schema``, the columns to write are chosen and checked
        too (a column of a type that cannot hold tensors, a missing ``name_col``...)."""
        path = options.get("path")
        if not path:
            raise UsageError("give the dataset's location: .save(path)")
        batch_size = _positive(options, "batch_size", None)
        name_col = options.get("name_col") or None
        if (batch_size is None) == (name_col is None):
            raise UsageError("give exactly one of batch_size (batch mode) or name_col (KV mode)")
        parsed = cls(
            path=str(path).rstrip("/"),
            batch_size=batch_size,
            name_col=name_col,
            tail_strategy=_choice(options, "tail_strategy", TAIL_STRATEGIES, "write"),
            kv_separator=str(options.get("kv_separator", "__")),
            target_shard_size=_shard_size(options),
            duplicates=_choice(options, "duplicatesStrategy", DUPLICATES_STRATEGIES, "fail"),
            generate_index=_flag(options, "generate_index"),
            checksums=_checksums(options),
            dtypes=_dtypes(options.get("dtype")),
            f16_rounding=_choice(options, "f16_rounding", F16_ROUNDINGS, "nearest"),
            shapes=_shapes(options.get("shapes")),
        )
        if schema is None:
            return parsed
        columns = parsed._columns(schema, _names(options.get("columns")))
        name_type = None if name_col is None else type_text(schema[name_col].dataType)
        return replace(parsed, columns=columns, name_type=name_type)

    def kv_record(self) -> dict[str, Any] | None:
        """KV mode: what the manifest records (as ``"kv"``) for a read to give the rows back:
        the name column, its Spark type and the separator; and that the rows are whole (every
        row of a write holds every column, and the commit leaves each key in one shard)."""
        if self.name_col is None:
            return None
        return {
            "name_col": self.name_col,
            "spark_type": self.name_type or "string",
            "separator": self.kv_separator,
            WHOLE_ROWS: True,
        }

    def _columns(self, schema: StructType, wanted: list[str] | None) -> dict[str, Column]:
        names = schema.names
        if self.name_col is not None:
            if self.name_col not in names:
                raise UsageError(
                    f"name_col {self.name_col!r} is not a column of the DataFrame ({names})"
                )
            key = schema[self.name_col].dataType
            if not isinstance(key, StringType | IntegerType | LongType):
                raise UsageError(
                    f"name_col {self.name_col!r} is {key.simpleString()}: names are strings "
                    "(or integers)"
                )
        if wanted is None:
            wanted = [n for n in names if n != self.name_col]
        missing = [n for n in wanted if n not in names]
        if missing:
            raise UsageError(f"option columns: {missing[0]!r} is not a column of {names}")
        if self.name_col in wanted:
            raise UsageError(f"option columns: name_col {self.name_col!r} names the tensors")
        if not wanted:
            raise UsageError("no column to write")
        out = {}
        for name in wanted:
            kind = column_of(schema[name].dataType)
            if kind is None:
                raise UsageError(
                    f"column {name!r} is {schema[name].dataType.simpleString()}: a tensor "
                    "column is a tensor struct (struct<data: binary, shape: array<int>, dtype: "
                    "string>), a number, a boolean or a (nested) array of numbers"
                )
            out[name] = kind
        if self.name_col is not None:
            _separable(list(out), self.kv_separator)
        for name in {*self.shapes, *(c for c in self.dtypes if c)}:
            if name not in out:
                raise UsageError(f"options shapes / dtype name {name!r}, not a column written")
        for name in self.shapes:
            if out[name].tensor:
                raise UsageError(f"option shapes: {name!r} is a tensor struct: it has a shape")
        return out

    def read_type(self, column: str) -> DataType:
        """The Spark type a read gives ``column`` back (the manifest records it): its own, or a
        flat array of its numbers where a ``shapes`` override changes its arrays' nesting."""
        kind = self.columns[column]
        shape = self.shapes.get(column)
        if kind.depth and shape is not None and len(shape) != kind.depth:
            return ArrayType(kind.element)
        return kind.spark

    def code_for(self, column: str) -> str | None:
        return self.dtypes.get(column, self.dtypes.get(""))

    def rows_of(self, column: pa.Array, name: str) -> Array:
        """The rows of ``column`` (one to write) as one array ``[rows, *shape]``."""
        kind = self.columns.get(name)
        code = None if kind is not None and kind.tensor else self.code_for(name)
        return stack_rows(
            column,
            name,
            code,
            kind=kind,
            shape=self.shapes.get(name),
            rounding=self.f16_rounding,
        )

    def empty(self, name: str) -> Array:
        """No sample of column ``name``: ``[0, *shape]`` as far as the schema tells."""
        kind = self.columns[name]
        if kind.tensor:
            return np.zeros((0, 0), np.uint8)
        shape = self.shapes.get(name, (0,) * kind.depth)
        code = self.code_for(name) or kind.dtype
        return np.zeros((0, *shape), dtype_from_code(code).numpy)

    def empty_schema(self) -> dict[str, dict[str, Any]]:
        """The manifest's schema of a write of no sample: every column, of the dtype and shape
        :meth:`empty` gives it (KV mode: one value's, without the rows), so that a read gives
        each column back (a KV shard of no sample holds no tensor to tell them from)."""
        out = {}
        for name in self.columns:
            array = self.empty(name)
            shape = array.shape[1:] if self.name_col is not None else array.shape
            out[name] = {"dtype": dtype_for(array.dtype).code, "shape": list(shape)}
        return out


def _separable(columns: list[str], separator: str, earlier: list[str] | None = None) -> None:
    """KV mode: refuses ``columns`` whose keys ``{name}{separator}{column}`` could be another
    name's of another column (one whose ``{separator}{column}`` ends another's), where a read
    could not tell the rows apart. A column holding the separator alone is read by its whole
    name as the key's end (``split_key``'s suffix match). An append gives the columns of the
    dataset it adds to as ``earlier``: their keys are checked against those of ``columns``
    (two of the dataset's own were written so, before this rule, and are left as they were)."""
    if not separator:
        raise UsageError("option kv_separator is empty: a key could not be split into its parts")
    dataset = earlier or []
    every = [*dataset, *(c for c in columns if c not in dataset)]
    for column in every:
        suffix = f"{separator}{column}"
        clash = [
            o
            for o in every
            if o != column
            and suffix.endswith(f"{separator}{o}")
            and not (column in dataset and o in dataset)
        ]
        if clash:
            beside = f" (or {clash[0]!r})"
            remedy = "rename it or choose another kv_separator"
            if earlier is not None:
                remedy = f"the dataset appended to holds {dataset}: rename the column appended"
            raise UsageError(
                f"KV column {column!r} with kv_separator {separator!r}: a key "
                f"{{name}}{suffix} could not tell the name from the column{beside}; {remedy}"
            )


def _specs(header: Header) -> Specs:
    return tuple((info.name, info.dtype, info.shape) for info in header.tensors)


@dataclass(frozen=True)
class StagedShard:
    """A shard as a commit handles it: one a task wrote under the staging prefix, as its commit
    message describes it, or one of the dataset appended to (``staged`` is then its place)."""

    task: int
    index: int
    name: str
    staged: str
    samples: int
    bytes: int
    tensors: Specs
    layout: dict[str, Any] | None = None
    """Where its rows lie, as the manifest records it (:data:`~._kv.LAYOUT_KEY`), if known."""


@dataclass
class ShardsWritten(WriterCommitMessage):
    """A task's commit message: its shards, and the schema it saw."""

    shards: list[StagedShard]
    schema: dict[str, dict[str, Any]]


class _TaskWriter:
    """One task attempt's shards: each saved under the staging prefix as it is complete."""

    def __init__(self, options: WriteOptions, staging: str) -> None:
        context = TaskContext.get()
        self.task = context.partitionId() if context is not None else 0
        self.options = options
        self.staging = staging
        self.tag = str(uuid.uuid4())  # a retried or speculative attempt writes other names
        self.shards: list[StagedShard] = []
        self.schema: dict[str, dict[str, Any]] = {}
        self.kv = KvShard()

    def seal(self, tensors: Mapping[str, Array], samples: int) -> None:
        """Batch mode: the shard saved straight from the arrays."""
        name, staged = self._next_shard()
        header = anyio.run(lambda: save(staged, tensors, checksums=self.options.checksums))
        self._staged(name, staged, samples, header.file_size, _specs(header))

    def _next_shard(self) -> tuple[str, str]:
        """The name of this attempt's next shard, and its place under the staging prefix."""
        name = shard_file_name(self.task, len(self.shards), self.tag)
        return name, _store.join(self.staging, name)

    def _staged(
        self,
        name: str,
        staged: str,
        samples: int,
        size: int,
        specs: Specs,
        layout: dict[str, Any] | None = None,
    ) -> None:
        self.shards.append(
            StagedShard(self.task, len(self.shards), name, staged, samples, size, specs, layout)
        )

    def describe(self, column: str, array: Array) -> None:
        self.schema.setdefault(
            column, {"dtype": dtype_for(array.dtype).code, "shape": list(array.shape)}
        )

    def batches(self, batches: Iterator[pa.RecordBatch]) -> None:
        """Batch mode: every ``batch_size`` rows one shard; the tail as the strategy says."""
        size = self.options.batch_size
        assert size is not None
        pending: list[pa.RecordBatch] = []
        count = 0
        for batch in batches:
            pending.append(batch)
            count += batch.num_rows
            while count >= size:
                table = pa.Table.from_batches(pending)
                self._batch(table.slice(0, size), size)
                rest = table.slice(size)
                pending, count = rest.to_batches(), rest.num_rows
        if count and self.options.tail_strategy != "drop":
            self._batch(pa.Table.from_batches(pending), count)

    def _batch(self, table: pa.Table, rows: int) -> None:
        size = self.options.batch_size
        assert size is not None
        tensors = {}
        for column in self.options.columns or table.column_names:
            array = self.options.rows_of(table.column(column), column)
            if rows < size and self.options.tail_strategy == "pad":
                padding = np.zeros((size - rows, *array.shape[1:]), array.dtype)
                array = np.concatenate([array, padding])
            tensors[column] = array
            self.describe(column, array)
        self.seal(tensors, len(next(iter(tensors.values()))))

    def cells(self, column: pa.Array, name: str) -> Array | list[Array]:
        """KV mode: the value of every row of ``column`` (one to write): one array ``[rows,
        *shape]`` when the rows share a shape and dtype, else an array per row (KV-mode rows
        may differ)."""
        try:
            return self.options.rows_of(column, name)
        except UsageError:  # rows that differ; row by row, a real error is raised again
            return [
                self.options.rows_of(column.slice(row, 1), name)[0] for row in range(len(column))
            ]

    def _blocks(self, batch: pa.RecordBatch) -> Iterator[Block]:
        """KV mode: the rows of ``batch`` as one block, or a block per row where some column's
        rows differ in shape or dtype."""
        name_col = self.options.name_col
        assert name_col is not None
        if name_col not in batch.schema.names:
            raise UsageError(f"name_col {name_col!r} is not a column of the DataFrame")
        named = batch.column(name_col)
        if named.null_count:
            raise UsageError(f"column {name_col!r} holds a null: every row needs a name")
        names = named.to_pylist()
        if not pa.types.is_string(named.type):
            names = [str(name) for name in names]
        columns = list(self.options.columns) or [c for c in batch.schema.names if c != name_col]
        separator = self.options.kv_separator
        cells = {column: self.cells(batch.column(column), column) for column in columns}
        for column, values in cells.items():
            if len(values):
                self.describe(column, values[0])
        if all(isinstance(values, np.ndarray) for values in cells.values()):
            yield Block(names, cast(dict[str, Array], cells), separator)
            return
        for row, name in enumerate(names):
            yield Block(
                [name],
                {
                    column: values[row][None] if isinstance(values, list) else values[row : row + 1]
                    for column, values in cells.items()
                },
                separator,
            )

    def keys(self, batches: Iterator[pa.RecordBatch]) -> None:
        """KV mode: one tensor per row and column, shards rolled over at the target size; a
        shard's samples are the names it holds. A batch's rows are added together, each column
        one run of tensors, unless one of their keys is written again (then row by row: the
        strategy decides)."""
        written: set[str] = set()
        for batch in batches:
            for block in self._blocks(batch):
                keys = [key for run in block.runs for key in run.keys]
                fresh = set(keys)
                if len(fresh) == len(keys) and fresh.isdisjoint(written):
                    written |= fresh
                    self._add_rows(block)
                else:
                    for row in range(block.rows):
                        self._add_row(block.part(row, row + 1), written)
        if self.kv.runs:
            self._seal_kv()

    def _add_rows(self, block: Block) -> None:
        """Add rows none of whose keys is written yet, sealing a shard before a row would take
        it past the target size (a shard takes at least one row)."""
        target = self.options.target_shard_size
        while block.rows:
            room = max(0, target - self.kv.size)
            fit = room // block.row_bytes if block.row_bytes else block.rows
            if not self.kv.runs:
                fit = max(1, fit)
            if not fit:
                self._seal_kv()
                continue
            fit = min(fit, block.rows)
            self.kv.add(block.part(0, fit) if fit < block.rows else block)
            block = block.part(fit, block.rows)

    def _add_row(self, row: Block, written: set[str]) -> None:
        """Add one row some of whose keys may be written already: refused (``fail``), or the
        later copy replaces an earlier one of the same shard in its place (``lastWin``; one in
        an earlier shard goes at the commit)."""
        runs = row.runs
        held = self.kv.holding()
        adding = sum(run.nbytes for run in runs if run.keys[0] not in held)
        if held and self.kv.size + adding > self.options.target_shard_size:
            self._seal_kv()
        shard = self.kv
        held = shard.holding()
        for run in runs:
            key = run.keys[0]
            if key in written and self.options.duplicates == "fail":
                raise WriterError(f"tensor key {key!r} is written twice", name=key)
            earlier = held.pop(key, None)
            shard.superseded |= earlier is not None
            shard.size += run.nbytes - (earlier or 0)
            held[key] = run.nbytes
            written.add(key)
        shard.runs += runs
        shard.blocks.append((1, tuple(row.columns)))
        shard.samples.update(row.names)

    def _seal_kv(self) -> None:
        """Write the KV shard being filled (made in memory, written at once) and start another."""
        shard, self.kv = self.kv, KvShard()
        data, specs, layout = shard_file(shard, self.options.checksums)
        name, staged = self._next_shard()
        anyio.run(_store.write_object, staged, data)
        self._staged(name, staged, len(shard.samples), len(data), specs, layout)

    def discard(self) -> None:
        """Remove every shard this attempt wrote."""
        for shard in self.shards:
            anyio.run(_store.remove, shard.staged)


STAGING_REMOVALS = 50
STAGING_RETRY_DELAY = 0.2
"""How often, and how far apart, an abort tries to remove the staging directory (10 s in all)."""


class SafetensorsWriter(DataSourceArrowWriter):
    """The data source's writer; see the module docstring."""

    def __init__(self, options: WriteOptions, overwrite: bool) -> None:
        self.options = options
        self.overwrite = overwrite
        self.staging = _store.join(options.path, f"_temporary/{uuid.uuid4()}")
        self.new_folders = _new_folders(options.path)  # abort() removes them again, if empty
        self.made: dict[Path, tuple[int, int]] = {}  # each one made here, as it was made
        if self.new_folders:  # a local folder: made one level at a time, each one recorded
            make_folders(self.new_folders[0], self.made)
        # Made here, before any task runs, and never by a task: once abort() has removed it, a
        # task still running cannot write there any more, and removes what it wrote.
        anyio.run(_store.make_directory, self.staging)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> ShardsWritten:
        task = _TaskWriter(self.options, self.staging)
        try:
            if self.options.name_col is None:
                task.batches(iterator)
            else:
                task.keys(iterator)
        except BaseException:
            task.discard()
            raise
        return ShardsWritten(task.shards, task.schema)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        anyio.run(self._commit, [m for m in messages if isinstance(m, ShardsWritten)])

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        anyio.run(self._clean_staging)

    async def _clean_staging(self) -> None:
        # A task the job is still cancelling may create a file while the tree is being removed,
        # which leaves the directory behind; it cannot create the directory again, so removing
        # what is left a little later finishes the job.
        for _ in range(STAGING_REMOVALS):
            if await _store.remove_tree(self.staging):
                break
            await anyio.sleep(STAGING_RETRY_DELAY)
        parent = self.staging.rsplit("/", 1)[0]
        if not await _store.list_names(parent):
            await _store.remove_tree(parent)
        remove_new_folders(self.new_folders, self.made)  # not one put in place of a moved one

    async def _commit(self, messages: list[ShardsWritten]) -> None:
        path = self.options.path
        kv = self.options.name_col is not None
        staged = sorted((s for m in messages for s in m.shards), key=lambda s: (s.task, s.index))
        schema: dict[str, dict[str, Any]] = {}
        for message in messages:
            for column, entry in message.schema.items():
                schema.setdefault(column, entry)
        listed = await _store.list_names(path)
        if not staged and (self.overwrite or MANIFEST_NAME not in listed):
            staged = [await self._empty_shard()]
            schema = self.options.empty_schema()
        previous: list[StagedShard] = []
        record = self.options.kv_record()
        if not self.overwrite and MANIFEST_NAME in listed:
            manifest = (await ShardIndex.read(_store.join(path, MANIFEST_NAME), Clock())).manifest
            previous = await _previous_shards(path, manifest, kv or self.options.generate_index)
            earlier = manifest.get("schema", {})
            every = (
                not staged
                or set(self.options.columns) == set(earlier)
                or (not manifest.get("total_samples") and set(earlier) <= set(self.options.columns))
            )
            if not kv:
                _check_appended_columns(earlier, self.options.columns)
            _check_appended_types(earlier, schema, self.options)
            schema = {**earlier, **schema}
            record = _appended_record(record, manifest, every)
            if record is not None:  # the dataset's rows and these read as one
                _separable(list(self.options.columns), self.options.kv_separator, list(earlier))
        for column in self.options.columns:  # a read gives these types back
            if column in schema:
                spark_type = type_text(self.options.read_type(column))
                schema[column] = {**schema[column], "spark_type": spark_type}
        shards = previous + staged
        if kv:
            shards = await self._one_copy_per_key(shards, list(schema))
        moved: list[str] = []
        try:
            for shard in shards:
                final = _store.join(path, shard.name)
                if shard.staged != final:
                    await _store.move(shard.staged, final)
                    moved.append(final)
            index = _store.join(path, INDEX_NAME)
            await _store.remove_tree(index)  # an earlier one: stale now, or replaced
            await _store.remove(index)  # one this source wrote as a single file
            if self.options.generate_index:
                # A Spark parquet directory: Spark skips a file whose name begins with "_"
                await _store.make_directory(index)
                await _store.write_object(
                    _store.join(index, f"part-00000-{uuid.uuid4()}-c000.parquet"),
                    _index_table(shards),
                )
            entries = [ShardEntry(s.name, s.samples, s.bytes) for s in shards]
            document = manifest_document(entries, schema)
            for entry, shard in zip(document["shards"], shards, strict=True):
                if shard.layout is not None:
                    entry[LAYOUT_KEY] = shard.layout
            if record is not None:
                document[KV_RECORD] = record
            text = json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")
            await _store.write_object(_store.join(path, MANIFEST_NAME), text)  # the commit point
        except BaseException:
            for final in moved:
                await _store.remove(final)
            raise
        # this job's staging, and whatever jobs whose driver died left there
        await _store.remove_tree(self.staging.rsplit("/", 1)[0])
        listed_now = {shard.name for shard in shards}
        replaced = [s.name for s in previous]
        if self.overwrite:
            replaced = [name for name in listed if SHARD_NAME.fullmatch(name)]
        for name in replaced:
            if name not in listed_now:
                await _store.remove(_store.join(path, name))

    async def _empty_shard(self) -> StagedShard:
        """The one shard of a dataset of no sample (the manifest lists at least one): in batch
        mode a tensor ``[0, *shape]`` per column, in KV mode no tensor."""
        kv = self.options.name_col is not None
        tensors = {} if kv else {name: self.options.empty(name) for name in self.options.columns}
        name = shard_file_name(0, 0, str(uuid.uuid4()))
        staged = _store.join(self.staging, name)
        header = await save(staged, tensors, checksums=self.options.checksums)
        return StagedShard(0, 0, name, staged, 0, header.file_size, _specs(header))

    async def _one_copy_per_key(
        self, shards: list[StagedShard], columns: list[str]
    ) -> list[StagedShard]:
        """KV mode: refuse a key in two shards (``fail``), or keep only its last copy
        (``lastWin``): a shard holding superseded keys is copied without them under a new name
        in the staging prefix, a shard left with none is dropped."""
        last = {key: i for i, shard in enumerate(shards) for key, _, _ in shard.tensors}
        out: list[StagedShard] = []
        for i, shard in enumerate(shards):
            live = [key for key, _, _ in shard.tensors if last[key] == i]
            if len(live) == len(shard.tensors):
                out.append(shard)
                continue
            if self.options.duplicates == "fail":
                twice = next(key for key, _, _ in shard.tensors if last[key] != i)
                raise WriterError(
                    f"tensor key {twice!r} is written twice (by two tasks, or again by an append)",
                    name=twice,
                )
            if live:
                out.append(await self._without_superseded(shard, live, columns))
        return out

    async def _without_superseded(
        self, shard: StagedShard, live: list[str], columns: list[str]
    ) -> StagedShard:
        name = shard_file_name(shard.task, shard.index, str(uuid.uuid4()))
        staged = _store.join(self.staging, name)
        header = (await cp(shard.staged, staged, include=live)).header
        separator = self.options.kv_separator
        samples = len({(split_key(key, columns, separator) or (key,))[0] for key in live})
        return StagedShard(
            shard.task, shard.index, name, staged, samples, header.file_size, _specs(header)
        )


def _new_folders(path: str) -> list[Path]:
    """The local folders a write to ``path`` makes (:func:`missing_folders`); none for an
    ``s3://`` one (an object store has no folder)."""
    try:
        return missing_folders(_local_folder(path))
    except UnsupportedSinkError:
        return []


def _check_appended_columns(earlier: Mapping[str, Any], columns: Mapping[str, Column]) -> None:
    """Batch mode: refuse (:class:`~stream_st.UsageError`) an append whose columns are not those
    of the dataset's manifest schema ``earlier`` (where it names any): a batch-mode dataset's
    shards all hold the same columns, else every reader takes its shards for KV-mode rows (46
    samples read as 2 rows, one a tensor name)."""
    if earlier and set(earlier) != set(columns):
        raise UsageError(
            f"the dataset's columns are {sorted(earlier)}; this append writes {sorted(columns)}: "
            "every shard of a batch-mode dataset holds the same columns; select the dataset's "
            "columns, or overwrite the dataset"
        )


def _check_appended_types(
    earlier: Mapping[str, Any], schema: Mapping[str, Mapping[str, Any]], options: WriteOptions
) -> None:
    """Refuse (:class:`~stream_st.UsageError`) an append that writes a column of the dataset's
    manifest schema ``earlier`` under another Spark type, or (a column of numbers) another dtype
    than it records: a read gives a column one type, so the earlier shards would be read cast to
    the new one (0.5 as 0), or the new ones to the old. A tensor struct's rows each carry their
    own dtype (nothing is cast): only its Spark type must agree."""
    for column, kind in options.columns.items():
        entry = earlier.get(column)
        if not isinstance(entry, dict):
            continue
        spark, dtype = type_text(options.read_type(column)), schema.get(column, {}).get("dtype")
        recorded = entry.get("spark_type")
        other_type = recorded is not None and recorded != spark
        written = entry.get("dtype")
        other_dtype = not kind.tensor and None not in (dtype, written) and dtype != written
        if other_type or other_dtype:
            raise UsageError(
                f"column {column!r} of the dataset is {recorded or 'of no recorded Spark type'} "
                f"({written}); this append writes it as {spark} ({dtype}): cast it to "
                "the dataset's type, or overwrite the dataset"
            )


def _appended_record(
    record: dict[str, Any] | None, manifest: Mapping[str, Any], every: bool
) -> dict[str, Any] | None:
    """The KV record of a dataset ``manifest`` is appended to with ``record``: none where it has
    none (written otherwise, its rows are read as tensors), and refused where their naming
    differs (the rows of the two could not be read as one). Its rows stay whole where they were
    and ``every`` holds: the append writes every column of the dataset and no other (a name
    appended again then leaves all its earlier tensors behind: ``lastWin`` drops them, ``fail``
    refuses it), or the append holds no row, or the dataset holds none and the append writes
    each of its columns; otherwise a name may now lie in two shards, or lack a column."""
    earlier = manifest.get(KV_RECORD)
    if record is None or earlier is None:
        return None
    naming = {key: value for key, value in record.items() if key != WHOLE_ROWS}
    if (
        not isinstance(earlier, dict)
        or {key: value for key, value in earlier.items() if key != WHOLE_ROWS} != naming
    ):
        raise UsageError(
            f"the dataset was written with name_col, its type and kv_separator {earlier}; "
            f"this append gives {naming}"
        )
    return {**naming, WHOLE_ROWS: every and whole_rows(manifest)}


async def _previous_shards(
    path: str, manifest: Mapping[str, Any], with_tensors: bool
) -> list[StagedShard]:
    """The shards of the dataset at ``path`` appended to, in place; their tensors read from their
    headers if ``with_tensors``."""
    shards = []
    for entry in manifest["shards"]:
        name = entry["shard_path"]
        place = _store.join(path, name)
        task, index = shard_position(name) or (0, 0)
        specs = _specs(await read_header(place)) if with_tensors else ()
        samples = entry.get("samples_count", 0)
        layout = entry.get(LAYOUT_KEY)
        shards.append(StagedShard(task, index, name, place, samples, entry["bytes"], specs, layout))
    return shards


def _index_table(shards: list[StagedShard]) -> bytes:
    """``_tensor_index.parquet``: a row per tensor of every shard."""
    return tensor_index_table(
        (key, shard.name, list(shape), dtype)
        for shard in shards
        for key, dtype, shape in shard.tensors
    )
