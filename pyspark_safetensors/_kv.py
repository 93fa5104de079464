"""KV mode's shards, made a batch of rows at a time.

A KV write holds one tensor per row and column, keyed ``{name}{separator}{column}``: a shard of
100,000 rows of three columns is 300,000 tensors. Planning them one by one (a spec, a dict entry,
a write each) costs far more than their bytes; here a batch's rows are taken together instead.
Each column of a :class:`Block` (rows whose columns each hold one dtype and shape) is a
:class:`Run`: its values back to back in the rows' order, one buffer. A shard is its runs in
order, its JSON header written in one pass over them (the offsets a running sum, one entry of
text per tensor) and framed as every stream_st header is
(:func:`~stream_st.core.layout.framed_header`): the very file stream_st's general writer makes
of the same tensors in the same order, its tensors a column after another within each block.

Where a shard's rows lie follows from its blocks alone: the writer records them with a digest of
the header (:class:`RowLayout`, in the shard's manifest entry), and a read whose shard still has
that header (:func:`checked_header`) finds its rows there (:func:`read_laid_out`) instead of
parsing a member of JSON per tensor; any other shard is read as every KV shard is, from its
parsed header.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np
import pyarrow as pa

from stream_st.core.digests import (
    Digests,
    algorithm_named,
    digest_of,
    digests_for,
    update_sliced,
)
from stream_st.core.dtypes import DTYPES, array_shape, dtype_for, dtype_from_code, wire_bytes
from stream_st.core.header import (
    DEFAULT_MAX_HEADER_SIZE,
    LENGTH_PREFIX_SIZE,
    METADATA_KEY,
    checked_dims,
    data_size,
)
from stream_st.core.layout import framed_header
from stream_st.errors import DtypeError, HeaderError, TruncatedStreamError
from stream_st.integrations.dataset import read_header_bytes, read_span

__all__ = [
    "LAYOUT_KEY",
    "Block",
    "KvShard",
    "LaidOut",
    "RowLayout",
    "Run",
    "Specs",
    "checked_header",
    "read_laid_out",
    "shard_file",
]

Array = np.ndarray[Any, Any]

Specs = tuple[tuple[str, str, tuple[int, ...]], ...]
"""A shard's tensors: key, dtype, shape."""


@dataclass(frozen=True)
class Run:
    """Tensors of one dtype and shape laid back to back: their keys, and ``data``, ``nbytes``
    bytes each in the keys' order."""

    keys: list[str]
    code: str
    shape: tuple[int, ...]
    nbytes: int
    data: memoryview

    def tensor(self, index: int) -> Run:
        """The run of the tensor at ``index`` alone."""
        start = index * self.nbytes
        return Run(
            [self.keys[index]],
            self.code,
            self.shape,
            self.nbytes,
            self.data[start : start + self.nbytes],
        )


@dataclass(frozen=True)
class Block:
    """Consecutive rows of a KV write whose every column holds one dtype and shape: the rows'
    names (as text), each column's values ``[rows, *shape]``, and the separator of the keys
    ``{name}{separator}{column}``."""

    names: list[str]
    columns: dict[str, Array]
    separator: str

    @property
    def rows(self) -> int:
        return len(self.names)

    @cached_property
    def row_bytes(self) -> int:
        """Bytes of one row's tensors."""
        return sum(values[0].nbytes for values in self.columns.values()) if self.rows else 0

    def part(self, start: int, stop: int) -> Block:
        """Rows ``start:stop`` (views of the same values)."""
        return Block(
            self.names[start:stop],
            {column: values[start:stop] for column, values in self.columns.items()},
            self.separator,
        )

    @cached_property
    def runs(self) -> list[Run]:
        """A run per column, in the columns' order, each its rows' tensors in order."""
        out = []
        for column, values in self.columns.items():
            suffix = f"{self.separator}{column}"
            out.append(
                Run(
                    [name + suffix for name in self.names],
                    dtype_for(values.dtype).code,
                    tuple(values.shape[1:]),
                    values[0].nbytes if self.rows else 0,
                    wire_bytes(values),
                )
            )
        return out


