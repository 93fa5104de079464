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
and tells the modes apart (:meth:`DatasetInfo.not_batch` says why shards are not in batch
mode); :func:`plan_pieces` splits the shards into pieces of bounded size (row
ranges in batch mode, groups of keys in KV mode) that a reader task reads on its own with
:func:`read_piece`, fetching only the byte ranges of the tensors it selects. A KV-mode dataset
is read as rows with :func:`kv_rows` (where each name's tensors lie, told from the headers a
column at a time) and :func:`read_kv_rows` (a part of the rows: each shard's bytes under them read
at once, cut with numpy); where its manifest says its rows are whole (:func:`whole_rows`), each
shard's rows are its own, told from its header alone by :func:`read_shard_rows`, so that no one
process reads every header. The Spark data source (``pyspark_safetensors``) and the torch dataset
(:mod:`stream_st.torch_dataset`) both read through these.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from .._api import load, open_stream, read_header
from ..core.digests import Digests, algorithm_named
from ..core.dtypes import array_shape, dtype_from_code
from ..core.header import (
    DEFAULT_MAX_HEADER_SIZE,
    LENGTH_PREFIX_SIZE,
    METADATA_KEY,
    Header,
    TensorInfo,
    checked_dims,
    data_size,
    parse_header,
)
from ..core.shards import MANIFEST_NAME, SHARD_NAME, is_index
from ..errors import (
    ArgumentTypeError,
    DtypeError,
    HeaderError,
    SafetensorsError,
    SourceChangedError,
    SourceNotFoundError,
    TrailingDataError,
    TruncatedStreamError,
    UnsupportedSourceError,
    UsageError,
    redact,
    some_names,
)
from ..reader import _read_tensor
from ..reader.header import _header_length, _named, _receive_header
from ..reader.stream import skip_to, tensor_dict
from ..sharded.reader import ShardIndex, shard_address
from ..transports import store as _store
from ..transports.cache.resolve import _validators
from ..transports.file.atomic import local_path
from ..transports.file.source import FileSource
from ..transports.options import Clock
from ..transports.registry import open_source

__all__ = [
    "KV_RECORD",
    "MANIFEST_NAME",
    "WHOLE_ROWS",
    "DatasetInfo",
    "KvColumn",
    "KvRows",
    "Piece",
    "check_alike",
    "describe_dataset",
    "kv_rows",
    "plan_pieces",
    "read_header_bytes",
    "read_kv_batches",
    "read_kv_rows",
    "read_piece",
    "read_shard_rows",
    "split_key",
    "verify_rows",
    "whole_rows",
]


Array = np.ndarray[Any, Any]

KV_RECORD = "kv"
"""The manifest field where a KV-mode write records how its rows were named: ``{"name_col":
the name column, "spark_type": its Spark type, "separator": the key separator, "whole_rows":
see :data:`WHOLE_ROWS`}`` (a field the layout's manifest schema leaves open); a read gives the
rows back with it."""

WHOLE_ROWS = "whole_rows"
"""The field of the :data:`KV_RECORD` a write sets (``true``) where every name's tensors lie in
one shard, one for each column of the manifest's schema: each shard's rows are then its own
(``samples_count`` of them, none null), known from its own header."""


def whole_rows(manifest: Mapping[str, Any]) -> bool:
    """Whether ``manifest``'s KV record says its rows are whole (:data:`WHOLE_ROWS`), and each
    of its shards how many (``samples_count``: a whole number)."""
    record = manifest.get(KV_RECORD)
    shards = manifest.get("shards")
    return (
        isinstance(record, dict)
        and record.get(WHOLE_ROWS) is True
        and isinstance(shards, list)
        and all(isinstance(e, dict) and _count(e.get("samples_count")) for e in shards)
    )


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


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
        held = [header for header in self.headers if len(header)]  # empty shards hold none
        if self.kv or not held:
            return []
        names = held[0].names()
        schema = self.manifest.get("schema")
        return list(schema) if isinstance(schema, dict) and set(schema) == set(names) else names

    @property
    def keys(self) -> dict[str, int]:
        return {name: i for i, header in enumerate(self.headers) for name in header.names()}

    def __repr__(self) -> str:
        """A bounded summary (a KV-mode dataset may hold millions of tensors): the home, the
        mode, how many shards and tensors (KV mode) or columns (batch mode) and the first shard,
        addresses masked; the headers are not counted where they were not read."""
        if self.shards and not self.headers:
            held = "headers not read"
        elif self.kv:
            held = f"n_tensors={sum(len(header) for header in self.headers)}"
        else:
            held = f"n_columns={len(self.columns)}"
        first = redact(self.shards[0]) if self.shards else None
        return (
            f"DatasetInfo(home={redact(self.home)!r}, kv={self.kv}, "
            f"n_shards={len(self.shards)}, {held}, first_shard={first!r})"
        )

    def not_batch(self) -> str | None:
        """Why the shards do not form batch mode (see :func:`describe_dataset`): which shard or
        column disagrees, or that there is no shard; None where they do (or where the headers
        were not read, ``from_manifest``)."""
        if self.kv and not self.headers and self.shards:
            return None
        return _not_batch(self.shards, self.headers, self.manifest)


