"""``http://`` and ``https://`` sources, with Range requests where the server has them.

The first request asks for the first 64 KiB (``Range: bytes=0-65535``). Its answer tells
everything needed: the total size (``Content-Range``) and whether ranges work (206) or not (200).

* Header only: that one request serves the prefix and a header up to 64 KiB - 8; a larger header
  costs one more ranged request. At most 2 requests and header + 64 KiB of transfer.
* Every tensor: the rest of the file in one more ranged request, read straight into the arrays.
* ``include=``: one ranged request per run of adjacent selected tensors (the reader's plan).
* No Range support (200): the answer is the whole body, streamed; skipped bytes are discarded.

A ranged read that breaks (connection reset, closed mid-body, 5xx) is resumed from the byte it
reached, up to ``retries`` times per read (one tensor, or the header) with exponential backoff. A
body that still ends early is reported by the reader as a
:class:`~stream_st.TruncatedStreamError` naming the URL and the offset; a server that stops
sending raises :class:`~stream_st.ReadTimeoutError` after ``timeout`` seconds.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import anyio

from .._http import HTTPClient, HTTPStatusError, Response, raise_for_status
from ..errors import ReadTimeoutError, TransportError
from .base import Source

__all__ = ["FIRST_RANGE", "HttpSource"]

FIRST_RANGE = 64 << 10
"""Bytes asked for by the first request: the prefix, the header (usually) and some data."""

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class HttpSource(Source):
    """An object at an ``http(s)://`` URL; a whole object, random access when ranges work."""

    def __init__(
        self,
        url: str,
        *,
        client: HTTPClient | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float | None = None,
        retries: int = 3,
        backoff: float = 0.25,
        name: str | None = None,
    ) -> None:
        super().__init__()
        self.url = url
        self.name = name or url
        self._owns_client = client is None
        self._client = client or HTTPClient(timeout=timeout)
        self._headers = dict(headers or {})
        self._retries = retries
        self._backoff = backoff
        self._response: Response | None = None
        self._response_at = 0  # absolute offset of the next byte the open response delivers
        self._response_end = 0  # absolute offset where the open response's body ends
        self._plan: list[tuple[int, int]] = []

    async def start(self) -> None:
        """Send the first request (the first 64 KiB) and learn size and Range support."""
        response = await self._get(0, FIRST_RANGE)
        if response is None:  # an empty object
            self.size = 0
            self.random_access = True
        else:
            self._adopt(response, 0)

    def _adopt(self, response: Response, start: int) -> None:
        if response.status == 206:
            match = _CONTENT_RANGE.fullmatch(response.headers.get("content-range", ""))
            if match is None or int(match.group(1)) != start:
                raise TransportError(
                    f"unusable Content-Range {response.headers.get('content-range')!r}",
                    url=self.name,
                )
            if match.group(3) != "*":
                self.size = int(match.group(3))
            self.random_access = True
            end = int(match.group(2)) + 1
        else:  # 200: the whole body, from byte 0
            self.size = response.content_length
            self.random_access = False
            end = self.size if self.size is not None else 1 << 62
        self._response = response
        self._response_at = start
        self._response_end = end

    async def _get(self, start: int, end: int | None) -> Response | None:
        """GET from ``start`` (to ``end``, exclusive, or the end), retrying retryable failures."""
        headers = dict(self._headers)
        headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        for attempt in range(self._retries + 1):
            try:
                response = await self._client.request(
                    "GET", self.url, self.prepare_headers("GET", self.url, headers)
                )
            except TransportError:
                if attempt == self._retries:
                    raise
            else:
                if response.status == 416 and start == 0:  # an empty object
                    await response.aclose()
                    return None
                if response.status not in _RETRYABLE_STATUS or attempt == self._retries:
                    await raise_for_status(response, name=self.name)
                    return response
                await response.aclose()
            await anyio.sleep(self._backoff * 2**attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def prepare_headers(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        """The headers to send with a request; object stores sign them here."""
        return headers

    async def plan_reads(self, ranges: Sequence[tuple[int, int]]) -> None:
        self._plan = list(ranges)

    def _planned_end(self, offset: int, minimum: int) -> int:
        """Where a request from ``offset`` should end: the end of the planned run it falls in,
        and at least ``minimum`` (the bytes asked for now)."""
        for start, end in self._plan:
            if start <= offset < end:
                return max(end, minimum)
        return minimum

    async def receive_into(self, buffer: memoryview) -> int:
        return await self._read_at(self.position, buffer, partial=True)

    async def fill(self, buffer: memoryview) -> int:
        return await self._read_at(self.position, buffer, partial=False)

    async def read_into_at(self, offset: int, buffer: memoryview) -> int:
        return await self._read_at(offset, buffer, partial=False)

    async def skip(self, count: int) -> int:
        if self.random_access:
            target = self.position + count
            if self.size is not None:
                target = min(target, self.size)
            skipped = target - self.position
            self.position = target
            return skipped
        return await super().skip(count)

    async def _read_at(self, offset: int, buffer: memoryview, *, partial: bool) -> int:
        if offset != self.position:
            if not self.random_access and offset > self.position:
                await super().skip(offset - self.position)
                if self.position != offset:
                    return 0
            else:
                self.position = offset
        filled = 0
        failures = 0
        while filled < len(buffer):
            at = offset + filled
            if self.size is not None and at >= self.size:
                break
            response = self._response
            if response is None or self._response_at != at or at >= self._response_end:
                if not self.random_access and response is not None:
                    break  # a 200 stream cannot jump: the body ended
                await self._close_response()
                end = self._planned_end(at, at + len(buffer) - filled)
                if self.size is not None:
                    end = min(end, self.size)
                fresh = await self._get(at, end)
                if fresh is None:
                    break
                self._adopt(fresh, at)
                response = fresh
            try:
                got = await response.receive_into(buffer[filled:])
            except HTTPStatusError:
                raise
            except TransportError as exc:
                await self._close_response()
                failures += 1
                if not self.random_access or failures > self._retries:
                    if isinstance(exc, ReadTimeoutError):
                        raise
                    break  # the body ended early: the reader reports the truncation
                await anyio.sleep(self._backoff * 2 ** (failures - 1))
                continue
            if got == 0:
                await self._close_response()
                break
            filled += got
            self._response_at += got
            if partial:
                break
        self.position = offset + filled
        return filled

    async def _close_response(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            await response.aclose()

    async def aclose(self) -> None:
        await self._close_response()
        if self._owns_client:
            await self._client.aclose()
