"""``http://`` and ``https://`` sinks: one streaming upload (PUT by default) of the message.

The writer announces the message's size before the first byte, so the body goes out with a
``Content-Length`` (chunked transfer encoding when the size is unknown) straight from each array's
memory. The upload is committed when the server answers 2xx to the complete body; an aborted
message drops the connection mid-body, so the server sees an incomplete request. When the answer
to the complete body is lost (the connection breaks, or no answer comes in time), the server may
have stored the message or not: that raises :class:`~stream_st.OutcomeUnknownError`.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Unpack

from ...errors import ArgumentTypeError, TransportError, UsageError, redact
from ..base import Sink
from ..options import Clock, LimitOptions
from . import ClientUser, HTTPClient, Upload, raise_for_status

__all__ = ["HttpSink"]

METHODS = ("PUT", "POST")
"""The methods an :class:`HttpSink` uploads with, spelt as HTTP has them (methods are
case-sensitive: ``put`` is another method, which servers refuse)."""


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
        self.url = url
        self.name = redact(name or url)  # what errors show: no password, no signature
        self._method = method
        self._use_client(
            client,
            {"Content-Type": "application/octet-stream", **dict(headers or {})},
            ssl_context,
            limits,
        )
        self._size: int | None = None
        self._upload: Upload | None = None

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
        try:
            if self._upload is None:
                raise TransportError("nothing was uploaded", url=self.name)
            response = await self._upload.finish()
            self._upload = None
            await raise_for_status(response, name=self.name)
            async with response:
                await response.read_all()
        finally:
            await self._close_client()

    async def abort(self) -> None:
        upload, self._upload = self._upload, None
        if upload is not None:
            await upload.abort()
        await self._close_client()


async def sink_for(url: str, clock: Clock, fsync: bool) -> Sink:
    """The registry's factory: a PUT upload to an ``http(s)://`` address."""
    return HttpSink(url)
