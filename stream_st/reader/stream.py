"""One safetensors file read as a stream: :class:`TensorStream`, which drives a source through
the header core and yields numpy arrays (torch tensors with ``framework="pt"``)."""

from __future__ import annotations

import contextlib
import os
import reprlib
import sys
import weakref
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Collection,
    Generator,
    Iterable,
)
from itertools import compress
from typing import TYPE_CHECKING, Any, Generic, NoReturn, Self, TypeVar, final

import anyio
import numpy as np

from .._util import AsyncClosing
from ..core.header import (
    DEFAULT_MAX_HEADER_SIZE,
    Header,
    TensorInfo,
    TensorTable,
    UnknownDtypes,
    refuse_unreadable,
    run_steps,
)
from ..core.stats import LoadStats, record_last
from ..core.steps import slices
from ..errors import (
    ArgumentTypeError,
    IntegrityError,
    TensorNotFoundError,
    TrailingDataError,
    TransportError,
    UsageError,
    boolean,
    rebuilt,
    some_names,
)
from ..memory.delivery import Delivery
from ..memory.recycle import Recycler
from ..transports.file.readahead import ReadAhead
from ..transports.file.source import FileSource
from ..transports.options import Clock
from ..transports.registry import Source, SourceLike
from .ahead import READ_AHEAD_FROM, _read_ahead
from .caps import Caps
from .header import check_size, header_cap, open_under, start_and_read_header
from .tensors import _read_tensor, merge_ranges
from .turns import give_turn, run_in_turns

Include = Collection[str] | Callable[[str], bool] | str | None
"""Which tensors to deliver: ``None`` for all, names, or a predicate on the name."""


T = TypeVar("T")

# What a TensorStream hands out for each tensor: a numpy array (a bare ``TensorStream``) or, read
# with framework="pt", a torch.Tensor. typing's TypeVar takes a default from Python 3.13 on;
# checkers know typing_extensions' (their own stubs: it is not imported when the code runs).
if TYPE_CHECKING:
    from typing_extensions import TypeVar as DefaultTypeVar

    from ..core.digests import Hasher, ObjectDigest

    TensorT = DefaultTypeVar("TensorT", covariant=True, default=np.ndarray[Any, Any])
else:
    TensorT = TypeVar("TensorT", covariant=True)


async def tensor_dict(stream: AsyncIterable[tuple[str, T]]) -> dict[str, T]:
    """Every ``(name, tensor)`` of ``stream`` in a dict. A step that fails lets go of the tensors
    read so far before its error propagates: the failed call's frames can outlive it (under
    ``asyncio.run`` its task and the error hold each other, through the traceback, until the
    cyclic garbage collector runs), and held there they would keep those tensors, and with
    views of a mapped file that file's descriptor, open after the call failed."""
    tensors: dict[str, T] = {}
    try:
        async for name, tensor in stream:
            tensors[name] = tensor
            del tensor  # held by the dict alone
    except BaseException:
        tensors.clear()
        raise
    return tensors


def include_names(include: Iterable[str] | str, argument: str = "include=") -> set[str]:
    """The names an ``include=`` other than a predicate (or None) lists: one name, or a
    collection of them; :class:`~stream_st.ArgumentTypeError` for anything else (a number, a
    list of lists, bytes, a collection holding other than strings), naming ``argument`` (the
    caller's parameter taking names as ``include=`` does)."""
    if isinstance(include, str):
        return {include}
    wrong = f"{argument} takes a tensor name, a collection of names or a predicate on the name"
    if isinstance(include, bytes | bytearray | memoryview):  # iterated, its bytes' numbers
        raise ArgumentTypeError(f"{wrong}, got bytes {reprlib.repr(include)}: names are str")
    try:
        names = set(include)
    except TypeError:  # not iterable, or names that cannot be names (a list in the list)
        raise ArgumentTypeError(f"{wrong}, got {reprlib.repr(include)}") from None
    others = [name for name in names if not isinstance(name, str)]
    if others:
        raise ArgumentTypeError(
            f"{wrong}: names are str, got {type(others[0]).__name__} {reprlib.repr(others[0])}"
        )
    return names


