"""``http://`` and ``https://`` sinks: one streaming upload (PUT by default) of the message.

The writer announces the message's size before the first byte, so the body goes out with a
``Content-Length`` (chunked transfer encoding when the size is unknown) straight from each array's
memory. The upload is committed when the server answers 2xx to the complete body; an aborted
message drops the connection mid-body, so the server sees an incomplete request. When the answer
to the complete body is lost (the connection breaks, or no answer comes in time), the server may
have stored the message or not: that raises :class:`~stream_st.OutcomeUnknownError`. Once the
whole body went out a cancellation lets the answer come (:attr:`HttpSink.abort_timeout`), as an
S3 upload's commit does.
"""

from __future__ import annotations

import contextlib
import ssl
from collections.abc import Mapping
from typing import Unpack

import anyio

from ..._util import seen_through
from ...errors import (
    ArgumentTypeError,
    TransportError,
    UnsupportedSinkError,
    UsageError,
    redact,
    string,
)
from ..base import Sink
from ..options import Clock, LimitOptions, Transport
from . import ClientUser, HTTPClient, Target, Upload, raise_for_status

__all__ = ["HttpSink"]

METHODS = ("PUT", "POST")
"""The methods an :class:`HttpSink` uploads with, spelt as HTTP has them (methods are
case-sensitive: ``put`` is another method, which servers refuse)."""

ANSWER_BODY_WAIT = 1.0
"""The most seconds the body of a 2xx answer to an upload is waited for: the upload is committed
by then, and the body is read only so that its connection can serve another request."""


class HttpSink(ClientUser, Sink):
    """Upload one message to ``url`` with ``method``: ``"PUT"`` or ``"POST"``, in capitals
    (anything else raises :class:`~stream_st.UsageError` here, a non-string
    :class:`~stream_st.ArgumentTypeError`). ``headers``, ``ssl_context`` and ``limits``
    (``timeout``, ``deadline``, ``speed_limit``, ``speed_time``) as in
    :class:`~stream_st.HttpSource`; the limits are used unless the writer is given its own."""

    def __init__(
        self,
        url: str,
        *,
        method: str = "PUT",
        headers: Mapping[str, str] | None = None,
        client: HTTPClient | None = None,
        ssl_context: ssl.SSLContext | None = None,
        name: str | None = None,
        **limits: Unpack[LimitOptions],
    ) -> None:
        super().__init__()
        if not isinstance(method, str):
            raise ArgumentTypeError(
                f"method must be the string 'PUT' or 'POST', got {type(method).__name__}"
            )
        if method not in METHODS:
            raise UsageError(f"method must be 'PUT' or 'POST' (in capitals), got {method!r}")
        self.url = string("url", url)
        if name is not None:
            string("name", name)
        self.name = redact(name or url)  # what errors show: no password, no signature
        self._method = method
        given = Transport.of(headers)  # checked as a source's are
        self._use_client(
            client, given.over({"Content-Type": "application/octet-stream"}), ssl_context, limits
        )
        self._size: int | None = None
        self._upload: Upload | None = None

    abort_timeout: float = 15.0
    """The most seconds the answer to a complete body is waited for once the write is cancelled
    (see :meth:`aclose`); the limits apply as always."""

    def prepare_headers(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        """The headers to send with a request; object stores sign them here."""
        return headers

    async def allocate(self, size: int) -> None:
        self._size = size

    async def send(self, buffer: memoryview) -> None:
        if self._upload is None:
            headers = self.prepare_headers(self._method, self.url, dict(self._headers))
            self._upload = await self._start_upload(self._method, self.url, headers, self._size)
        await self._upload.send(buffer)
        self.position += len(buffer)

    async def aclose(self) -> None:
        """The commit: end the body and read the answer. A 2xx status is the commit, whatever
        its body then does (read for :data:`ANSWER_BODY_WAIT` seconds at most, its errors
        ignored); an error status raises with what its body says. The whole body went out, so
        the server may store it: a cancellation now lets the answer come, for
        :attr:`abort_timeout` seconds more at most, then goes on as
        :func:`~stream_st._util.seen_through` says (stored, the write reports success under a
        cancel scope; asyncio's own cancellation is raised once the answer is in), never
        reporting a cancelled write the server went on to store."""
        try:
            upload, self._upload = self._upload, None
            if upload is None:
                raise TransportError("nothing was uploaded", url=self.name)

            async def commit() -> None:
                response = await upload.finish()
                await raise_for_status(response, name=self.name)
                # 2xx: committed. The answer's body is only read to keep the connection, when
                # short and quick to come; otherwise the connection is dropped unread.
                async with response:
                    with anyio.move_on_after(ANSWER_BODY_WAIT), contextlib.suppress(OSError):
                        await response.discard()

            def bound(shield: anyio.CancelScope) -> None:
                shield.deadline = anyio.current_time() + self.abort_timeout

            await seen_through(commit, bound)
        finally:
            await self._close_client()

    async def abort(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            await upload.abort()
        await self._close_client()


async def sink_for(url: str, clock: Clock, fsync: bool) -> Sink:
    """The registry's factory: a PUT upload to an ``http(s)://`` address."""
    Target.parse(url, UnsupportedSinkError)  # an address with no host: refused as a destination
    return HttpSink(url)
