"""``stream-st validate``: statistics of every tensor, checked for NaN, Inf, missing layers, mixed
dtypes and, given a model's ``config.json``, the shapes and parameter count it implies.

Errors make a file invalid; warnings are reported apart (the split of the design notes):

* errors: NaN or Inf values; a shape other than the expected one (``expect_shapes=``, or the
  config's); a tensor ``expect_shapes`` names that is missing; a layer lacking a part
  (``expect_layers=``, or one of the config's nine); a whole layer missing between layers that
  are there (layers 0, 1 and 3 but not 2); a layer beyond the config's ``num_hidden_layers``;
* warnings: all-zero or constant tensors (a complex one: of constant magnitude), values beyond
  ``warn_abs``, floating-point tensors in more than one dtype (or other than the config's
  ``dtype``, or ``torch_dtype``), expected layers or tensors missing around those present (a
  shard, a pipeline stage), tensors the config does not describe, a parameter count other than
  the config's.

Statistics come from :mod:`stream_st.core.moments` (one cache-friendly pass, float64-exact;
an integer tensor's min and max exact ints, its mean its exact sum over its count), computed by
worker threads while later tensors arrive. The arguments are checked before the source is
opened (:class:`~stream_st.ArgumentTypeError` or :class:`~stream_st.UsageError`, naming the
argument). The checks of the header's structure and
of a model's config are in :mod:`stream_st.tools.model_checks`; their names are importable from
here too.
"""

from __future__ import annotations

import os
import queue
import reprlib
from collections import deque
from collections.abc import AsyncIterator, Collection, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from numbers import Real
from typing import Any, Unpack

import anyio
import anyio.to_thread
import numpy as np

from .._api import stream_for
from .._util import lock_and_condition, task_group
from ..core.digests import ALGORITHM_KEY, Digests
from ..core.dtypes import DTYPES
from ..core.header import Header, TensorInfo
from ..core.moments import Moments, moments_of, summarisable
from ..core.stats import LoadStats
from ..errors import (
    ArgumentTypeError,
    IntegrityError,
    TensorNotFoundError,
    integer_at_least,
    redact,
)
from ..reader import TensorStream
from ..reader.stream import OBJECT_ONLY
from ..sharded.reader import ShardedStream
from ..transports.options import Clock, TransportOptions, checked_number
from ..transports.registry import SourceLike
from .common import (
    Progress,
    checked_progress,
    command_clock,
    expect_totals,
    headers_of,
    plural,
    result_repr,
)
from .diff import Key, _keyed, _label
from .model_checks import (
    ModelConfig,
    check_layer_sequence,
    check_layers,
    validate_dtype_consistency,
)

__all__ = [
    "ModelConfig",
    "TensorStats",
    "Validation",
    "check_layer_sequence",
    "check_layers",
    "tensor_stats",
    "validate",
    "validate_dtype_consistency",
]

Array = np.ndarray[Any, Any]

SEGMENT = 1 << 20
"""A tensor of more values than this is summarised in parts of this many values (4 MiB of F32,
about a millisecond's work), by several worker threads at once, the parts merged in order: small
enough that the last parts of a file end close together."""

IN_FLIGHT = 16 << 20
"""Tensors received and not yet summarised hold at most this many bytes (or one part): the
stream reads ahead while the workers summarise, in bounded memory. No more than the stream reads
ahead of a caller that drops what it is given (``reader.ahead.READ_AHEAD_BYTES``), so that the
stream sees its arrays let go of and uses their memory again (with 64 MiB here, every page of every
tensor was a fresh one: 132 000 page faults for a 538 MB model against 43 000, and the kernel's
time doubled). Once it is reached, no part is queued until the queue is down to half of it: the
event loop waits for room once per several parts."""