def _not_batch(
    shards: Sequence[str], headers: Sequence[Header], manifest: Mapping[str, Any]
) -> str | None:
    """Why the shards at ``shards`` (their ``headers``) and their ``manifest`` (empty for a
    directory without one) do not form batch mode, or None where they do: batch mode is every
    shard holding the same tensors, each with one leading (sample) dimension per shard, as many
    rows as the manifest counts samples in it (:func:`_miscounted`), and the manifest's schema
    (if any) naming exactly those. A shard of no tensor (a writer closed before its first batch
    writes one) holds no sample of any. The reason names one tensor, never all of them (a
    KV-mode dataset may hold millions)."""
    schema = manifest.get("schema")
    held = [(shard, header) for shard, header in zip(shards, headers, strict=True) if len(header)]
    if held:
        why = _unlike(held, schema)
    elif isinstance(schema, dict):
        why = None
    elif not shards:
        why = "it has no shard"
    else:
        why = "its shards hold no tensor and no manifest schema names its columns"
    return why or _miscounted(shards, headers, manifest.get("shards"))


def _unlike(held: Sequence[tuple[str, Header]], schema: object) -> str | None:
    """Why the shards ``held`` (address and header, each holding some tensor) are not alike:
    a tensor that one holds and another, or the manifest's ``schema`` (if any), does not, a 0-d
    tensor, or tensors of one shard holding different numbers of rows; None where they are."""
    first, header = held[0]
    names = set(header.names())
    if isinstance(schema, dict) and schema and set(schema) != names:
        extra = sorted(names - set(schema))
        if extra:
            return f"tensor {extra[0]!r} of {first} is not in the manifest's schema"
        lacking = sorted(set(schema) - names)[0]
        return f"column {lacking!r} of the manifest's schema is not in {first}"
    for shard, header in held:
        others = set(header.names())
        if others != names:
            extra = sorted(others - names)
            if extra:
                return f"tensor {extra[0]!r} of {shard} is not in {first}"
            return f"tensor {sorted(names - others)[0]!r} of {first} is not in {shard}"
        rows: tuple[str, int] | None = None
        for info in header.tensors:
            if not info.shape:
                return f"tensor {info.name!r} of {shard} is 0-d: it has no sample dimension"
            if rows is None:
                rows = (info.name, info.shape[0])
            elif info.shape[0] != rows[1]:
                return (
                    f"in {shard}, tensor {info.name!r} holds {info.shape[0]} rows, "
                    f"{rows[0]!r} {rows[1]}"
                )
    return None


def _miscounted(shards: Sequence[str], headers: Sequence[Header], entries: object) -> str | None:
    """Which of the shards at ``shards`` (their ``headers``, alike: see :func:`_unlike`) holds
    other rows than its manifest entry (of ``entries``, the manifest's ``shards``, one a shard in
    their order) counts samples (``samples_count``; a shard of no tensor holds none): readers
    would give samples the manifest does not count, or miss some it does. None where none does,
    or where no entry counts them (a directory without a manifest, a manifest listing other
    shards: refused where the dataset is described)."""
    if not isinstance(entries, list) or len(entries) != len(shards):  # no entry a shard
        return None
    for shard, header, entry in zip(shards, headers, entries, strict=True):
        count = entry.get("samples_count") if isinstance(entry, dict) else None
        rows = header.tensors[0].shape[0] if len(header) else 0
        if _count(count) and rows != count:
            return f"{shard} holds {rows} rows, the manifest counts {count} samples for it"
    return None


def check_alike(
    dataset: DatasetInfo, columns: Iterable[str] | None = None, *, shapes: bool = True
) -> None:
    """:class:`~stream_st.UsageError` where a batch-mode column (of ``columns``; None: every
    one) differs between two shards in its dtype or, with ``shapes``, the shape of its rows:
    its samples could not be batched together, nor read as one type without casting some. A
    tensor of no row (an empty write's shard, appended to later) describes no sample: it is
    not compared."""
    wanted = None if columns is None else set(columns)
    seen: dict[str, tuple[str, tuple[int, ...], str]] = {}
    for address, header in zip(dataset.shards, dataset.headers, strict=True):
        for info in header.tensors:
            if (wanted is not None and info.name not in wanted) or 0 in info.shape[:1]:
                continue
            row = (info.dtype, tuple(info.shape[1:]), address)
            first = seen.setdefault(info.name, row)
            if first[0] != row[0] or (shapes and first[1] != row[1]):
                raise UsageError(
                    f"column {info.name!r} differs between shards: {first[0]} rows of shape "
                    f"{list(first[1])} in {first[2]}, {row[0]} rows of shape {list(row[1])} in "
                    f"{address}"
                )


