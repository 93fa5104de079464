"""Differential fuzzer of whole files, with the reference ``safetensors`` package as the oracle.

A mutation fuzzer over a seed corpus of valid files: byte flips, inserts, deletions and
truncations; JSON-aware mutations of the header (numbers -> ``-0`` / ``1.0`` / ``1e3`` /
``2**64``, strings with escapes and lone surrogates, duplicated entries, long dimension lists,
consistent re-layouts that keep the file valid) and of its framing (the length prefix, padding,
the data section's length). Seeded :mod:`random`, so a run is reproducible.

Every input is read by stream_st from bytes and from an async iterator cut at random points
(empty chunks included), on asyncio, and by ``safetensors.deserialize``. Allowed outcomes:

* both accept, with identical tensors (names, dtype codes, shapes, bytes; each array of the dtype
  and shape the dtype table promises) and identical metadata;
* both refuse, ours with a :class:`~stream_st.SafetensorsError`;
* we alone refuse, for one of the reasons we are deliberately stricter (:data:`STRICTER`).

Anything else is a finding: an exception that is not a SafetensorsError, a file we accept and the
reference refuses, different tensors or metadata, a refusal for an unknown reason, bytes and chunks
disagreeing, a yielded tensor that is short or not the file's bytes, an iterator or task left
open, or an input far slower for us than for the reference, or a hang. Run it through
``python -m tests.fuzz.fuzz_header``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import random
import re
import resource
import signal
import struct
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import safetensors
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.core.header import LENGTH_PREFIX_SIZE, Header
from stream_st.core.layout import build_header

from .._util import sample_tensors
from ..core.test_differential import stricter_reason

__all__ = ["REGRESSIONS", "Fuzzer", "Judge", "Verdict", "chunkings", "fuzz", "seed_corpus"]

REGRESSIONS = Path(__file__).parent / "regressions"
"""Every input that ever found a bug, as ``<what>.bin``; the suite replays them all."""

SLOW_SECONDS = 0.25
SLOWER_THAN_REFERENCE = 50
"""An input we take longer than ``SLOW_SECONDS`` and ``SLOWER_THAN_REFERENCE`` times the
reference to judge, twice in a row, is a finding: a super-linear path."""

HANG_SECONDS = 5.0
"""A judgement still running after this long is stopped and is the finding ``hang``."""

_DIGITS = re.compile(r" at line \d+ column \d+|\d+")
"""Positions and numbers in the reference's messages, left out of a finding's signature."""


# ---------------------------------------------------------------- the oracle


@dataclass
class Verdict:
    """The judgement of one input: ``outcome`` always, ``finding`` when a promise broke.

    ``outcome`` is ``"accepted"``, ``"refused by both"`` or ``"stricter: <reason>"``; ``finding``
    is a short signature shared by inputs that break the same promise, ``detail`` says more;
    ``header`` is ours when we accepted the input.
    """

    outcome: str
    finding: str | None = None
    detail: str = ""
    header: Header | None = None


@dataclass
class _Read:
    """What stream_st made of one source: the header, the arrays yielded, the error raised."""

    header: Header | None = None
    arrays: list[tuple[str, np.ndarray[Any, Any]]] = field(default_factory=list)
    error: BaseException | None = None


class _Chunks:
    """An async iterator over ``data`` cut at ``cuts``; knows whether it was closed."""

    def __init__(self, data: bytes, cuts: list[int], kinds: int) -> None:
        self._pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        self._kinds = kinds
        self._next = 0
        self.closed = False

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> Any:
        if self.closed or self._next == len(self._pieces):
            raise StopAsyncIteration
        piece = self._pieces[self._next]
        self._next += 1
        wrap: Callable[[bytes], Any] = (bytes, bytearray, memoryview)[self._next % self._kinds]
        return wrap(piece)

    async def aclose(self) -> None:
        self.closed = True


MAX_CHUNKS = 256
"""At most this many chunks (a large input is cut in larger chunks)."""


def chunkings(data: bytes, rng: random.Random) -> list[int]:
    """Random cut points for ``data``: none, every k bytes, or a few, often near the frame's
    boundaries (the prefix, the header's end, the data's edges), sometimes doubled (empty chunk)."""
    mode = rng.randrange(4)
    if mode == 0 or not data:
        return []
    if mode == 1:
        step = max(rng.choice([1, 2, 3, 7, 8, 9, 64]), len(data) // MAX_CHUNKS)
        return list(range(step, len(data), step))
    points = [rng.randrange(len(data) + 1) for _ in range(rng.randint(1, 6))]
    if mode == 3 and len(data) >= LENGTH_PREFIX_SIZE:
        (n,) = struct.unpack("<Q", data[:LENGTH_PREFIX_SIZE])
        edges = [LENGTH_PREFIX_SIZE, LENGTH_PREFIX_SIZE + n, len(data)]
        points += [min(max(e + rng.randint(-1, 1), 0), len(data)) for e in edges]
    return sorted(points)


class _Hang(BaseException):
    """Raised by the watchdog into a judgement that runs too long."""


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Raise :class:`_Hang` in the block once ``seconds`` have passed (Unix; else a no-op)."""
    if not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise _Hang

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _innermost(error: BaseException) -> str:
    """``file:function`` of the frame that raised ``error``, for a stable signature."""
    frames = traceback.extract_tb(error.__traceback__)
    last = frames[-1] if frames else None
    return f"{Path(last.filename).name}:{last.name}" if last else "?"


