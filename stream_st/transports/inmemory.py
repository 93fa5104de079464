"""Sources over data already in memory, or arriving as an async iterable of chunks."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

import numpy as np

from ..errors import TransportError, UnsupportedSourceError, UsageError
from .base import Source, Waits, give_turn

__all__ = ["BytesSource", "ChunkIteratorSource", "as_bytes_view", "refuse_path_bytes"]

_PATH_BYTES = 4096
"""Bytes given as a source and no longer than this are checked for being a path or address."""


def _released() -> UnsupportedSourceError:
    """The error for a memoryview given released (any use of it is a bare ``ValueError``)."""
    return UnsupportedSourceError(
        "the memoryview given was released (memoryview.release()): its bytes cannot be read"
    )


def refuse_path_bytes(data: bytes | bytearray | memoryview) -> None:
    """Refuse ``data`` given as a file's contents where it is a path or address instead
    (``b"/models/m.safetensors"``, ``b"s3://bucket/key"``): text of one line that no safetensors
    file can be, its first 8 bytes read as a header length promising more than follows; and a
    released memoryview."""
    try:
        size = data.nbytes if isinstance(data, memoryview) else len(data)
    except ValueError:  # the memoryview was released
        raise _released() from None
    if size > _PATH_BYTES or size < 8:
        return
    raw = bytes(data)
    if int.from_bytes(raw[:8], "little") <= len(raw) - 8:
        return  # a length prefix that fits: read as a file
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return
    if not text.isprintable() or not ("/" in text or "\\" in text or text.endswith(".safetensors")):
        return
    raise UsageError(
        f"{text!r} was given as bytes, which are read as a file's contents: "
        "give a path or address as str"
    )


_EMPTY = memoryview(b"")


def as_bytes_view(chunk: Any) -> memoryview:
    """A flat byte view of a bytes-like ``chunk``; a non-contiguous one (a strided numpy view)
    is copied, its elements in C order; an empty one, of any shape, is no bytes."""
    if type(chunk) is bytes:  # most chunks: flat bytes already
        return memoryview(chunk)
    try:
        view = memoryview(chunk)
    except (TypeError, ValueError):  # ValueError: a buffer numpy cannot export (datetime64)
        if isinstance(chunk, memoryview):  # which memoryview() refuses once released alone
            raise _released() from None
        if isinstance(chunk, np.ndarray) and chunk.dtype.kind == "V" and not chunk.dtype.hasobject:
            # ml_dtypes' bfloat16, float8...: numbers, as float16 is, which memoryview takes
            return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8).data
        raise UnsupportedSourceError(
            f"chunks must be bytes-like, got {type(chunk).__name__}"
        ) from None
    if "O" in view.format:  # Python objects: their bytes are pointers, not data
        raise UnsupportedSourceError(
            f"chunks must be bytes-like, got a buffer of Python objects ({type(chunk).__name__})"
        )
    if not view.nbytes:  # of a shape with a 0 in it (0 by 3), which cast refuses
        return _EMPTY
    if not view.c_contiguous:
        view = memoryview(view.tobytes())
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class BytesSource(Source):
    """A bytes-like object holding a whole file."""

    random_access = True

    def __init__(self, data: Any, name: str = "<bytes>") -> None:
        super().__init__()
        self._data = as_bytes_view(data)
        self.size = len(self._data)
        self.name = name

    async def receive_into(self, buffer: memoryview) -> int:
        return await self.read_into_at(self.position, buffer)

    async def read_into_at(self, offset: int, buffer: memoryview) -> int:
        piece = self._data[offset : offset + len(buffer)]
        buffer[: len(piece)] = piece
        self.position = offset + len(piece)
        return len(piece)

    async def skip(self, count: int) -> int:
        skipped = max(0, min(count, len(self._data) - self.position))
        self.position += skipped
        return skipped


def _iterator_of(chunks: AsyncIterable[Any]) -> AsyncIterator[Any]:
    """``aiter(chunks)``; :class:`~stream_st.UnsupportedSourceError` where ``__aiter__`` gives
    no async iterator (a bare ``TypeError``), as one written ``async def`` does (it is not
    called: its coroutine would never be awaited)."""
    kind = type(chunks).__name__
    wrong = (
        f"{kind}.__aiter__ must return an async iterator (an object with 'async def "
        "__anext__'), from a plain 'def'"
    )
    if inspect.iscoroutinefunction(getattr(type(chunks), "__aiter__", None)):
        raise UnsupportedSourceError(f"{wrong}, not 'async def'")
    try:
        return aiter(chunks)
    except TypeError as exc:  # what __aiter__ returned has no __anext__
        raise UnsupportedSourceError(f"{wrong}: {exc}") from exc


def _read_elsewhere(name: str, iterator: object) -> UsageError:
    """The refusal of a stream over ``iterator`` (read as ``name``) that another reads."""
    kind = "async generator" if inspect.isasyncgen(iterator) else "async iterator"
    return UsageError(
        f"{name}: the {kind} is being read by another stream; give each stream an iterator of "
        "its own"
    )


_READERS: weakref.WeakValueDictionary[int, ChunkIteratorSource] = weakref.WeakValueDictionary()
"""The source reading each iterator (by the iterator's id), from its making to its close: two
streams sharing one would each take chunks the other never sees, between any two of its steps.
Keyed by id, as an iterator need be neither hashable nor weakly referable: the source holds its
iterator, so the id is that iterator's while the source lives (and a source dropped unclosed
lets go of it when collected)."""


class ChunkIteratorSource(Source):
    """An async iterable of bytes-like chunks of any sizes, together making one whole file.
    Its iterator is read by this source alone until it closes: another source made over it
    meanwhile is a :class:`~stream_st.UsageError`. Its close, from any task, cuts short a read
    waiting for the next chunk (see :class:`~.base.Waits`)."""

    def __init__(
        self, chunks: AsyncIterable[Any], name: str = "<async iterator>", owner: object = None
    ) -> None:
        """``owner``: what the chunks come from, claimed in place of their iterator, where each
        iteration of it makes a new iterator (aiohttp's reader, see :func:`aiohttp_source`)."""
        super().__init__()
        self._iterable = chunks
        self._iterator: AsyncIterator[Any] = _iterator_of(chunks)
        self._claim = self._iterator if owner is None else owner
        if _READERS.get(id(self._claim)) is not None:
            raise _read_elsewhere(name, self._claim)
        _READERS[id(self._claim)] = self
        # Whether each step is checked to be awaitable: an async generator's always are.
        self._check_steps = not inspect.isasyncgen(self._iterator)
        self._chunk = _EMPTY
        self._done = False
        self._waits = Waits()
        self.name = name

    async def receive_into(self, buffer: memoryview) -> int:
        self._waits.check(self)
        if not self._chunk and not await self._next():
            return 0
        return self._take(buffer)

    async def fill(self, buffer: memoryview) -> int:
        """Fill ``buffer`` from as many chunks as it takes, in one call: a call per chunk cost
        more than the copy of a chunk of a few KiB."""
        filled, total = 0, len(buffer)
        self._waits.check(self)
        while filled < total:
            if not self._chunk and not await self._next():
                break
            filled += self._take(buffer[filled:])
        return filled

    async def _next(self) -> bool:
        """Wait for the next chunk that is not empty; False at the end. The empty chunks before
        it are part of that one wait for data, which the clock bounds as a whole: a producer
        yielding ``b""`` for ever gives no data, not a new wait each time."""
        if self._done:
            return False
        # A producer that never suspends (slices of bytes in memory; ``b""`` past its end,
        # yielded for ever) would hold the loop, deaf to a cancellation and a time limit, for a
        # whole tensor or without end: the loop gets its turn every TURN_EVERY between steps,
        # as between tensors; within the wait after an empty chunk (no data yet), outside it
        # after the chunk that ends it (the loop's time is then no wait for the producer).
        try:
            with self.clock.waiting(self.name, self.position):
                chunk = as_bytes_view(await self._step())
                while not chunk:
                    await give_turn()
                    chunk = as_bytes_view(await self._step())
        except StopAsyncIteration:
            self._done = True
            return False
        await give_turn()
        self._chunk = chunk
        self.clock.moved(len(chunk))
        return True

    async def _step(self) -> Any:
        """The producer's next chunk, as it gives it; StopAsyncIteration at its end."""
        if getattr(self._iterator, "ag_running", False):  # stepped by another reader now
            raise _read_elsewhere(self.name, self._iterator)
        step = anext(self._iterator)
        if self._check_steps and not inspect.isawaitable(step):
            raise UnsupportedSourceError(
                f"{self.name}: {type(self._iterator).__name__}.__anext__ returned a "
                f"{type(step).__name__}, not an awaitable: an async iterator's __anext__ is "
                "'async def'"
            )
        # Only a wait for the producer takes a cancel scope: a chunk at hand is taken with a
        # plain closed check (see fill).
        with self._waits.reading(self):
            return await step

    def _take(self, buffer: memoryview) -> int:
        """Copy what ``buffer`` holds of the current chunk into it; how many bytes."""
        chunk = self._chunk
        count = min(len(buffer), len(chunk))
        buffer[:count] = chunk[:count]
        # A chunk taken whole is let go of: a view of it kept while the next is awaited would
        # stop its producer from reusing its buffer (a bytearray cleared or grown: BufferError).
        self._chunk = chunk[count:] if count < len(chunk) else _EMPTY
        self.position += count
        return count

    async def aclose(self) -> None:
        """Close the iterator. One that a read in another task is waiting in cannot be closed
        from here (an async generator refuses it): that read is cancelled instead, which ends
        an async generator there (its ``finally`` blocks run), and fails. The iterator is free
        for another source from here on."""
        self._waits.close()
        if _READERS.get(id(self._claim)) is self:
            del _READERS[id(self._claim)]
        closer = getattr(self._iterator, "aclose", None)
        if callable(closer) and not getattr(self._iterator, "ag_running", False):
            closing = closer()
            if inspect.isawaitable(closing):  # a plain method of that name has closed it
                await closing


def aiohttp_source(reader: Any) -> ChunkIteratorSource:
    """A source over aiohttp's ``StreamReader`` (``response.content``), read by chunks
    (``iter_any()``: iterated itself, it gives lines): claimed as one iterator is, and its
    failures (aiohttp's ``ClientError``, such as a body cut short, or an ``OSError``) raised as
    :class:`~stream_st.TransportError` at the byte reached."""
    source: ChunkIteratorSource

    async def chunks() -> AsyncIterator[Any]:
        try:
            async for chunk in reader.iter_any():
                yield chunk
        except Exception as exc:
            if not (isinstance(exc, OSError) or type(exc).__module__.startswith("aiohttp")):
                raise
            raise TransportError(
                f"read failed: {exc}", url=source.name, position=source.position
            ) from exc

    source = ChunkIteratorSource(chunks(), "<aiohttp response>", owner=reader)
    return source
