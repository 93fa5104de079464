"""The safetensors-spark dataset layout: its names and manifest, and reading it in pieces.

The layout (a directory or ``s3://`` prefix)::

    part-{task:05d}-{shard:04d}-{uuid}.safetensors   shards
    dataset_manifest.json                            always, written last (the commit point)
    _tensor_index.parquet                            optional: tensor_key, file_name, shape, dtype

Every writer of the layout names its shards with :func:`shard_file_name` and builds its manifest
with :func:`manifest_document`: one policy, here. A dataset is written in one of two modes:

* batch mode: every shard holds one tensor per column, ``[samples, *sample_shape]``; a sample is
  a row across the columns;
* KV mode: every tensor is one value, keyed ``{name}{separator}{column}``.

:func:`describe_dataset` reads a manifest (or lists a directory of shards), every shard's header,
and tells the modes apart; :func:`plan_pieces` splits the shards into pieces of bounded size (row
ranges in batch mode, groups of keys in KV mode) that a reader task reads on its own with
:func:`read_piece`, fetching only the byte ranges of the tensors it selects. The Spark data source
(``pyspark_safetensors``) and the torch dataset (:mod:`stream_st.torch_dataset`) both read
through these.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._api import load, open_stream, read_header
from ..core.header import Header
from ..core.shards import MANIFEST_NAME, SHARD_NAME, is_index
from ..errors import HeaderError, SourceNotFoundError, UsageError
from ..reader import _read_tensor
from ..sharded.reader import ShardIndex, shard_address
from ..transports import store as _store
from ..transports.options import Clock

__all__ = [
    "KV_RECORD",
    "MANIFEST_NAME",
    "DatasetInfo",
    "KvSample",
    "Piece",
    "describe_dataset",
    "kv_samples",
    "plan_pieces",
    "read_piece",
    "split_key",
]


Array = np.ndarray[Any, Any]

KV_RECORD = "kv"
"""The manifest field where a KV-mode write records how its rows were named: ``{"name_col":
the name column, "spark_type": its Spark type, "separator": the key separator}`` (a field the
layout's manifest schema leaves open); a read gives the rows back with it."""


@dataclass(frozen=True)
class DatasetInfo:
    """A dataset as read: its shards (addresses, in reading order) and their headers, its
    manifest (empty for a directory without one) and its mode.

    ``columns`` are the tensor names of a batch-mode dataset; in KV mode, ``keys`` maps every
    key to the shard that holds it (the last one, if several do: the later write wins).
    """

    home: str
    shards: tuple[str, ...]
    headers: tuple[Header, ...]
    manifest: Mapping[str, Any]
    kv: bool

    @property
    def columns(self) -> list[str]:
        """Batch mode: the tensors of every shard, in the manifest schema's order if it has one."""
        if self.kv or not self.headers:
            return []
        names = self.headers[0].names()
        schema = self.manifest.get("schema")
        return list(schema) if isinstance(schema, dict) and set(schema) == set(names) else names

    @property
    def keys(self) -> dict[str, int]:
        return {name: i for i, header in enumerate(self.headers) for name in header.names()}


def _batch_mode(headers: Sequence[Header], schema: object) -> bool:
    """Whether every shard holds the same tensors, each with one leading (sample) dimension per
    shard, and the manifest's schema (if any) names exactly those."""
    if not headers:
        return isinstance(schema, dict)
    names = set(headers[0].names())
    if isinstance(schema, dict) and schema and set(schema) != names:
        return False
    for header in headers:
        leading = {info.shape[0] if info.shape else None for info in header.tensors}
        if set(header.names()) != names or len(leading) != 1 or None in leading:
            return False
    return True


async def describe_dataset(
    address: str | os.PathLike[str], *, kv: bool | None = None
) -> DatasetInfo:
    """Read the manifest at ``address`` (or, for a directory or ``s3://`` prefix, its
    ``dataset_manifest.json``, else every ``part-*.safetensors`` in it; for an ``http(s)://``
    directory, which cannot be listed, its ``dataset_manifest.json``) and every shard's header.

    ``kv`` forces the mode; by default a dataset is in batch mode when its shards hold the same
    tensors, each with one leading sample dimension, and the manifest's schema names them.
    """
    address = os.fspath(address)
    given = bool(is_index(address))
    manifest: Mapping[str, Any] = {}
    # an http(s) location cannot be listed: its manifest is required
    if given or not _store.listable(address) or MANIFEST_NAME in await _store.list_names(address):
        where = address if given else _store.join(address, MANIFEST_NAME)
        index = await ShardIndex.read(where, Clock())
        manifest = index.manifest
        names = list(index.shards)
        shards = tuple(shard_address(index.home, shard) for shard in names)
        home = index.home.rsplit("/", 1)[0]
    else:
        names = [n for n in await _store.list_names(address) if SHARD_NAME.fullmatch(n)]
        if not names:
            raise SourceNotFoundError(f"{address}: no {MANIFEST_NAME} and no shards")
        home = address.rstrip("/")
        shards = tuple(_store.join(home, name) for name in names)
        index = None
    headers = []
    for name, shard in zip(names, shards, strict=True):
        header = await read_header(shard)
        if index is not None:
            index.check(name, shard, header)
        headers.append(header)
    batch = _batch_mode(headers, manifest.get("schema")) if kv is None else not kv
    return DatasetInfo(home, shards, tuple(headers), manifest, not batch)


def split_key(key: str, columns: Iterable[str], separator: str) -> tuple[str, str] | None:
    """A KV-mode ``key`` as its name and column (``{name}{separator}{column}``; the longest
    column that fits), or None if it ends with no ``{separator}{column}``."""
    return _key_splitter(columns, separator)(key)


def _key_splitter(
    columns: Iterable[str], separator: str
) -> Callable[[str], tuple[str, str] | None]:
    """:func:`split_key` for many keys: one dictionary look-up a key where no column holds the
    separator."""
    ordered = sorted(columns, key=len, reverse=True)
    known = set(ordered)

    def by_suffix(key: str) -> tuple[str, str] | None:
        for column in ordered:
            if key.endswith(separator + column):
                return key[: -len(separator + column)], column
        return None

    def at_separator(key: str) -> tuple[str, str] | None:
        name, found, column = key.rpartition(separator)
        return (name, column) if found and column in known else None

    return by_suffix if any(separator in column for column in ordered) else at_separator


@dataclass(frozen=True)
class KvSample:
    """A KV-mode sample: its ``name`` and, for each of its columns, the shard (its position in
    :attr:`DatasetInfo.shards`) and key of the tensor that holds its value."""

    name: str
    tensors: dict[str, tuple[int, str]]


def kv_samples(dataset: DatasetInfo, columns: Sequence[str], separator: str) -> list[KvSample]:
    """The samples of a KV-mode dataset written with ``columns`` and ``separator``: one per
    name, in the order of their first tensor (the shards in order, each in its tensors' order),
    each with the columns it holds (a key held by several shards: the last one's). Refuses a
    key that belongs to none of ``columns``."""
    winners = dataset.keys
    split_key = _key_splitter(columns, separator)
    samples: dict[str, KvSample] = {}
    for i, header in enumerate(dataset.headers):
        for key in header.names():
            split = split_key(key)
            if split is None:
                raise UsageError(
                    f"tensor {key!r} of {dataset.shards[i]} is no column of {list(columns)} "
                    f"(key {{name}}{separator}{{column}})"
                )
            if winners[key] == i:
                name, column = split
                sample = samples.get(name)
                if sample is None:
                    sample = samples[name] = KvSample(name, {})
                sample.tensors[column] = (i, key)
    return list(samples.values())


@dataclass(frozen=True)
class Piece:
    """What one reader task reads: rows ``start:stop`` of the ``names`` of the shard at
    ``address`` (batch mode), or the tensors ``names`` of it (KV mode, ``start == stop == 0``)."""

    address: str
    names: tuple[str, ...]
    start: int = 0
    stop: int = 0

    @property
    def rows(self) -> bool:
        return self.stop > self.start


def plan_pieces(
    dataset: DatasetInfo,
    names: Iterable[str] | None = None,
    *,
    max_bytes: int = 64 << 20,
    at_least: int = 1,
) -> list[Piece]:
    """Split the dataset's shards into pieces of at most ``max_bytes`` of selected data (a piece
    holds at least one row or one tensor), in reading order; with ``at_least``, every batch-mode
    shard is cut in at least ``ceil(at_least / shards)`` row ranges, so that many readers each get
    one. ``names`` selects the columns (batch mode) or keys (KV mode) to read: None, all of them.

    The plan is bounded by the shards' bytes, whatever their headers declare: a shard makes at
    most ``ceil(at_least / shards)`` pieces plus one per ``max_bytes`` of its selected data (rows
    of no bytes, such as ``F32 [10**15, 0]``, are read as one piece).
    """
    if max_bytes < 1 or at_least < 1:
        raise UsageError("max_bytes and at_least must be positive")
    wanted = None if names is None else set(names)
    pieces: list[Piece] = []
    if dataset.kv:
        winners = dataset.keys
        for i, (address, header) in enumerate(zip(dataset.shards, dataset.headers, strict=True)):
            group: list[str] = []
            size = 0
            for info in header.tensors:
                if winners[info.name] != i or (wanted is not None and info.name not in wanted):
                    continue
                if group and size + info.nbytes > max_bytes:
                    pieces.append(Piece(address, tuple(group)))
                    group, size = [], 0
                group.append(info.name)
                size += info.nbytes
            if group:
                pieces.append(Piece(address, tuple(group)))
        return pieces
    columns = dataset.columns if wanted is None else [c for c in dataset.columns if c in wanted]
    missing = sorted((wanted or set()) - set(dataset.columns))
    if missing:
        raise UsageError(f"the dataset has no column {missing[0]!r} (it has {dataset.columns})")
    cuts = max(1, math.ceil(at_least / max(1, len(dataset.shards))))
    for address, header in zip(dataset.shards, dataset.headers, strict=True):
        rows = header[columns[0]].shape[0] if columns else 0
        row_bytes = sum(header[c].nbytes // rows for c in columns) if rows else 0
        step = max(1, math.ceil(rows / cuts))
        if row_bytes:  # pieces: at most ``cuts`` plus the shard's bytes over max_bytes
            step = max(1, min(max_bytes // row_bytes, step))
        pieces += [
            Piece(address, tuple(columns), start, min(start + step, rows))
            for start in range(0, rows, step)
        ]
    return pieces


async def read_piece(piece: Piece) -> dict[str, Array]:
    """The arrays of ``piece``: only their bytes are read (ranged requests on HTTP and S3).

    Whole tensors (a KV piece, or every row of a shard) are checked against the digests their
    shard records, as every read is; a range of rows cannot be (a digest covers a whole tensor).
    """
    if not piece.rows:
        return await load(piece.address, include=list(piece.names))
    async with open_stream(piece.address, include=list(piece.names)) as stream:
        header = stream.header
        rows = header[piece.names[0]].shape[:1]
        if any(header[name].shape[:1] != rows for name in piece.names):
            raise HeaderError(f"{piece.address}: the columns hold different numbers of samples")
        if (piece.start, piece.stop) == (0, *rows):
            out = {name: array async for name, array in stream}
        else:
            out = {}
            for info in sorted((header[n] for n in piece.names), key=lambda info: info.start):
                part = info.rows(piece.start, piece.stop)
                out[info.name] = await _read_tensor(stream.source, part, header.data_start)
        return {name: out[name] for name in piece.names}