def _reference(data: bytes) -> tuple[dict[str, tuple[str, list[int], bytes]] | None, str]:
    """The reference's tensors, or ``None`` and its reason for refusing."""
    try:
        tensors = safetensors.deserialize(data)
    except BaseException as exc:  # a Rust panic arrives as a BaseException
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        return None, str(exc)
    return {name: (t["dtype"], list(t["shape"]), bytes(t["data"])) for name, t in tensors}, ""


class Judge:
    """Judges inputs; holds a scratch file for the reference's metadata (it reads only paths)."""

    def __init__(self, slow: float = SLOW_SECONDS) -> None:
        self.slow = slow
        self._reference_seconds = 0.0
        self._scratch = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives with the judge
            suffix=".safetensors", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._scratch.close()

    def _reference_metadata(self, data: bytes) -> dict[str, str]:
        self._scratch.seek(0)
        self._scratch.truncate()
        self._scratch.write(data)
        self._scratch.flush()
        with safetensors.safe_open(self._scratch.name, "numpy") as handle:
            return dict(handle.metadata() or {})

    async def judge(self, data: bytes, cuts: list[int]) -> Verdict:
        """The verdict on ``data``, read whole and as chunks cut at ``cuts``.

        A judgement cut short after ``HANG_SECONDS`` (an interval timer, where there is one) is
        the finding ``hang``.
        """
        began = time.perf_counter()
        try:
            with _watchdog(HANG_SECONDS):
                return await self._timed(data, cuts)
        except _Hang:
            elapsed = time.perf_counter() - began
            return Verdict("?", "hang", f"stopped after {elapsed:.0f} s, {len(data)} bytes")

    async def _timed(self, data: bytes, cuts: list[int]) -> Verdict:
        for _ in range(2):  # a slow input must be slow twice: not a pause of the machine
            began = time.perf_counter()
            verdict = await self._judge(data, cuts)
            reference = self._reference_seconds
            ours = time.perf_counter() - began - reference
            if verdict.finding or ours < max(self.slow, SLOWER_THAN_REFERENCE * reference):
                return verdict
        detail = f"{ours:.2f} s for {len(data)} bytes, the reference {reference:.3f} s"
        return Verdict(verdict.outcome, "slow", detail)

    async def _judge(self, data: bytes, cuts: list[int]) -> Verdict:
        began = time.perf_counter()
        expected, reference_reason = _reference(data)
        self._reference_seconds = time.perf_counter() - began
        chunks = _Chunks(data, cuts, kinds=1 + len(cuts) % 3)
        tasks = asyncio.all_tasks()
        reads = [await _read(data), await _read(chunks)]
        if not chunks.closed:
            return Verdict("?", "iterator left open", "the chunk iterator was never closed")
        if asyncio.all_tasks() - tasks:
            return Verdict("?", "task left running", repr(asyncio.all_tasks() - tasks))
        for read, how in zip(reads, ("bytes", "chunks"), strict=True):
            problem = _misbehaviour(read, data)
            if problem:
                return Verdict("?", f"{how}: {problem[0]}", problem[1])
        whole, cut = reads
        if (whole.error is None) != (cut.error is None):
            return Verdict("?", "bytes and chunks disagree", f"{whole.error!r} / {cut.error!r}")
        if whole.error is None:
            assert whole.header is not None
            if expected is None:
                signature = _DIGITS.sub("#", reference_reason)
                return Verdict("accepted", f"accepted by us alone: {signature}", reference_reason)
            for read in reads:
                difference = _difference(read, expected)
                if difference:
                    return Verdict("accepted", "different tensors", difference)
            if whole.header.metadata != self._reference_metadata(data):
                return Verdict("accepted", "different metadata", repr(whole.header.metadata))
            return Verdict("accepted", header=whole.header)
        if expected is None:
            return Verdict("refused by both")
        known = stricter_reason(data, whole.error)
        if known is None:
            reason = str(whole.error)
            return Verdict("?", f"refused by us alone: {type(whole.error).__name__}", reason)
        return Verdict(f"stricter: {known}")


