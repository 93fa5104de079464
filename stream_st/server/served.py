"""The object a server presents: one safetensors file, laid out in full before the first request,
whose bytes come from where they already are.

:func:`served_object` plans it from what it is given:

* a safetensors file: the file as it is (one piece, sent with ``sendfile``), unless its digests
  are to change (added, replaced or dropped, see ``checksums``): then a new header and the
  file's data section;
* a sharded checkpoint (a ``*.index.json`` or ``dataset_manifest.json``): one file holding every
  tensor of every shard, in shard order and offset order within each, with the shards'
  ``__metadata__`` merged: byte for byte what ``stream-st cp --merge`` writes. Each shard's data
  is one piece of that shard's file;
* tensors in memory (``{name: array}``: numpy arrays, torch tensors): the file
  :func:`~stream_st.save` writes of them (the reference writer's order); each tensor's piece is
  its array's memory (a C-contiguous little-endian array is not copied).

Any byte range of the object maps to pieces (:meth:`ServedObject.pieces_in`) without building
the object. A file served is found again by its path on every request and must be the one
planned (same device, inode, size and modification time, :class:`SourceFile`); a change seen is
refused, never served mixed with the old bytes (a write in place after an answer's last check is
not seen: see ``app``).
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import io
import os
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio.to_thread

from .._api import stream_for
from ..core.digests import Digests, algorithm_named, digests_for, hash_view, is_record_key
from ..core.dtypes import wire_bytes
from ..core.header import Header
from ..core.layout import TensorSpec, build_header
from ..core.shards import INDEX_SUFFIX, is_index, scheme_of, shard_address
from ..errors import (
    ArgumentTypeError,
    SourceChangedError,
    SourceNotFoundError,
    TransportError,
    UsageError,
)
from ..sharded.reader import ShardIndex
from ..tools.common import command_clock, headers_of, merged_metadata, model_sources, tensors_of
from ..tools.cp import _copied_digests
from ..transports.options import Clock
from ..writer import lay_out

__all__ = ["Piece", "ServedObject", "SourceFile", "Tensors", "checked_name", "served_object"]

Tensors = Mapping[str, Any]
"""Tensors in memory, by name: numpy arrays, torch tensors, anything ``numpy.asarray`` takes."""

SUFFIX = ".safetensors"

_NO_DESCRIPTOR = (errno.EMFILE, errno.ENFILE)
"""Why a file may fail to open that says nothing of the file: no descriptor free."""


@dataclass(frozen=True, slots=True)
class SourceFile:
    """A file served, as it was when serving began: its ``path`` and identity (device, inode,
    size, modification time in ns)."""

    path: str
    identity: tuple[int, int, int, int]

    @property
    def size(self) -> int:
        return self.identity[2]

    @staticmethod
    def identity_of(status: os.stat_result) -> tuple[int, int, int, int]:
        return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)

    @classmethod
    def of(cls, path: str) -> SourceFile:
        """``path`` as it is now; :class:`~stream_st.SourceNotFoundError` if it is missing."""
        try:
            status = os.stat(path)
        except FileNotFoundError:
            raise SourceNotFoundError(f"no such file: {path}", url=path) from None
        except OSError as exc:
            raise SourceNotFoundError(f"{path}: cannot read: {exc.strerror}", url=path) from None
        if not stat.S_ISREG(status.st_mode):
            raise UsageError(f"{path} is not a regular file")
        return cls(path, cls.identity_of(status))

    def change(self) -> str | None:
        """Why the file at ``path`` is no longer the one planned, or None if it still is."""
        try:
            now = self.identity_of(os.stat(self.path))
        except OSError as exc:
            return f"{self.path}: {exc.strerror or exc}"
        return None if now == self.identity else f"{self.path} changed on disk"

    def open(self) -> io.FileIO:
        """The file, opened for reading; :class:`~stream_st.SourceChangedError` unless it is the
        one planned, :class:`~stream_st.TransportError` when no file descriptor is free (in this
        process, or in the system): it may be the one planned, and may open a moment later."""
        try:
            handle = io.FileIO(self.path, "r")
        except OSError as exc:
            kind = TransportError if exc.errno in _NO_DESCRIPTOR else SourceChangedError
            raise kind(f"{self.path}: {exc.strerror or exc}", url=self.path) from None
        if self.identity_of(os.fstat(handle.fileno())) != self.identity:
            handle.close()
            raise SourceChangedError(f"{self.path} changed on disk", url=self.path)
        return handle


@dataclass(frozen=True, slots=True)
class Piece:
    """Bytes ``start`` to ``end`` of the object: ``data`` in memory, or ``file`` from position
    ``offset`` on."""

    start: int
    end: int
    data: memoryview | None = None
    file: SourceFile | None = None
    offset: int = 0


@dataclass(eq=False)
class ServedObject:
    """The object served (see the module): its ``header``, ``size``, strong ``etag`` (quoted)
    and the ``pieces`` its bytes come from, in order."""

    name: str
    header: Header
    pieces: list[Piece]
    etag: str = ""
    _starts: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self._starts = [piece.start for piece in self.pieces]

    @property
    def size(self) -> int:
        return self.header.file_size

    @property
    def files(self) -> list[SourceFile]:
        """The files served, each once."""
        return list(dict.fromkeys(p.file for p in self.pieces if p.file is not None))

    def pieces_in(self, start: int, end: int) -> Iterator[tuple[Piece, int, int]]:
        """The pieces holding bytes ``start`` to ``end`` of the object, each with the part of
        it in that range (as positions in the object)."""
        index = bisect.bisect_right(self._starts, start) - 1
        while start < end:
            piece = self.pieces[index]
            stop = min(end, piece.end)
            if stop > start:
                yield piece, start, stop
            start = stop
            index += 1

    def change(self) -> str | None:
        """Why a file served is no longer the one planned, or None if none changed."""
        return next((why for file in self.files if (why := file.change()) is not None), None)


def _etag(head: bytes, files: Sequence[SourceFile], unique: bool) -> str:
    """A strong ETag: a digest of the header's bytes and the files' identities; ``unique`` adds
    random bytes (tensors in memory with no digests in their header)."""
    digest = hashlib.blake2b(head, digest_size=16)
    for file in files:
        digest.update(repr(file.identity).encode())
    if unique:
        digest.update(os.urandom(16))
    return f'"{digest.hexdigest()}"'


def _merged(pieces: list[Piece]) -> list[Piece]:
    """``pieces`` with each run of consecutive bytes of one file made one piece."""
    merged: list[Piece] = []
    for piece in pieces:
        last = merged[-1] if merged else None
        if (
            last is not None
            and piece.file is not None
            and last.file == piece.file
            and last.offset + (last.end - last.start) == piece.offset
        ):
            merged[-1] = Piece(last.start, piece.end, file=last.file, offset=last.offset)
        else:
            merged.append(piece)
    return merged


async def served_object(
    source: str | os.PathLike[str] | Tensors,
    *,
    name: str | None = None,
    metadata: Mapping[str, str] | None = None,
    checksums: bool | str | None = None,
) -> ServedObject:
    """Plan the object that serves ``source`` (see the module) at ``/<name>.safetensors``.

    ``checksums``: None keeps a file's or shards' digests as they are and computes xxh3-128
    digests of tensors in memory; True (or an algorithm's name) makes every tensor carry a
    digest, those recorded in the source if of that algorithm, else computed now (a file is
    read once); False serves none (those a file records are checked first: it is read once).
    ``metadata`` (tensors in memory only) goes in ``__metadata__``.
    """
    name = checked_name(name)
    if isinstance(source, Mapping):
        return await _from_tensors(source, name or "model", metadata, checksums)
    if metadata is not None:
        raise UsageError("metadata= is for tensors in memory: a file is served with its own")
    if not isinstance(source, str | os.PathLike):
        raise UsageError(
            "serve takes a path (a safetensors file, an index, a model directory) or a mapping "
            f"of names to tensors, got {type(source).__name__}"
        )
    path = os.fspath(source)
    if scheme_of(path) is not None:
        raise UsageError(f"serve takes a local path, not a URL: {path}")
    found = model_sources(path)
    if len(found) > 1:
        raise UsageError(f"{path} holds {len(found)} safetensors files and no index: name one")
    return await _from_checkpoint(found[0], name, checksums)


def _servable(name: str) -> bool:
    """Whether the object can be served at ``/<name>.safetensors``: a name not empty, without
    ``/``, surrounding spaces or control characters (a newline is matched by no route), all of
    it valid UTF-8 (no surrogate escaping a byte of a file name that is not: a URL has none)."""
    return bool(name) and "/" not in name and name == name.strip() and name.isprintable()


def checked_name(name: object) -> str | None:
    """``name=`` as given to :func:`~stream_st.serving` (None: the default), without a
    trailing ``.safetensors``; :class:`~stream_st.UsageError` unless it can be served (see
    :func:`_servable`), :class:`~stream_st.ArgumentTypeError` unless a string."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise ArgumentTypeError(f"name must be a string or None, got {type(name).__name__}")
    name = name.removesuffix(SUFFIX)  # "model.safetensors" is served at /model.safetensors
    if not _servable(name):
        raise UsageError(
            "name must be a plain file name in UTF-8, without '/', surrounding spaces or "
            f"control characters, got {name!r}"
        )
    return name


def _default_name(path: str) -> str:
    """The name a checkpoint is served under: its file name without ``.safetensors`` (and an
    index's ``.index.json``); ``model`` for a manifest. :class:`~stream_st.UsageError` when
    that name is not one ``name=`` would take (see :func:`_servable`: a newline in it, bytes
    that are not UTF-8), saying to give one."""
    base = os.path.basename(path)
    for suffix in (INDEX_SUFFIX, SUFFIX):
        base = base.removesuffix(suffix)
    name = "model" if is_index(path) and not path.endswith(INDEX_SUFFIX) else base
    if not _servable(name):
        raise UsageError(
            f"{path!r} cannot be served under its file's name {name!r} (it must be a plain "
            "name without surrounding spaces or control characters, in UTF-8): give another "
            "with name= (stream-st serve --name)"
        )
    return name


async def _from_checkpoint(
    address: str, name: str | None, checksums: bool | str | None
) -> ServedObject:
    served = name or _default_name(address)  # refused before any file is read
    clock = command_clock({})
    if is_index(address):
        index = await ShardIndex.read(address, clock)
        paths = [shard_address(index.home, shard) for shard in index.shards]
    else:
        paths = [address]
    files = [SourceFile.of(path) for path in paths]
    headers = await headers_of(address, clock)
    tensors = tensors_of(headers)
    names = [t.name for t in tensors]
    digests = _copied_digests(checksums, headers, names, False)
    inherited = isinstance(digests, Digests)
    if isinstance(digests, str) or (digests is False and any(map(_recorded, headers))):
        digests = await _read_through(address, clock, digests)
    now = [SourceFile.of(path) for path in paths]
    if now != files:  # replaced while its header (or digests) were read
        raise SourceChangedError(f"{address} changed while it was being read", url=address)
    single = len(files) == 1 and (inherited or (digests is False and not _recorded(headers[0])))
    if single:  # served as it is
        with files[0].open() as handle:
            head = os.pread(handle.fileno(), headers[0].data_start, 0)
        pieces = [Piece(0, files[0].size, file=files[0])]
        header = headers[0]
    else:
        kept = merged_metadata(headers)
        recorded = digests.add_to(kept, names) if isinstance(digests, Digests) else kept or None
        specs = [TensorSpec(t.name, t.dtype, t.shape) for t in tensors]
        head, header = build_header(specs, recorded)
        pieces = [Piece(0, len(head), data=memoryview(head))]
        shard_of = {t.name: file for file, h in zip(files, headers, strict=True) for t in h}
        shard_header = {t.name: h for h in headers for t in h}
        for info in header.tensors:
            origin = shard_header[info.name]
            pieces.append(
                Piece(
                    header.data_start + info.start,
                    header.data_start + info.end,
                    file=shard_of[info.name],
                    offset=origin.data_start + origin[info.name].start,
                )
            )
        pieces = _merged(pieces)
    return ServedObject(served, header, pieces, _etag(head, files, unique=False))


async def _read_through(address: str, clock: Clock, algorithm: str | bool) -> Digests | bool:
    """Read every tensor of ``address`` under ``clock``, mapped: the read checks the digests
    recorded before they are replaced or dropped (a damaged tensor is never served as a clean
    one), and refuses shards that repeat a name. Returns the digests by ``algorithm`` where it
    names one, else ``algorithm``. One tensor at a time, each view hashed and dropped before the
    next, so the mapping lets go of each window read (every view held and hashed at the end kept
    the whole file in memory)."""
    values: dict[str, str] = {}
    async with stream_for(address, clock=clock, copy=False) as stream:
        async for name, array in stream:
            if isinstance(algorithm, str):
                hasher = algorithm_named(algorithm).new()
                await hash_view(hasher, wire_bytes(array))
                values[name] = hasher.digest().hex()
            del array
    return Digests(algorithm, values) if isinstance(algorithm, str) else algorithm


def _recorded(header: Header) -> bool:
    """Whether ``header`` records digests (or anything under their keys)."""
    return any(map(is_record_key, header.metadata))


async def _from_tensors(
    tensors: Tensors, name: str, metadata: Mapping[str, str] | None, checksums: bool | str | None
) -> ServedObject:
    checksums = True if checksums is None else checksums
    # The file save() writes of the same dict; digests, one pass over every array, off the loop.
    head, header, data = await anyio.to_thread.run_sync(lay_out, tensors, metadata, checksums)
    pieces = [Piece(0, len(head), data=memoryview(head))]
    for info, view in zip(header.tensors, data, strict=True):
        start = header.data_start + info.start
        pieces.append(Piece(start, start + len(view), data=view))
    etag = _etag(head, [], unique=digests_for(checksums) is None)
    return ServedObject(name, header, pieces, etag)