def _workers() -> int:
    """Worker threads summarising at once: one per CPU this process may use."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class TensorStats:
    """Statistics of one tensor: min, max, mean and std (population) of its finite values, and
    its NaN and Inf counts (floating types). None where there are no finite values, or no
    values to summarise (the packed F4 and F6 types). An integer or boolean tensor's min and
    max are exact ints, taken in its own dtype (an I64 or U64 value beyond 2**53 is not rounded),
    its mean the exact sum of its values divided by their count, rounded once to a float."""

    name: str
    dtype: str
    shape: list[int]
    min: int | float | None
    max: int | float | None
    mean: float | None
    std: float | None
    nan: int = 0
    inf: int = 0

    @classmethod
    def of(cls, name: str, dtype: str, shape: Sequence[int], moments: Moments) -> TensorStats:
        """The statistics ``moments`` summarise."""
        if not moments.count:
            return cls(name, dtype, list(shape), None, None, None, None, moments.nan, moments.inf)
        return cls(
            name,
            dtype,
            list(shape),
            moments.low,
            moments.high,
            moments.mean,
            moments.std,
            moments.nan,
            moments.inf,
        )


@dataclass
class Validation:
    """Per-tensor statistics, errors (fail) and warnings (reported apart). ``load``: the read's
    :class:`~stream_st.LoadStats` (bytes, seconds, time waited on the source), not part of
    :meth:`to_json` unless asked for."""

    source: str
    tensors: list[TensorStats] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    digests: str = ""  # the header's digests: which algorithm, how many tensors verified
    load: LoadStats = field(default_factory=LoadStats)

    @property
    def ok(self) -> bool:
        """True when there is no error (warnings allowed)."""
        return not self.errors

    def __repr__(self) -> str:
        """A bounded summary: whether valid, then the first statistics, errors and warnings."""
        return result_repr(self, ok=self.ok)

    def to_json(self, *, load: bool = False) -> dict[str, Any]:
        """The result as JSON-ready values; ``load=True`` adds the read's statistics."""
        record = asdict(self)
        del record["load"]
        if load:
            record["load"] = self.load.to_json()
        return {**record, "ok": self.ok}


def tensor_stats(name: str, dtype: str, shape: Sequence[int], array: Array) -> TensorStats:
    """min, max, mean, std (exact to float64, see :mod:`stream_st.core.moments`) of the finite
    values, NaN and Inf counts, in bounded scratch memory, on the calling thread. Packed
    sub-byte types (F4, F6) have no values to summarise: ``None`` everywhere."""
    if not summarisable(dtype):
        return TensorStats(name, dtype, list(shape), None, None, None, None)
    return TensorStats.of(name, dtype, shape, moments_of(array))


def _config_of(config: ModelConfig | Mapping[str, Any] | str | os.PathLike[str]) -> ModelConfig:
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, str | os.PathLike):
        return ModelConfig.read(config)
    return ModelConfig.from_json(config)


# -- validation ----------------------------------------------------------------------------------