@dataclass
class KvShard:
    """The shard a task is filling: its runs, its data size, the names of its rows, whether a
    key was written twice in it (``lastWin``: the later copy stays, in its place), and its
    blocks: the rows and columns of each, whose runs follow one another in ``runs``."""

    runs: list[Run] = field(default_factory=list)
    size: int = 0
    samples: set[str] = field(default_factory=set)
    superseded: bool = False
    held: dict[str, int] | None = None
    """Its keys and their bytes, made when first asked for (:meth:`holding`)."""
    blocks: list[tuple[int, tuple[str, ...]]] = field(default_factory=list)

    def holding(self) -> dict[str, int]:
        """The shard's keys and their bytes (kept up to date from now on)."""
        if self.held is None:
            self.held = {key: run.nbytes for run in self.runs for key in run.keys}
        return self.held

    def add(self, block: Block) -> None:
        """Add the rows of ``block``, none of whose keys the shard holds."""
        self.blocks.append((block.rows, tuple(block.columns)))
        for run in block.runs:
            self.runs.append(run)
            if self.held is not None:
                self.held.update(dict.fromkeys(run.keys, run.nbytes))
        self.size += block.rows * block.row_bytes
        self.samples.update(block.names)


def _last_copies(runs: list[Run]) -> list[Run]:
    """``runs`` with only the last copy of every key (a run per tensor where one was dropped)."""
    last = {key: (r, i) for r, run in enumerate(runs) for i, key in enumerate(run.keys)}
    out = []
    for r, run in enumerate(runs):
        kept = [i for i, key in enumerate(run.keys) if last[key] == (r, i)]
        if len(kept) == len(run.keys):
            out.append(run)
        else:
            out += [run.tensor(i) for i in kept]
    return out


def _json_keys(keys: list[str]) -> list[str]:
    """``keys`` as the insides of JSON strings: as they are, unless some character needs
    escaping (checked on all of them at once)."""
    joined = "".join(keys)
    if len(json.dumps(joined, ensure_ascii=False)) == len(joined) + 2:
        return keys
    return [json.dumps(key, ensure_ascii=False)[1:-1] for key in keys]


def _entries(run: Run, keys: list[str], offset: int) -> str:
    """The JSON header's entries of the tensors of ``run`` (``keys``: their keys as JSON
    text), whose data start at ``offset``."""
    shape = json.dumps(list(run.shape), separators=(",", ":"))
    tail = f'":{{"dtype":"{run.code}","shape":{shape},"data_offsets":['
    count, size = len(run.keys), run.nbytes
    starts = range(offset, offset + count * size, size) if size else itertools.repeat(offset, count)
    return ",".join(
        f'"{key}{tail}{start},{start + size}]}}' for key, start in zip(keys, starts, strict=True)
    )


def _digests(runs: list[Run], algorithm: str) -> dict[str, str]:
    """``__metadata__`` recording every tensor's digest by ``algorithm``."""
    values = {
        key: digest_of(algorithm, run.data[i * run.nbytes : (i + 1) * run.nbytes])
        for run in runs
        for i, key in enumerate(run.keys)
    }
    return Digests(algorithm, values).add_to(None, values)


