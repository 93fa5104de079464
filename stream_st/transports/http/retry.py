"""How a read over HTTP retries, and how it holds every answer to one version of the object.

:class:`Retries`: which statuses are retried, how long a ``Retry-After`` may make a read wait,
and the exponential back-off between attempts. :class:`VersionPin`: the first answer's validator
(a strong ``ETag``, else ``Last-Modified``) goes with every later request of the read
(``If-Match``, else ``If-Unmodified-Since``), and each later answer is compared with the first,
so a tensor is never made of bytes from two versions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...errors import ReadTimeoutError, SourceChangedError
from ..options import Clock
from .framing import Response, sendable
from .status import RETRYABLE, retry_after

__all__ = ["Retries", "VersionPin"]

_ASKS_TO_WAIT = frozenset({429, 503})  # statuses whose Retry-After is honoured
_MAX_RETRY_AFTER = 300.0  # seconds a Retry-After may ask for when no deadline bounds the read


@dataclass(frozen=True, slots=True)
class Retries:
    """``count`` more attempts after a failed one, ``backoff`` seconds before the first, doubled
    before each next one, unless the server says how long to wait."""

    count: int
    backoff: float

    @staticmethod
    def retryable(status: int) -> bool:
        """True for a status worth asking again for (a timeout, too many requests, a 5xx)."""
        return status in RETRYABLE

    async def server_wait(
        self, response: Response, clock: Clock, name: str, position: int
    ) -> float | None:
        """The seconds to wait before retrying the request ``response`` failed: what its server
        asks (``Retry-After`` on a 429 or 503), else None (the usual back-off). ``inf`` when it
        asks for more than 5 minutes and no deadline says the read may wait that long: no retry.
        Past the deadline: :class:`ReadTimeoutError` at once (closing ``response``)."""
        asked = retry_after(response.headers) if response.status in _ASKS_TO_WAIT else None
        if asked is None:
            return None
        if asked > clock.remaining():
            await response.aclose()
            raise ReadTimeoutError(
                f"the server asked to retry after {round(asked, 1):g} s (Retry-After), past the "
                f"deadline of {clock.limits.deadline:g} s",
                url=name,
                position=position,
            )
        if asked > _MAX_RETRY_AFTER and clock.limits.deadline is None:
            return math.inf
        return asked

    def delay(self, failures: int) -> float:
        """The exponential back-off's seconds before the next attempt after ``failures``
        failed ones."""
        return self.backoff * 2.0 ** (failures - 1)

    async def back_off(
        self, clock: Clock, failures: int, name: str, position: int, wait: float | None = None
    ) -> None:
        """Wait before the next attempt after ``failures`` failed ones: ``wait`` seconds when
        the server said, else :meth:`delay`; a deadline that passes first ends the read
        instead."""
        await clock.pause(self.delay(failures) if wait is None else wait, name, position)


class VersionPin:
    """The version of an object a read has seen: its first successful answer's ``ETag`` and
    ``Last-Modified``."""

    __slots__ = ("seen",)

    def __init__(self) -> None:
        self.seen: tuple[str, str] | None = None

    def _pinning(self) -> int:
        """Which of the first answer's validators pins the version: 0, its ETag, where it is
        strong or there is no Last-Modified; else 1, its Last-Modified (a weak ETag does not
        vouch for bytes)."""
        assert self.seen is not None
        etag, modified = self.seen
        return 1 if modified and (not etag or etag.startswith("W/")) else 0

    def preconditions(self) -> dict[str, str]:
        """The headers that make a later request of this read answer for the version of the
        first answer only: ``If-Match`` with its strong ETag, else ``If-Unmodified-Since`` with
        its Last-Modified; none for a weak ETag alone, nor for a validator no request header can
        carry (a server's answer holding a NUL: :meth:`check` still compares later answers
        with it)."""
        if self.seen is None:
            return {}
        etag, modified = self.seen
        if self._pinning():
            pinned = {"If-Unmodified-Since": modified}
        else:
            pinned = {"If-Match": etag} if etag and not etag.startswith("W/") else {}
        return {key: value for key, value in pinned.items() if sendable(value)}

    async def check(self, response: Response, name: str, position: int) -> None:
        """Pin the object's version on the first successful answer; on a later one, raise
        :class:`SourceChangedError` (closing ``response``) if it serves another version, or is
        a 412 to the preconditions. Any other error status (a 503, a 403 for a signature that
        expired, a 404) speaks of the server or the request, not of a version, and names none
        (S3 and CloudFront send no ``ETag`` with one): it is left to be raised as itself."""
        if response.status >= 300 and response.status != 412:
            return
        seen = (response.headers.get("etag", ""), response.headers.get("last-modified", ""))
        if self.seen is None:
            if response.status < 300:
                self.seen = seen
            return
        if response.status == 412:
            asked = ", ".join(f"{key}: {value}" for key, value in self.preconditions().items())
            change = f"412 Precondition Failed to {asked}"
        else:
            keys = ("ETag", "Last-Modified")
            # The validator that pinned the version (a strong ETag, else Last-Modified, else a
            # weak ETag) must come again: an answer without it could be any version (a 206
            # carries the validators a 200 would); the other one may be left out, not changed.
            pinning = self._pinning()
            changes = [
                f"{key} {old!r}, then {new!r}" if new else f"{key} {old!r}, then none"
                for at, (key, old, new) in enumerate(zip(keys, self.seen, seen, strict=True))
                if old and old != new and (new or at == pinning)
            ]
            if not changes:
                return
            change = "; ".join(changes)
        await response.aclose()
        raise SourceChangedError(
            f"the object changed on the server during the read: {change}",
            url=name,
            position=position,
        )