Listed = set[str] | Callable[[str], bool] | None
"""An ``include=`` as :func:`listed` keeps it: its names in a set, a predicate, or None."""


def listed(include: Include) -> Listed:
    """``include=`` with its names taken once, checked (:func:`include_names`): an iterator
    would be spent by a second look; a predicate or None as it is."""
    return include if include is None or callable(include) else include_names(include)


def _selector(include: Listed, header: Header) -> Callable[[str], bool]:
    if include is None:
        return lambda name: True
    if callable(include):
        return include
    missing = sorted(n for n in include if n not in header)
    if missing:
        raise TensorNotFoundError(
            f"include= names tensors not in the header: {some_names(missing)}"
        )
    return include.__contains__


def _kept(column: list[T], taken: list[bool]) -> list[T]:
    """The items of ``column`` whose place in ``taken`` is True."""
    return list(compress(column, taken))


@final
class ObjectOnly:
    """The type of :data:`OBJECT_ONLY`."""

    def __repr__(self) -> str:
        return "OBJECT_ONLY"


OBJECT_ONLY = ObjectOnly()
"""A :class:`TensorStream`'s ``verify=`` for a reader that checks the header's per-tensor digests
itself, each tensor's (``stream_st.tools.validate``): the stream checks the whole object's digest
(:meth:`Source.object_digest`) as ``verify=True`` does, and no tensor's. Not a value the public
``verify=`` takes."""