async def describe_dataset(
    address: str | os.PathLike[str], *, kv: bool | None = None, from_manifest: bool = False
) -> DatasetInfo:
    """Read the manifest at ``address`` (or, for a directory or ``s3://`` prefix, its
    ``dataset_manifest.json``, else every ``part-*.safetensors`` in it; for an ``http(s)://``
    directory, which cannot be listed, its ``dataset_manifest.json``) and every shard's header.

    ``kv`` forces the mode; by default a dataset is in batch mode when its shards hold the same
    tensors, each with one leading sample dimension of as many rows as the manifest counts
    samples in its shard, and the manifest's schema names them.
    With ``from_manifest``, a KV-mode dataset whose manifest says its rows are whole
    (:func:`whole_rows`) is described from the manifest alone: no header is read, ``headers``
    is empty (a reader reads each shard's own, :func:`read_shard_rows`).
    """
    if isinstance(address, os.PathLike):
        address = os.fspath(address)
    if not isinstance(address, str):
        raise ArgumentTypeError(
            f"a dataset is named by a path or URL (a str or os.PathLike of one), got "
            f"{type(address).__name__}"
        )
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
        if from_manifest and kv is not False and whole_rows(manifest):
            return DatasetInfo(home, shards, (), manifest, True)
    else:
        names = [n for n in await _store.list_names(address) if SHARD_NAME.fullmatch(n)]
        if not names:
            raise SourceNotFoundError(f"{redact(address)}: no {MANIFEST_NAME} and no shards")
        home = address.rstrip("/")
        shards = tuple(_store.join(home, name) for name in names)
        index = None
    headers = []
    for name, shard in zip(names, shards, strict=True):
        header = await read_header(shard)
        if index is not None:
            index.check(name, shard, header)
        headers.append(header)
    batch = _not_batch(shards, headers, manifest) is None if kv is None else not kv
    return DatasetInfo(home, shards, tuple(headers), manifest, not batch)


def split_key(key: str, columns: Iterable[str], separator: str) -> tuple[str, str] | None:
    """A KV-mode ``key`` as its name and column (``{name}{separator}{column}``; the longest
    column that fits), or None if it ends with no ``{separator}{column}``."""
    return _key_splitter(columns, separator)(key)


def _key_splitter(
    columns: Iterable[str], separator: str
) -> Callable[[str], tuple[str, str] | None]:
    """:func:`split_key` for many keys: one dictionary look-up a key where no
    ``{separator}{column}`` holds the separator but at its start (a key's last separator then
    splits it); else each column's ending tried in turn (``_v`` with ``__``: ``a___v``)."""
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

    suffixes = (separator + column for column in ordered)
    return by_suffix if any(separator in suffix[1:] for suffix in suffixes) else at_separator


@dataclass(frozen=True)
class KvColumn:
    """Where one column's tensors of a KV-mode dataset's rows lie, a row after another: the
    shard holding it (its position in :attr:`KvRows.shards`; -1 where the row has none), its
    data offsets in that shard, its dtype and shape (an index into ``specs``) and the digest
    its shard records (``digests`` None where no shard records any)."""

    shard: Array
    start: Array
    end: Array
    spec: Array
    specs: tuple[tuple[str, tuple[int, ...]], ...]
    digests: Array | None

    def part(self, start: int, stop: int) -> KvColumn:
        """Rows ``start:stop``."""
        digests = None if self.digests is None else self.digests[start:stop]
        return KvColumn(
            self.shard[start:stop],
            self.start[start:stop],
            self.end[start:stop],
            self.spec[start:stop],
            self.specs,
            digests,
        )

    def nbytes(self) -> Array:
        """Each row's bytes (0 where it has no tensor)."""
        return np.where(self.shard >= 0, self.end - self.start, 0)


@dataclass(frozen=True)
class KvRows:
    """A KV-mode dataset (or some of its rows) as rows: one per name (``names``), in the order
    of its first tensor (the shards in order, each in its tensors' order), and for each column
    where its rows' tensors lie (a key held by several shards: the last one's). ``shards``
    are the shards' addresses, ``bases`` where their data start, ``algorithms`` the digest
    algorithm each records (None: none)."""

    shards: tuple[str, ...]
    bases: tuple[int, ...]
    algorithms: tuple[str | None, ...]
    separator: str
    names: list[str]
    columns: dict[str, KvColumn]

    def part(self, start: int, stop: int, columns: Iterable[str]) -> KvRows:
        """Rows ``start:stop``, with ``columns`` only."""
        return replace(
            self,
            names=self.names[start:stop],
            columns={column: self.columns[column].part(start, stop) for column in columns},
        )

    def __repr__(self) -> str:
        """A bounded summary (there may be millions of rows; asyncio shows a task's result)."""
        return (
            f"KvRows(rows={len(self.names)}, columns={list(self.columns)}, "
            f"shards={len(self.shards)})"
        )


def _split_keys(keys: Any, columns: Sequence[str], separator: str, shard: str) -> tuple[Any, Array]:
    """The names (an Arrow string array) and columns (positions in ``columns``) of a shard's
    ``keys`` (an Arrow string array), ``{name}{separator}{column}``: each key's ending bytes
    compared by numpy with every ``{separator}{column}`` where none holds the separator but at
    its start (a key's last separator then splits it, and at most one column fits), else key
    by key. Refuses a key that ends with no column."""
    import pyarrow as pa

    suffixes = [separator + column for column in columns]
    if separator and len(keys) and all(separator not in suffix[1:] for suffix in suffixes):
        bounds = np.frombuffer(keys.buffers()[1], np.int32)[
            keys.offset : keys.offset + len(keys) + 1
        ]
        data = np.frombuffer(keys.buffers()[2] or b"", np.uint8)
        owners = np.full(len(keys), -1, np.int32)
        cuts = np.repeat(bounds, 2)[1:-1]  # each name's start and end: the key's, so far
        for i, suffix in enumerate(suffixes):
            tail = suffix.encode()
            at = np.flatnonzero(np.diff(bounds) >= len(tail))
            for back, byte in enumerate(reversed(tail), 1):  # the candidates, narrowed
                at = at[data[bounds[at + 1] - back] == byte]
            owners[at] = i
            cuts[2 * at + 1] -= len(tail)
        if (owners >= 0).all():
            spans = pa.Array.from_buffers(
                pa.string(), len(cuts) - 1, [None, pa.py_buffer(cuts), keys.buffers()[2]]
            )
            return spans.take(np.arange(0, len(cuts), 2)), owners
        bad = keys[int(np.argmin(owners))].as_py()
    else:
        split = _key_splitter(columns, separator)
        pairs = [split(key) for key in keys.to_pylist()]
        found_pairs = [pair for pair in pairs if pair is not None]
        if len(found_pairs) == len(pairs):
            position = {column: i for i, column in enumerate(columns)}
            names = pa.array([name for name, _ in found_pairs], pa.string())
            return names, np.array([position[column] for _, column in found_pairs], np.int32)
        bad = keys[pairs.index(None)].as_py()
    raise UsageError(
        f"tensor {bad!r:.80} of {shard} is no column of {some_names(columns)} "
        f"(key {{name}}{separator}{{column}})"
    )


