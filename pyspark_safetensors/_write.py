"""Writing a DataFrame as a safetensors dataset: options, the task's writer, commit and abort.

Each task writes its shards (through stream_st: a file, or an S3 upload) under the job's staging
prefix ``{path}/_temporary/{job}/`` and returns their descriptions. The driver's ``commit`` moves
the shards named by the successful attempts into place, writes ``_tensor_index.parquet`` (when
asked), then ``dataset_manifest.json`` last: the commit point. Then it removes the staging prefix
(with whatever failed or speculative attempts left there) and, when overwriting, the previous
dataset's shards. ``abort`` removes the staging prefix. A task that fails removes its own shards
at once.
"""

from __future__ import annotations

import io
import json
import uuid
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, WriterCommitMessage

from stream_st import _store
from stream_st._limits import Clock
from stream_st.convenience import save
from stream_st.dataset import (
    INDEX_NAME,
    MANIFEST_NAME,
    SHARD_NAME,
    ShardEntry,
    manifest_document,
    shard_file_name,
)
from stream_st.dtypes import DTYPES, dtype_for
from stream_st.errors import UsageError, WriterError
from stream_st.reader import read_header
from stream_st.sharded import ShardIndex

from ._arrow import stack_rows

__all__ = ["SafetensorsWriter", "WriteOptions"]

Array = np.ndarray[Any, Any]