class TensorStream(AsyncClosing, Generic[TensorT]):
    """One safetensors file read as a stream. Create it with :func:`open_stream`.

    Use it as ``async with open_stream(src) as stream`` to see ``stream.header`` before any data,
    then ``async for name, array in stream``; or iterate it directly, which opens and closes it
    (after a ``break``, once the event loop finalises the iteration: trio then warns with a
    ``ResourceWarning``, so under trio leave early only from inside ``async with``).
    Arrays are fresh, writable, native-endian and handed over to the caller: the stream keeps no
    reference to them (with ``copy=False``, a local file's are read-only views of its mapping, see
    :func:`open_stream`). ``clock`` holds the time limits of the read (see :func:`open_stream`);
    it starts when the stream opens. ``delivery`` says where tensors land and what they are
    handed out as (see ``framework=`` and ``into=`` of :func:`open_stream`); the type parameter
    says which (``TensorStream[torch.Tensor]``; a bare ``TensorStream`` hands out numpy arrays).
    ``max_tensor_bytes`` and ``max_total_bytes`` cap what the read may allocate (see
    :func:`open_stream`). ``verify`` checks the header's digests, if it has any, and the whole
    object's digest when its transport gives one and every tensor is read
    (:meth:`Source.object_digest`); after the read, ``object_check`` says how that went (None:
    the transport gave no digest). :data:`OBJECT_ONLY` checks the whole object's digest alone.
    ``stats`` (a :class:`~stream_st.LoadStats`) counts the bytes, tensors and time of the read.
    ``unknown_dtypes="keep"`` (for a read of the header alone) keeps a tensor of a dtype code
    stream_st does not know (see :func:`~stream_st.core.header.parse_header`); iterating over
    such a tensor raises :class:`~stream_st.UnknownDtypeError`.
    """

    def __init__(
        self,
        source: SourceLike,
        *,
        include: Include = None,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        verify: bool | ObjectOnly = True,
        clock: Clock | None = None,
        delivery: Delivery | None = None,
        copy: bool = True,
        max_tensor_bytes: int | None = None,
        max_total_bytes: int | None = None,
        unknown_dtypes: UnknownDtypes = "refuse",
    ) -> None:
        self._caps = Caps.of(max_tensor_bytes, max_total_bytes)
        self._unknown_dtypes: UnknownDtypes = unknown_dtypes
        self._source_like = source
        self._include = listed(include)  # looked at more than once: an iterator's names kept
        self._delivery = delivery or Delivery()
        self._max_header_size = header_cap(max_header_size)
        self._verify = verify if isinstance(verify, ObjectOnly) else boolean("verify", verify)
        self._copy = boolean("copy", copy)
        self._clock = clock or Clock()
        self._source: Source | None = None
        self._header: Header | None = None
        self._opening: _Opening | None = None  # the open under way, which others wait for
        self._iterated = False
        # The iteration, held weakly: a strong reference would make a cycle (its frame holds
        # the stream), so one left with 'break' outside 'async with' would be closed, its file
        # and read-ahead threads released, only when the cycle collector runs. Held strongly
        # too (``_held``) when the stream was open before it began ('async with'): leaving the
        # block closes it then, so what it holds (the array handed out last, tensors read
        # ahead) goes at once, not when the loop gets a turn to finalise it after a 'break'.
        self._generator: weakref.ref[AsyncGenerator[tuple[str, TensorT]]] | None = None
        self._held: AsyncGenerator[tuple[str, TensorT]] | None = None
        self._reading: ReadAhead | None = None  # the iteration's read-ahead, if it has one
        self._cut: str | None = None  # the source's name, once aclose cut the iteration short
        self._recycler = Recycler()  # fresh memory the caller has let go of, for later tensors
        self._closed = False
        self._pid: int | None = None  # the process that opened it (see _check_here)
        self._head: tuple[bytes, memoryview] | None = None  # the prefix and header, as read
        self.object_check: str | None = None
        self.stats = LoadStats()

    @property
    def header(self) -> Header:
        """The validated header; available once the stream is open."""
        if self._header is None:
            raise UsageError("the header is read when the stream opens: use 'async with' first")
        return self._header

    @property
    def head(self) -> tuple[bytes, memoryview] | None:
        """The 8-byte length prefix and the header's bytes as the stream read them, padding
        kept: once open, until an iteration starts (which lets them go); None otherwise."""
        return self._head

    def selected(self) -> list[TensorInfo]:
        """The tensors an iteration hands out (those ``include=`` selects), in the order it hands
        them out; the stream must be open. Raises as the iteration does before it reads any:
        ``include=`` naming a tensor the header lacks, a tensor over the caps
        (``max_tensor_bytes``, ``max_total_bytes``), one of a dtype with no reader."""
        header = self.header
        selected = _selector(self._include, header)
        return list(run_steps(self._checked(header, selected, self.source.name))[0])

    def _checked(
        self, header: Header, selected: Callable[[str], bool], name: str
    ) -> Generator[None, None, tuple[TensorTable, int]]:
        """The tensors of ``header`` that ``selected`` takes and the bytes they declare (read
        from ``name``, for a message), refused
        as a whole where one of them cannot be read or is over the caps (before anything is
        allocated for them): a generator that yields between two slices of a big header's
        tensors (:func:`slices`), where the loop gets its turn (:func:`run_in_turns`). They are
        a table: a list of as many :class:`TensorInfo` would be that many objects made in a
        row, and full passes of the garbage collector over them (tens of milliseconds each)."""
        wanted = header.tensors
        if self._include is not None:
            taken: list[bool] = []
            for names in slices(wanted.names()):
                taken += map(selected, names)
                yield
            names, codes, shapes, starts, ends = wanted.columns()
            wanted = TensorTable(
                _kept(names, taken),
                _kept(codes, taken),
                _kept(shapes, taken),
                _kept(starts, taken),
                _kept(ends, taken),
            )
        if header.unreadable:
            for part in slices(wanted):
                refuse_unreadable(part)
                yield
        total = 0
        for part in slices(wanted):
            total = self._caps.tally(part, name, total)
            yield
        return wanted, self._caps.check_total(total, name)

    @property
    def source(self) -> Source:
        """The open source the stream reads; in the process that opened it only."""
        self._check_here()
        if self._source is None:
            raise UsageError("the stream is not open")
        return self._source

    async def open(self, *, read_all: bool = False) -> Header:
        """Open the source, read and validate the header. Idempotent: a call made while another
        task's open is under way waits for it and gets its header (also where the stream was
        closed since: an iteration's end), or raises an error of its own like that open's (its
        class, message and attributes), from it (where that open was cancelled instead, it
        opens the stream itself, unless that open closed it: then a
        :class:`~stream_st.UsageError`, as for any closed stream). In a copy of the process
        that opened it made by ``os.fork()``, a :class:`~stream_st.UsageError` (see
        :meth:`_check_here`).

        ``read_all`` promises that every tensor will be read next, so a ranged transport may
        fetch everything with its first request.
        """
        self._check_here()
        while True:
            if self._closed:
                raise UsageError("the stream is closed")
            if self._header is not None:
                return self._header
            opening = self._opening
            if opening is None:
                break
            await opening.done.wait()
            header, error = opening.header, opening.failed
            opening = None  # held by its frame, its error would be in a cycle
            if header is not None:  # the stream may be closed since (an iteration's end)
                return header
            if error is not None:  # not raised itself: each raise would add to its traceback
                try:  # (this task's frames kept with it) and set its context (this task's)
                    raise rebuilt(error) from error
                finally:
                    del error
        opening = self._opening = _Opening()
        self._pid = os.getpid()
        try:
            header = opening.header = await self._open(read_all=read_all)
            return header
        except Exception as exc:
            opening.failed = exc
            raise
        finally:
            self._opening = None
            opening.done.set()
            del opening

    async def _open(self, *, read_all: bool) -> Header:
        """:meth:`open`'s work, one task at a time: open the source and read the header."""
        self.stats.begin()
        source = await open_under(self._source_like, self._clock)
        if self._closed:  # closed from another task while the source was being opened
            await source.aclose()
            raise _closed_opening(source)
        self._source = source
        try:
            self._header, self._head = await start_and_read_header(
                source, self._max_header_size, self._unknown_dtypes, read_all=read_all
            )
            if self._closed:  # meanwhile, where the source's read was let finish (a producer's)
                raise _closed_opening(source)
            self.stats.received(self._header.data_start)
        except BaseException:
            await self.aclose()
            raise
        return self._header

    async def aclose(self) -> None:
        """Close the source. Bytes not yet read stay unread. An iteration left part way (a
        ``break``) is closed first, so nothing still reads from the source (a local file's
        read-ahead threads are stopped and waited for). In a copy of the process that opened
        it made by ``os.fork()``, only lets the copy go (see :meth:`_let_go`)."""
        if not self._here():
            self._let_go()
            return
        self._closed = True
        await self._close_iteration()
        self._recycler = Recycler()  # no later tensor: let memory kept for one go
        source, self._source = self._source, None
        if source is not None:
            header = self._header
            if header is not None and source.position >= header.file_size:
                source.message_read()  # every byte taken (a break on the last tensor): done
            record_last(self.stats)
            await source.aclose()

    async def __aenter__(self) -> Self:
        await self.open()
        return self

    async def _close_iteration(self) -> None:
        """Close an iteration left part way, if any (its ``finally`` blocks run now), and stop
        its read-ahead threads and wait for them in any case: also where the iteration is
        running in another task at this moment (which then meets the closed source), or was
        dropped after a ``break`` and waits for the loop to close it. In a copy of the process
        that opened the stream made by ``os.fork()``, only lets the copy go (see
        :meth:`_let_go`)."""
        if not self._here():
            self._let_go()
            return
        alive, self._generator = self._generator, None
        held, self._held = self._held, None
        generator = held if alive is None else alive()
        if generator is not None and not getattr(generator, "ag_running", False):
            if getattr(generator, "ag_frame", None) is not None:  # not at its end: cut short
                self._cut = self._shown_name()
            await generator.aclose()
        reading, self._reading = self._reading, None
        if reading is not None:
            await reading.close()

    def __iter__(self) -> NoReturn:
        """Refused, where a plain ``for`` was a bare ``TypeError``: iterate with ``async for``."""
        raise UsageError("a TensorStream is an async iterator: use `async for`")

    def __aiter__(self) -> AsyncIterator[tuple[str, TensorT]]:
        self._check_here()
        if self._iterated:
            raise UsageError("a TensorStream can be iterated only once")
        self._iterated = True
        generator = self._iterate()
        self._generator = weakref.ref(generator)
        if self._opened():  # closed with the stream, which 'async with' does (see __init__)
            self._held = generator
        return _Iteration(generator, self)

    def _here(self) -> bool:
        """Whether this is the process that opened the stream (or it was not opened yet), not
        a copy of it made by ``os.fork()``."""
        return self._pid is None or self._pid == os.getpid()

    def _check_here(self) -> None:
        """:class:`~stream_st.UsageError` in a copy of the process that opened the stream made by
        ``os.fork()``, before anything of the stream is touched: its source's connections are
        the parent's sockets (each process would take part of the bytes of one response), and
        a local file's read-ahead threads run in the parent alone (a step would wait for them
        for ever)."""
        if not self._here():
            raise UsageError(
                f"{self._shown_name()}: this stream was opened in another process, of which "
                "this one is a copy made by os.fork() (a DataLoader worker is one): its "
                "connections and read-ahead threads stayed there. Open it again in this process "
                "(in a DataLoader worker: in worker_init_fn, or on first use in __getitem__)"
            )

    def _let_go(self) -> None:
        """Close the stream in a copy of the process that opened it made by ``os.fork()``:
        let go of the copy's references to its iteration and source, touching neither (their
        connections are the parent's, their read-ahead threads run there alone)."""
        self._closed = True
        self._generator = self._held = None
        self._reading = None
        self._source = None
        self._recycler = Recycler()

    def _shown_name(self) -> str:
        """The name of what this stream reads, for a message."""
        if self._source is not None:
            return self._source.name
        given = self._source_like
        return os.fspath(given) if isinstance(given, str | os.PathLike) else "<stream>"

    def _after_end(self, failed: type[BaseException] | None, finalized: bool) -> None:
        """The iteration ended: :class:`~stream_st.TransportError` if :meth:`aclose` cut it
        short (from another task, or from the loop's body), :class:`~stream_st.UsageError` if a
        step raised before (``failed``, the error's class: a timeout caught around it, say) or
        if it was closed from outside before this step (``finalized``: by the event loop it
        began in, which ended and closed the async generators it had seen), not the end of the
        tensors."""
        if self._cut is not None:
            raise _closed_early(self._cut) from None
        if failed is not None:
            raise UsageError(
                f"{self._shown_name()}: this stream's iteration failed ({failed.__name__}) "
                "and cannot go on: open the source again to read it"
            ) from None
        if finalized:
            raise UsageError(
                f"{self._shown_name()}: the iteration was closed by its event loop (finalized) "
                "before its end: step it from one event loop (asyncio.run() for each step ends "
                "the loop, which closes it), or open the source again to read it"
            ) from None

    def _check_open(self, name: str) -> None:
        """:class:`~stream_st.TransportError` ("closed on this side", naming ``name``) if the
        stream was closed, by another task while this one's iteration waited."""
        if self._closed:
            raise _closed_early(name)

    def _opened(self) -> bool:
        """Whether the stream was opened (``async with``) before its iteration began."""
        return self._header is not None

    async def _iterate(self) -> AsyncGenerator[tuple[str, TensorT]]:
        self.stats.asked(first=True)
        owns = self._header is None
        # Iterated without 'async with' and nothing to skip: every byte will be read.
        header = await self.open(read_all=owns and self._include is None)
        self._check_open(self._shown_name())  # closed by another task since the open waited for
        name = self.source.name
        try:
            selected = _selector(self._include, header)
            self._delivery.check(header.names())
            async with contextlib.aclosing(self._tensors(header, selected)) as items:
                async for item in items:
                    if self._closed:  # by another task during the step: no array of a closed
                        raise _closed_early(name)  # stream (a view of its mapping, say)
                    self.stats.handed(header[item[0]].nbytes)
                    yield item
                    del item  # hold no array while the next one is read
                    self.stats.asked()
        except IntegrityError:
            with anyio.CancelScope(shield=True):
                await self._refuted()
            raise
        finally:
            if owns:
                self._generator = self._held = None  # this one: ending, not closed again
                await self.aclose()

    async def _refuted(self) -> None:
        """Bytes read failed the file's own digests (:class:`~stream_st.IntegrityError`), the
        source still open: a stream that keeps what it reads (a cache's copy) lets go of it."""

    async def _tensors(
        self, header: Header, selected: Callable[[str], bool]
    ) -> AsyncGenerator[tuple[str, Any]]:
        source = self.source
        delivery = self._delivery
        base = header.data_start
        wanted, total = await run_in_turns(self._checked(header, selected, source.name))
        digests = None
        if self._verify is True and header.metadata:  # digests are kept in the metadata
            from ..core.digests import Digests

            digests = await run_in_turns(Digests.from_header_steps(header))
        ranges: list[tuple[int, int]] = []
        for part in slices(wanted):
            merge_ranges(((base + t.start, base + t.end) for t in part), ranges)
            await give_turn()
        self._check_open(source.name)  # closed by another task during those turns
        mapped = (
            None
            if self._copy or not isinstance(source, FileSource)
            else source.map(private=delivery.writable)
        )
        if mapped is None:
            await source.plan_reads(ranges)
        else:
            mapped.plan(ranges)
        whole = await self._object_hash(len(wanted) == len(header.tensors))
        hasher = None if whole is None else whole[1]
        if (
            mapped is None
            and hasher is None
            and isinstance(source, FileSource)
            and total >= READ_AHEAD_FROM
        ):
            ahead = _read_ahead(
                source, wanted, base, delivery, self._recycler, self._started_reading, digests
            )
            async with contextlib.aclosing(ahead) as items:
                async for item in items:
                    yield item
                    del item
            return
        stop = source.clock.deadline_stop(source.name)
        for info in wanted:
            source.clock.check(source.name, source.position)
            await give_turn()
            await skip_to(source, header, base + info.start)  # a loss there named as such
            target = delivery.target(info)
            if mapped is None or target is not None:
                array = await _read_tensor(
                    source, info, base, target, digests, hasher, self._recycler.take
                )
            else:
                array = await mapped.view(info, base)
                if digests is not None:  # a local file: no whole-object digest to feed
                    await digests.check_view(info.name, array, source.name, stop)
            if sys.byteorder == "big" and array.dtype.itemsize > 1:  # pragma: no cover
                array.byteswap(inplace=True)
            yield info.name, delivery.deliver(info, array, target is not None)
            del array
        await self._finish(header)
        if whole is not None:
            digest, hasher = whole
            digest.check(hasher, source.name)
            self.object_check = f"{digest.label}: verified"

    def _started_reading(self, ahead: ReadAhead) -> None:
        self._reading = ahead  # stopped by a close, also one from another task

    async def _object_hash(self, every_byte: bool) -> tuple[ObjectDigest, Hasher] | None:
        """The whole object's digest, if its transport gives one and the read will take every
        byte, with a hasher already fed the prefix and the header; None otherwise."""
        head, self._head = self._head, None
        if self._verify is False or not every_byte or head is None:
            return None
        digest = await self.source.object_digest()
        if digest is None:
            return None
        if digest.new is None:
            self.object_check = f"{digest.label}: not checked, {digest.reason}"
            return None
        from ..core.digests import hash_view

        hasher = digest.new()
        hasher.update(head[0])
        await hash_view(hasher, head[1])
        return digest, hasher

    async def _finish(self, header: Header) -> None:
        """Consume the message's tail; a whole object must end right after it."""
        source = self.source
        if source.random_access:
            return  # size checked against the header at open
        end = header.file_size
        await skip_to(source, header, end)
        if source.whole_object and not await source.at_end():
            raise TrailingDataError(f"{source.name}: bytes follow the last tensor at byte {end}")
        source.message_read()


