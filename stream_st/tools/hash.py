"""``stream-st hash``: a structural hash (names, dtypes, shapes), content digests per tensor, and
the SHA-256 of every byte of a file.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NotRequired, TypedDict, Unpack

import anyio
import numpy as np

from .._api import stream_for
from .._util import task_group
from ..core.digests import HASH_INLINE
from ..core.dtypes import wire_bytes
from ..core.header import Header, TensorInfo
from ..core.shards import is_index
from ..errors import ArgumentTypeError, UsageError, redact
from ..reader import Include, TensorStream
from ..reader.header import check_size
from ..reader.stream import listed
from ..transports.base import Source, give_turn
from ..transports.options import Clock, TransportOptions
from ..transports.registry import SourceLike, open_source
from .common import (
    Progress,
    checked_progress,
    command_clock,
    expect_totals,
    headers_of,
    included,
    opened,
    tensors_of,
)

__all__ = [
    "FILE_CHUNK",
    "Hashes",
    "content_digests",
    "file_sha256",
    "hash",
    "structural_hash",
    "structure_of",
]


class Hashes(TypedDict):
    """What :func:`hash` gives (``stream-st hash --json`` prints it): the ``source`` (any
    credentials in it redacted), its ``structural_hash`` (:func:`structural_hash`) and
    ``tensor_count``; with ``content``, the ``content_hash``; with ``file``, the
    ``file_sha256``."""

    source: str
    structural_hash: str
    tensor_count: int
    content_hash: NotRequired[str]
    file_sha256: NotRequired[str]


def structural_hash(tensors: Iterable[TensorInfo]) -> str:
    """sha256 (hex) of the structure, independent of layout and JSON key order.

    The hashed text is the compact JSON (sorted keys, UTF-8) of
    ``{"format": "safetensors", "tensors": [{"name", "dtype" (lower case; a code stream_st does
    not know, kept by a header-only read, as written: ``i4`` and ``I4`` hash apart), "shape",
    "byte_length"}, ... sorted by name]}``. ``tensors`` is a header's (an iterable of
    :class:`~stream_st.TensorInfo`); anything else is an :class:`~stream_st.ArgumentTypeError`.
    """
    wrong = "structural_hash takes a header's tensors (TensorInfo entries)"
    if not isinstance(tensors, Iterable):
        raise ArgumentTypeError(f"{wrong}, got {type(tensors).__name__}")
    listed = list(tensors)
    for entry in listed:
        if not isinstance(entry, TensorInfo):
            raise ArgumentTypeError(f"{wrong}, got an entry of type {type(entry).__name__}")
    document = {
        "format": "safetensors",
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype.lower() if t.readable else t.dtype,
                "shape": list(t.shape),
                "byte_length": t.nbytes,
            }
            for t in sorted(listed, key=lambda t: t.name)
        ],
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


async def digest_stream(stream: TensorStream, progress: Progress | None) -> dict[str, str]:
    """sha256 of each tensor's bytes; hashing runs in a thread while the next tensor is read,
    or, for a tensor of at most :data:`~stream_st.core.digests.HASH_INLINE` bytes, on the
    loop's own thread (cheaper than a thread's round trip), a turn given as the reader does."""
    digests: dict[str, str] = {}
    done_bytes = 0
    done = 0

    def sha256(array: np.ndarray[Any, Any]) -> str:
        return hashlib.sha256(wire_bytes(array)).hexdigest()

    async def digest(name: str, array: np.ndarray[Any, Any], finished: anyio.Event) -> None:
        digests[name] = await anyio.to_thread.run_sync(sha256, array)
        finished.set()

    previous: anyio.Event | None = None
    async with task_group() as group:
        async for name, array in stream:
            if previous is not None:
                await previous.wait()  # one tensor hashing while the next is read, no more
                previous = None
            if array.nbytes <= HASH_INLINE:
                digests[name] = sha256(array)
                await give_turn()
            else:
                previous = anyio.Event()
                group.start_soon(digest, name, array, previous)
            done_bytes += array.nbytes
            done += 1
            if progress is not None:
                progress(done_bytes, done)
            del array
    return digests


async def content_digests(
    source: SourceLike,
    *,
    include: Include = None,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> dict[str, str]:
    """sha256 (hex) of each tensor's bytes, streamed one tensor at a time; ``include`` (one
    name, a collection of them or a predicate on the name) selects tensors. The arguments are
    checked before the source is opened: :class:`~stream_st.ArgumentTypeError`, naming the
    argument, for a wrong type."""
    include = listed(include)  # names taken once, or an ArgumentTypeError saying what it takes
    progress = checked_progress(progress)
    async with opened(source, command_clock(options), include=include) as (stream, headers):
        expect_totals(progress, [t for t in tensors_of(headers) if included(include, t.name)])
        return await digest_stream(stream, progress)


def _combined_content(digests: Mapping[str, str]) -> str:
    text = "".join(f"{name}\0{digests[name]}\n" for name in sorted(digests))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


async def hash(  # the command's name (shadows the builtin only inside this module)
    source: SourceLike,
    *,
    content: bool = False,
    file: bool = False,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> Hashes:
    """The structural hash (header only); with ``content``, also a hash of the data; with
    ``file``, the plain sha256 of the file's bytes (``file_sha256``: what ``sha256sum`` prints,
    and a Hugging Face Hub LFS file's oid).

    The content hash is sha256 over ``name NUL sha256(tensor bytes) LF`` for every tensor in name
    order, so it does not depend on the layout either. With ``file`` the source is read once,
    front to back, every byte through the file's hash on its way to the header parser and the
    content hashes: so a pipe, a FIFO or standard input gives the same ``file_sha256`` as the
    file itself.
    """
    progress = checked_progress(progress)
    clock = command_clock(options)
    if not file:
        if not content:
            return structure_of(source, await headers_of(source, clock, unknown_dtypes="keep"))
        return await _content_of(source, source, clock, progress)
    if isinstance(source, str | os.PathLike) and is_index(source):
        raise UsageError("the sha256 of a file takes one file, not a sharded checkpoint's index")
    hashing = _Hashing(await open_source(source, clock))
    try:
        if content:  # the reader reads the message to its end (a whole object's end checked)
            result = await _content_of(source, hashing, clock, progress)
            end = hashing.position
        else:
            async with stream_for(hashing, clock=clock, unknown_dtypes="keep") as stream:
                header = stream.header
            result = structure_of(source, [header])
            end = header.file_size
        # a whole object is read to its end, a connection to its message's (the rest unread)
        result["file_sha256"] = await hashing.finish(None if hashing.whole_object else end)
        if not content:  # the bytes its header describes, no more, no fewer
            check_size(header, hashing.position, hashing.name)
        hashing.message_read()
    finally:
        await hashing.inner.aclose()
    return result


async def _content_of(
    source: SourceLike, reading: SourceLike, clock: Clock, progress: Progress | None
) -> Hashes:
    """The structure and content hash of ``source``, read from ``reading``."""
    async with opened(reading, clock) as (stream, headers):
        result = structure_of(source, headers)
        expect_totals(progress, tensors_of(headers))
        result["content_hash"] = _combined_content(await digest_stream(stream, progress))
    return result


class _Hashing(Source):
    """``inner`` read front to back, every byte that passes through a sha256 (the whole file's,
    or a connection's message's, whoever reads it); closing it leaves ``inner`` open, so
    :meth:`finish` can read the rest."""

    def __init__(self, inner: Source) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.size = inner.size
        self.whole_object = inner.whole_object
        self._sha = hashlib.sha256()
        self._started = False

    async def start(self, *, read_all: bool = False) -> None:
        if not self._started:
            self._started = True
            await self.inner.start(read_all=True)

    async def receive_into(self, buffer: memoryview) -> int:
        got = await self.inner.receive_into(buffer)
        if got:
            self._sha.update(buffer[:got])
            self.position += got
        return got

    def message_read(self) -> None:
        """The message is read whole: ``inner``'s connection may go to the next one."""
        self.inner.message_read()

    async def finish(self, end: int | None = None) -> str:
        """Read what no one read yet through the hash, up to byte ``end`` (None: to the
        source's end; a connection's message ends where its header says, and what follows is
        the next message's); the sha256 (hex) of every byte read. The operation's deadline is
        checked at every chunk (a local file's reads wait for nothing it would bound
        otherwise)."""
        await self.start()
        chunk = memoryview(bytearray(FILE_CHUNK))
        while end is None or self.position < end:
            wanted = chunk if end is None else chunk[: end - self.position]
            if not (got := await self.inner.fill(wanted)):
                break
            self.inner.clock.check(self.name, self.position)
            await anyio.to_thread.run_sync(self._sha.update, chunk[:got])
            self.position += got
        return self._sha.hexdigest()


async def file_sha256(source: SourceLike, **options: Unpack[TransportOptions]) -> str:
    """sha256 (hex) of every byte of ``source``, whatever it holds (``sha256sum``'s)."""
    hashing = _Hashing(await open_source(source, command_clock(options)))
    try:
        return await hashing.finish()
    finally:
        await hashing.inner.aclose()


FILE_CHUNK = 8 << 20


def structure_of(source: SourceLike, headers: Sequence[Header]) -> Hashes:
    return {
        "source": redact(str(source)),
        "structural_hash": structural_hash(tensors_of(headers)),
        "tensor_count": sum(len(h) for h in headers),
    }