async def validate(
    source: SourceLike,
    *,
    expect_shapes: Mapping[str, Sequence[int]] | None = None,
    expect_layers: Sequence[str] = (),
    config: ModelConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
    warn_abs: float = 1e4,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> Validation:
    """Stream every tensor and check it: NaN and Inf are errors, as are shapes differing from
    ``expect_shapes`` (name -> shape; a missing tensor too), layers lacking a part of
    ``expect_layers`` and whole layers missing between others. ``config``: a Llama-family
    model's ``config.json`` (a path, its parsed JSON or a :class:`ModelConfig`): the shapes,
    layers, parameter count and dtype it implies are checked too (see the module for which
    findings are errors). Warnings: all-zero or constant tensors (constant magnitude, for a
    complex one), values beyond ``warn_abs``, floating-point tensors in several dtypes.
    ``result.load`` tells how the read went.

    A name a dataset repeats in every shard (``dataset_manifest.json``) is validated shard by
    shard, each tensor against its own shard's header and digest, and reported as
    ``name (shard N)``, N counted from 0 in the manifest's order (as :func:`~stream_st.tools.diff`
    names it); ``expect_shapes`` applies to each, ``config`` sees the first shard's.

    The arguments are checked before the source is opened: ``expect_shapes`` must map names
    (str) to shapes (sequences of integers from 0), ``expect_layers`` be names (not one str),
    ``warn_abs`` a number (``math.inf``: no such warning; None is refused), ``progress`` a
    callable; :class:`~stream_st.ArgumentTypeError` for another type,
    :class:`~stream_st.UsageError` for a negative dimension or ``warn_abs``, each naming the
    argument."""
    if isinstance(warn_abs, bool) or not isinstance(warn_abs, Real):
        raise ArgumentTypeError(
            f"warn_abs takes a number >= 0 (math.inf: no warning), got {type(warn_abs).__name__}"
        )
    # NaN or a negative number: a UsageError; any other Real (a Fraction: no format g) a float
    limit = checked_number("warn_abs", warn_abs)
    assert limit is not None  # a Real, checked above
    shapes = expected_shapes(expect_shapes)
    layers = _expected_layers(expect_layers)
    progress = checked_progress(progress)
    model = None if config is None else _config_of(config)
    clock = command_clock(options)
    async with _opened_views(source, clock) as (stream, headers):
        return await _validate_stream(
            redact(str(source)),
            stream,
            headers,
            shapes,
            layers,
            model,
            limit,
            progress,
            clock,
        )


def expected_shapes(given: object) -> dict[str, list[int]]:
    """``expect_shapes`` checked: a mapping of names to shapes, each a sequence of integers
    (numpy's too) of at least 0; :class:`~stream_st.ArgumentTypeError` for anything else (a
    list of pairs, a bare number, a bool or float dimension), :class:`~stream_st.UsageError`
    for a negative dimension."""
    if given is None:
        return {}
    if not isinstance(given, Mapping):
        raise ArgumentTypeError(
            "expect_shapes takes a mapping of tensor names to shapes ({name: [dim, ...]}), "
            f"got {type(given).__name__} {reprlib.repr(given)}"
        )
    shapes: dict[str, list[int]] = {}
    for name, shape in given.items():
        if not isinstance(name, str):
            raise ArgumentTypeError(
                f"expect_shapes: tensor names are str, got {type(name).__name__} {name!r}"
            )
        if isinstance(shape, str | bytes | Mapping) or not isinstance(shape, Iterable):
            raise ArgumentTypeError(
                f"expect_shapes[{name!r}] must be a shape (a sequence of integers), "
                f"got {type(shape).__name__} {reprlib.repr(shape)}"
            )
        shapes[name] = [
            integer_at_least(f"expect_shapes[{name!r}]: a dimension", dim, 0) for dim in shape
        ]
    return shapes


def _expected_layers(given: object) -> list[str]:
    """``expect_layers`` checked: names (str) of the parts every layer must have;
    :class:`~stream_st.ArgumentTypeError` for one str (whose letters would be taken as the
    names) or anything but names."""
    if isinstance(given, str | bytes) or not isinstance(given, Iterable):
        raise ArgumentTypeError(
            "expect_layers takes a sequence of name parts (['q_proj', 'k_proj']), "
            f"got {type(given).__name__} {reprlib.repr(given)}"
        )
    layers = list(given)
    wrong = next((part for part in layers if not isinstance(part, str)), None)
    if wrong is not None:
        raise ArgumentTypeError(
            f"expect_layers: name parts are str, got {type(wrong).__name__} {wrong!r}"
        )
    return layers


@asynccontextmanager
async def _opened_views(
    source: SourceLike, clock: Clock
) -> AsyncIterator[tuple[TensorStream, list[Header]]]:
    """The source opened once, with its headers (as :func:`~stream_st.tools.common.opened`),
    a local file's tensors handed out as read-only views of its mapping (``copy=False``): the
    statistics read the page cache itself, no copy is made, no fresh page is touched. The
    header's digests are not checked by the stream, which would stop at the first tensor failing:
    :class:`_Checker` checks every tensor's. The whole object's digest (an S3 checksum, a Hub
    file's SHA-256) is, after the last tensor (:data:`~stream_st.reader.stream.OBJECT_ONLY`)."""
    stream = stream_for(source, clock=clock, copy=False, verify=OBJECT_ONLY, unique_names=False)
    async with stream:
        if isinstance(stream, ShardedStream):  # every shard's header, up front
            yield stream, await headers_of(source, clock)
        else:
            yield stream, [stream.header]


async def _validate_stream(
    source: str,
    stream: TensorStream,
    headers: Sequence[Header],
    expect_shapes: Mapping[str, list[int]],
    expect_layers: Sequence[str],
    config: ModelConfig | None,
    warn_abs: float,
    progress: Progress | None,
    clock: Clock,
) -> Validation:
    result = Validation(source, load=stream.stats)
    infos = _keyed(headers, ())[0]  # a name a dataset repeats: once per shard
    named: dict[str, list[tuple[Key, TensorInfo]]] = {}  # each name's tensors, in shard order
    for key, info in infos.items():
        named.setdefault(key[0], []).append((key, info))
    if not infos:
        result.warnings.append("the file holds no tensors")
    for name, shape in expect_shapes.items():
        if name not in named:
            result.errors.append(f"{name}: expected shape {shape}, tensor missing")
        for key, info in named.get(name, ()):
            if list(info.shape) != shape:
                result.errors.append(f"{_label(key)}: shape {list(info.shape)}, expected {shape}")
    result.errors.extend(check_layers(named, expect_layers))
    result.errors.extend(check_layer_sequence(named))
    if config is not None:  # a name repeated: its first shard's tensor
        errors, warnings = config.check({name: found[0][1] for name, found in named.items()})
        result.errors.extend(errors)
        result.warnings.extend(warnings)
    if config is None or config.dtype is None:
        dtypes = {_label(key): info.dtype for key, info in infos.items()}
        result.warnings.extend(validate_dtype_consistency(dtypes))
    algorithms = {h.metadata[ALGORITHM_KEY] for h in headers if ALGORITHM_KEY in h.metadata}
    digests, damaged, unchecked = _recorded_digests(result, headers, infos)
    expect_totals(progress, list(infos.values()))
    checker = _Checker(infos, progress, clock, digests=digests, unchecked=unchecked, source=source)
    await checker.run(stream)
    for stats, info in checker.done:
        _findings(result, stats, info, warn_abs)
    result.errors.extend(checker.mismatches)
    if checker.failure is not None:
        result.errors.append(checker.failure)
    failed = len(checker.mismatches) + damaged + (checker.failure is not None)
    if checker.mismatches:
        verified = f"FAILED ({plural(len(checker.mismatches), 'tensor')} of {len(infos)})"
    elif failed:  # the records themselves, or the whole object's check: not a tensor's
        verified = "FAILED (see the errors)"
    else:
        verified = f"{plural(checker.checked, 'tensor')} verified"
    algorithm = ", ".join(sorted(algorithms))  # "" for digests recorded without one
    if algorithm:
        result.digests = f"{algorithm}: {verified}"
    else:  # digests whose algorithm is missing still failed, as their error says
        result.digests = verified if damaged else "none"
    return result


def _recorded_digests(
    result: Validation, headers: Sequence[Header], infos: Mapping[Key, TensorInfo]
) -> tuple[dict[Key, Digests], int, set[Key]]:
    """Each tensor's recorded digests (the :class:`Digests` of its header), by its key in
    ``infos`` (a name repeated across shards: each shard's own); how many headers record
    digests that cannot be checked (each an error in ``result``, naming a tensor as the other
    findings do: unquoted, a name repeated across shards with its shard), and the keys of
    those headers' tensors."""
    found: dict[Key, Digests] = {}
    damaged = 0
    unchecked: set[Key] = set()
    for shard, header in enumerate(headers):
        try:
            digests = Digests.from_header(header, partial(_named_in, infos, shard))
        except IntegrityError as exc:
            result.errors.append(str(exc))
            damaged += 1
            unchecked.update(_key_in(infos, shard, name) for name in header.names())
            continue
        if digests is not None:
            found.update((_key_in(infos, shard, name), digests) for name in digests.values)
    return found, damaged, unchecked


def _key_in(infos: Mapping[Key, TensorInfo], shard: int, name: str) -> Key:
    """The key in ``infos`` of the tensor ``name`` of shard ``shard``: ``(name, shard)`` for a
    name repeated across shards, else ``(name, -1)``."""
    return (name, shard) if (name, shard) in infos else (name, -1)


def _named_in(infos: Mapping[Key, TensorInfo], shard: int, name: str) -> str:
    """The tensor ``name`` of shard ``shard`` as the findings name it (:func:`_key_in`)."""
    return _label(_key_in(infos, shard, name))


@dataclass
class _Pending:
    """A tensor being summarised: its slot in the results, its name as reported (``name`` or
    ``name (shard N)``), the summaries of its parts."""

    slot: int
    label: str
    info: TensorInfo
    parts: list[Moments | None]
    left: int


@dataclass
class _Piece:
    """Part ``index`` of a tensor: the values ``start:stop`` of ``array``, ``nbytes`` of them."""

    tensor: _Pending
    index: int
    array: Array
    start: int
    stop: int
    nbytes: int


class _Checker:
    """Summarises a stream's tensors in worker threads while later ones arrive: one long-lived
    worker per CPU takes parts off a queue (a tensor of more than :data:`SEGMENT` values in
    parts, others whole), so that a worker done with one part goes on with the next without
    waiting for the event loop; at most :data:`IN_FLIGHT` bytes of tensors are queued or being
    summarised. ``infos``: the tensors to come, by :data:`~stream_st.tools.diff.Key` (a name a
    dataset repeats in every shard: each shard's, taken in shard order as the stream delivers
    them). ``done``: the statistics, with each tensor's info, in stream order. Each tensor with a
    recorded digest in ``digests`` (by the same keys) is checked against it: ``checked`` counts
    those that match, ``mismatches`` describes each that does not (every tensor is still
    summarised). A tensor that fails its digest, or one of ``unchecked`` (whose header records
    digests that cannot be checked), refutes the copy a cache keeps of the read it came in
    (:meth:`_refute`), as a read raising :class:`~stream_st.IntegrityError` does. ``clock``:
    the operation's, whose deadline is checked at every part and every slice of a digest's
    hashing (the summaries and the hashing are no wait for the transport that it bounds
    otherwise)."""

    def __init__(
        self,
        infos: Mapping[Key, TensorInfo],
        progress: Progress | None,
        clock: Clock,
        *,
        digests: Mapping[Key, Digests] | None = None,
        unchecked: Collection[Key] = (),
        source: str = "",
    ) -> None:
        self._infos = infos
        self._keys: dict[str, deque[Key]] = {}  # each name's keys yet to be streamed
        for key in infos:
            self._keys.setdefault(key[0], deque()).append(key)
        self._progress = progress
        self._clock = clock
        self._stop = clock.deadline_stop(source)  # of a big tensor's hashing, slice by slice
        self._digests = digests or {}
        self._unchecked = unchecked
        self._refuted: TensorStream | None = None  # the stream whose copy was last refuted
        self._source = source
        self.checked = 0
        self.mismatches: list[str] = []
        self._slots: list[tuple[TensorStats, TensorInfo] | None] = []
        self._bytes_done = 0
        self._tensors_done = 0
        self._queue: queue.SimpleQueue[_Piece | None] = queue.SimpleQueue()
        # guards the three below; taken as self._lock (see lock_and_condition)
        self._lock, self._room = lock_and_condition()
        self._held = 0  # bytes of the parts queued or being summarised
        self._summarised: list[tuple[_Pending, int, Moments]] = []  # parts not yet recorded
        self._stopped = False  # a worker has ended: nobody waits for room
        self.failure: str | None = None

    @property
    def done(self) -> list[tuple[TensorStats, TensorInfo]]:
        return [done for done in self._slots if done is not None]

    async def run(self, stream: TensorStream) -> None:
        workers = _workers()
        limiter = anyio.CapacityLimiter(workers)  # not the default one, which waits for room
        async with task_group() as group:
            for _ in range(workers):
                group.start_soon(self._worker, limiter)
            try:
                await self._feed(stream)
            finally:  # even cancelled: the workers end once the queue is done
                for _ in range(workers):
                    self._queue.put(None)
        self._record_summarised()

    async def _feed(self, stream: TensorStream) -> None:
        """Queue every tensor of ``stream``, in parts, recording what is summarised meanwhile."""
        try:
            async for name, array in stream:
                keys = self._keys.get(name)
                if not keys:
                    raise TensorNotFoundError(f"{name} streamed but not in the header")
                key = keys.popleft()
                info, label = self._infos[key], _label(key)
                await self._check_digest(key, array, stream)
                self._slots.append(None)
                starts = range(0, array.size, SEGMENT) if summarisable(info.dtype) else ()
                slot = len(self._slots) - 1
                tensor = _Pending(slot, label, info, [None] * len(starts), len(starts))
                if not starts:
                    self._record(tensor, tensor_stats(label, info.dtype, info.shape, array))
                    continue
                for index, start in enumerate(starts):
                    self._clock.check(self._source)
                    stop = min(start + SEGMENT, array.size)
                    nbytes = (stop - start) * array.itemsize
                    await self._put(_Piece(tensor, index, array, start, stop, nbytes))
                del array
                self._record_summarised()
        except IntegrityError as exc:  # the tensors before it are still summarised
            self.failure = str(exc)

    async def _check_digest(self, key: Key, array: Array, stream: TensorStream) -> None:
        """Check the tensor ``key``, just streamed by ``stream``, against its recorded digest,
        if it has one: a mismatch is a finding naming the tensor as the others do, unquoted (a
        name repeated across shards with its shard), not the :class:`~stream_st.IntegrityError`
        a read raises, which quotes it. A mismatch, or a tensor of ``unchecked``, refutes the
        copy it was read through (once per stream)."""
        if key in self._unchecked:
            await self._refute(stream)
        elif (recorded := self._digests.get(key)) is not None:
            problem = await recorded.view_mismatch(key[0], array, self._stop)
            if problem is None:
                self.checked += 1
            else:
                self.mismatches.append(f"{_label(key)}: {problem}")
                await self._refute(stream)

    async def _refute(self, stream: TensorStream) -> None:
        """The tensor ``stream`` just delivered fails the file's digests (or its header's record
        of them): the stream that read it (for a sharded stream, the shard's) lets go of what it
        keeps of its read, a cache's copy (:meth:`~stream_st.TensorStream._refuted`), so that the
        next read fetches the object again; the read goes on, for the other tensors' findings."""
        reading = stream._current if isinstance(stream, ShardedStream) else stream
        if reading is None or reading is self._refuted:
            return
        self._refuted = reading
        with anyio.CancelScope(shield=True):  # a cancelled validation keeps no copy either
            await reading._refuted()

    async def _put(self, piece: _Piece) -> None:
        """Queue ``piece``, once the parts before it leave room (:data:`IN_FLIGHT`)."""
        with self._lock:
            full = self._held + piece.nbytes > IN_FLIGHT and self._held and not self._stopped
        if full:  # a cancellation need not wait: the thread ends once the workers make room
            await anyio.to_thread.run_sync(self._wait_for_room, abandon_on_cancel=True)
        with self._lock:
            self._held += piece.nbytes
        self._queue.put(piece)

    def _wait_for_room(self) -> None:
        """Block until the parts queued or being summarised are down to half of
        :data:`IN_FLIGHT` (in a worker thread)."""
        with self._lock:
            self._room.wait_for(lambda: self._held <= IN_FLIGHT // 2 or self._stopped)

    async def _worker(self, limiter: anyio.CapacityLimiter) -> None:
        await anyio.to_thread.run_sync(self._work, limiter=limiter)

    def _work(self) -> None:
        """Summarise queued parts until the queue says to stop (in a worker thread: numpy
        releases the GIL). A part's array is let go of as soon as it is summarised."""
        try:
            while (piece := self._queue.get()) is not None:
                tensor, index, nbytes = piece.tensor, piece.index, piece.nbytes
                moments = moments_of(piece.array, piece.start, piece.stop)
                del piece
                with self._lock:
                    self._summarised.append((tensor, index, moments))
                    self._held -= nbytes
                    self._room.notify_all()
        finally:
            with self._lock:
                self._stopped = True
                self._room.notify_all()

    def _record_summarised(self) -> None:
        """Record the tensors whose parts are all summarised (on the event loop's thread)."""
        with self._lock:
            summarised, self._summarised = self._summarised, []
        for tensor, index, moments in summarised:
            tensor.parts[index] = moments
            tensor.left -= 1
            if not tensor.left:
                total = Moments()
                for part in tensor.parts:
                    if part is not None:
                        total.merge(part)
                info = tensor.info
                self._record(tensor, TensorStats.of(tensor.label, info.dtype, info.shape, total))

    def _record(self, tensor: _Pending, stats: TensorStats) -> None:
        self._slots[tensor.slot] = (stats, tensor.info)
        self._bytes_done += tensor.info.nbytes
        self._tensors_done += 1
        if self._progress is not None:
            self._progress(self._bytes_done, self._tensors_done)


def _findings(result: Validation, stats: TensorStats, info: TensorInfo, warn_abs: float) -> None:
    """Add ``stats`` and the errors and warnings they show to ``result``."""
    name = stats.name
    result.tensors.append(stats)
    if stats.nan:
        result.errors.append(f"{name}: {plural(stats.nan, 'NaN value')}")
    if stats.inf:
        result.errors.append(f"{name}: {plural(stats.inf, 'Inf value')}")
    if stats.max is not None and stats.min is not None:
        if max(abs(stats.max), abs(stats.min)) > warn_abs:
            result.warnings.append(
                f"{name}: values up to {max(abs(stats.max), abs(stats.min)):.4g} "
                f"(beyond {warn_abs:g})"
            )
        if stats.min == stats.max and info.nelements > 1 and not (stats.nan or stats.inf):
            # a complex tensor's statistics are its values' magnitudes: [1, -1, 1j] is not constant
            of = " magnitude" if DTYPES[info.dtype].numpy.kind == "c" else ""
            what = "all zeros" if stats.min == 0 else f"constant{of} {stats.min:.4g}"
            result.warnings.append(f"{name}: {what}")