def shard_file(shard: KvShard, checksums: bool | str) -> tuple[bytes, Specs, dict[str, Any] | None]:
    """The bytes of ``shard``'s file (header and data), its tensors, and where its rows lie
    (as the manifest records it, see :class:`RowLayout`; None where none describes them:
    digests in its header, a key written twice, a name JSON escapes, too many blocks)."""
    runs = _last_copies(shard.runs) if shard.superseded else shard.runs
    if any(METADATA_KEY in run.keys for run in runs):
        raise HeaderError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
    texts: list[str] = []  # the header's members: the metadata, then each run's
    wanted = digests_for(checksums)
    if wanted is not None:
        metadata = json.dumps(
            _digests(runs, wanted.algorithm), separators=(",", ":"), ensure_ascii=False
        )
        texts.append(f'"{METADATA_KEY}":{metadata}')
    keys = [_json_keys(run.keys) for run in runs]
    offset = 0
    for run, escaped in zip(runs, keys, strict=True):
        if run.keys:
            texts.append(_entries(run, escaped, offset))
        offset += len(run.data)
    try:
        members = [text.encode("utf-8") for text in texts]
    except UnicodeEncodeError as exc:  # a lone surrogate in a name
        raise HeaderError(f"names must be valid Unicode text: {exc}") from None
    prefix = framed_header(b"{" + b",".join(members) + b"}")
    specs = tuple(
        itertools.chain.from_iterable(
            zip(run.keys, itertools.repeat(run.code), itertools.repeat(run.shape)) for run in runs
        )
    )
    layout = None
    unescaped = all(k is run.keys for k, run in zip(keys, runs, strict=True))
    if wanted is None and not shard.superseded and unescaped:
        layout = _layout(shard, members, prefix)
    return b"".join([prefix, *(run.data for run in runs)]), specs, layout


LAYOUT_KEY = "kv_rows"
"""The field of a shard's manifest entry where a KV write records where the shard's rows lie
(:class:`RowLayout`; an extra field, which the layout's manifest schema allows)."""

HEADER_DIGEST = "xxh3-128"
"""The digest a :class:`RowLayout` records of its shard's header and of itself."""

MAX_BLOCKS = 1024
"""A shard of more blocks of rows than this records no :class:`RowLayout` (the manifest stays
small: a block is one Arrow batch of the write, or a row of its own)."""

_QUOTES = 10
"""The quotes of a compact member: its key's, and those of ``dtype``, its code, ``shape`` and
``data_offsets``."""


