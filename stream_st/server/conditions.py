"""How a GET or HEAD of the served object is answered: byte ranges (RFC 9110 section 14) and
conditional requests (section 13), as pure functions of the request's header values. No I/O.

The order of the checks is the RFC's (13.2.2): ``If-Match`` (412 unless it names the ETag),
``If-None-Match`` (304 when it does), then ``Range`` for a GET, honoured only where
``If-Range`` (if any) names the ETag. Only strong ETags are served, so a weak one never matches
``If-Match`` or ``If-Range``. One range is served (206); a syntax this module does not take, a
unit other than ``bytes`` or several ranges at once ask for nothing it can answer better than
the whole object (200), as the RFC allows; a range that starts past the end is 416.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

__all__ = ["UNSATISFIABLE", "Answer", "answer", "byte_range", "etags"]

UNSATISFIABLE: Literal["unsatisfiable"] = "unsatisfiable"

_RANGE = re.compile(r"\s*bytes\s*=\s*(\d{0,30})\s*-\s*(\d{0,30})\s*", re.IGNORECASE | re.ASCII)
"""One range; positions of more than 30 digits (far beyond any object) make the header one this
server ignores, as one it cannot parse, not a number it cannot convert."""
_ETAG = re.compile(r'\s*(W/)?("[\x21\x23-\x7e\x80-\xff]*")\s*(?:,|$)')


@dataclass(frozen=True, slots=True)
class Answer:
    """What to answer: ``status`` (200, 206, 304, 412 or 416) and, for 200 and 206, the body:
    bytes ``start`` to ``end`` (exclusive) of the object."""

    status: int
    start: int = 0
    end: int = 0


def byte_range(value: str, size: int) -> tuple[int, int] | Literal["unsatisfiable"] | None:
    """The bytes ``(start, end)`` (end exclusive) a ``Range`` header asks of an object of
    ``size`` bytes; :data:`UNSATISFIABLE` when none of them exists; None when the header is to
    be ignored (not one ``bytes`` range of valid syntax, or a last byte before the first)."""
    match = _RANGE.fullmatch(value)
    if match is None:
        return None
    first, last = match[1], match[2]
    if not first:  # -n: the last n bytes
        if not last:
            return None
        count = int(last)
        return (max(size - count, 0), size) if count else UNSATISFIABLE
    start = int(first)
    if last and int(last) < start:
        return None
    if start >= size:
        return UNSATISFIABLE
    return start, size if not last else min(int(last) + 1, size)


def etags(value: str) -> list[tuple[bool, str]] | Literal["*"] | None:
    """The entity tags of an ``If-Match`` / ``If-None-Match`` value, each as (weak, tag with
    its quotes); ``"*"`` for any; None if the value is not a list of entity tags."""
    if value.strip() == "*":
        return "*"
    found: list[tuple[bool, str]] = []
    position = 0
    while position < len(value):
        match = _ETAG.match(value, position)
        if match is None or match.end() == position:
            return None
        found.append((bool(match[1]), match[2]))
        position = match.end()
    return found or None


def _matches(value: str, etag: str, *, weak: bool) -> bool:
    """Whether the list ``value`` names ``etag`` (``weak``: by the weak comparison)."""
    tags = etags(value)
    if tags == "*":
        return True
    return tags is not None and any(tag == etag and (weak or not w) for w, tag in tags)


def answer(
    method: str,
    size: int,
    etag: str,
    *,
    range_: str | None = None,
    if_match: str | None = None,
    if_none_match: str | None = None,
    if_range: str | None = None,
) -> Answer:
    """The answer to a GET or HEAD (``method``) of an object of ``size`` bytes whose strong ETag
    is ``etag`` (with its quotes), given the request's header values (None: absent)."""
    if if_match is not None and not _matches(if_match, etag, weak=False):
        return Answer(412)
    if if_none_match is not None and _matches(if_none_match, etag, weak=True):
        return Answer(304)
    whole = Answer(200, 0, size)
    if method != "GET" or range_ is None:
        return whole
    if if_range is not None and if_range.strip() != etag:  # a date or another tag: the whole
        return whole
    wanted = byte_range(range_, size)
    if wanted is None:
        return whole
    if wanted == UNSATISFIABLE:
        return Answer(416)
    return Answer(206, *wanted)
