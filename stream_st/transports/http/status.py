"""What an answer's status means to the caller: the errors for error statuses and lost answers,
and how long a server asks to wait before the next attempt.

Error messages are one line: an S3 ``<Error>`` is reduced to its ``<Code>`` and ``<Message>``,
any other body (HTML pages included) to a short excerpt with its markup and line breaks gone.
S3's answer to a bucket asked for in another region (301 ``PermanentRedirect``, no
``Location``) names the bucket's region and endpoint, from ``x-amz-bucket-region`` and the body.
The body itself stays on the error (``.body``), unless it is encoded (compressed): bodies are
asked for as they are, and an encoded one is never taken for what was asked.
"""

from __future__ import annotations

import datetime as dt
import email.utils
import html
import math
import re
from collections.abc import Mapping
from typing import Protocol

from ...errors import (
    HTTPNotFoundError,
    HTTPStatusError,
    OutcomeUnknownError,
    TransportError,
    redact,
)

__all__ = [
    "RETRYABLE",
    "ascii_number",
    "outcome_unknown",
    "raise_for_status",
    "retry_after",
    "summary",
    "unreadable_coding",
    "xml_field",
]

RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})
"""Statuses worth asking again for: a timeout, too many requests, a 5xx."""

_NUMBER_DIGITS = 100  # far beyond any size or count; int() refuses more than 4300


class Answer(Protocol):
    """What :func:`raise_for_status` needs of an answer (a ``framing.Response`` has it): its
    status, headers and URL, and a way to read its body and to close it."""

    url: str
    status: int
    reason: str
    headers: dict[str, str]

    async def read_all(self, limit: int = ...) -> bytes: ...

    async def aclose(self) -> None: ...


_BODY_LIMIT = 64 << 10  # of an error answer's body, kept on the error
_EXCERPT = 200  # characters of a body shown in a message
_MARKUP = re.compile(r"<[^<>]*>")  # [^<>]: a run of "<" with no ">" stays linear
_NO_CODING = frozenset({"", "identity"})


def unreadable_coding(headers: Mapping[str, str]) -> str | None:
    """The header naming a coding of the body other than chunks (``Content-Encoding: gzip``),
    which this client does not undo; None for a body sent as it is."""
    content = headers.get("content-encoding", "").strip().lower()
    if content not in _NO_CODING:
        return f"Content-Encoding: {content[:40]}"
    transfer = headers.get("transfer-encoding", "").lower()
    if {coding.strip() for coding in transfer.split(",")} - _NO_CODING - {"chunked"}:
        return f"Transfer-Encoding: {transfer[:40]}"
    return None


def xml_field(xml: bytes | str, tag: str) -> str | None:
    """The text of the first ``<tag>`` element in ``xml``, entities decoded."""
    text = xml.decode("utf-8", "replace") if isinstance(xml, bytes) else xml
    match = re.search(f"<{tag}>([^<]*)</{tag}>", text)
    return None if match is None else html.unescape(match[1])


def summary(body: bytes) -> str:
    """One line saying what an error answer's ``body`` says: ``Code: Message`` for an S3
    ``<Error>``, else its text with markup and runs of white space collapsed, cut short."""
    text = body.decode("utf-8", "replace")
    code = xml_field(text, "Code")
    if code is not None:
        text = f"{code}: {xml_field(text, 'Message') or ''}"
    elif text.lstrip().startswith("<"):
        text = html.unescape(_MARKUP.sub(" ", text))
    text = " ".join(text.split()).rstrip(":")
    return text if len(text) <= _EXCERPT else text[: _EXCERPT - 3] + "..."


async def raise_for_status(response: Answer, *, name: str | None = None) -> None:
    """Turn an answer other than 1xx or 2xx into :class:`HTTPStatusError` (404:
    :class:`HTTPNotFoundError`): an error, or a redirect not followed (the request was not
    carried out where it was sent).

    ``name`` is the address to report (e.g. ``s3://bucket/key``), by default the HTTP URL.
    """
    if response.status < 300:
        return
    try:
        body = b"" if unreadable_coding(response.headers) else await response.read_all(_BODY_LIMIT)
    except TransportError:
        body = b""
    finally:
        await response.aclose()
    detail = summary(body)
    if response.status == 304:  # not asked for (the cache's If-None-Match handles its own)
        where = "not modified, an answer only to If-None-Match or If-Modified-Since (never to "
        where += "If-Match or If-Unmodified-Since)"
        detail = f"{where}: {detail}" if detail else where
    elif response.status < 400:
        location = response.headers.get("location")
        moved = None if location else _bucket_elsewhere(response.headers, body)
        # Masked before it is cut: a password cut from its '@' would no longer be seen as one.
        where = moved or f"redirected to {redact(location or 'nowhere')[:200]}"
        detail = f"{where}: {detail}" if detail else where
    kind = HTTPNotFoundError if response.status == 404 else HTTPStatusError
    raise kind(response.status, response.reason, url=name or response.url, detail=detail, body=body)


def _bucket_elsewhere(headers: Mapping[str, str], body: bytes) -> str | None:
    """Where S3 says the bucket is, when asked for in another region than its own (its region:
    ``x-amz-bucket-region`` or ``<Region>``; its endpoint: ``<Endpoint>``), and what to do; None
    when the answer says neither."""
    found = [
        (what, " ".join(value.split())[:100])
        for what, value in (
            ("region", headers.get("x-amz-bucket-region") or xml_field(body, "Region") or ""),
            ("endpoint", xml_field(body, "Endpoint") or ""),
        )
        if value.strip()
    ]
    if not found:
        return None
    named = ", ".join(f"{what} {value}" for what, value in found)
    return f"the bucket is elsewhere ({named}): give its region (region=, AWS_REGION, --region)"


def ascii_number(text: str) -> int | None:
    """``text`` as a whole number when it is ASCII digits alone (at most 100), None otherwise:
    what a number in a header, a status or a file name must be. ``str.isdigit`` takes ``'²'``,
    which ``int`` refuses, and ``int`` takes ``' 1_0'`` and other scripts' digits."""
    if text.isascii() and text.isdigit() and len(text) <= _NUMBER_DIGITS:
        return int(text)
    return None


def retry_after(headers: Mapping[str, str]) -> float | None:
    """The seconds a ``Retry-After`` header asks to wait (a number of seconds or an HTTP date),
    at least 0; None without a usable one."""
    value = headers.get("retry-after", "").strip()
    number = ascii_number(value)
    if number is not None:
        return float(number)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:  # "-0000": UTC, as HTTP dates are
        when = when.replace(tzinfo=dt.UTC)
    seconds = (when - dt.datetime.now(dt.UTC)).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


def outcome_unknown(
    request: str, failure: BaseException, url: str, more: str = ""
) -> OutcomeUnknownError:
    """The error for a final ``request`` whose answer was lost to ``failure`` (or unclear): the
    object may or may not have been stored at ``url``. ``more`` is added to the message."""
    reason = str(failure).split(", url=", 1)[0] or type(failure).__name__
    return OutcomeUnknownError(
        f"no clear answer to the {request} ({reason}): the object may or may not have been "
        f"stored{more}",
        url=url,
    )
