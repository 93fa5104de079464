"""Sharded checkpoints: a Hugging Face style ``model.safetensors.index.json`` read as one stream.

The index maps every tensor to its shard::

    {"metadata": {"total_size": 123},
     "weight_map": {"embed.weight": "model-00001-of-00002.safetensors", ...}}

:func:`~stream_st.open_stream` on an index (a path, ``file://``, ``http(s)://`` or ``s3://``
address ending in ``.index.json``) yields every tensor of every shard, shard after shard (shards
in name order, tensors in offset order within each); ``include=`` applies across shards and a shard
with nothing selected is not opened. Shard addresses are resolved next to the index. Each shard's
header must hold exactly the tensors the index assigns to it.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .errors import HeaderError, TensorNotFoundError, UsageError
from .header import DEFAULT_MAX_HEADER_SIZE, Header
from .reader import Include, TensorStream
from .sources import read_object

__all__ = ["INDEX_SUFFIX", "ShardIndex", "ShardedStream", "is_index", "shard_address"]

INDEX_SUFFIX = ".index.json"
MAX_INDEX_SIZE = 64 << 20


def is_index(source: object) -> bool:
    """True for a ``str`` or path naming a ``*.index.json`` file."""
    text = source if isinstance(source, str) else getattr(source, "__fspath__", lambda: "")()
    return isinstance(text, str) and urlsplit(text).path.endswith(INDEX_SUFFIX)


def shard_address(index: str, shard: str) -> str:
    """The address of ``shard`` (a file name from the weight map) next to ``index``."""
    if "://" not in index:
        return posixpath.join(posixpath.dirname(index), shard)
    parts = urlsplit(index)
    path = posixpath.join(posixpath.dirname(parts.path), shard)
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


class ShardIndex:
    """A validated index: ``metadata`` (any JSON object) and ``weight_map`` (name -> shard)."""

    def __init__(self, raw: bytes, name: str) -> None:
        try:
            obj = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HeaderError(f"{name}: the index is not valid JSON: {exc}") from None
        weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise HeaderError(f"{name}: the index needs a 'weight_map' of tensor name -> shard")
        for shard in set(weight_map.values()):
            if shard.startswith("/") or ".." in shard.split("/") or "://" in shard:
                raise HeaderError(f"{name}: shard {shard!r} must be a path next to the index")
        metadata = obj.get("metadata", {})
        self.metadata: dict[str, Any] = metadata if isinstance(metadata, dict) else {}
        self.weight_map: dict[str, str] = weight_map
        self.shards: list[str] = sorted(set(weight_map.values()))

    def names_in(self, shard: str) -> set[str]:
        return {name for name, where in self.weight_map.items() if where == shard}


class ShardedStream(TensorStream):
    """Every tensor of every shard of an index; used like any :class:`~stream_st.TensorStream`.

    ``index`` (the :class:`ShardIndex`) is available once open. ``header`` is the header of the
    shard being read; ``headers`` maps each shard opened so far to its header.
    """

    def __init__(
        self,
        index: str | os.PathLike[str],
        *,
        include: Include = None,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        timeout: float | None = None,
    ) -> None:
        super().__init__(index, include=include, max_header_size=max_header_size, timeout=timeout)
        self._address = os.fspath(index)
        self._index: ShardIndex | None = None
        self._current: TensorStream | None = None
        self.headers: dict[str, Header] = {}

    @property
    def index(self) -> ShardIndex:
        if self._index is None:
            raise UsageError("the index is read when the stream opens: use 'async with' first")
        return self._index

    @property
    def header(self) -> Header:
        """The header of the shard being read."""
        if self._current is None or self._current._header is None:
            raise UsageError("a sharded stream has one header per shard: see .headers, .index")
        return self._current._header

    async def open(self) -> Header:
        """Read and validate the index (shards are opened as iteration reaches them)."""
        if self._index is None:
            raw = await read_object(self._address, timeout=self._timeout, limit=MAX_INDEX_SIZE)
            self._index = ShardIndex(raw, self._address)
        return Header.from_tensors((), {}, 0)

    def _selector(self, index: ShardIndex) -> Callable[[str], bool]:
        include = self._include
        if include is None:
            return lambda name: True
        if callable(include):
            return include
        names = {include} if isinstance(include, str) else set(include)
        missing = sorted(names - index.weight_map.keys())
        if missing:
            raise TensorNotFoundError(f"include= names tensors not in the index: {missing}")
        return names.__contains__

    async def _iterate(self) -> AsyncIterator[tuple[str, np.ndarray[Any, Any]]]:
        await self.open()
        index = self.index
        selected = self._selector(index)
        for shard in index.shards:
            expected = index.names_in(shard)
            wanted = {name for name in expected if selected(name)}
            if not wanted:
                continue
            address = shard_address(self._address, shard)
            stream = TensorStream(
                address,
                include=wanted,
                max_header_size=self._max_header_size,
                timeout=self._timeout,
            )
            self._current = stream
            try:
                async with stream:
                    header = stream.header
                    if set(header.names()) != expected:
                        raise HeaderError(
                            f"{address}: the shard holds {sorted(header.names())[:5]}..., the "
                            f"index assigns it {sorted(expected)[:5]}... (they differ)"
                        )
                    self.headers[shard] = header
                    async for item in stream:
                        yield item
                        del item
            finally:
                self._current = None

    async def aclose(self) -> None:
        current, self._current = self._current, None
        if current is not None:
            await current.aclose()

    async def __aenter__(self) -> ShardedStream:
        await self.open()
        return self