async def _read(source: Any) -> _Read:
    read = _Read()
    try:
        async with stream_st.open_stream(source) as stream:
            read.header = stream.header
            async for item in stream:
                read.arrays.append(item)
    except Exception as exc:
        read.error = exc
    return read


def _misbehaviour(read: _Read, data: bytes) -> tuple[str, str] | None:
    """A broken promise in one read: a foreign exception, or a yielded tensor not the file's."""
    if read.error is not None and not isinstance(read.error, stream_st.SafetensorsError):
        where = _innermost(read.error)
        return f"{type(read.error).__name__} at {where}", f"{read.error!r}"[:500]
    if read.header is None:
        return None
    base = read.header.data_start
    for name, array in read.arrays:
        info = read.header[name]
        stored = data[base + info.start : base + info.end]
        if len(stored) != info.nbytes or array.tobytes() != stored:
            return "yielded a tensor that is not the file's bytes", name
        if array.dtype != info.array_dtype or array.shape != info.array_shape:
            return "yielded a tensor of the wrong dtype or shape", f"{name}: {array.dtype}"
    return None


def _difference(read: _Read, expected: dict[str, tuple[str, list[int], bytes]]) -> str:
    """How ``read`` differs from the reference's tensors; empty if it does not."""
    assert read.header is not None
    got = {
        name: (read.header[name].dtype, list(read.header[name].shape), array.tobytes())
        for name, array in read.arrays
    }
    if got == expected:
        return ""
    names = sorted(got.keys() ^ expected.keys()) or sorted(n for n in got if got[n] != expected[n])
    return f"tensors differ: {names[:5]}"


# ---------------------------------------------------------------- the seed corpus


def _raw(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def seed_corpus() -> list[bytes]:
    """Small valid files covering every dtype, metadata, scalars, empties and escaped names."""
    seeds = [
        reference_numpy.save(sample_tensors()),
        reference_numpy.save(sample_tensors(), metadata={"format": "np", "é": "\u2603"}),
        reference_numpy.save({"a": np.zeros(1, np.uint8)}, metadata={"k": "v"}),
        _raw(b"{}", b""),
        _raw(b'{"__metadata__":{"k":"v"}}      ', b""),
    ]
    rng = random.Random(0)
    plan = [
        stream_st.TensorSpec(f"t{code}", code, (2, 4) if code != "BOOL" else (3,))
        for code in stream_st.DTYPES
    ]
    plan += [
        stream_st.TensorSpec("odd", "F4", (2, 3)),
        stream_st.TensorSpec("scalar", "F64", ()),
        stream_st.TensorSpec("empty", "BF16", (0, 5)),
    ]
    for specs, metadata in ((plan, None), (plan[:3], {"m": "x"}), (plan[-3:], {})):
        head, header = build_header(specs, metadata)
        seeds.append(head + rng.randbytes(header.data_size))
    escaped = {"caf\u00e9": "\U0001f600", 'q"\\/\t': "\u0000"}
    for ascii_only in (True, False):
        text = json.dumps(
            {
                "__metadata__": escaped,
                **{
                    name: {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]}
                    for i, name in enumerate(escaped)
                },
            },
            ensure_ascii=ascii_only,
        ).encode()
        seeds.append(_raw(text, b"\x01\x02"))
    return seeds


