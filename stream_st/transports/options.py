"""Time limits of an operation: the one policy for ``timeout``, ``deadline``, ``speed_limit`` and
``speed_time``, how they are checked and how every transport wait obeys them.

* ``timeout``: seconds any single wait for the transport (connecting, the next bytes, the peer
  taking bytes) may last.
* ``deadline``: seconds for the whole operation, from the call that opens it (``open()``, the
  first iteration, ``load``) until its last byte. Checked at every wait and before every tensor,
  so it also ends a long read of a local file between two tensors.
* ``speed_limit`` (bytes per second) and ``speed_time`` (seconds), in the spirit of curl's
  ``--speed-limit``/``--speed-time``: the transfer fails when, over ``speed_time`` seconds spent
  waiting on the transport, fewer than ``speed_limit * speed_time`` bytes moved. Only time spent
  waiting counts: a consumer that takes its time between tensors is not blamed for it. Either one
  alone enables the guard: ``speed_time`` defaults to 30 s (curl's default), ``speed_limit`` to
  1 byte per second.

Every limit that passes raises :class:`~stream_st.ReadTimeoutError` saying which one. Values are
checked once, when an entry point is called (:class:`Limits`): finite numbers >= 0 or ``None``
(``timeout`` and ``deadline`` also take ``inf``, meaning no limit); anything else is a
:class:`~stream_st.UsageError`.

A transport plugs in by waiting inside ``with self.clock.waiting(name, position):`` (only where it
really waits: data already buffered needs none) and reporting what moved with
``self.clock.moved(count)``; the reader and writer give every source and sink the clock of their
operation. Not public API.

The other options of an operation, ``headers`` and ``ssl_context`` (:class:`Transport`), travel
with its clock: every path that opens a transport (a source, a sink, an index, each shard)
already receives the operation's clock, so none can miss them. They are validated with the
limits, in :func:`clock_of`.
"""

from __future__ import annotations

import math
import ssl
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, fields, replace
from numbers import Real
from typing import TypedDict

import anyio

from ..errors import ArgumentTypeError, ReadTimeoutError, UsageError, integer_at_least

HEADER_BREAKS = "\r\n\0"
"""What no request header's value may hold: each would end its line early (a header of the
value's choosing). Checked where ``headers=`` is given and again on every request's head."""

_FRAMING = frozenset(
    {
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "te",
        "trailer",
        "upgrade",
        "expect",
        "keep-alive",
        "proxy-connection",
        "range",
        "if-range",
    }
)
"""The headers (in lower case) that frame a request, its connection or the bytes it asks for:
the client writes those it needs itself, and one given in ``headers=`` beside them could make
the server read another body or another request than the one sent, or answer with other bytes
than the ones asked for (a second ``Range``, an ``If-Range`` turning a ranged answer whole)."""

__all__ = [
    "NO_LIMITS",
    "NO_TRANSPORT",
    "UNLIMITED",
    "Clock",
    "LimitOptions",
    "Limits",
    "Transport",
    "TransportOptions",
    "checked_number",
    "clock_of",
    "credential_problem",
    "header_problem",
]

DEFAULT_SPEED_TIME = 30.0
"""Seconds of waiting over which the speed guard measures, when only ``speed_limit`` is given."""

DEFAULT_SPEED_LIMIT = 1.0
"""Bytes per second the speed guard asks for, when only ``speed_time`` is given."""


class LimitOptions(TypedDict, total=False):
    """The keyword arguments every reading and writing entry point takes (see the module)."""

    timeout: float | None
    deadline: float | None
    speed_limit: float | None
    speed_time: float | None


class TransportOptions(LimitOptions, total=False):
    """The keyword arguments every entry point that takes a URL takes: the limits, plus
    ``headers`` (sent with every HTTP or S3 request; S3 signs them) and ``ssl_context`` (the
    certificates https trusts; default: the system's)."""

    headers: Mapping[str, str] | None
    ssl_context: ssl.SSLContext | None