def _layout(shard: KvShard, members: list[bytes], prefix: bytes) -> dict[str, Any] | None:
    """Where the rows of ``shard`` lie, as :class:`RowLayout` records it, its header framed as
    ``prefix`` from ``members`` (a run's members each, in the runs' order; no metadata); None
    where its blocks do not account for its runs or are too many."""
    blocks = shard.blocks
    width = len(blocks[0][1]) if blocks else 0
    if (
        not width
        or len(blocks) > MAX_BLOCKS
        or any(columns != blocks[0][1] for _, columns in blocks)
        or len(shard.runs) != len(blocks) * width
        or len(members) != len(shard.runs)
        or any(len(run.keys) != blocks[i // width][0] for i, run in enumerate(shard.runs))
    ):
        return None
    specs: dict[tuple[str, tuple[int, ...]], int] = {}
    rows = []
    at = 1  # past the header's opening brace
    for index, (count, _) in enumerate(blocks):
        runs = range(index * width, (index + 1) * width)
        first = len(members[runs[0]])
        kinds = [(shard.runs[i].code, shard.runs[i].shape) for i in runs]
        rows.append([count, at, at + first, *(specs.setdefault(k, len(specs)) for k in kinds)])
        at += sum(len(members[i]) + 1 for i in runs)
    header = memoryview(prefix)[LENGTH_PREFIX_SIZE:]
    columns = list(blocks[0][1])
    table = [[code, list(shape)] for code, shape in specs]
    return {
        "header": {"bytes": len(header), HEADER_DIGEST: _digest(header, columns, table, rows)},
        "columns": columns,
        "specs": table,
        "blocks": rows,
    }


def _digest(header: memoryview, columns: Any, specs: Any, blocks: Any) -> str:
    """The digest a :class:`RowLayout` records: of its shard's ``header`` (its N bytes), then of
    its ``columns``, ``specs`` and ``blocks`` as compact JSON text."""
    layout = json.dumps([columns, specs, blocks], separators=(",", ":"), ensure_ascii=False)
    hasher = algorithm_named(HEADER_DIGEST).new()
    update_sliced(hasher, header)
    hasher.update(layout.encode("utf-8"))
    return hasher.digest().hex()


def _whole(value: object, least: int = 0) -> bool:
    return type(value) is int and value >= least


@dataclass(frozen=True)
class RowLayout:
    """Where the rows of a KV shard lie, as its writer recorded them (:data:`LAYOUT_KEY` of its
    manifest entry): its header's length, and a digest of its header and of the rest of the
    layout, which a read compares before trusting anything else here; the columns, in the order
    of each block's runs; the dtypes and shapes of the runs; and its blocks in order, each
    ``(rows, start, end, spec, ...)``: its rows, where the members of its first column's run
    lie in the header (from the quote opening the first to the brace closing the last), the
    spec of each column's run. A block's runs lie back to back in the data, a column after
    another, as the blocks do."""

    header: int
    digest: str
    columns: tuple[str, ...]
    specs: tuple[tuple[str, tuple[int, ...]], ...]
    blocks: tuple[tuple[int, ...], ...]

    @classmethod
    def parse(
        cls, document: object, columns: Sequence[str], samples: int, size: int
    ) -> RowLayout | None:
        """The layout a manifest entry records (``document``) of a shard of ``samples`` rows
        and ``size`` bytes holding every one of ``columns``; None for one that does not
        describe such a shard (or a header longer than a read takes), or is no layout at all
        (then the shard is read from its parsed header)."""
        if not isinstance(document, dict):
            return None
        header, names, specs, blocks = (
            document.get(k) for k in ("header", "columns", "specs", "blocks")
        )
        if not (
            isinstance(header, dict)
            and _whole(header.get("bytes"), 2)
            and header["bytes"] <= DEFAULT_MAX_HEADER_SIZE
            and isinstance(header.get(HEADER_DIGEST), str)
            and isinstance(names, list)
            and all(isinstance(name, str) for name in names)
            and len(set(names)) == len(names) == len(columns)
            and set(names) == set(columns)
            and isinstance(specs, list)
            and isinstance(blocks, list)
            and 0 < len(blocks) <= MAX_BLOCKS
        ):
            return None
        nbytes = []
        for spec in specs:
            if not (isinstance(spec, list) and len(spec) == 2):
                return None
            code, shape = spec
            if not (
                isinstance(code, str)
                and code in DTYPES
                and isinstance(shape, list)
                and all(_whole(d) for d in shape)
            ):
                return None
            try:
                nbytes.append(data_size("", dtype_from_code(code), checked_dims("", shape)))
            except (HeaderError, DtypeError):
                return None
        length = header["bytes"]
        data = 0
        for block in blocks:
            if not (
                isinstance(block, list)
                and len(block) == 3 + len(names)
                and all(_whole(v) for v in block)
                and block[0] >= 1
                and 0 < block[1] < block[2] <= length
                and max(block[3:]) < len(nbytes)
            ):
                return None
            data += block[0] * sum(nbytes[spec] for spec in block[3:])
        if (
            sum(block[0] for block in blocks) != samples
            or size != LENGTH_PREFIX_SIZE + length + data
        ):
            return None
        return cls(
            length,
            header[HEADER_DIGEST],
            tuple(names),
            tuple((code, tuple(shape)) for code, shape in specs),
            tuple(tuple(block) for block in blocks),
        )

    def column_specs(self, column: str) -> list[tuple[str, tuple[int, ...]]]:
        """The dtypes and shapes of ``column``'s runs."""
        at = 3 + self.columns.index(column)
        return [self.specs[spec] for spec in sorted({block[at] for block in self.blocks})]


LaidOut = list[tuple[pa.Array, dict[str, Array]]]
"""Rows in batches: each batch's names, and its values of each column ``[rows, *shape]``."""


async def checked_header(address: str, layout: RowLayout, size: int) -> Array | None:
    """The header (its N bytes) of the shard at ``address`` if it is the one ``layout``
    recorded: as long, and of the same digest (with the layout's), in a shard of the ``size``
    bytes its manifest entry gives it (which :meth:`RowLayout.parse` matched), none after;
    else None (the shard is then read from its parsed header, which says what is wrong)."""
    try:
        length, text, held = await read_header_bytes(address)
    except TruncatedStreamError:
        return None
    if length != layout.header or held not in (None, size):
        return None
    if _digest(text.data, layout.columns, layout.specs, layout.blocks) != layout.digest:
        return None
    return text


@dataclass(frozen=True)
class _Part:
    """Rows ``skip:skip + count`` of a block, and where each column's run of the block starts
    in the data, and its spec."""

    count: int
    skip: int
    starts: list[int]
    specs: list[int]


async def read_laid_out(
    address: str,
    layout: RowLayout,
    text: Array,
    separator: str,
    rows: range,
    columns: Sequence[str],
    step: int,
) -> LaidOut | None:
    """Rows ``rows`` of the KV shard at ``address`` whose rows lie as ``layout`` says, its
    header ``text`` the one ``layout`` recorded (:func:`checked_header`), in batches of at
    most ``step`` rows (cut where a block ends), with ``columns``: each column of a batch a
    view of the bytes read (one read for them all, from the first tensor of the rows to the
    last), the names cut from the header's members at their quotes. None where the members
    are not where ``layout`` says (the shard is then read from its parsed header)."""
    where = [layout.columns.index(column) for column in columns]
    sizes = [data_size("", dtype_from_code(code), shape) for code, shape in layout.specs]
    suffix = len(f"{separator}{layout.columns[0]}".encode())
    cuts: list[Array] = []  # each name's first byte and the byte after its last
    parts: list[_Part] = []
    row = offset = 0
    for count, start, stop, *specs in layout.blocks:
        low, high = max(rows.start, row), min(rows.stop, row + count)
        if low < high:
            quotes = np.flatnonzero(text[start:stop] == ord('"')) + start
            if len(quotes) != _QUOTES * count:
                return None
            opening, closing = (quotes[at::_QUOTES][low - row : high - row] for at in (0, 1))
            cuts.append(np.stack([opening + 1, closing - suffix], 1).reshape(-1))
            runs = offset + np.cumsum([0, *(count * sizes[spec] for spec in specs[:-1])])
            chosen = [int(runs[j]) for j in where], [specs[j] for j in where]
            parts.append(_Part(high - low, low - row, *chosen))
        row += count
        offset += count * sum(sizes[spec] for spec in specs)
    if not parts:
        return []
    bounds = np.concatenate(cuts).astype(np.int32)
    if (np.diff(bounds) < 0).any():
        return None
    spans = pa.Array.from_buffers(
        pa.string(), len(bounds) - 1, [None, pa.py_buffer(bounds), pa.py_buffer(text)]
    )
    names = spans.take(np.arange(0, len(bounds), 2))
    ranges = [
        (at + part.skip * sizes[spec], at + (part.skip + part.count) * sizes[spec])
        for part in parts
        for at, spec in zip(part.starts, part.specs, strict=True)
    ]
    first = min((a for a, b in ranges if b > a), default=0)
    last = max((b for _, b in ranges), default=0)  # none: only the names are read
    base = LENGTH_PREFIX_SIZE + layout.header
    data = await read_span(address, base + first, base + last) if last > first else text[:0]
    out: LaidOut = []
    taken = 0
    for part in parts:
        for at in range(0, part.count, step):
            size = min(step, part.count - at)
            values = {}
            for column, origin, spec in zip(columns, part.starts, part.specs, strict=True):
                code, shape = layout.specs[spec]
                dtype = dtype_from_code(code)
                begin = origin + (part.skip + at) * sizes[spec] - first
                values[column] = (
                    data[begin : begin + size * sizes[spec]]
                    .view(dtype.numpy)
                    .reshape(size, *array_shape(dtype, shape))
                )
            out.append((names.slice(taken, size), values))
            taken += size
    return out
