"""``s3://bucket/key`` sources on any S3-compatible store: signed ranged GETs.

Everything about ranges, retries, resumption and truncation is the HTTP source's; this module
adds the address and the SigV4 signature of each request (configuration:
``stream_st.transports.s3.config``),
with credentials looked for (and refreshed) off the event loop before a request needs them.

It also asks for the object's checksum (``x-amz-checksum-mode: ENABLED``) and offers it to a
reader that reads every byte (:meth:`S3Source.object_digest`): a store returns it with a GET of
the whole object (what iterating a stream directly sends, one part at a time aside), else one
HEAD asks for it. An object uploaded in parts has a "checksum of checksums" (``<base64>-N``):
it is checked from the parts' own checksums, computed as the bytes arrive, once two HEADs
(``?partNumber=1`` and ``?partNumber=N``) have shown the parts to be of one size but the last,
as every SDK uploads them; other layouts are not checked, and ``object_check`` says why. Those
HEADs answer for the version read: S3 gives a part's answer the object's ETag, compared with the
read's; a store that gives a part its own ETag (moto) is asked once more, after them, for the
object pinned to that version. An object replaced meanwhile raises
:class:`~stream_st.SourceChangedError`, never a false mismatch.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import importlib
import importlib.util
import ssl
from collections.abc import Callable, Mapping
from typing import NamedTuple, Unpack

from ..._util import task_group
from ...core.digests import Crc32, Hasher, ObjectDigest, PartedHash
from ...errors import ArgumentTypeError, HTTPStatusError, SourceChangedError, string
from ..base import Source
from ..http import HTTPClient, Response, raise_for_status
from ..http.framing import content_length
from ..http.source import HttpSource
from ..http.status import ascii_number
from ..options import Clock, LimitOptions
from .config import S3Config, parse_s3_url

__all__ = ["S3Source"]

CHECKSUM_HEADER = "x-amz-checksum-"
"""An answer's ``x-amz-checksum-<algorithm>`` header holds the object's checksum (base64)."""


def _crc32c() -> Hasher:
    crc32c = importlib.import_module("crc32c")
    hasher: Hasher = crc32c.CRC32CHash()
    return hasher


_CHECKSUMS: dict[str, tuple[Callable[[], Hasher], str]] = {
    "crc32": (Crc32, ""),
    "crc32c": (_crc32c, "crc32c"),
    "sha1": (hashlib.sha1, ""),
    "sha256": (hashlib.sha256, ""),
}
"""S3's checksum algorithms this module checks: the hasher, and the package it needs."""


class _Checksum(NamedTuple):
    """The object's checksum as an answer gave it."""

    algorithm: str  # crc32, crc32c, sha1, sha256, crc64nvme...
    value: str  # base64, with "-N" for a composite one of N parts
    kind: str  # x-amz-checksum-type: COMPOSITE, FULL_OBJECT or ""
    etag: str

    @classmethod
    def of(cls, headers: Mapping[str, str]) -> _Checksum | None:
        """The checksum ``headers`` carry, or None."""
        for name, value in headers.items():
            algorithm = name[len(CHECKSUM_HEADER) :]
            if name.startswith(CHECKSUM_HEADER) and algorithm not in ("type", "algorithm"):
                kind = headers.get(CHECKSUM_HEADER + "type", "").upper()
                return cls(algorithm, value.strip(), kind, headers.get("etag", ""))
        return None


def _parts_suffix(text: str) -> int | None:
    """N from a multipart value's ``-N`` suffix (a checksum or an ETag); None without one."""
    _, dash, count = text.strip('"').rpartition("-")
    return (ascii_number(count) or None) if dash else None