class _Opening:
    """A stream's open under way: ``done`` once it ended, ``header`` the header it read,
    ``failed`` its error if that is an :class:`Exception` (a cancellation, or an interrupt, is
    the opening task's alone)."""

    __slots__ = ("done", "failed", "header")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.header: Header | None = None
        self.failed: Exception | None = None


async def skip_to(source: Source, header: Header, offset: int) -> None:
    """Move a sequential ``source`` ahead to the absolute ``offset`` of ``header``'s file,
    discarding the bytes before it; :class:`~stream_st.TruncatedStreamError` if it ends
    first, naming the tensor its bytes ran out in (one skipped, not the next one asked for nor
    the file's last) and that tensor's end as the byte expected. A source that jumps (random
    access) is left where it is: its reads go where they ask. Every loop reading chosen
    tensors, or rows of them, from a stream skips the bytes between them through this."""
    if not source.random_access and source.position < offset:
        await source.skip(offset - source.position)
        if source.position < offset:  # short of the file's end: check_size raises
            check_size(header, source.position, source.name)


def _closed_opening(source: Source) -> TransportError:
    """The error of an open whose stream was closed (from another task) before it ended."""
    return TransportError(
        "open failed: the stream was closed on this side", url=source.name, position=source.position
    )


def _closed_early(name: str) -> TransportError:
    """The error of an iteration's step after its stream, reading ``name``, was closed (from
    another task, or from the loop's body) before the end."""
    return TransportError("the stream was closed on this side before its end", url=name)