Spec = tuple[str, tuple[int, ...]]
"""A tensor's dtype code and shape."""


@dataclass(frozen=True)
class _Tensors:
    """One shard's tensors a field at a time, in offset order: their keys (an Arrow string
    array), dtype and shape (``spec``, positions in ``specs``) and data offsets, and the digest
    algorithm and digests the shard records (None: none)."""

    keys: Any
    spec: Array
    specs: tuple[Spec, ...]
    start: Array
    end: Array
    algorithm: str | None = None
    digests: Array | None = None


def _header_tensors(header: Header) -> _Tensors:
    """The tensors of a parsed ``header``."""
    import pyarrow as pa

    held, codes, shapes, starts, ends = header.tensors.columns()
    specs: dict[Spec, int] = {}
    spec = np.fromiter(
        (specs.setdefault(pair, len(specs)) for pair in zip(codes, shapes, strict=True)),
        np.int64,
        len(held),
    )
    digests = Digests.from_header(header)
    return _Tensors(
        pa.array(held, pa.string()),
        spec,
        tuple(specs),
        np.array(starts, np.int64),
        np.array(ends, np.int64),
        None if digests is None else digests.algorithm,
        None if digests is None else np.array(list(map(digests.values.__getitem__, held)), object),
    )


_MIDDLE = re.compile(
    r':\{"dtype":"([A-Za-z0-9_]+)","shape":\[((?:0|[1-9][0-9]*)(?:,(?:0|[1-9][0-9]*))*)?\],'
    r'"data_offsets"'
)
"""What a compact tensor member (``"name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},``)
holds between its name's closing quote and its offsets: the same text for every tensor of one
dtype and shape."""
_SPACE = b" \t\n\r"
_POWERS = 10 ** np.arange(1, 19, dtype=np.int64)


