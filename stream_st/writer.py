"""The streaming writer: lays out a plan with the header core and drives a sink with arrays.

The plan (a list of :class:`~stream_st.TensorSpec`) fixes every byte before any data: the header
is written as soon as the writer opens, then each tensor's bytes go straight from the array's
memory to the sink. On a file tensors may come in any order (positioned writes); on a stream they
must come in header order. A tensor may come whole (:meth:`TensorWriter.write`) or as consecutive
pieces along its first axis (:meth:`TensorWriter.write_part`, :meth:`TensorWriter.tensor`).

The writer fails closed: any misuse, failed I/O, exception in the ``async with`` body or
cancellation aborts the whole message. A file destination is then left untouched (no file, or its
previous content, and no temporary file); a stream is closed so the peer sees an incomplete
message. On a stream the message's last byte is held back until the commit, so even a writer that
fails after every tensor went out leaves its peer one byte short, never with a complete message.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Literal, Self, TypeVar, Unpack

import anyio
import anyio.from_thread
import anyio.lowlevel
import numpy as np

from ._util import AsyncClosing, seen_through, task_group
from .core.arrays import as_array
from .core.digests import Digests, OrderedHash, digests_for, without_record
from .core.dtypes import _BUFFER_CHARS, DTYPES, NATIVE_IS_LITTLE, DType, dtype_for, wire_bytes
from .core.header import Header, TensorInfo
from .core.layout import TensorSpec, build_header
from .core.message import Order, lay_out, ordered
from .errors import (
    NAMES_SHOWN,
    ArgumentTypeError,
    TensorNotFoundError,
    TruncatedStreamError,
    UsageError,
    WriterError,
    boolean,
    integer_at_least,
    some_names,
)
from .transports.file.atomic import local_destination, save_at_once
from .transports.file.sink import NOT_STAGED, STAGED_WROTE, FileSink
from .transports.options import Clock, TransportOptions, clock_of
from .transports.registry import Sink, SinkLike, open_sink

__all__ = [
    "Order",
    "TensorParts",
    "TensorWriter",
    "lay_out",
    "local_destination",
    "open_writer",
    "run_stoppable",
    "save_at_once",
]

_NEW, _OPEN, _COMMITTED, _ABORTED = "new", "open", "committed", "aborted"

T = TypeVar("T")


Mode = Literal["whole", "part", "begin"]
"""How bytes are claimed: a whole tensor, its next part, or the start of a write in parts."""

GATHER_BELOW = 256 << 10
"""Whole tensors shorter than this, given to :meth:`TensorWriter.write_many` one after another
in the message (to a destination other than a local file, which stages them), are gathered:
copied into one buffer of up to :data:`GATHER_MAX` bytes, handed to the destination in one
write. What a small tensor costs is the work of each write (the sink's, the event loop's), not
its copy: 10,000 of 4 KiB make 40 writes instead of 10,000."""

GATHER_MAX = 1 << 20
"""The most bytes :meth:`TensorWriter.write_many` gathers into one write."""


def _describe(info: TensorInfo) -> str:
    """``info``'s dtype and shape, as messages show them."""
    return f"{info.dtype} {list(info.shape)}"


def _check_dtype(info: TensorInfo, array: np.ndarray[Any, Any]) -> DType:
    """The dtype planned for ``info``; :class:`~stream_st.WriterError` unless ``array`` has it."""
    planned = info.dtype_info
    if array.dtype == planned.numpy:  # most arrays: the planned dtype itself (packed: uint8)
        return planned
    if planned.packed:
        ok = False
    else:
        try:
            ok = dtype_for(array.dtype).code == planned.code  # another byte order
        except Exception:
            ok = False
    if not ok:
        raise WriterError(
            f"tensor {info.name!r:.80}: planned {_describe(info)} takes an array of dtype "
            f"{info.array_dtype}, got {array.dtype}",
            name=info.name,
        )
    return planned


def _whole_view(info: TensorInfo, value: Any) -> memoryview:
    """The bytes of ``value``, the whole tensor ``info``; :class:`~stream_st.WriterError` for
    another dtype or shape."""
    array = value if type(value) is np.ndarray else as_array(value, info.name)
    packed = _check_dtype(info, array).packed
    if array.shape != (info.array_shape if packed else info.shape):
        raise WriterError(
            f"tensor {info.name!r:.80}: planned {_describe(info)} takes an array of shape "
            f"{info.array_shape}, got {array.shape}",
            name=info.name,
        )
    return wire_bytes(array)