def regression_cases() -> list[Path]:
    """The regression corpus, sorted by name."""
    return sorted(REGRESSIONS.glob("*.bin"))


# ---------------------------------------------------------------- the mutator

_NUMBER = re.compile(rb"-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?")
_INTEGER = re.compile(rb"-?\d+")
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')

NUMBERS = [
    b"-0",
    b"0",
    b"1",
    b"-1",
    b"1.0",
    b"1e3",
    b"1E0",
    b"0.0",
    b"-0.0",
    b"01",
    b"2",
    b"3",
    b"4",
    b"8",
    b"4294967296",
    b"9223372036854775807",
    b"9223372036854775808",
    b"18446744073709551615",
    b"18446744073709551616",
    b"36893488147419103232",
    b"1" + b"0" * 30,
    b"9" * 4301,
    b"true",
    b"null",
    b'"1"',
    b"[]",
    b"{}",
    b"1 ",
    b" 1",
]
STRINGS = [
    b'"a\\ud800"',
    b'"\\udc00"',
    b'"\\ud800\\udc00"',
    b'"\\ud83d\\ude00"',
    b'"\\uD800"',
    b'"\\ud800x"',
    b'"\\u0000"',
    b'"\\u00e9"',
    '"é"'.encode(),
    b'"__metadata__"',
    b'""',
    b'"\\\\"',
    b'"\\""',
    b'"\\/"',
    b'"\\x"',
    b'"\t"',
    b'"\\u12"',
    b'"\xff"',
    b'"\xed\xa0\x80"',
    b'"\xc0\xaf"',
    b'"F4"',
    b'"F6_E2M3"',
    b'"BF16"',
    b'"F8_E8M0"',
    b'"BOOL"',
    b'"f32"',
    b"1",
    b"null",
    b'"dtype"',
    b'"shape"',
    b'"data_offsets"',
]
JUNK = [b",", b"}", b"{", b"[", b"]", b":", b'"', b"\\", b" ", b"\t", b"\n", b"\x00", b"\xff"]
HUGE_DIMS = [0, 1, 2, 3, 2**32, 2**63, 2**64 - 1]


