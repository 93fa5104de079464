"""Filters on a KV dataset's keys, decided per shard from ``_tensor_index.parquet``.

Spark hands a Python source the filters of a ``where`` (with
``spark.sql.python.filterPushdown.enabled=true``); those on the KV name column (or on
``tensor_key``, read as a row per tensor) that the index can decide (equality, ``In``, a prefix)
tell which shards can hold a matching row: the shards whose keys, as the index lists them, could
be one of a matching name's. A read plans only those. Every filter still goes back to Spark,
which applies it to the rows read: a shard is skipped only where the index says it holds no key
a matching row would have, never a row of a shard read.

The index is trusted only where it lists exactly the shards the manifest (or the listing) gives,
each with as many tensors as it holds; else, or where it is missing or cannot be read (an
``http(s)://`` directory cannot be listed), nothing is pushed.
"""

from __future__ import annotations

import functools
import io
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyspark.sql.datasource import EqualNullSafe, EqualTo, Filter, In, StringStartsWith

from stream_st.core.shards import INDEX_NAME
from stream_st.errors import SafetensorsError
from stream_st.transports import store as _store
from stream_st.transports.registry import read_object

__all__ = ["KeyColumn", "decided", "index_table", "shards_matching"]

MAX_INDEX_BYTES = 256 << 20
"""An index part larger than this is not read (nothing is pushed)."""


@dataclass(frozen=True)
class KeyColumn:
    """The column whose filters the index decides: ``name`` (its values text), whose value
    ``v`` is held in keys ``{v}{separator}{column}`` for each of ``columns`` (read as a row per
    tensor: ``tensor_key`` itself, no separator, one empty column)."""

    name: str
    separator: str = ""
    columns: tuple[str, ...] = ("",)

    def keys(self, values: Iterable[str]) -> list[str]:
        """The keys rows of names ``values`` are held in."""
        return [f"{v}{self.separator}{c}" for v in values for c in self.columns]


def _wanted(key: KeyColumn, found: Filter) -> pc.Expression | None:
    """Whether a row of the index holds a key a row ``found`` keeps could have; None for a
    filter the index does not decide."""
    if getattr(found, "attribute", None) != (key.name,):
        return None
    keys = pc.field("tensor_key")
    if isinstance(found, EqualTo | EqualNullSafe) and isinstance(found.value, str):
        return keys.isin(key.keys([found.value]))
    if isinstance(found, In) and all(isinstance(v, str) or v is None for v in found.value):
        return keys.isin(key.keys(v for v in found.value if v is not None))
    if isinstance(found, StringStartsWith) and isinstance(found.value, str):
        return pc.starts_with(keys, found.value)  # a key starts with its name
    return None


def decided(key: KeyColumn, filters: Sequence[Filter]) -> pc.Expression | None:
    """Whether a row of the index holds a key a row all of ``filters`` keep could have, as far
    as the index decides them; None where it decides none."""
    wanted = [w for w in (_wanted(key, found) for found in filters) if w is not None]
    if not wanted:
        return None
    return functools.reduce(operator.and_, wanted)


def shards_matching(wanted: pc.Expression, table: pa.Table) -> set[str]:
    """The names of the shards of the index ``table`` holding a key ``wanted`` keeps."""
    return set(table.filter(wanted).column("file_name").unique().to_pylist())


def index_table(home: str, tensors: Mapping[str, int]) -> pa.Table | None:
    """The ``tensor_key`` and ``file_name`` of every row of the index of the dataset at
    ``home`` whose shards (by name) hold ``tensors`` each; None where it has none, it cannot be
    read, or it does not list exactly those."""
    if not _store.listable(home):
        return None
    try:
        table = anyio.run(_read_index, _store.join(home, INDEX_NAME))
    except (SafetensorsError, pa.ArrowException):
        return None
    if table is None:
        return None
    if table.column("tensor_key").null_count or table.column("file_name").null_count:
        return None
    counts = table.group_by("file_name").aggregate([("tensor_key", "count")])
    listed = dict(
        zip(
            counts.column("file_name").to_pylist(),
            counts.column("tensor_key_count").to_pylist(),
            strict=True,
        )
    )
    held = {name: count for name, count in tensors.items() if count}
    return table if listed == held else None


async def _read_index(index: str) -> pa.Table | None:
    """The index at ``index``: the parquet files of a Spark parquet directory; None for none."""
    parts = [
        name
        for name in await _store.list_names(index)
        if name.endswith(".parquet") and not name.startswith(("_", "."))
    ]
    if not parts:
        return None
    tables = []
    for name in parts:
        data, _ = await read_object(_store.join(index, name), limit=MAX_INDEX_BYTES)
        tables.append(pq.read_table(io.BytesIO(data), columns=["tensor_key", "file_name"]))
    return pa.concat_tables(tables)
