"""What a :class:`~stream_st.compat._reference.SafeOpen` of a source other than a local file
reads through, on its bridge's event loop: one safetensors file opened for reads by name
(:class:`_File`: arrays read whole from a source that cannot jump, a private mapping, or ranged
reads), and a file or every shard of an index (:class:`_Checkpoint`). Not public API.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from .._api import cached_stream
from ..core.digests import Digests
from ..core.header import Header, TensorInfo
from ..core.shards import is_index, shard_address
from ..errors import IntegrityError, TensorNotFoundError
from ..reader import TensorStream, _read_tensor, merge_ranges
from ..reader.stream import tensor_dict
from ..sharded.reader import ShardIndex, _open_shard, repeated_name
from ..transports.file.mmap import FileMap
from ..transports.file.source import FileSource
from ..transports.options import Clock
from ..transports.registry import SourceLike


@dataclass(frozen=True)
class _Options:
    """How a :class:`SafeOpen` reads: under ``clock``, checking digests (``verify``), viewing
    local files through a private mapping (``mapped``) rather than reading them."""

    clock: Clock
    verify: bool
    mapped: bool
    cache: object = None  # cache= (stream_st._api)


Rows = tuple[int, int] | None
"""A run of rows along the first dimension, ``(first, end)``; ``None`` for the whole tensor."""


class _File:
    """One safetensors file opened for reads by name (on the bridge's loop).

    Tensors come from one of: the arrays read whole at open (a source that cannot jump), the
    file's private mapping (``mapped``), or ranged reads of the source into fresh memory.
    ``digests`` (those the header records, when verifying) are checked for each whole tensor.
    """

    def __init__(
        self,
        stream: TensorStream,
        arrays: dict[str, np.ndarray[Any, Any]] | None,
        mapped: FileMap | None,
        digests: Digests | None,
    ):
        self.stream = stream
        self.header = stream.header
        self._arrays = arrays
        self._map = mapped
        self._digests = digests
        self._verified: set[str] = set()  # mapped tensors checked; the caller may write to them
        self._lock = anyio.Lock()  # one read at a time on the source

    @property
    def mapped(self) -> bool:
        """Whether its tensors are read as views of the file's private mapping (a write into
        one is in every later view of the same bytes), not into fresh memory."""
        return self._map is not None

    @classmethod
    async def open(cls, address: SourceLike, options: _Options, shard: bool = False) -> _File:
        stream = cached_stream(  # read on demand: not every byte (see CachedStream)
            address, options.cache, clock=options.clock, verify=options.verify, whole=False
        ) or TensorStream(address, clock=options.clock, verify=options.verify)
        if shard:
            await _open_shard(stream, str(address))
        else:
            await stream.open()
        source = stream.source
        if not source.random_access:
            try:  # checked against the digests by the stream
                arrays = await tensor_dict(stream)
            finally:
                await stream.aclose()
            return cls(stream, arrays, None, None)
        try:
            digests = Digests.from_header(stream.header) if options.verify else None
            mapped = (
                source.map(private=True)
                if options.mapped and isinstance(source, FileSource)
                else None
            )
        except BaseException:
            await stream.aclose()
            raise
        return cls(stream, None, mapped, digests)

    async def read(self, info: TensorInfo, rows: Rows) -> np.ndarray[Any, Any]:
        """Tensor ``info`` (or its ``rows``), reading only those bytes from the source; a whole
        tensor is checked against its digest. Rows of a mapped tensor with a digest not yet
        checked are a copy, as :meth:`~stream_st.compat._local.LocalFile.array` gives them: a
        caller writing to a view of them would change the mapping a later check of the whole
        reads (a false :class:`~stream_st.IntegrityError`, and a cache's good copy let go)."""
        if self._arrays is not None:
            whole = self._arrays[info.name]
            return (whole if rows is None else whole[rows[0] : rows[1]]).copy()
        wanted = info if rows is None else info.rows(*rows)
        digests = self._digests if rows is None else None
        base = self.header.data_start
        async with self._refuting():
            if self._map is not None:  # faulted in as touched, as the reference's views are
                array = await self._view(wanted, digests)
                if rows is None or self._digests is None or info.name in self._verified:
                    return array
                return array.copy()
            async with self._lock:
                source = self.stream.source
                await source.plan_reads(merge_ranges([(base + wanted.start, base + wanted.end)]))
                return await _read_tensor(source, wanted, base, digests=digests)

    async def read_all(self) -> dict[str, np.ndarray[Any, Any]]:
        """Every tensor, in offset order, with the whole read planned at once."""
        if self._arrays is not None:
            return {name: array.copy() for name, array in self._arrays.items()}
        base = self.header.data_start
        tensors = list(self.header.tensors)
        ranges = merge_ranges((base + t.start, base + t.end) for t in tensors)
        async with self._refuting():
            if self._map is not None:
                self._map.plan(ranges)  # populated a window ahead
                return {t.name: await self._view(t, self._digests) for t in tensors}
            async with self._lock:
                source = self.stream.source
                await source.plan_reads(ranges)
                return {
                    t.name: await _read_tensor(source, t, base, digests=self._digests)
                    for t in tensors
                }

    @contextlib.asynccontextmanager
    async def _refuting(self) -> AsyncIterator[None]:
        """A tensor that fails its digest: the stream lets go of what it kept of the read (a
        cache's copy: see :meth:`~stream_st.TensorStream._refuted`) before the error goes on."""
        try:
            yield
        except IntegrityError:
            with anyio.CancelScope(shield=True):
                await self.stream._refuted()
            raise

    async def _view(self, info: TensorInfo, digests: Digests | None) -> np.ndarray[Any, Any]:
        """Tensor ``info`` as a view of the mapping, checked against ``digests`` if given. Views
        of the same bytes share them, as the reference's do: a tensor is checked the first time
        only, as what the caller wrote to it since is no damage."""
        assert self._map is not None
        array = await self._map.view(info, self.header.data_start)
        if digests is not None and info.name not in self._verified:
            await digests.check_view(info.name, array, self.stream.source.name)
            self._verified.add(info.name)
        return array

    async def aclose(self) -> None:
        await self.stream.aclose()


async def _close_quietly(files: Iterable[_File]) -> None:
    """Close ``files`` after a refusal (shielded), each on its own: an error closing one neither
    leaves the others open nor replaces the refusal."""
    with anyio.CancelScope(shield=True):
        for file in files:
            with contextlib.suppress(Exception):
                await file.aclose()


class _Checkpoint:
    """A file, or every shard of an index, opened for reads by name (on the bridge's loop)."""

    def __init__(self, options: _Options) -> None:
        self.options = options
        self.files: dict[str, _File] = {}  # by address
        self.where: dict[str, str] = {}  # tensor name -> address of its file
        self.index: ShardIndex | None = None
        self._opening: dict[str, anyio.Lock] = {}  # by address: one opening of each shard

    @classmethod
    async def open(cls, src: SourceLike, options: _Options) -> _Checkpoint:
        self = cls(options)
        clock = options.clock
        clock.start()
        if isinstance(src, str | os.PathLike) and is_index(src):
            self.index = await ShardIndex.read(os.fspath(src), clock)
            if self.index.weight_map is not None:
                home = self.index.home
                for name, shard in self.index.weight_map.items():
                    self.where[name] = shard_address(home, shard)
            else:  # a manifest names no tensors: open every shard now
                try:
                    for shard in self.index.shards:
                        await self._shard(shard_address(self.index.home, shard))
                except BaseException:  # those opened before the refusal are closed
                    await _close_quietly(self.files.values())
                    raise
        else:
            file = await _File.open(src, options)
            self.files[""] = file
            self.where = dict.fromkeys(file.header.names(), "")
        return self

    async def _shard(self, address: str) -> _File:
        """The shard at ``address``, opened once however many threads ask for it at once (they
        wait for the first one's opening, then share the file)."""
        file = self.files.get(address)
        if file is not None:
            return file
        async with self._opening.setdefault(address, anyio.Lock()):
            file = self.files.get(address)
            if file is not None:
                return file
            file = await _File.open(address, self.options, shard=True)
            try:
                self._check(address, file.header)
            except BaseException:
                await _close_quietly([file])
                raise
            for name in file.header.names():
                self.where[name] = address
            self.files[address] = file  # kept only once checked: a refused shard is every time
        return file

    def _check(self, address: str, header: Header) -> None:
        """:class:`~stream_st.HeaderError` unless ``header`` (of the shard at ``address``) is
        what the index says of it; :class:`~stream_st.UsageError` if it holds a tensor another
        shard holds."""
        index = self.index
        assert index is not None
        shard = next(s for s in index.shards if shard_address(index.home, s) == address)
        index.check(shard, address, header)
        for name in header.names():
            first = self.where.get(name, address)
            if first != address:
                raise repeated_name(index.home, name, first, address)

    async def file_of(self, name: str) -> _File:
        address = self.where.get(name)
        if address is None:
            raise TensorNotFoundError(f"File does not contain tensor {name}")
        return self.files[address] if address == "" else await self._shard(address)

    def mapped(self, name: str) -> bool:
        """Whether tensor ``name``, its file open (:meth:`info` opened it), is read as views of
        a private mapping (:attr:`_File.mapped`); safe to ask off the bridge's loop."""
        return self.files[self.where[name]].mapped

    async def info(self, name: str) -> TensorInfo:
        return (await self.file_of(name)).header[name]

    async def read(self, info: TensorInfo, rows: Rows) -> np.ndarray[Any, Any]:
        """Tensor ``info`` (one of a file's, or its bytes as another dtype), or its ``rows``."""
        return await (await self.file_of(info.name)).read(info, rows)

    async def _all_files(self) -> list[_File]:
        """Every file, opening every shard, in reading order: the index's shard order (as
        :func:`~stream_st.open_stream` reads them), whichever were read before."""
        index = self.index
        if index is None:
            return [self.files[""]]
        return [await self._shard(shard_address(index.home, shard)) for shard in index.shards]

    async def headers(self) -> list[Header]:
        """Every file's header, in reading order (opening every shard)."""
        return [file.header for file in await self._all_files()]

    async def read_all(self) -> dict[str, np.ndarray[Any, Any]]:
        return {
            k: v for file in await self._all_files() for k, v in (await file.read_all()).items()
        }

    async def aclose(self) -> None:
        for file in self.files.values():
            await file.aclose()