class Fuzzer:
    """Mutates files of a corpus; ``rng`` decides everything, so a seed reproduces a run."""

    def __init__(self, corpus: Iterable[bytes], rng: random.Random) -> None:
        self.corpus = list(corpus)
        self.rng = rng
        self._seeds = len(self.corpus)
        self._seen: set[tuple[Any, ...]] = set()

    def add(self, data: bytes, header: Header, limit: int = 1000) -> None:
        """Keep an accepted input as a seed if its header is of a new kind (tensor count,
        dtypes, ranks, metadata size); past ``limit`` it replaces an earlier addition."""
        kind = (
            len(header),
            frozenset(t.dtype for t in header),
            tuple(sorted(len(t.shape) for t in header)),
            len(header.metadata),
            header.header_size % 8,
        )
        if kind in self._seen:
            return
        self._seen.add(kind)
        if len(self.corpus) < self._seeds + limit:
            self.corpus.append(data)
        else:
            self.corpus[self._seeds + self.rng.randrange(limit)] = data

    def next(self) -> bytes:
        """One new input: 1 to 3 mutations of a corpus file."""
        rng = self.rng
        data = rng.choice(self.corpus)
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            data = rng.choice(self._mutations)(self, data)
        return data

    # -- framing helpers

    @staticmethod
    def _split(data: bytes) -> tuple[bytes, bytes]:
        """The header bytes and the data bytes of ``data`` as its prefix frames them."""
        if len(data) < LENGTH_PREFIX_SIZE:
            return data, b""
        (n,) = struct.unpack("<Q", data[:LENGTH_PREFIX_SIZE])
        n = min(n, len(data) - LENGTH_PREFIX_SIZE)
        return data[8 : 8 + n], data[8 + n :]

    def _frame(self, header: bytes, data: bytes) -> bytes:
        """Prefix ``header`` with its length (usually), and often fit ``data`` to its offsets."""
        rng = self.rng
        if rng.random() < 0.6:
            data = self._fit(header, data)
        n = len(header)
        roll = rng.random()
        if roll < 0.04:
            n += rng.randint(-9, 9)
        elif roll < 0.05:
            n = rng.choice([0, 1, 2, rng.getrandbits(64), 100_000_001, 2**63])
        return struct.pack("<Q", max(0, n) % 2**64) + header + data

    def _fit(self, header: bytes, data: bytes) -> bytes:
        """``data`` cut or extended to the largest end offset the header names, if small."""
        try:
            obj = json.loads(header)
            end = max(
                (
                    v["data_offsets"][1]
                    for v in obj.values()
                    if isinstance(v, dict) and isinstance(v.get("data_offsets"), list)
                ),
                default=0,
            )
        except Exception:
            return data
        if not isinstance(end, int) or not 0 <= end <= 1 << 16:
            return data
        return data[:end] + self.rng.randbytes(max(0, end - len(data)))

    # -- byte mutations of the whole file

    def _flip(self, data: bytes) -> bytes:
        if not data:
            return b"\x00"
        at = self.rng.randrange(len(data))
        return data[:at] + bytes([data[at] ^ (1 << self.rng.randrange(8))]) + data[at + 1 :]

    def _insert(self, data: bytes) -> bytes:
        at = self.rng.randrange(len(data) + 1)
        piece = self.rng.choice([self.rng.randbytes(self.rng.randint(1, 4)), *JUNK])
        return data[:at] + piece + data[at:]

    def _delete(self, data: bytes) -> bytes:
        at = self.rng.randrange(len(data) + 1)
        return data[:at] + data[at + self.rng.randint(1, 8) :]

    def _truncate(self, data: bytes) -> bytes:
        return data[: self.rng.randrange(len(data) + 1)]

    def _append(self, data: bytes) -> bytes:
        return data + self.rng.choice([b"\x00", b" ", self.rng.randbytes(self.rng.randint(1, 9))])

    def _splice(self, data: bytes) -> bytes:
        other = self.rng.choice(self.corpus)
        return data[: self.rng.randrange(len(data) + 1)] + other[self.rng.randrange(len(other)) :]

    # -- mutations of the header's text, the frame recomputed

    def _tokens(self, data: bytes, pattern: re.Pattern[bytes], pool: list[bytes]) -> bytes:
        header, body = self._split(data)
        found = list(pattern.finditer(header))
        if not found:
            return data
        match = self.rng.choice(found)
        value = self.rng.choice(pool)
        if pool is NUMBERS and self.rng.random() < 0.5:
            value = self._respell(match.group())
        return self._frame(header[: match.start()] + value + header[match.end() :], body)

    def _respell(self, number: bytes) -> bytes:
        """``number`` as a neighbour, or the same value spelt another way (``-0``, ``3.0``)."""
        leading = _INTEGER.match(number)
        if leading is None or len(leading.group()) > 30:
            return number
        value = int(leading.group())
        spellings = [f"{value + self.rng.randint(-2, 2)}", f"{value}.0", f"{value}e0"]
        spellings += [f"{value}0e-1", f"0{value}", "-0" if value == 0 else f"-{value}"]
        return self.rng.choice(spellings).encode()

    def _number(self, data: bytes) -> bytes:
        return self._tokens(data, _NUMBER, NUMBERS)

    def _string(self, data: bytes) -> bytes:
        return self._tokens(data, _STRING, STRINGS)

    def _text(self, data: bytes) -> bytes:
        """A JSON-ish splice in the header: junk inserted, a span deleted or repeated."""
        header, body = self._split(data)
        rng = self.rng
        at = rng.randrange(len(header) + 1)
        end = min(len(header), at + rng.randint(1, 24))
        kind = rng.randrange(3)
        if kind == 0:
            header = header[:at] + rng.choice(JUNK) + header[at:]
        elif kind == 1:
            header = header[:at] + header[end:]
        else:
            header = header[:end] + b"," + header[at:end] + header[end:]
        return self._frame(header, body)

    def _pad(self, data: bytes) -> bytes:
        header, body = self._split(data)
        pad = self.rng.choice([b" ", b"\t", b"\n", b"\r", b"\x00", b"  \x00", b" x"])
        header = pad * self.rng.randint(1, 9) + header if self.rng.random() < 0.2 else header + pad
        return self._frame(header, body)

    # -- structural mutations of the decoded header

    def _structure(self, data: bytes) -> bytes:
        header, body = self._split(data)
        try:
            obj = json.loads(header)
        except Exception:
            return self._text(data)
        if not isinstance(obj, dict):
            return self._text(data)
        rng = self.rng
        names = [k for k, v in obj.items() if k != "__metadata__" and isinstance(v, dict)]
        kind = rng.randrange(9 if names else 2)
        if kind == 0:
            obj["__metadata__"] = rng.choice(
                [
                    None,
                    1,
                    "x",
                    [],
                    {},
                    {"a": 1},
                    {"a": None},
                    {"a": "b" * rng.randint(0, 99)},
                    {"a": {"b": "c"}},
                    {"": ""},
                ]
            )
        elif kind == 1:
            text = json.dumps(obj)
            entry = rng.choice([*obj.items(), ("__metadata__", {"k": "v"})])
            extra = json.dumps(entry[0]) + ":" + json.dumps(entry[1])
            return self._frame(
                (text[:-1] + ("," if obj else "") + extra + "}").encode("utf-8", "surrogatepass"),
                body,
            )
        else:
            entry = obj[rng.choice(names)]
            if kind == 2:
                many = rng.choice([1, 2, 65, 230, 231, 500])
                if rng.random() < 0.0002:  # rare: a header of some megabytes
                    many = 300_000
                entry["shape"] = [rng.choice(HUGE_DIMS)] * many
            elif kind == 3:
                entry["shape"] = [rng.randint(0, 5) for _ in range(rng.randint(0, 4))]
                _relayout(obj)
            elif kind == 4:
                entry["dtype"] = rng.choice([*stream_st.DTYPES, "F17", "f32", 4, None])
                if rng.random() < 0.7:
                    _relayout(obj)
            elif kind == 5:
                start, end = entry["data_offsets"] if _pair(entry) else (0, 0)
                entry["data_offsets"] = rng.choice(
                    [[end, start], [start, end + 1], [start - 1, end], [start], [], [start, start]]
                )
            elif kind == 6:
                key = rng.choice(["dtype", "shape", "data_offsets"])
                entry.pop(key, None) if rng.random() < 0.5 else entry.update(extra=1)
            elif kind == 7:
                obj[rng.choice(["__metadata__", "", "x", "\u00e9"])] = entry
            else:
                obj = dict(reversed(obj.items()))
        text = json.dumps(
            obj, ensure_ascii=rng.random() < 0.5, separators=rng.choice([(",", ":"), (", ", ": ")])
        )
        return self._frame(text.encode("utf-8", "surrogatepass"), body)

    _mutations: ClassVar[tuple[Callable[[Fuzzer, bytes], bytes], ...]] = (
        *(_flip, _insert, _delete, _truncate, _append, _splice),
        *(_number, _number, _number, _string, _string, _text, _pad),
        *(_structure, _structure, _structure, _structure),
    )