def _piece_view(info: TensorInfo, value: Any) -> memoryview:
    """The bytes of ``value``, rows of tensor ``info`` (``(rows, *rest)`` or one row ``rest``);
    :class:`~stream_st.WriterError` for another dtype or shape."""
    piece = value if type(value) is np.ndarray else as_array(value, info.name)
    _check_dtype(info, piece)
    shape = info.array_shape
    rest = shape[1:]
    rows = piece.ndim == len(shape) and piece.shape[1:] == rest
    if not (rows or piece.shape == rest):
        raise WriterError(
            f"tensor {info.name!r:.80}: a part of {_describe(info)} must have shape "
            f"(rows, *{rest}) or {rest}, got {piece.shape}",
            name=info.name,
        )
    return wire_bytes(piece)


class _Progress:
    """How far each tensor of ``header`` is claimed and written. On a stream (not
    ``random_access``) tensors are claimed in header order."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self._position: dict[str, int] | None = None  # on a stream: each name's index
        self._claimed: dict[str, int] = {}  # bytes handed out per started tensor
        self._done: dict[str, int] = {}  # bytes written per started tensor
        self._next = 0  # on a stream: index of the first tensor not fully claimed

    def written(self, name: str) -> int:
        """Bytes of tensor ``name`` written so far."""
        return self._done.get(name, 0)

    def complete(self, info: TensorInfo) -> bool:
        return self._done.get(info.name) == info.nbytes

    def wrote(self, name: str, count: int) -> None:
        """``count`` more bytes of tensor ``name`` (claimed before) are written."""
        self._done[name] += count

    def claim(self, info: TensorInfo, count: int, mode: Mode, random_access: bool) -> int:
        """Reserve the next ``count`` bytes of ``info``; returns their offset in the tensor."""
        name = info.name
        claimed = self._claimed.get(name)
        if claimed is not None and mode != "part":
            state = "written" if claimed == info.nbytes else "being written in parts"
            raise WriterError(f"tensor {name!r:.80} is already {state}", name=name)
        start = claimed or 0
        if start + count > info.nbytes:
            raise WriterError(
                f"tensor {name!r:.80}: parts add up to {start + count} bytes, more than the "
                f"{info.nbytes} bytes planned for {_describe(info)}",
                name=name,
            )
        if not random_access:
            if self._position is None:
                self._position = {name: i for i, name in enumerate(self.header.names())}
            index = self._position[name]
            if index != self._next and not (claimed is not None and count == 0):
                expected = self.header.tensors[self._next].name
                raise WriterError(
                    f"tensor {name!r:.80} is out of order: a stream takes tensors in header order "
                    f"and the next one is {expected!r:.80}",
                    name=name,
                )
        self._claimed[name] = start + count
        self._done.setdefault(name, 0)
        if not random_access:
            tensors = self.header.tensors
            while self._next < len(tensors) and self._claimed.get(tensors[self._next].name) == (
                tensors[self._next].nbytes
            ):
                self._next += 1
        return start

    def incomplete(self) -> WriterError | None:
        """The error for the tensors not completely written, if any."""
        done = self._done
        if len(done) == len(self.header) and sum(done.values()) == self.header.data_size:
            return None  # every tensor started, none past its size: every one complete
        missing = [t for t in self.header.tensors if not self.complete(t)]
        written = ", ".join(f"{self.written(t.name)} of {t.nbytes}" for t in missing[:NAMES_SHOWN])
        return WriterError(
            f"{len(missing)} tensor(s) not completely written when the writer closed: "
            f"{some_names([t.name for t in missing])} (written: {written} bytes)",
            name=missing[0].name,
        )


_STAGED_DTYPES: dict[str, np.dtype[Any]] = {
    code: d.kind
    for code, d in DTYPES.items()
    if NATIVE_IS_LITTLE
    and not d.packed
    and isinstance(d.kind, np.dtype)  # not ml_dtypes' (not imported for this)
    and d.kind.char in _BUFFER_CHARS
}
"""The dtypes whose arrays :class:`_Staged` takes: numpy's own (their buffer is their bytes on
the wire, in native byte order, little-endian), by code."""


class _Staged:
    """The quick way of a whole small tensor to a local file, the writer open and recording no
    digests: checked against its plan and copied into the sink's staging buffer
    (:meth:`~.transports.file.sink.FileSink.stage`) with no await and no object made.

    :meth:`put` does what it can at once, else nothing: the writer's general path then checks the
    array again (and raises what is wrong) or, for a write that does not join the staged ones,
    writes them and lets the event loop run other tasks. ``async def write`` of a tensor that
    awaits nothing costs the coroutine alone (a cancellation is seen at the next write of the
    staged bytes, or at the commit, as :class:`FileSink` says).
    """

    __slots__ = ("_claimed", "_codes", "_done", "_index", "_shapes", "_sink", "_starts")

    def __init__(self, header: Header, progress: _Progress, sink: FileSink) -> None:
        names, self._codes, self._shapes, starts, _ends = header.tensors.columns()
        data_start = header.data_start
        self._starts = [data_start + start for start in starts]  # in the file
        self._index = dict(zip(names, range(len(names)), strict=True))
        self._claimed, self._done = progress._claimed, progress._done
        self._sink = sink

    def put(self, name: str, array: Any) -> int:
        """Write the whole tensor ``name`` from ``array`` if it can be done at once, as
        :meth:`~.transports.file.sink.FileSink.stage` says (a write of the file meanwhile owes
        the event loop a turn); else do nothing (``NOT_STAGED``)."""
        index = self._index.get(name) if type(name) is str else None
        if index is None or type(array) is not np.ndarray or name in self._claimed:
            return NOT_STAGED
        planned = _STAGED_DTYPES.get(self._codes[index])
        if (
            planned is None
            or array.dtype != planned
            or array.shape != self._shapes[index]
            or not array.flags.c_contiguous
        ):
            return NOT_STAGED
        count = array.nbytes  # the planned size: the planned dtype and shape
        staged = self._sink.stage(self._starts[index], array.data, count)
        if staged != NOT_STAGED:
            self._claimed[name] = self._done[name] = count
        return staged


class TensorWriter(AsyncClosing):
    """One safetensors message being written. Create it with :func:`open_writer`.

    Use it as ``async with open_writer(dst, plan) as writer``: the header is written on entry, the
    message is committed on a clean exit (a file appears at its destination) and aborted on an
    exception. :attr:`header` is available at once, with every offset. ``clock`` holds the time
    limits of the write (see :func:`open_writer`); it starts when the writer opens.
    """

    def __init__(
        self,
        dst: SinkLike,
        plan: Iterable[TensorSpec],
        *,
        metadata: Mapping[str, str] | None = None,
        order: Order = "plan",
        fsync: bool = False,
        checksums: bool | str | Digests = False,
        clock: Clock | None = None,
        digests_up_front: Callable[[str], Digests | None] | None = None,
    ) -> None:
        specs = ordered(plan, order)
        self._digests = digests_for(checksums)
        self._specs, self._metadata = specs, metadata
        self._hashes: dict[str, OrderedHash] = {}  # with checksums: per started tensor
        self._digests_up_front = digests_up_front  # for a front-to-back sink; None: no digests
        self._prefix, self._header = build_header(specs, self._recorded(self._digests))
        self._dst = dst
        self._fsync = boolean("fsync", fsync)
        self._clock = clock or Clock()
        self._sink: Sink | None = None
        self._state = _NEW
        self._failure: BaseException | None = None
        self._progress = _Progress(self._header)  # bytes claimed and written per tensor
        self._last_send: anyio.Event | None = None  # on a stream: sends go out in claim order
        self._held = b""  # on a stream: the message's last byte, sent only on commit
        self._staged: _Staged | None = None  # open on a local file, no digests: the quick way

    # ------------------------------------------------------------------ state

    @property
    def header(self) -> Header:
        """The header this writer writes: names, dtypes, shapes and every offset."""
        return self._header

    @property
    def remaining(self) -> list[str]:
        """Names of the tensors not yet completely written, in header order."""
        return [t.name for t in self._header.tensors if not self._progress.complete(t)]

    @property
    def random_access(self) -> bool:
        """True when tensors may be written in any order (a file); False on a stream."""
        return self._require_sink().random_access

    def _require_sink(self) -> Sink:
        if self._sink is None:
            raise UsageError("the writer is not open: use 'async with open_writer(...)'")
        return self._sink

    def _check_usable(self) -> Sink:
        if self._state == _OPEN and self._sink is not None:
            return self._sink
        if self._state == _ABORTED:
            raise UsageError(self._aborted()) from self._failure
        if self._state == _COMMITTED:
            raise UsageError("the writer is closed: every tensor was already written")
        return self._require_sink()

    # ------------------------------------------------------------------ lifecycle

    async def open(self) -> Header:
        """Open the destination and write the header. Idempotent."""
        if self._state == _OPEN:
            return self._header
        if self._state != _NEW:
            raise UsageError("the writer is closed")
        self._clock.start()
        sink = await open_sink(self._dst, fsync=self._fsync, clock=self._clock)
        sink.clock.start()  # a lent connection brings the clock of its message
        self._sink, self._state = sink, _OPEN
        prefix = memoryview(self._prefix)
        try:
            digests = self._digests
            if digests is not None and not digests.values and not await sink.hold_head(len(prefix)):
                prefix = memoryview(await self._digests_first(sink, digests.algorithm))
            await sink.allocate(self._header.file_size)
            if sink.random_access:
                await sink.write_at(0, prefix)
                if (
                    isinstance(sink, FileSink)
                    and digests is None
                    and math.isinf(
                        sink.clock.remaining()  # no deadline to check at each write
                    )
                ):
                    self._staged = _Staged(self._header, self._progress, sink)
            else:
                if not self._header.data_size:  # nothing follows: hold back the header's end
                    prefix, self._held = prefix[:-1], bytes(prefix[-1:])
                await sink.send(prefix)
        except BaseException as exc:
            await self._abort(exc)
            raise
        return self._header

    async def aclose(self) -> None:
        """Commit: check that every tensor was written in full, then close the sink.

        A file is moved into place; a stream is flushed and left open. Raises
        :class:`~stream_st.WriterError` (and aborts) if any tensor is missing or incomplete.
        """
        if self._state == _COMMITTED:
            return
        if self._state == _NEW:
            self._state = _ABORTED
            return
        if self._state == _ABORTED:
            raise WriterError(self._aborted()) from self._failure
        self._staged = None  # committing: any write goes the general way, and is refused
        try:  # a small write to a file is no cancellation point: a cancellation shows here
            await anyio.lowlevel.checkpoint_if_cancelled()
        except BaseException as exc:
            await self._abort(exc)
            raise
        error = self._progress.incomplete()
        if error is not None:
            await self._abort(error)
            raise error
        sink = self._require_sink()
        try:
            if self._digests is not None:
                await self._seal_digests(sink)
            if self._held:
                await sink.send(memoryview(self._held))
                self._held = b""
            await sink.aclose()
        except BaseException as exc:
            await self._abort(exc)
            raise
        self._state = _COMMITTED

    async def _digests_first(self, sink: Sink, algorithm: str) -> bytes:
        """For a sink that cannot patch the header later: compute the digests now, if this
        writer knows how, and lay the header out with them."""
        if self._digests_up_front is None:
            raise UsageError(
                f"{sink.name} is written front to back: the header's digests cannot be "
                "patched in at the end, so give them up front "
                "(checksums=stream_st.Digests.compute(arrays), or save(), which does)"
            )
        self._digests = await anyio.to_thread.run_sync(self._digests_up_front, algorithm)
        # None: the caller would rather write no digests than none of the message (cp passing
        # a source's digests on, when it converts tensors and so would have to compute them).
        self._prefix, self._header = build_header(self._specs, self._recorded(self._digests))
        return self._prefix

    async def _seal_digests(self, sink: Sink) -> None:
        """Check the digests given up front against the bytes written, or patch the computed
        ones over the placeholders of the header written at the start."""
        assert self._digests is not None
        hashes, empty = self._hashes, self._digests.hasher().digest().hex()
        computed = {  # a tensor no piece was fed for is empty (its parts added up to nothing)
            info.name: hashes[info.name].hasher.digest().hex() if info.name in hashes else empty
            for info in self._header.tensors
        }
        given = self._digests.values
        if given:
            for info in self._header.tensors:
                if computed[info.name] != given[info.name]:
                    raise WriterError(
                        f"tensor {info.name!r:.80}: the bytes written do not match the "
                        f"{self._digests.algorithm} digest given for them",
                        name=info.name,
                    )
            return
        sealed = Digests(self._digests.algorithm, computed)
        prefix, header = build_header(self._specs, self._recorded(sealed))
        assert len(prefix) == len(self._prefix), "a digest changed the header's length"
        await sink.patch_head(memoryview(prefix))
        self._prefix, self._header = prefix, header

    def _recorded(self, digests: Digests | None) -> Mapping[str, str] | None:
        """The metadata to write: the caller's, with ``digests`` recorded in it (without them,
        the caller's less any digest record it holds, which describes other bytes)."""
        if digests is None:
            return without_record(self._metadata)
        return digests.add_to(self._metadata, [spec.name for spec in self._specs])

    async def abort(self) -> None:
        """Throw the message away: no file at the destination, or a closed stream."""
        await self._abort(None)

    def _aborted(self) -> str:
        """What an aborted writer says when used: why it was aborted."""
        why = "by abort()" if self._failure is None else f"({self._failure!r})"
        return f"the write was aborted {why}; nothing was committed"

    async def _abort(self, cause: BaseException | None) -> None:
        if self._state in (_ABORTED, _COMMITTED):
            return
        self._state, self._failure = _ABORTED, cause
        self._staged = None
        sink = self._sink
        if sink is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await sink.abort()
            except Exception as exc:
                if cause is None:
                    raise
                # Already failing (or cancelled): the first error is the one to report, with
                # what the abort left (an S3 upload that may still be pending) as its note.
                cause.add_note(str(exc))

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def _abandon(self, cause: BaseException) -> None:
        await self._abort(cause)

    # ------------------------------------------------------------------ writing

    async def write(self, name: str, array: Any) -> None:
        """Write the whole tensor ``name`` from ``array``.

        ``array`` must have the planned dtype (any byte order) and the shape the tensor is
        delivered as (:attr:`~stream_st.TensorInfo.array_shape`: packed F4/F6 as ``uint8``).
        Its memory is read until this returns and may be reused afterwards.
        """
        staged = self._staged
        if staged is not None:
            try:
                done = staged.put(name, array)
                if done == STAGED_WROTE:
                    await anyio.lowlevel.checkpoint()
            except BaseException as exc:
                await self._abort(exc)
                raise
            if done != NOT_STAGED:
                return
        await self._write(name, array, _whole_view, "whole")

    async def write_part(self, name: str, piece: Any) -> None:
        """Write the next rows of tensor ``name``: consecutive pieces along the first axis.

        ``piece`` has the tensor's dtype and shape ``(k, *rest)`` for ``k`` rows, or ``rest`` for
        one row, where ``rest`` is the delivered shape without its first axis. The running byte
        count is checked against the plan; going past it raises :class:`~stream_st.WriterError`.
        """
        await self._write(name, piece, _piece_view, "part")

    async def write_many(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """Write several whole tensors, given as a mapping or as ``(name, array)`` pairs, each as
        :meth:`write` writes it.

        On a local file each goes as :meth:`write` takes it (small tensors staged by the file,
        written a block at a time). On any other destination, tensors shorter than
        :data:`GATHER_BELOW` that follow each other in the message (given in header order) are
        copied into one buffer and written together, up to :data:`GATHER_MAX` bytes at a time:
        many small tensors cost a few writes of the destination, not one each. The arrays'
        memory is read until this returns.
        """
        sink = self._check_usable()
        pairs = _pairs(tensors)
        if self._staged is not None:
            try:
                for name, value in pairs:
                    await self.write(name, value)
            except BaseException as exc:
                await self._abort(exc)
                raise
            return
        gathered = _Gathered()
        try:
            for name, value in pairs:
                info = self._timely(sink, name)
                data = _whole_view(info, value)
                self._claim(info, len(data), "whole")
                offset = self._header.data_start + info.start
                if not gathered.takes(offset, len(data)):
                    await self._put_gathered(gathered)
                if len(data) >= GATHER_BELOW:
                    await self._send(info, 0, data)
                    continue
                if self._digests is not None:  # a small tensor: hashed at once
                    await self._hashes.setdefault(name, OrderedHash(self._digests.hasher())).turn()(
                        data
                    )
                gathered.add(offset, name, data)
            await self._put_gathered(gathered)
        except BaseException as exc:
            await self._abort(exc)
            raise

    async def _write(
        self,
        name: str,
        value: Any,
        view: Callable[[TensorInfo, Any], memoryview],
        kind: Literal["whole", "part"],
    ) -> None:
        """Check, place and send ``value`` for ``name``; any failure aborts the message."""
        sink = self._check_usable()
        try:
            info = self._timely(sink, name)
            data = view(info, value)
            start = self._claim(info, len(data), kind)
            await self._send(info, start, data)
        except BaseException as exc:
            await self._abort(exc)
            raise

    def _timely(self, sink: Sink, name: str) -> TensorInfo:
        """The planned tensor ``name``, once the sink's time limits are checked at the byte the
        tensor starts at in the message (where the sink writes in order, its own position)."""
        info = self._lookup(name)
        at = self._header.data_start + info.start if sink.random_access else sink.position
        sink.clock.check(sink.name, at)
        return info

    async def _send(self, info: TensorInfo, start: int, data: memoryview) -> None:
        """Send ``data``, claimed at ``start`` of tensor ``info``, hashed meanwhile if the
        writer records digests."""
        if self._digests is None:
            await self._put(info, start, data)
            return
        feed = self._hashes.setdefault(info.name, OrderedHash(self._digests.hasher())).turn()
        async with task_group() as group:
            group.start_soon(feed, data)
            await self._put(info, start, data)

    async def copy_from_file(
        self, name: str, source: int, at: int, origin: str = "", *, then: Sequence[str] = ()
    ) -> bool:
        """Write the whole tensor ``name`` from its bytes at offset ``at`` of the local file open
        as ``source`` (``origin``: its name, for errors), copied by the kernel, page cache to
        page cache: none of them passes through this process. ``then`` names tensors that follow
        it in the file being written with no gap, each after the one before, whose bytes follow
        its own in the source: they are copied with it, in one call (many small tensors copied
        one by one cost a thread's round trip each). Returns False, nothing done, where the
        destination is not a local file, or where the writer computes digests (which need the
        bytes): write the tensors' arrays instead. A source that ends first raises
        :class:`~stream_st.TruncatedStreamError`, one that is not an open regular file, or is
        the file being written, :class:`~stream_st.UsageError`, as does a tensor of ``then``
        that does not follow the one before; any of them aborts the message as any failed
        write."""
        sink = self._check_usable()
        try:
            source = integer_at_least("copy_from_file: the source's descriptor", source, 0)
            at = integer_at_least("copy_from_file: the offset", at, 0, " (bytes)")
            if source >= 2**31 or at >= 2**63:
                raise UsageError(
                    f"copy_from_file: no file has descriptor {source} or offset {at} (bytes)"
                )
            if isinstance(then, str) or not isinstance(then, Sequence):
                raise ArgumentTypeError(
                    f"copy_from_file: then= takes a sequence of names, got {type(then).__name__}"
                )
            if self._digests is not None or not sink.kernel_copies:
                return False
            run = [self._timely(sink, name)]
            for following in then:
                info, before = self._lookup(following), run[-1]
                if info.start != before.start + before.nbytes:
                    raise UsageError(
                        f"copy_from_file: tensor {following!r:.80} does not follow "
                        f"{before.name!r:.80} in the file being written"
                    )
                run.append(info)
            for info in run:
                self._claim(info, info.nbytes, "whole")
            first, count = run[0], run[-1].start + run[-1].nbytes - run[0].start
            copied = await sink.copy_in(source, at, self._header.data_start + first.start, count)
            if copied < count:
                short = next(i for i in run if i.start + i.nbytes - first.start > copied)
                raise TruncatedStreamError(
                    f"tensor {short.name!r:.80}",
                    name=short.name,
                    offset=at + copied,
                    expected=at + short.start + short.nbytes - first.start,
                    source=origin,
                )
            for info in run:
                self._progress.wrote(info.name, info.nbytes)
        except BaseException as exc:
            await self._abort(exc)
            raise
        return True

    def tensor(self, name: str) -> TensorParts:
        """``async with writer.tensor(name) as t: await t.write(rows)``: write one tensor in parts.

        Leaving the block checks that the parts added up to the whole tensor.
        """
        return TensorParts(self, name)

    def _lookup(self, name: str) -> TensorInfo:
        if not isinstance(name, str):
            raise ArgumentTypeError(f"tensor names are str, got {type(name).__name__} {name!r:.80}")
        try:
            return self._header[name]
        except TensorNotFoundError:
            raise WriterError(f"no tensor named {name!r:.80} in the plan", name=name) from None

    def _claim(self, info: TensorInfo, count: int, mode: Mode) -> int:
        """Reserve the next ``count`` bytes of ``info``; returns their offset in the tensor."""
        return self._progress.claim(info, count, mode, self._require_sink().random_access)

    async def _put(self, info: TensorInfo, start: int, data: memoryview) -> None:
        await self._put_at(self._header.data_start + info.start + start, data)
        self._progress.wrote(info.name, len(data))

    async def _put_gathered(self, gathered: _Gathered) -> None:
        """Send the tensors gathered, if any, in one write."""
        if gathered.members:
            members, data = gathered.members, gathered.buffer
            gathered.members, gathered.buffer = [], bytearray()
            await self._put_at(gathered.at, memoryview(data))
            for name, count in members:
                self._progress.wrote(name, count)

    async def _put_at(self, offset: int, data: memoryview) -> None:
        """Send ``data``, the message's bytes from ``offset``."""
        sink = self._require_sink()
        count = len(data)
        if count and sink.random_access:
            await sink.write_at(offset, data)
        elif count:
            if offset + count == self._header.file_size:
                # The message's last byte waits for the commit: a stream whose writer fails
                # after sending everything still ends one byte short, never complete.
                data, self._held = data[:-1], bytes(data[-1:])
            previous, mine = self._last_send, anyio.Event()
            self._last_send = mine
            try:
                if previous is not None:
                    await previous.wait()
                self._check_usable()
                await sink.send(data)
            finally:
                mine.set()


def _pairs(tensors: object) -> Iterator[tuple[str, Any]]:
    """The ``(name, array)`` pairs of ``tensors``, a mapping or an iterable of pairs; an
    :class:`~stream_st.ArgumentTypeError` for anything else, as the pairs come."""
    if isinstance(tensors, Mapping):
        yield from tensors.items()
        return
    if isinstance(tensors, str | bytes) or not isinstance(tensors, Iterable):
        raise ArgumentTypeError(
            f"write_many takes {{name: array}} or (name, array) pairs, got {type(tensors).__name__}"
        )
    for pair in tensors:
        try:
            name, value = pair  # a tuple, a list: what unpacks into two, as before
        except (TypeError, ValueError):
            raise ArgumentTypeError(
                f"write_many takes (name, array) pairs, got {pair!r:.80}"
            ) from None
        yield name, value


class _Gathered:
    """Small whole tensors that follow each other in the message, copied into one buffer to be
    written together (copied: a caller may refill the same array for the next one): see
    :meth:`TensorWriter.write_many`."""

    def __init__(self) -> None:
        self.at = 0  # the message's offset of the buffer's first byte
        self.buffer = bytearray()
        self.members: list[tuple[str, int]] = []  # each tensor's name and byte count

    def takes(self, offset: int, count: int) -> bool:
        """Whether ``count`` bytes at ``offset`` may join (none gathered yet, or they follow
        and fit) without the tensors gathered being written first."""
        return not self.members or (
            count < GATHER_BELOW
            and offset == self.at + len(self.buffer)
            and len(self.buffer) + count <= GATHER_MAX
        )

    def add(self, offset: int, name: str, data: memoryview) -> None:
        if not self.members:
            self.at = offset
        self.buffer += data
        self.members.append((name, len(data)))


class TensorParts:
    """One tensor written in consecutive pieces; see :meth:`TensorWriter.tensor`."""

    def __init__(self, writer: TensorWriter, name: str) -> None:
        self._writer = writer
        self.name = name

    @property
    def info(self) -> TensorInfo:
        """The tensor's entry in the header."""
        return self._writer.header[self.name]

    @property
    def written(self) -> int:
        """Bytes of this tensor written so far."""
        return self._writer._progress.written(self.name)

    @property
    def remaining(self) -> int:
        """Bytes of this tensor still to write."""
        return self.info.nbytes - self.written

    async def write(self, piece: Any) -> None:
        """Write the next rows; see :meth:`TensorWriter.write_part`."""
        await self._writer.write_part(self.name, piece)

    async def __aenter__(self) -> TensorParts:
        writer = self._writer
        writer._check_usable()
        try:
            writer._claim(writer._lookup(self.name), 0, "begin")
        except BaseException as exc:
            await writer._abort(exc)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        writer = self._writer
        if exc is not None:
            await writer._abort(exc)
            return
        if writer._state == _OPEN and self.remaining:
            info = self.info
            error = WriterError(
                f"tensor {self.name!r:.80}: parts add up to {self.written} bytes, fewer than the "
                f"{info.nbytes} bytes planned for {_describe(info)}",
                name=self.name,
            )
            await writer._abort(error)
            raise error


def open_writer(
    dst: SinkLike,
    plan: Iterable[TensorSpec],
    *,
    metadata: Mapping[str, str] | None = None,
    order: Order = "plan",
    fsync: bool = False,
    checksums: bool | str | Digests = False,
    **options: Unpack[TransportOptions],
) -> TensorWriter:
    """Write a safetensors message to ``dst`` following ``plan``, tensor by tensor.

    ``dst`` is a path (``str``, ``os.PathLike``, ``file://`` URL), ``tcp://host:port``,
    ``http(s)://`` (a PUT upload), ``s3://bucket/key`` (a multipart upload), a
    :class:`~stream_st.Connection` (its next message), an anyio ``ByteSendStream``, an asyncio
    ``StreamWriter`` or a :class:`~stream_st.sinks.Sink`. Time
    limits as in :func:`~stream_st.open_stream`: ``timeout`` bounds connecting and each wait for
    the destination to take bytes, ``deadline`` the whole write from opening to the last tensor,
    ``speed_limit``/``speed_time`` a transfer that stays too slow; ``headers`` and ``ssl_context``
    as there, for an HTTP or S3 destination. ``plan`` lists every tensor as a
    :class:`~stream_st.TensorSpec` (dtype as a safetensors code or a numpy dtype, ml_dtypes'
    bfloat16 and float8 types included); ``order="reference"`` sorts it as the reference writer
    does. ``metadata`` (``str`` to ``str``) is the header's ``__metadata__``; a digest record
    copied into it (the ``stream_st.digest`` keys, which the new file's bytes would fail) is
    left out without ``checksums``, and is a :class:`~stream_st.UsageError` with it (it records
    the new file's). The header is built (and a bad plan refused) right away and written when
    the writer opens.

    A file is written to a hidden temporary file beside ``dst`` and renamed into place only when
    every tensor has been written; tensors may come in any order. On a stream they must come in
    header order, and the stream is left open after a complete message. Any error aborts the
    message: see :class:`TensorWriter`. ``fsync=True`` flushes the temporary file to stable
    storage before the rename, and the directory after it (best effort: the file is in place,
    an error there is ignored), so that after a power loss ``dst`` holds the old file or the
    whole new one; other destinations (streams, uploads, a FIFO) ignore it.

    ``checksums=True`` (or an algorithm's name, see :data:`stream_st.integrity.ALGORITHMS`)
    records a digest of every tensor in ``__metadata__``, computed while the bytes go out; the
    header is written with placeholders and the digests are patched in at the commit, which a
    file and an S3 upload allow. A destination written front to back (a socket, a pipe, an HTTP
    upload) needs them up front: pass a :class:`~stream_st.Digests` (``Digests.compute(arrays)``),
    which is also checked against the bytes written before the commit. Without them such a
    destination is a :class:`~stream_st.UsageError`.
    """
    clock = clock_of(options)
    return TensorWriter(
        dst, plan, metadata=metadata, order=order, fsync=fsync, checksums=checksums, clock=clock
    )


async def run_stoppable(work: Callable[..., T], inline: bool = False) -> T:
    """``work(stop=...)`` in a worker thread, the event loop free meanwhile; ``work`` asks
    ``stop()`` as it goes (as :func:`save_at_once` does).

    Cancelled (by a cancel scope, or asyncio's own ``Task.cancel``: ``asyncio.timeout``,
    ``wait_for``), the call waits for the thread: ``stop()`` says true from then on, and the
    work ends as it does on any error (a write at once removes its temporary file), or has
    committed already (then, under a cancel scope, its result is returned: see
    :func:`~stream_st._util.seen_through`). Either way nothing of the work is left running once
    the call has ended: the destination holds the old file or the whole new one (a caller that
    timed out may retry, or clean up, at once).

    ``inline``: quick work (a small file) runs on the event loop's thread instead, after a
    turn of the loop (where a cancellation shows): handing it to a worker and back cost more
    than the work (``save`` of 100 tensors of 4 KiB: 0.59x the reference's ``save_file``
    through a thread, 0.92x here, quiet machine)."""
    if inline:
        await anyio.lowlevel.checkpoint()
        return work(stop=lambda: False)
    called_off = False

    def stop() -> bool:
        return called_off

    def call_off(_: anyio.CancelScope) -> None:
        nonlocal called_off
        called_off = True  # the thread stops before its next block (or has committed)

    return await seen_through(
        lambda: anyio.to_thread.run_sync(functools.partial(work, stop=stop)), call_off
    )