class _Iteration(Generic[TensorT]):
    """The iteration of a :class:`TensorStream`: its generator, and an error in place of the
    end where the stream's :meth:`~TensorStream.aclose` closed the generator part way, a step
    raised before (a timeout caught and the step tried again), or the generator was closed
    from outside between two steps (the event loop it began in ended, and finalized it; the
    next step runs in another loop): the generator itself could only end, and the loop would
    end short as if the tensors were all there."""

    __slots__ = ("_failed", "_generator", "_over", "_stream")

    def __init__(
        self, generator: AsyncGenerator[tuple[str, TensorT]], stream: TensorStream[TensorT]
    ) -> None:
        self._generator = generator
        self._stream = stream
        # The class of what a step raised (the generator is done), not the error: its traceback
        # holds the step's frame, so this iteration; held here, it would be a cycle that only
        # the garbage collector frees, keeping its frames' tensors (and a mapping's descriptor).
        self._failed: type[BaseException] | None = None
        self._over = False  # its end was seen, or aclose() called here: later steps just end

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> tuple[str, TensorT]:
        self._stream._check_here()  # a copy made by os.fork(): before the generator is touched
        if getattr(self._generator, "ag_running", False):  # another task's step is under way
            raise UsageError(
                f"{self._stream._shown_name()}: a stream was iterated from two tasks at once; "
                "iterate it from one task"
            )
        # No frame before the step: the generator was closed, and not by this iteration.
        finalized = not self._over and getattr(self._generator, "ag_frame", None) is None
        try:
            return await anext(self._generator)
        except StopAsyncIteration:
            self._stream._after_end(self._failed, finalized)
            self._over = True
            raise
        except BaseException as exc:  # cancelled too: a later step must not end quietly
            self._failed = type(exc)
            raise

    async def aclose(self) -> None:
        """Close the iteration (as an async generator's ``aclose``); in a copy of the process
        that opened the stream made by ``os.fork()``, leave its generator untouched (its
        ``finally`` blocks would close the parent's source, wait for its threads)."""
        self._over = True
        if self._stream._here():
            await self._generator.aclose()