def _compact_tensors(raw: Array) -> _Tensors | None:
    """The tensors of the header ``raw`` (its N bytes) if it is written compactly, as a KV
    shard's is (no metadata, whitespace or escape; each member's fields in order; the tensors
    in offset order, tiling the data): read by Arrow a field at a time, with no Python code run
    per tensor. None for any other header, which :func:`~stream_st.core.header.parse_header`
    then reads (and tells what is wrong with, if anything).

    Each member is cut at its quotes into three texts, viewed in place: its name and the quote
    closing it, what follows up to its offsets (one text per dtype and shape, checked once
    each), and its offsets with the next member's opening quote. A key listed twice is not
    looked for here: the rows of the shard find it (:func:`_rows_of`)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    tail = raw[-4096:].tobytes().rstrip(_SPACE)  # without the padding
    size = len(raw) - min(len(raw), 4096) + len(tail)
    opening = raw[: len(METADATA_KEY) + 2].tobytes()
    if len(tail) < 2 or opening[:2] != b'{"' or opening[2:] == METADATA_KEY.encode():
        return None
    if tail[-1:] != b"}" or size >= 2**31 - 1:
        return None
    text = np.empty(size + 1, np.uint8)  # its last member then ends as the others: ``]},"``
    text[:-2] = raw[: size - 1]
    text[-2:] = (ord(","), ord('"'))
    if (text == ord("\\")).any() or text.min() < 0x20:
        return None  # an escape, whitespace or a control character
    if text.max() >= 0x80:
        whole = pa.Array.from_buffers(
            pa.string(), 1, [None, pa.py_buffer(np.array([0, size], np.int32)), pa.py_buffer(text)]
        )
        try:
            whole.validate(full=True)  # UTF-8
        except pa.ArrowInvalid:
            return None
    quotes = np.flatnonzero(text == ord('"'))  # ``{"``, then 10 a member
    count, extra = divmod(len(quotes) - 1, 10)
    if extra or not count or quotes[0] != 1:
        return None
    cuts = np.empty(3 * count + 1, np.int32)
    for at, quote in enumerate((0, 1, 9)):  # after a name's quotes, and its offsets' first
        cuts[at:-1:3] = quotes[quote:-1:10] + 1
    cuts[-1] = len(text)
    parts = pa.Array.from_buffers(
        pa.string(), 3 * count, [None, pa.py_buffer(cuts), pa.py_buffer(text)]
    )
    every = np.arange(0, 3 * count, 3)
    keys = pc.utf8_slice_codeunits(parts.take(every), 0, -1)
    offsets = _offsets(parts.take(every + 2))
    if offsets is None or pc.any(pc.equal(keys, METADATA_KEY)).as_py():
        return None
    start, end = offsets
    middles = parts.take(every + 1).dictionary_encode()
    spec = middles.indices.to_numpy()
    specs: list[Spec] = []
    sizes = []
    try:
        for middle in middles.dictionary.to_pylist():
            found = _MIDDLE.fullmatch(middle)
            if found is None:
                return None
            dims = checked_dims("", tuple(map(int, filter(None, (found[2] or "").split(",")))))
            sizes.append(data_size("", dtype_from_code(found[1]), dims))
            specs.append((found[1], dims))
    except (HeaderError, DtypeError, ValueError):
        return None
    if start[0] or (start[1:] != end[:-1]).any() or (end - start != np.array(sizes)[spec]).any():
        return None
    return _Tensors(keys, spec.astype(np.int64), tuple(specs), start, end)


def _offsets(texts: Any) -> tuple[Array, Array] | None:
    """The data offsets compact members' texts ``:[start,end]},"`` give (up to the next
    member's quote), each a plain JSON integer (no sign, no leading zero) below 2**63; None if
    one is not."""
    import pyarrow as pa
    import pyarrow.compute as pc

    numbers = pc.split_pattern(pc.utf8_slice_codeunits(texts, 2, -4), ",")
    if not (
        pc.all(pc.starts_with(texts, ":[")).as_py()
        and pc.all(pc.ends_with(texts, ']},"')).as_py()
        and pc.all(pc.equal(pc.list_value_length(numbers), 2)).as_py()
    ):
        return None
    try:
        both = pc.cast(numbers.flatten(), pa.int64()).to_numpy()
    except pa.ArrowInvalid:  # not digits, or too many
        return None
    digits = 1 + np.searchsorted(_POWERS, both, side="right")
    lengths = pc.binary_length(texts).to_numpy()
    if both.min() < 0 or (lengths != 7 + digits[0::2] + digits[1::2]).any():
        return None  # a sign or a leading zero: ``:[`` ``,`` ``]},"`` and the digits alone
    return both[0::2], both[1::2]


def _shard_tensors(raw: Array, address: str) -> _Tensors:
    """The tensors of the header ``raw`` (its N bytes) of the shard at ``address``: compact as
    a KV shard's, or any other (:func:`~stream_st.core.header.parse_header`, which refuses a
    bad one, its error naming the shard)."""
    compact = _compact_tensors(raw)
    if compact is not None:
        return compact
    try:
        header = parse_header(raw.data)
    except HeaderError as exc:
        raise _named(exc, redact(address)) from None
    return _header_tensors(header)


def _rows_of(
    tables: Sequence[_Tensors],
    shards: tuple[str, ...],
    bases: tuple[int, ...],
    columns: Sequence[str],
    separator: str,
) -> KvRows:
    """The rows of the KV-mode shards at ``shards`` (their data at ``bases``), whose tensors are
    ``tables``, written with ``columns`` and ``separator`` (see :class:`KvRows`). Refuses a key
    that belongs to none of ``columns``, and a key listed twice in one shard."""
    import pyarrow as pa

    specs: dict[Spec, int] = {}
    names: list[Any] = []
    fields: list[list[Array]] = [[] for _ in range(5)]  # column, shard, start, end, spec
    for i, table in enumerate(tables):
        named, owners = _split_keys(table.keys, columns, separator, shards[i])
        numbered = np.array([specs.setdefault(spec, len(specs)) for spec in table.specs], np.int64)
        for values, more in zip(
            fields,
            (
                owners,
                np.full(len(owners), i, np.int32),
                table.start,
                table.end,
                numbered[table.spec] if len(numbered) else table.spec,
            ),
            strict=True,
        ):
            values.append(more)
        names.append(named)
    owner, shard, start, end, spec = (
        values[0] if len(values) == 1 else np.concatenate(values) for values in fields
    )
    algorithms = tuple(table.algorithm for table in tables)
    digest = None
    if any(algorithms):
        digest = np.concatenate(
            [np.full(len(t.keys), None, object) if t.digests is None else t.digests for t in tables]
        )
    name = pa.concat_arrays(names) if names else pa.array([], pa.string())
    encoded = name.dictionary_encode()
    row = encoded.indices.to_numpy().astype(np.int64)
    cell = row * max(1, len(columns)) + owner
    if len(cell) and np.bincount(cell).max() > 1:  # a key in several shards: the last's copy
        kept = _last_copies(cell, shard, pa.concat_arrays([t.keys for t in tables]), shards)
        owner, shard, start, end, spec, row = (
            a[kept] for a in (owner, shard, start, end, spec, row)
        )
        digest = None if digest is None else digest[kept]
        encoded = name.filter(pa.array(kept)).dictionary_encode()
        row = encoded.indices.to_numpy().astype(np.int64)
    count = len(encoded.dictionary)
    # every field a column at a time: a row of ``count`` per column, each tensor at its cell
    cell = owner * count + row
    grid = (len(columns), count)
    at = np.full(grid, -1, np.int32)
    begins, stops, sorts = (np.zeros(grid, np.int64) for _ in range(3))
    for out, given in ((at, shard), (begins, start), (stops, end), (sorts, spec)):
        out.reshape(-1)[cell] = given
    checks = None
    if digest is not None:
        checks = np.full(grid, None, object)
        checks.reshape(-1)[cell] = digest
    where = {
        column: KvColumn(
            at[i],
            begins[i],
            stops[i],
            sorts[i],
            tuple(specs),
            None if checks is None else checks[i],
        )
        for i, column in enumerate(columns)
    }
    return KvRows(shards, bases, algorithms, separator, encoded.dictionary.to_pylist(), where)


def _last_copies(cell: Array, shard: Array, keys: Any, shards: tuple[str, ...]) -> Array:
    """Which tensors to keep, each a ``cell`` (a name's column): the last copy of each, from
    the last shard holding it; refuses a cell twice in one shard (a key listed twice)."""
    last = np.zeros(int(cell.max()) + 1, np.int64)
    positions = np.arange(len(cell))
    np.maximum.at(last, cell, positions)
    kept: Array = last[cell] == positions
    later = positions[~kept]
    same = shard[later] == shard[last[cell[later]]]
    if same.any():
        twice = int(later[np.argmax(same)])
        raise HeaderError(
            f"{redact(shards[int(shard[twice])])}: tensor {keys[twice].as_py()!r} is listed twice"
        )
    return kept


def kv_rows(dataset: DatasetInfo, columns: Sequence[str], separator: str) -> KvRows:
    """The rows of a KV-mode dataset written with ``columns`` and ``separator`` (see
    :class:`KvRows`), told from its headers a column of fields at a time. Refuses a key that
    belongs to none of ``columns``, and a shard whose digests cannot be checked."""
    tables = [_header_tensors(header) for header in dataset.headers]
    bases = tuple(header.data_start for header in dataset.headers)
    return _rows_of(tables, dataset.shards, bases, columns, separator)


async def read_shard_rows(
    address: str, columns: Sequence[str], separator: str, *, size: int | None = None
) -> KvRows:
    """The rows of the KV-mode shard at ``address`` alone (see :class:`KvRows`): its header read
    as :func:`~stream_st.read_header` reads it (one request remotely), and read a field at a
    time where it is written compactly, as a KV shard's is. ``size``: the bytes the manifest
    gives the shard, which its header must describe. Refuses what :func:`kv_rows` refuses, and
    (:class:`~stream_st.TrailingDataError`) a shard holding bytes after its last tensor."""
    n, raw, held = await read_header_bytes(address)
    table = _shard_tensors(raw, address)
    data = int(table.end[-1]) if len(table.end) else 0
    described = LENGTH_PREFIX_SIZE + n + data
    if size is not None and size != described:
        raise HeaderError(
            f"{redact(address)}: the manifest says {size} bytes, the shard's header describes a "
            "different size"
        )
    if held is not None and held > described:
        raise TrailingDataError(
            f"{redact(address)}: {held - described} bytes follow the last tensor (the header "
            f"describes {described} bytes, the source has {held})"
        )
    return _rows_of([table], (address,), (LENGTH_PREFIX_SIZE + n,), columns, separator)


async def read_header_bytes(address: str) -> tuple[int, Array, int | None]:
    """The length N of the header of the object at ``address``, its N bytes and the object's
    size (None where its source does not say), read from its start as
    :func:`~stream_st.read_header` reads them (one request remotely), not parsed."""
    clock = Clock()
    clock.start()
    source = await open_source(address, clock)
    try:
        source.clock.start()
        await source.start()
        prefix = memoryview(bytearray(LENGTH_PREFIX_SIZE))
        got = await source.fill(prefix)
        n = _header_length(prefix, got, source.size, DEFAULT_MAX_HEADER_SIZE, source.name)
        raw, got = await _receive_header(source, n)
        if got < n:
            raise TruncatedStreamError(
                "the header",
                name=None,
                offset=LENGTH_PREFIX_SIZE + got,
                expected=LENGTH_PREFIX_SIZE + n,
                source=source.name,
            )
        return n, np.frombuffer(raw, np.uint8), source.size
    finally:
        await source.aclose()


async def read_span(address: str, start: int, end: int) -> Array:
    """Bytes ``start:end`` of the object at ``address`` (one read: a ranged request on HTTP and
    S3), as an array of bytes: of a local file, a read-only view of its mapping (populated at
    once), no copy."""
    clock = Clock()
    clock.start()
    source = await open_source(address, clock)
    try:
        source.clock.start()
        await source.start()
        span = TensorInfo(f"bytes {start}-{end}", "U8", (end - start,), start, end)
        inside = start < end <= (source.size or 0)
        mapped = source.map() if inside and isinstance(source, FileSource) else None
        if mapped is None:
            return await _read_tensor(source, span, 0)
        mapped.plan([(start, end)])
        return await mapped.view(span, 0)
    finally:
        await source.aclose()


def _checked(rows: KvRows, column: str, row: int, data: Array) -> None:
    """Refuse the bytes ``data`` of ``column``'s tensor of row ``row`` unless they match the
    digest its shard records (if it records one)."""
    where = rows.columns[column]
    recorded = None if where.digests is None else where.digests[row]
    if recorded is None:
        return
    shard = int(where.shard[row])
    algorithm = rows.algorithms[shard]
    assert algorithm is not None
    hasher = algorithm_named(algorithm).new()
    hasher.update(data)
    if hasher.digest().hex() != recorded:
        key = f"{rows.names[row]}{rows.separator}{column}"
        Digests(algorithm, {key: recorded}).check(key, hasher, rows.shards[shard])


def _runs(out: Array, places: Array, starts: Array, nbytes: int, span: Array) -> None:
    """Copy into rows ``places`` (ascending) of ``out`` the tensors of ``nbytes`` bytes at
    ``starts`` of ``span``: a copy per run of tensors that lie back to back, for rows that
    follow one another."""
    if not nbytes or not len(places):
        return
    breaks = np.flatnonzero((np.diff(places) != 1) | (np.diff(starts) != nbytes)) + 1
    edges = [0, *breaks.tolist(), len(places)]
    for first, stop in itertools.pairwise(edges):
        at = int(starts[first])
        count = stop - first
        row = int(places[first])
        out[row : row + count] = span[at : at + count * nbytes].reshape(count, nbytes)


def _column_values(
    rows: KvRows, column: str, spans: Mapping[int, tuple[int, Array]]
) -> Array | list[Array | None]:
    """One column of ``rows``: an array ``[rows, *shape]`` where every row holds a tensor of one
    dtype and shape (a view of the read bytes where they lie back to back in one shard, else
    gathered run by run), else an array per row (None where it has none)."""
    where = rows.columns[column]
    count = len(rows.names)
    if not count or (where.shard < 0).any() or where.spec.min() != where.spec.max():
        values: list[Array | None] = []
        for row in range(count):
            if where.shard[row] < 0:
                values.append(None)
                continue
            first, span = spans[int(where.shard[row])]
            data = span[where.start[row] - first : where.end[row] - first]
            _checked(rows, column, row, data)
            code, shape = where.specs[where.spec[row]]
            dtype = dtype_from_code(code)
            values.append(data.view(dtype.numpy).reshape(array_shape(dtype, shape)))
        return values
    code, shape = where.specs[int(where.spec[0])]
    nbytes = int(where.end[0] - where.start[0])
    shards = np.unique(where.shard)
    first, span = spans[int(shards[0])]
    starts = where.start - first
    if len(shards) == 1 and (np.diff(starts) == nbytes).all():
        data = span[starts[0] : starts[0] + count * nbytes].reshape(count, nbytes)
    else:
        data = np.empty((count, nbytes), np.uint8)
        for shard in shards:
            places = np.flatnonzero(where.shard == shard)
            first, span = spans[int(shard)]
            _runs(data, places, where.start[places] - first, nbytes, span)
    if where.digests is not None:
        for row in range(count):
            _checked(rows, column, row, data[row])
    dtype = dtype_from_code(code)
    return data.view(dtype.numpy).reshape(count, *array_shape(dtype, shape))


async def _read_spans(rows: KvRows) -> dict[int, tuple[int, Array]]:
    """Each shard's bytes under ``rows``, read at once, from the first of their tensors to the
    end of the last: by the shard's position, where they start in its data and the bytes."""
    spans: dict[int, tuple[int, Array]] = {}
    held = [where for where in rows.columns.values() if len(where.shard)]
    for shard in np.unique(np.concatenate([w.shard for w in held])) if held else ():
        if shard < 0:
            continue
        first = min(int(w.start[w.shard == shard].min(initial=2**63 - 1)) for w in held)
        last = max(int(w.end[w.shard == shard].max(initial=0)) for w in held)
        base = rows.bases[shard]
        spans[int(shard)] = (first, await read_span(rows.shards[shard], base + first, base + last))
    return spans


async def read_kv_rows(rows: KvRows) -> dict[str, Array | list[Array | None]]:
    """The values of every column of ``rows`` (see :func:`_column_values`): each shard's bytes
    under them read at once, from the first of their tensors to the end of the last, and every
    tensor checked against the digest its shard records."""
    spans = await _read_spans(rows)
    return {column: _column_values(rows, column, spans) for column in rows.columns}


KvBatch = tuple[int, int, dict[str, Array | list[Array | None]]]
"""Rows ``start:stop`` of a :class:`KvRows` and their values, a column each."""


async def read_kv_batches(rows: KvRows, step: int) -> list[KvBatch]:
    """The values of ``rows`` as :func:`read_kv_rows` reads them, in batches of at most ``step``
    consecutive rows, cut also where a column's tensors stop lying back to back in one shard:
    each batch's column of one dtype and shape is then a view of the bytes read, never a
    copy."""
    spans = await _read_spans(rows)
    cuts = np.zeros(len(rows.names), bool)
    for where in rows.columns.values():
        cuts[1:] |= (where.shard[1:] != where.shard[:-1]) | (where.start[1:] != where.end[:-1])
    bounds: list[int] = []
    for start, stop in itertools.pairwise([0, *np.flatnonzero(cuts).tolist(), len(cuts)]):
        bounds += range(start, stop, step)
    out = []
    for start, stop in itertools.pairwise([*bounds, len(cuts)]):
        part = rows.part(start, stop, rows.columns)
        out.append((start, stop, {c: _column_values(part, c, spans) for c in part.columns}))
    return out


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

    def __repr__(self) -> str:
        """A bounded summary (a KV-mode piece may name a hundred thousand tensors): the address
        masked, the first name and how many more, and the rows."""
        return (
            f"Piece(address={redact(self.address)!r}, names={some_names(self.names, 1)}, "
            f"start={self.start}, stop={self.stop})"
        )


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
        held = dataset.columns
        raise UsageError(
            f"the dataset has no column {some_names(missing)} (it has {len(held)} columns: "
            f"{some_names(held)})"
        )
    cuts = max(1, math.ceil(at_least / max(1, len(dataset.shards))))
    for address, header in zip(dataset.shards, dataset.headers, strict=True):
        rows = header[columns[0]].shape[0] if columns and len(header) else 0  # empty: none
        row_bytes = sum(header[c].nbytes // rows for c in columns) if rows else 0
        step = max(1, math.ceil(rows / cuts))
        if row_bytes:  # pieces: at most ``cuts`` plus the shard's bytes over max_bytes
            step = max(1, min(max_bytes // row_bytes, step))
        pieces += [
            Piece(address, tuple(columns), start, min(start + step, rows))
            for start in range(0, rows, step)
        ]
    return pieces


def changed(address: str) -> SourceChangedError:
    """The error for shard ``address`` found rewritten since the dataset was described."""
    return SourceChangedError(
        f"{redact(address)} changed since the dataset was described (its header is another): "
        "describe the dataset again",
        url=address,
    )


_VERIFIED: dict[tuple[str, tuple[int, ...]], tuple[Header, frozenset[str], tuple[str, str]]] = {}
"""What this process has read whole and found to match the digests the shard records, by (shard
address, the file's identity: ``st_dev``, ``st_ino``, ``st_size``, ``st_mtime_ns`` for a local
one, else empty): the whole header the check was made against (its digests, tensor offsets and
data start), the tensors checked, and the ``ETag`` / ``Last-Modified`` the check's read saw
(empty where the source gives none). A shard rewritten in any of these is read again."""


def _identity(address: str) -> tuple[int, ...]:
    """The identity of the local file at ``address`` (see :data:`_VERIFIED`); empty for a remote
    source, or a file that cannot be examined (its read says why)."""
    try:
        path = local_path(address, UnsupportedSourceError)
        if path is None:
            return ()
        found = os.stat(path)
    except (OSError, SafetensorsError):
        return ()
    return (found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns)


async def verify_rows(address: str, names: Sequence[str], described: Header) -> tuple[str, str]:
    """Check the tensors ``names`` of the shard at ``address`` (described by ``described``)
    against the digests it records, before rows of them are read alone (a digest covers a whole
    tensor): each read whole once per process, through the verified read, its bytes dropped as
    soon as they are checked. :class:`~stream_st.IntegrityError` for a tensor that does not match,
    :class:`~stream_st.SourceChangedError` for a shard whose header is no longer ``described``;
    nothing read for a shard that records no digests or tensors this process checked already in
    this header of this file (see :data:`_VERIFIED`). Returns the ``ETag`` and ``Last-Modified``
    the check's read saw, which later reads of rows must see again (:func:`read_piece`'s
    ``version``)."""
    if Digests.from_header(described) is None:
        return "", ""
    key = (address, _identity(address))
    known = _VERIFIED.get(key)
    if known is not None and known[0] == described and known[1] >= set(names):
        return known[2]
    async with open_stream(address, include=list(names), copy=False) as stream:
        if stream.header != described:
            raise changed(address)
        async for _ in stream:  # each tensor checked before it is yielded, then dropped
            pass
        version = _validators(stream.source)
    if known is not None and known[0] == described and known[2] == version:
        names = [*known[1], *names]
    _VERIFIED[key] = (described, frozenset(names), version)
    return version


async def read_piece(
    piece: Piece, described: Header | None = None, version: tuple[str, str] = ("", "")
) -> dict[str, Array]:
    """The arrays of ``piece``: only their bytes are read (ranged requests on HTTP and S3).

    Whole tensors (a KV piece, or every row of a shard) are checked against the digests their
    shard records, as every read is; a range of rows cannot be (a digest covers a whole tensor).
    A shard whose header is not ``described`` (the one the plan was made from), or that holds
    fewer rows than the piece names, raises :class:`~stream_st.SourceChangedError`: it was
    rewritten since; so does one that answers with another ``ETag`` or ``Last-Modified`` than
    ``version`` names (where it names one: the version :func:`verify_rows` checked).
    """
    if not piece.rows:
        return await load(piece.address, include=list(piece.names))
    async with open_stream(piece.address, include=list(piece.names)) as stream:
        header = stream.header
        rows = header[piece.names[0]].shape[:1]
        if any(header[name].shape[:1] != rows for name in piece.names):
            raise HeaderError(
                f"{redact(piece.address)}: the columns hold different numbers of samples"
            )
        if (described is not None and header != described) or piece.stop > sum(rows):
            raise changed(piece.address)
        seen = _validators(stream.source)
        if any(old and old != new for old, new in zip(version, seen, strict=True)):
            raise SourceChangedError(
                f"{redact(piece.address)} changed since its digests were checked "
                f"(ETag, Last-Modified {version}, then {seen}): describe the dataset again",
                url=piece.address,
            )
        if (piece.start, piece.stop) == (0, *rows):
            out = await tensor_dict(stream)
        else:
            out = {}
            source, base = stream.source, header.data_start
            for info in sorted((header[n] for n in piece.names), key=lambda info: info.start):
                part = info.rows(piece.start, piece.stop)
                await skip_to(source, header, base + part.start)  # a loss there named as such
                out[info.name] = await _read_tensor(source, part, base)
        return {name: out[name] for name in piece.names}
