"""``s3://bucket/key`` sinks: a multipart upload fed by the streaming writer.

Bytes are gathered into parts of ``part_size`` (at least 5 MiB, S3's minimum for every part but
the last) and each full part is uploaded as it fills, so memory stays at one part. The object
appears only when the upload is completed, after the last tensor; on any failure, cancellation
or abort the multipart upload is aborted: no object at the key, no pending upload left. A message
that fits in one part is sent as a single PUT instead.
"""

from __future__ import annotations

import re
from urllib.parse import quote
from xml.sax.saxutils import escape

import anyio

from .._http import ClientClock, HTTPClient, raise_for_status
from .._s3 import S3Config, parse_s3_url
from ..errors import TransportError, UsageError
from .base import Sink

__all__ = ["MIN_PART_SIZE", "S3Sink"]

MIN_PART_SIZE = 5 << 20
_UPLOAD_ID = re.compile(r"<UploadId>([^<]+)</UploadId>")


class S3Sink(ClientClock, Sink):
    """An object in an S3-compatible store, written by multipart upload."""

    def __init__(
        self,
        url: str,
        *,
        config: S3Config | None = None,
        client: HTTPClient | None = None,
        part_size: int = 16 << 20,
    ) -> None:
        super().__init__()
        if part_size < MIN_PART_SIZE:
            raise UsageError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        self.name = url
        self.bucket, self.key = parse_s3_url(url)
        self.config = config or S3Config.resolve()
        self._owns_client = client is None
        self._client = client or HTTPClient()
        self._part_size = part_size
        self._part = bytearray()
        self._size: int | None = None
        self._upload_id: str | None = None
        self._etags: list[str] = []

    def _url(self, query: str = "") -> str:
        return self.config.object_url(self.bucket, self.key, query)

    async def _call(self, method: str, query: str, body: bytes | None = None) -> bytes:
        url = self._url(query)
        headers = self.config.sign(method, url, {})
        response = await self._client.request(method, url, headers, body, follow_redirects=False)
        await raise_for_status(response, name=self.name)
        async with response:
            etag = response.headers.get("etag", "")
            answer = await response.read_all()
        if method == "PUT":
            return etag.encode()
        if b"<Error>" in answer:  # S3 may report a failed completion inside a 200
            raise TransportError(f"S3 refused the request: {answer[:300]!r}", url=self.name)
        return answer

    async def allocate(self, size: int) -> None:
        self._size = size

    async def send(self, buffer: memoryview) -> None:
        view = buffer.cast("B") if buffer.format != "B" else buffer
        while view:
            room = self._part_size - len(self._part)
            self._part += view[:room]
            view = view[room:]
            if len(self._part) == self._part_size and (
                self._size is None or self._size > self._part_size
            ):
                await self._flush_part()
        self.position += len(buffer)

    async def _flush_part(self) -> None:
        if self._upload_id is None:
            answer = await self._call("POST", "uploads=")
            match = _UPLOAD_ID.search(answer.decode("utf-8", "replace"))
            if match is None:
                raise TransportError(
                    "no UploadId in the answer to CreateMultipartUpload", url=self.name
                )
            self._upload_id = match.group(1)
        number = len(self._etags) + 1
        query = f"partNumber={number}&uploadId={quote(self._upload_id, safe='')}"
        etag = await self._call("PUT", query, bytes(self._part))
        self._etags.append(etag.decode())
        self._part.clear()

    async def aclose(self) -> None:
        try:
            if self._upload_id is None:  # the whole message fits in one part: one PUT
                await self._call("PUT", "", bytes(self._part))
                return
            if self._part:
                await self._flush_part()
            parts = "".join(
                f"<Part><PartNumber>{i}</PartNumber><ETag>{escape(tag)}</ETag></Part>"
                for i, tag in enumerate(self._etags, start=1)
            )
            body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
            await self._call("POST", f"uploadId={quote(self._upload_id, safe='')}", body)
            self._upload_id = None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.abort()
            raise
        finally:
            self._part = bytearray()
            if self._owns_client:
                await self._client.aclose()

    async def abort(self) -> None:
        upload_id, self._upload_id = self._upload_id, None
        self._part = bytearray()
        try:
            if upload_id is not None:
                await self._call("DELETE", f"uploadId={quote(upload_id, safe='')}")
        finally:
            if self._owns_client:
                await self._client.aclose()
