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
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from stream_st.core.digests import Digests, digest_of, digests_for
from stream_st.core.dtypes import dtype_for, wire_bytes
from stream_st.core.header import METADATA_KEY
from stream_st.core.layout import framed_header
from stream_st.errors import HeaderError

__all__ = ["Block", "KvShard", "Run", "Specs", "shard_file"]

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
    """The shard a task is filling: its runs, its data size, the names of its rows, and whether
    a key was written twice in it (``lastWin``: the later copy stays, in its place)."""

    runs: list[Run] = field(default_factory=list)
    size: int = 0
    samples: set[str] = field(default_factory=set)
    superseded: bool = False
    held: dict[str, int] | None = None
    """Its keys and their bytes, made when first asked for (:meth:`holding`)."""

    def holding(self) -> dict[str, int]:
        """The shard's keys and their bytes (kept up to date from now on)."""
        if self.held is None:
            self.held = {key: run.nbytes for run in self.runs for key in run.keys}
        return self.held

    def add(self, block: Block) -> None:
        """Add the rows of ``block``, none of whose keys the shard holds."""
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


def _entries(run: Run, offset: int) -> Iterator[str]:
    """The JSON header's entries of the tensors of ``run``, whose data start at ``offset``."""
    shape = json.dumps(list(run.shape), separators=(",", ":"))
    tail = f'":{{"dtype":"{run.code}","shape":{shape},"data_offsets":['
    count, size = len(run.keys), run.nbytes
    starts = range(offset, offset + count * size, size) if size else itertools.repeat(offset, count)
    return (
        f'"{key}{tail}{start},{start + size}]}}'
        for key, start in zip(_json_keys(run.keys), starts, strict=True)
    )


def _digests(runs: list[Run], algorithm: str) -> dict[str, str]:
    """``__metadata__`` recording every tensor's digest by ``algorithm``."""
    values = {
        key: digest_of(algorithm, run.data[i * run.nbytes : (i + 1) * run.nbytes])
        for run in runs
        for i, key in enumerate(run.keys)
    }
    return Digests(algorithm, values).add_to(None, values)


def shard_file(shard: KvShard, checksums: bool | str) -> tuple[bytes, Specs]:
    """The bytes of ``shard``'s file (header and data) and its tensors."""
    runs = _last_copies(shard.runs) if shard.superseded else shard.runs
    if any(METADATA_KEY in run.keys for run in runs):
        raise HeaderError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
    parts: list[Iterator[str]] = []
    wanted = digests_for(checksums)
    if wanted is not None:
        metadata = json.dumps(
            _digests(runs, wanted.algorithm), separators=(",", ":"), ensure_ascii=False
        )
        parts.append(iter([f'"{METADATA_KEY}":{metadata}']))
    offset = 0
    for run in runs:
        parts.append(_entries(run, offset))
        offset += len(run.data)
    text = "{" + ",".join(itertools.chain.from_iterable(parts)) + "}"
    try:
        prefix = framed_header(text.encode("utf-8"))
    except UnicodeEncodeError as exc:  # a lone surrogate in a name
        raise HeaderError(f"names must be valid Unicode text: {exc}") from None
    specs = tuple(
        itertools.chain.from_iterable(
            zip(run.keys, itertools.repeat(run.code), itertools.repeat(run.shape)) for run in runs
        )
    )
    return b"".join([prefix, *(run.data for run in runs)]), specs