def checked_number(
    name: str, value: object, *, infinite: bool = True, zero: bool = True
) -> float | None:
    """Option ``name``'s ``value`` as a float: ``None``, or a number >= 0 (> 0 unless ``zero``;
    finite unless ``infinite``). Anything else (NaN, a bool, a string) is a UsageError. A number
    too large for a float (``10**400``) is infinite."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Real):
        raise UsageError(f"{name} must be a number or None, got {type(value).__name__} {value!r}")
    try:
        number = float(value)
    except OverflowError:
        number = -math.inf if value < 0 else math.inf
    if math.isnan(number) or number < 0 or (number == 0 and not zero):
        floor = ">= 0" if zero else "> 0"
        raise UsageError(f"{name} must be a number {floor}, got {number!r}")
    if math.isinf(number) and not infinite:
        raise UsageError(f"{name} must be finite, got {number!r}")
    return number


def header_problem(value: str) -> str | None:
    """What keeps ``value`` (a credential) out of an HTTP header: a line break or another control
    character (it would inject a header), or a character Latin-1 cannot encode (one a header
    cannot carry); None when it can go as it is. Callers name where the value came from, never
    the value."""
    if any(c != "\t" and (c < " " or c == "\x7f") for c in value):  # RFC 9110: tab is text
        return "a line break or another control character"
    if any(c > "\xff" for c in value):  # beyond Latin-1 (a header's obs-text goes to 0xFF)
        return "characters beyond Latin-1, which an HTTP header cannot carry"
    return None


def credential_problem(value: str) -> str | None:
    """:func:`header_problem` for a key or token, which also refuses whitespace at either end:
    text a header may carry, but a server strips it from a header's value (a token pasted with a
    tab or a no-break space would fail as refused, unexplained)."""
    problem = header_problem(value)
    if problem is None and value != value.strip():
        return "whitespace at its start or end"
    return problem


@dataclass(frozen=True, slots=True)
class Limits:
    """The validated limits of an operation; see the module. Build one with :meth:`of`."""

    timeout: float | None = None
    deadline: float | None = None
    speed_limit: float | None = None
    speed_time: float | None = None

    def __post_init__(self) -> None:
        checked = {
            "timeout": checked_number("timeout", self.timeout),
            "deadline": checked_number("deadline", self.deadline),
            "speed_limit": checked_number("speed_limit", self.speed_limit, infinite=False),
            "speed_time": checked_number("speed_time", self.speed_time, infinite=False, zero=False),
        }
        if checked["timeout"] == math.inf:
            checked["timeout"] = None
        if checked["deadline"] == math.inf:
            checked["deadline"] = None
        if checked["speed_limit"] == 0:  # as in curl, a limit of 0 turns the guard off
            checked["speed_limit"] = checked["speed_time"] = None
        elif checked["speed_limit"] is not None or checked["speed_time"] is not None:
            if checked["speed_limit"] is None:
                checked["speed_limit"] = DEFAULT_SPEED_LIMIT
            if checked["speed_time"] is None:
                checked["speed_time"] = DEFAULT_SPEED_TIME
        for name, value in checked.items():
            object.__setattr__(self, name, value)

    @classmethod
    def of(cls, options: Mapping[str, object], *, transport: bool = True) -> Limits:
        """The limits named by an entry point's keyword arguments; unknown ones (a misspelt
        keyword) are an :class:`~stream_st.ArgumentTypeError`, a ``TypeError`` as Python's own
        for an unexpected keyword argument. ``transport``: whether the entry point also takes
        ``headers`` and ``ssl_context`` (the message lists what it takes)."""
        known = {field.name for field in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            takes = "headers, ssl_context and the limits" if transport else "the limits"
            raise ArgumentTypeError(
                f"unknown option(s) {unknown} (unexpected keyword arguments); the options are "
                f"{takes} {sorted(known)}"
            )
        return cls(**options)  # type: ignore[arg-type]  # each value is checked on construction

    @property
    def limited(self) -> bool:
        """True when any limit is set."""
        return self != NO_LIMITS


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Transport:
    """The validated ``headers`` and ``ssl_context`` of an operation (see the module), and the
    ``concurrency`` of a read (ranged requests at once per remote object; None: the source's
    own, adaptive by default)."""

    headers: tuple[tuple[str, str], ...] = ()
    ssl_context: ssl.SSLContext | None = None
    concurrency: int | None = None

    def reading(self, concurrency: object) -> Transport:
        """These options for a read of ``concurrency`` requests at once (None: the sources'
        own); UsageError unless it is an integer >= 1."""
        if concurrency is None:
            return self
        return replace(self, concurrency=integer_at_least("concurrency", concurrency, 1))

    @classmethod
    def of(cls, headers: object = None, ssl_context: object = None) -> Transport:
        """Check the options: UsageError unless ``headers`` is a mapping of str to str that a
        request can carry (see :func:`header_problem`; the value never shown; none of the
        headers that frame it, such as Content-Length or Host), and
        ``ssl_context`` an :class:`ssl.SSLContext` (each may be None)."""
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise UsageError(
                f"ssl_context must be an ssl.SSLContext, got {type(ssl_context).__name__}"
            )
        if headers is None:
            return cls((), ssl_context)
        if not isinstance(headers, Mapping):
            raise UsageError(
                f"headers must be a mapping of str to str, got {type(headers).__name__}"
            )
        pairs = []
        for name, value in headers.items():
            # A value is never shown: it may be a token (a trailing newline read from a file).
            if not (isinstance(name, str) and isinstance(value, str)):
                raise UsageError(
                    f"headers must map str to str, got {name!r} mapped to {type(value).__name__}"
                )
            if not name or any(c in name for c in ":\r\n \t") or header_problem(name):
                raise UsageError(f"header {name!r} has no valid name")
            if name.lower() in _FRAMING:
                raise UsageError(
                    f"header {name!r} frames the request, which the client does itself: "
                    "it cannot be given"
                )
            problem = header_problem(value)
            if problem is not None:
                raise UsageError(f"the value of header {name!r} holds {problem}")
            pairs.append((name, value))
        return cls(tuple(pairs), ssl_context)

    def over(self, headers: Mapping[str, str]) -> dict[str, str]:
        """``headers`` with these on top (a name given in both, in any case, takes this value)."""
        mine = {name.lower() for name, _ in self.headers}
        out = {k: v for k, v in headers.items() if k.lower() not in mine}
        out.update(self.headers)
        return out

    def __bool__(self) -> bool:
        return bool(self.headers) or self.ssl_context is not None or self.concurrency is not None

    def __repr__(self) -> str:  # header names only: a value may be a credential
        names = [name for name, _ in self.headers]
        return (
            f"Transport(headers={names!r}, ssl_context={self.ssl_context!r}, "
            f"concurrency={self.concurrency!r})"
        )


NO_TRANSPORT = Transport()


_UNBOUND: AbstractContextManager[None] = nullcontext()
"""What :meth:`Clock.waiting` gives without limits: a wait bound by nothing."""


class Clock:
    """One operation's limits, as time passes; every transport wait goes through it.

    The timeout applies from the start; the deadline and the speed guard from :meth:`start`
    (called when the operation opens: on a connection, waiting for the next message to begin
    counts against neither).
    """

    def __init__(self, limits: Limits = NO_LIMITS, transport: Transport = NO_TRANSPORT) -> None:
        self.limits = limits
        self.transport = transport
        self._ends_at: float | None = None  # monotonic time of the deadline, once started
        self._guarding = False  # the speed guard runs once started
        self._window_waited = 0.0  # seconds waited in the current speed window
        self._window_bytes = 0  # bytes moved in the current speed window

    @property
    def limited(self) -> bool:
        """True when any limit is set."""
        return self.limits is not NO_LIMITS and self.limits.limited  # most: known by identity

    def start(self) -> None:
        """The operation opens: the deadline and the speed guard run from now. Idempotent."""
        limits = self.limits
        if limits.deadline is not None and self._ends_at is None:
            self._ends_at = time.monotonic() + limits.deadline
        self._guarding = limits.speed_limit is not None

    def moved(self, count: int) -> None:
        """``count`` bytes went through the transport."""
        if self._guarding:
            self._window_bytes += count

    def check(self, name: str, position: int | None = None) -> None:
        """Raise :class:`~stream_st.ReadTimeoutError` if the deadline has passed."""
        if self._ends_at is not None and time.monotonic() >= self._ends_at:
            raise ReadTimeoutError(self._deadline_passed(), url=name, position=position)

    def remaining(self) -> float:
        """Seconds left before the deadline: ``inf`` without one (or before :meth:`start`)."""
        return math.inf if self._ends_at is None else self._ends_at - time.monotonic()

    async def pause(self, seconds: float, name: str, position: int | None = None) -> None:
        """Sleep ``seconds`` before another attempt, never past the deadline: when it comes
        first, raise :class:`~stream_st.ReadTimeoutError` then (at once if it has passed)."""
        left = self.remaining()
        await anyio.sleep(max(0.0, min(seconds, left)))
        if left <= seconds:
            raise ReadTimeoutError(self._deadline_passed(), url=name, position=position)

    def within_deadline(
        self, name: str, position: int | None = None
    ) -> AbstractContextManager[None]:
        """Bound work that is no wait for the transport (a big header's parse, a local file's
        read by worker threads) by the deadline alone; :class:`~stream_st.ReadTimeoutError`
        when it passes. Without a deadline nothing is bound, at the cost of no generator."""
        if self._ends_at is None:
            return _UNBOUND
        return self._until_deadline(name, position)

    def deadline_stop(self, name: str) -> Callable[[], bool] | None:
        """A ``stop`` for work in a worker thread asked between its steps (a local file's write,
        block by block: see :func:`~.file.atomic.write_blocks`) that raises
        :class:`~stream_st.ReadTimeoutError` once the deadline has passed; None without one."""
        if self._ends_at is None:
            return None

        def stop() -> bool:
            self.check(name)
            return False

        return stop

    @contextmanager
    def _until_deadline(self, name: str, position: int | None) -> Iterator[None]:
        assert self._ends_at is not None  # see within_deadline
        with anyio.move_on_after(self._ends_at - time.monotonic()) as scope:
            yield
        if scope.cancelled_caught:
            raise ReadTimeoutError(self._deadline_passed(), url=name, position=position)

    def waiting(
        self, name: str | None = None, position: int | None = None, *, stalled: str = "no data"
    ) -> AbstractContextManager[None]:
        """Bound the wait in the ``with`` block by every limit.

        A limit that passes raises :class:`~stream_st.ReadTimeoutError` for ``name`` at
        ``position``; with no ``name``, a plain :class:`TimeoutError` with the same message, for
        callers that translate OS errors themselves. ``stalled`` says what the timeout saw
        ("no data", "the peer took no data"). Without limits (most reads) nothing is bound, at
        the cost of no generator: a wait is taken per chunk, some of a few KiB.
        """
        if not self.limited:
            return _UNBOUND
        return self._bounded(name, position, stalled)

    @contextmanager
    def _bounded(self, name: str | None, position: int | None, stalled: str) -> Iterator[None]:
        bound, reason = self._bound(stalled)
        if bound <= 0:
            raise self._error(reason, name, position)
        began = time.monotonic()
        with anyio.move_on_after(bound) as scope:
            yield
        if scope.cancelled_caught:
            raise self._error(reason, name, position)
        if self._guarding:
            self._waited(time.monotonic() - began, name, position)

    def _bound(self, stalled: str) -> tuple[float, str]:
        """The longest the next wait may last, and what to say when it does."""
        limits = self.limits
        bound, reason = math.inf, ""
        if limits.timeout is not None:
            bound, reason = limits.timeout, f"{stalled} for {limits.timeout:g} s (timeout)"
        if self._ends_at is not None and self._ends_at - time.monotonic() < bound:
            bound, reason = self._ends_at - time.monotonic(), self._deadline_passed()
        if self._guarding:
            # No bytes move during a wait: a window short of bytes fails when it ends, and one
            # with enough is followed by another, which fails if the wait fills it all.
            left = self._speed_time() - self._window_waited
            if self._window_bytes >= self._needed():
                left += self._speed_time()
            if left < bound:
                bound, reason = left, self._too_slow()
        return bound, reason

    def _waited(self, seconds: float, name: str | None, position: int | None) -> None:
        """Count a wait that ended in time against the speed windows.

        The bytes moved so far count for the first window the wait ends; any later one it spans
        saw none. Constant time, however many windows that is (``speed_time`` may be tiny).
        """
        ended, self._window_waited = divmod(self._window_waited + seconds, self._speed_time())
        if not ended:
            return
        needed = self._needed()  # 0 only when speed_limit * speed_time underflows
        if self._window_bytes < needed or (ended > 1 and needed > 0):
            raise self._error(self._too_slow(), name, position)
        self._window_bytes = 0

    def _speed_time(self) -> float:
        assert self.limits.speed_time is not None
        return self.limits.speed_time

    def _needed(self) -> float:
        assert self.limits.speed_limit is not None
        return self.limits.speed_limit * self._speed_time()

    def _deadline_passed(self) -> str:
        return f"the deadline of {self.limits.deadline:g} s passed"

    def _too_slow(self) -> str:
        return (
            f"the transfer stayed below {self.limits.speed_limit:g} bytes/s for "
            f"{self._speed_time():g} s (speed_limit)"
        )

    @staticmethod
    def _error(reason: str, name: str | None, position: int | None) -> OSError:
        if name is None:
            return TimeoutError(reason)
        return ReadTimeoutError(reason, url=name, position=position)


def clock_of(options: Mapping[str, object]) -> Clock:
    """The clock of an operation called with ``options`` (:class:`TransportOptions`), every one
    checked; UsageError for a bad value or an unknown option."""
    if not options:  # most calls: nothing to check
        return Clock()
    limits = dict(options)
    transport = Transport.of(limits.pop("headers", None), limits.pop("ssl_context", None))
    return Clock(Limits.of(limits), transport)


UNLIMITED = Clock()
"""The clock of a transport used outside any limited operation: every wait is unbounded."""