class S3Source(HttpSource):
    """An object in an S3-compatible store. ``config`` defaults to the AWS environment; the other
    options are :class:`~stream_st.HttpSource`'s (``headers``, signed with the rest,
    ``ssl_context``, ``concurrency``, ``part_size``, the limits)."""

    def __init__(
        self,
        url: str,
        *,
        config: S3Config | None = None,
        client: HTTPClient | None = None,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        retries: int = 3,
        backoff: float = 0.25,
        concurrency: int | None = None,
        part_size: int = 8 << 20,
        **limits: Unpack[LimitOptions],
    ) -> None:
        bucket, key = parse_s3_url(string("url", url))
        if config is not None and not isinstance(config, S3Config):
            raise ArgumentTypeError(f"config must be an S3Config, got {type(config).__name__}")
        self.config = config or S3Config.resolve()
        super().__init__(
            self.config.object_url(bucket, key),
            client=client,
            headers=headers,
            ssl_context=ssl_context,
            retries=retries,
            backoff=backoff,
            concurrency=concurrency,
            part_size=part_size,
            name=url,
            **limits,
        )
        self._checksum: _Checksum | None = None  # as an answer of this read gave it

    async def _get(self, start: int, end: int | None) -> Response | None:
        await self.config.ready(self.clock, self.name)
        return await super()._get(start, end)

    async def _accept(self, response: Response, position: int) -> Response:
        response = await super()._accept(response, position)
        self._note_checksum(response)
        return response

    def _note_checksum(self, response: Response) -> None:
        """Keep the object's checksum, when ``response`` tells it."""
        self._checksum = _Checksum.of(response.headers) or self._checksum

    def prepare_headers(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        return self.config.sign(method, url, {**headers, "x-amz-checksum-mode": "ENABLED"})

    async def _head(self, part: int | None = None) -> Response:
        """A signed HEAD of the object, for the version the read has seen; of its ``part``
        (a number from 1) if given: its size. (A part's HEAD carries no preconditions: moto
        matches them with the part's own ETag, and refuses the version read; its answer is
        compared with that version by :meth:`_confirm_version`.)"""
        await self.config.ready(self.clock, self.name)
        url = self.url if part is None else f"{self.url}?partNumber={part}"
        headers = {**self._headers, **(self._pin.preconditions() if part is None else {})}
        with self._reported():
            response = await self._request("HEAD", url, self.prepare_headers("HEAD", url, headers))
            async with response:
                if part is None:
                    return await super()._accept(response, 0)
                await raise_for_status(response, name=self.name)
                return response

    async def object_digest(self) -> ObjectDigest | None:
        """The object's checksum from the store (see the module docstring), or None when the
        store has none."""
        try:
            if self._checksum is None:
                self._note_checksum(await self._head())
            if self._checksum is None:
                return None
            return await self._checksum_digest(self._checksum)
        except HTTPStatusError as exc:
            return ObjectDigest("the store's checksum", reason=f"asking for it failed: {exc}")

    async def _checksum_digest(self, found: _Checksum) -> ObjectDigest:
        """``found`` as a digest to check the bytes against (or why it cannot be)."""
        algorithm, value = found.algorithm, found.value
        label = f"the store's {algorithm.upper()} checksum (x-amz-checksum-{algorithm})"
        if algorithm not in _CHECKSUMS:
            return ObjectDigest(label, reason="this version cannot compute that algorithm")
        new, package = _CHECKSUMS[algorithm]
        if package and importlib.util.find_spec(package) is None:
            return ObjectDigest(label, reason=f"it needs the {package!r} package")
        encoded = value.partition("-")[0]
        try:
            expected = base64.b64decode(encoded, validate=True)
        except binascii.Error:
            return ObjectDigest(label, reason=f"the store sent {value!r}, not base64")
        count = None
        if found.kind != "FULL_OBJECT":  # a composite one: moto leaves "-N" out on HEAD
            count = _parts_suffix(value) or _parts_suffix(found.etag)
        if count is None:
            return ObjectDigest(label, expected, new)
        label = f"{label[:-1]}, a checksum of {count} parts' checksums)"
        part_size = await self._uploaded_part_size(count)
        if part_size is None:
            return ObjectDigest(label, reason="its parts are not all of one size but the last")
        return ObjectDigest(label, expected, functools.partial(PartedHash, new, part_size))

    async def _uploaded_part_size(self, count: int) -> int | None:
        """The size of each of the object's ``count`` parts when all but the last have one size
        (the first and last parts' HEADs tell); None otherwise."""
        sizes = [0, 0]
        etags = ["", ""]

        async def size_of(index: int, number: int) -> None:
            response = await self._head(number)
            sizes[index] = content_length(response.headers, response.url) or 0
            etags[index] = response.headers.get("etag", "")

        async with task_group() as group:
            group.start_soon(size_of, 0, 1)
            group.start_soon(size_of, 1, count)
        await self._confirm_version(etags)
        first, last = sizes
        total = self.size or 0
        if count == 1:
            return first if first == total else None
        if first > 0 and 0 < last <= first and (count - 1) * first + last == total:
            return first
        return None

    async def _confirm_version(self, etags: list[str]) -> None:
        """Raise :class:`SourceChangedError` unless the parts' answers, whose ETags are
        ``etags``, are of the version read: each carries its strong ETag, or (a store that
        gives a part its own ETag, a plain MD5, or none) a HEAD of the object, sent after them
        and pinned to that version, is answered (a 412 raises). An answer with another
        object's ETag (``<md5>-N``) is of another version."""
        etag, _ = self.validators
        other = next((tag for tag in etags if tag != etag and _parts_suffix(tag)), None)
        if etag and other is not None:
            raise SourceChangedError(
                f"the object changed on the server during the read: ETag {etag!r}, then "
                f"{other!r} (a HEAD of one of its parts)",
                url=self.name,
                position=0,
            )
        if not etag or etag.startswith("W/") or any(tag != etag for tag in etags):
            await self._head()


async def source_for(url: str, clock: Clock) -> Source:
    """The registry's factory: an ``s3://bucket/key`` object."""
    return S3Source(url)