def _pair(entry: dict[str, Any]) -> bool:
    offsets = entry.get("data_offsets")
    return (
        isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    )


def _relayout(obj: dict[str, Any]) -> None:
    """Give every well-formed tensor entry consistent offsets for its dtype and shape."""
    offset = 0
    for value in obj.values():
        if not isinstance(value, dict):
            continue
        code, shape = value.get("dtype"), value.get("shape")
        dtype = stream_st.DTYPES.get(code) if isinstance(code, str) else None
        if (
            dtype is None
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and 0 <= d < 1 << 16 for d in shape)
        ):
            continue
        nbytes = dtype.nbytes(prod(shape))
        if nbytes is None or nbytes > 1 << 16:
            continue
        value["data_offsets"] = [offset, offset + nbytes]
        offset += nbytes


# ---------------------------------------------------------------- the run


@dataclass
class Report:
    """What a run saw: inputs judged, outcomes by kind, findings by signature."""

    inputs: int = 0
    seconds: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    findings: Counter[str] = field(default_factory=Counter)
    peak_rss_mib: int = 0

    def summary(self) -> str:
        rate = self.inputs / self.seconds if self.seconds else 0.0
        lines = [f"{self.inputs} inputs in {self.seconds:.0f} s ({rate:.0f}/s)"]
        lines.append(f"peak resident memory {self.peak_rss_mib} MiB")
        lines += [f"  {count:9d}  {kind}" for kind, count in self.outcomes.most_common()]
        lines += [f"  FINDING {count:6d}  {sig}" for sig, count in self.findings.most_common()]
        lines.append(
            "no finding" if not self.findings else f"{len(self.findings)} kinds of finding"
        )
        return "\n".join(lines)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:60]