TAIL_STRATEGIES = ("drop", "pad", "write")
DUPLICATES_STRATEGIES = ("fail", "lastWin")


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
    value = str(options.get(name, default))
    if value not in choices:
        raise UsageError(f"option {name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _dtypes(text: str | None) -> dict[str, str]:
    """``"F16"`` (every column) or ``"image:F16,label:I64"`` -> ``{column or "": code}``."""
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        column, _, code = item.rpartition(":")
        if code not in DTYPES:
            raise UsageError(f"option dtype: {code!r} is not a safetensors dtype")
        out[column.strip()] = code
    return out


@dataclass(frozen=True)
class WriteOptions:
    """The write options, checked on the driver before any task runs."""

    path: str
    batch_size: int | None
    name_col: str | None
    tail_strategy: str
    kv_separator: str
    target_shard_size: int
    duplicates: str
    generate_index: bool
    dtypes: dict[str, str] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriteOptions:
        path = options.get("path")
        if not path:
            raise UsageError("give the dataset's location: .save(path)")
        batch_size = _positive(options, "batch_size", None)
        name_col = options.get("name_col") or None
        if (batch_size is None) == (name_col is None):
            raise UsageError("give exactly one of batch_size (batch mode) or name_col (KV mode)")
        return cls(
            path=str(path).rstrip("/"),
            batch_size=batch_size,
            name_col=name_col,
            tail_strategy=_choice(options, "tail_strategy", TAIL_STRATEGIES, "write"),
            kv_separator=str(options.get("kv_separator", "__")),
            target_shard_size=(_positive(options, "target_shard_size_mb", 300) or 300) << 20,
            duplicates=_choice(options, "duplicatesStrategy", DUPLICATES_STRATEGIES, "fail"),
            generate_index=_flag(options, "generate_index"),
            dtypes=_dtypes(options.get("dtype")),
        )

    def code_for(self, column: str) -> str | None:
        return self.dtypes.get(column, self.dtypes.get(""))


@dataclass(frozen=True)
class StagedShard:
    """A shard a task wrote under the staging prefix, as its commit message describes it."""

    task: int
    index: int
    name: str
    staged: str
    samples: int
    bytes: int
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]  # key, dtype, shape


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

    def seal(self, tensors: Mapping[str, Array], samples: int) -> None:
        name = shard_file_name(self.task, len(self.shards), self.tag)
        staged = _store.join(self.staging, name)
        header = anyio.run(_save, staged, tensors)
        specs = tuple((info.name, info.dtype, info.shape) for info in header.tensors)
        self.shards.append(
            StagedShard(self.task, len(self.shards), name, staged, samples, header.file_size, specs)
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
        for column in table.column_names:
            array = stack_rows(table.column(column), column, self.options.code_for(column))
            if rows < size and self.options.tail_strategy == "pad":
                padding = np.zeros((size - rows, *array.shape[1:]), array.dtype)
                array = np.concatenate([array, padding])
            tensors[column] = array
            self.describe(column, array)
        self.seal(tensors, len(next(iter(tensors.values()))))

    def keys(self, batches: Iterator[pa.RecordBatch]) -> None:
        """KV mode: one tensor per row and column, shards rolled over at the target size."""
        name_col, separator = self.options.name_col, self.options.kv_separator
        assert name_col is not None
        current: dict[str, Array] = {}
        written: set[str] = set()
        size = samples = 0
        for batch in batches:
            if name_col not in batch.schema.names:
                raise UsageError(f"name_col {name_col!r} is not a column of the DataFrame")
            names = batch.column(name_col)
            columns = [c for c in batch.schema.names if c != name_col]
            for row in range(batch.num_rows):
                name = names[row].as_py()
                if name is None:
                    raise UsageError(f"column {name_col!r} holds a null: every row needs a name")
                row_tensors = {}
                for column in columns:
                    cell = batch.column(column).slice(row, 1)
                    array = stack_rows(cell, column, self.options.code_for(column))[0]
                    self.describe(column, array)
                    row_tensors[f"{name}{separator}{column}"] = array
                adding = sum(a.nbytes for k, a in row_tensors.items() if k not in current)
                if current and size + adding > self.options.target_shard_size:
                    self.seal(current, samples)
                    current, size, samples = {}, 0, 0
                for key, array in row_tensors.items():
                    if key in written and self.options.duplicates == "fail":
                        raise WriterError(f"tensor key {key!r} is written twice", name=key)
                    size += array.nbytes - (current[key].nbytes if key in current else 0)
                    current[key] = array  # lastWin: the later row replaces the earlier here
                    written.add(key)
                samples += 1
        if current:
            self.seal(current, samples)

    def discard(self) -> None:
        """Remove every shard this attempt wrote."""
        for shard in self.shards:
            anyio.run(_store.remove, shard.staged)


async def _save(address: str, tensors: Mapping[str, Array]) -> Any:
    return await save(address, tensors)


STAGING_REMOVALS = 50
STAGING_RETRY_DELAY = 0.2
"""How often, and how far apart, an abort tries to remove the staging directory (10 s in all)."""


class SafetensorsWriter(DataSourceArrowWriter):
    """The data source's writer; see the module docstring."""

    def __init__(self, options: WriteOptions, overwrite: bool) -> None:
        self.options = options
        self.overwrite = overwrite
        self.staging = _store.join(options.path, f"_temporary/{uuid.uuid4()}")
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

    async def _commit(self, messages: list[ShardsWritten]) -> None:
        path = self.options.path
        shards = sorted((s for m in messages for s in m.shards), key=lambda s: (s.task, s.index))
        schema: dict[str, dict[str, Any]] = {}
        for message in messages:
            for column, entry in message.schema.items():
                schema.setdefault(column, entry)
        present = [n for n in await _store.list_names(path) if SHARD_NAME.fullmatch(n)]
        previous: list[ShardEntry] = []
        if not self.overwrite and MANIFEST_NAME in await _store.list_names(path):
            index = await ShardIndex.read(_store.join(path, MANIFEST_NAME), Clock())
            previous = [
                ShardEntry(entry["shard_path"], entry.get("samples_count", 0), entry["bytes"])
                for entry in index.manifest["shards"]
            ]
            schema = {**index.manifest.get("schema", {}), **schema}
        if self.options.name_col is not None and self.options.duplicates == "fail":
            _refuse_duplicates(shards)
        moved: list[str] = []
        try:
            for shard in shards:
                final = _store.join(path, shard.name)
                await _store.move(shard.staged, final)
                moved.append(final)
            entries = previous + [ShardEntry(s.name, s.samples, s.bytes) for s in shards]
            if self.options.generate_index:
                table = await _index_table(path, previous, shards)
                await _store.write_object(_store.join(path, INDEX_NAME), table)
            document = manifest_document(entries, schema)
            text = json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")
            await _store.write_object(_store.join(path, MANIFEST_NAME), text)  # the commit point
        except BaseException:
            for final in moved:
                await _store.remove(final)
            raise
        await self._clean_staging()
        if self.overwrite:
            keep = {entry.shard_path for entry in entries}
            for name in present:
                if name not in keep:
                    await _store.remove(_store.join(path, name))
            if not self.options.generate_index:
                await _store.remove(_store.join(path, INDEX_NAME))


def _refuse_duplicates(shards: list[StagedShard]) -> None:
    counts = Counter(key for shard in shards for key, _, _ in shard.tensors)
    twice = sorted(key for key, count in counts.items() if count > 1)
    if twice:
        raise WriterError(f"tensor key {twice[0]!r} is written by two tasks", name=twice[0])


async def _index_table(path: str, previous: list[ShardEntry], shards: list[StagedShard]) -> bytes:
    """``_tensor_index.parquet``: a row per tensor of every shard (the previous ones' read from
    their headers)."""
    rows: list[tuple[str, str, list[int], str]] = []
    for entry in previous:
        header = await read_header(_store.join(path, entry.shard_path))
        rows += [(i.name, entry.shard_path, list(i.shape), i.dtype) for i in header.tensors]
    for shard in shards:
        rows += [(key, shard.name, list(shape), dtype) for key, dtype, shape in shard.tensors]
    keys, files, shapes, dtypes = zip(*rows, strict=True) if rows else ((), (), (), ())
    table = pa.table(
        {
            "tensor_key": pa.array(keys, pa.string()),
            "file_name": pa.array(files, pa.string()),
            "shape": pa.array(shapes, pa.list_(pa.int32())),
            "dtype": pa.array(dtypes, pa.string()),
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()