def save_finding(directory: Path, data: bytes, cuts: list[int], verdict: Verdict) -> Path:
    """Write the reproducer ``<signature>-<hash>.bin`` and a ``.txt`` that explains it."""
    directory.mkdir(parents=True, exist_ok=True)
    kind = hashlib.sha256(str(verdict.finding).encode()).hexdigest()[:6]
    stem = f"{_slug(str(verdict.finding))[:40]}-{kind}-{hashlib.sha256(data).hexdigest()[:10]}"
    (directory / f"{stem}.bin").write_bytes(data)
    (directory / f"{stem}.txt").write_text(
        f"finding: {verdict.finding}\ndetail: {verdict.detail}\n"
        f"chunks cut at: {cuts[:20]}{' ...' if len(cuts) > 20 else ''} ({len(cuts)} cuts)\n"
    )
    return directory / f"{stem}.bin"


async def fuzz(
    *,
    seed: int = 0,
    inputs: int | None = None,
    seconds: float | None = None,
    findings: Path | None = None,
    keep: int = 3,
    progress: Callable[[Report], None] | None = None,
    slow: float = SLOW_SECONDS,
) -> Report:
    """Judge mutated inputs until ``inputs`` are done or ``seconds`` have passed.

    The first ``keep`` inputs of each finding signature are written to ``findings``. ``slow``
    is the time an input may take before it can be a finding (``math.inf``: speed is not judged,
    as in the test suite, which times nothing).
    """
    rng = random.Random(seed)
    corpus = [*seed_corpus(), *(path.read_bytes() for path in regression_cases())]
    fuzzer = Fuzzer(corpus, rng)
    report = Report()
    began = time.perf_counter()
    with Judge(slow) as judge:
        while inputs is None or report.inputs < inputs:
            if report.inputs % 1000 == 0:
                report.seconds = time.perf_counter() - began
                if seconds is not None and report.seconds >= seconds:
                    break
                if progress is not None and report.inputs % 100_000 == 0:
                    progress(report)
            data = fuzzer.next()
            cuts = chunkings(data, rng)
            verdict = await judge.judge(data, cuts)
            report.inputs += 1
            report.outcomes["finding" if verdict.finding else verdict.outcome] += 1
            if verdict.header is not None:
                fuzzer.add(data, verdict.header)
            if verdict.finding is not None:
                report.findings[verdict.finding] += 1
                if findings is not None and report.findings[verdict.finding] <= keep:
                    save_finding(findings, data, cuts, verdict)
    report.seconds = time.perf_counter() - began
    report.peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return report
