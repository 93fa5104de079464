"""``s3://bucket/key`` sinks: a multipart upload fed by the streaming writer.

Bytes are gathered into parts of ``part_size`` (at least 5 MiB, S3's minimum for every part but
the last, and at most 5 GiB, its largest part and PUT) and each full part is uploaded as it
fills, so memory stays at one part. A part (or a single PUT) answered with a status worth
retrying (408, 425, 429, 500, 502, 503, 504: a busy store's ``SlowDown``) is sent again, the
same bytes under the same number, as a read's request is (:data:`_PART_RETRIES`): after the
``Retry-After`` a 429 or 503 asks for (unless that passes the ``deadline``, a
:class:`~stream_st.ReadTimeoutError` at once, or is over 5 minutes without one), else after an
exponential back-off. So is a part whose connection is reset or closed before its answer came
(sending it, or waiting for the answer), after the back-off, within the same retries and
deadline; when they run out, the connection's error is raised and the upload aborted. S3 takes at
most :attr:`S3Sink.max_parts` (10,000) parts: a message announced (:meth:`S3Sink.allocate`) as
larger than that many parts hold has its parts made larger, the size over 10,000 rounded up to a
MiB (so is the memory the part takes), and one over 10,000 parts of 5 GiB, S3's largest, is
refused before any byte is sent; a message of unknown size that outgrows the parts fails before
the part past the last is sent. The object
appears only when the upload is completed, after the last tensor; on any failure, cancellation
or abort before that the multipart upload is aborted: no object at the key, no pending upload
left. A message
that fits in one part is sent as a single PUT instead, unless :meth:`S3Sink.prepare` asks for every
byte to be sent before the commit (copying a sharded checkpoint: every shard's upload is completed
only once all are uploaded); one announced as fitting that outgrows a part all the same goes up
as a multipart upload, the announced size being a hint.

Every part (and a single PUT) carries its CRC32 (``x-amz-checksum-crc32``), which the store
checks before it takes the part: a byte changed on the way is refused, never stored. A writer
that patches the header at the commit (the digests of ``checksums=``) has the parts holding it
held back (:meth:`S3Sink.hold_head`); they go last, parts being numbered by their place and not
by when they arrive.

The clean-up after a failure runs shielded from cancellation but gives up after
:attr:`S3Sink.abort_timeout` seconds, whatever ``timeout`` is; a cancellation is re-raised as
itself once it is done. An AbortMultipartUpload answered with a 5xx or a 429 is sent again
within that time; an upload left pending all the same is named in a note on the error raised
(or on the cancellation). When an answer is lost (the connection breaks or times out after the
request went out), the sink asks the store what happened:

* CreateMultipartUpload: it is seen through as the commit is (a cancellation waits at most
  :attr:`S3Sink.abort_timeout` seconds for its answer, then aborts the upload it names). An
  answer lost all the same leaves an upload with no known id: S3 lists a key's pending uploads
  with nothing that tells one writer's from another's (no metadata; the same owner, and a start
  time from the store's clock), so the sink never aborts an upload it cannot prove its own, which
  might be another writer's of the same key. That upload may stay pending, and a note on the
  error says so (a lifecycle rule's AbortIncompleteMultipartUpload removes it). So may one
  answered with a 5xx (which does not say whether the store made the upload), with a 200
  carrying an ``<Error>`` (which does not say so either), or with a 200 that names no UploadId;
  the note says which. A redirect or a 4xx (a 429 too) made none.
* CompleteMultipartUpload (also answered with a 5xx, or with a 200 carrying an ``<Error>``): the
  upload is aborted. Had the store still had it pending, nothing was stored and the original error
  is raised. Was it gone, the object at the key is compared with the one sent (its ETag with the
  one computed from the parts' ETags): the same object means the write succeeded; anything else
  raises :class:`~stream_st.OutcomeUnknownError`.
* A single PUT: the object at the key is compared with the body sent (ETag with its MD5) in the
  same way: success, or :class:`~stream_st.OutcomeUnknownError`.

The request that stores the object (CompleteMultipartUpload, or the single PUT) is the commit
point, as the rename of a local file is. A cancellation before it goes out aborts the upload;
once it is sent it is seen through, shielded from the cancellation (anyio's, or asyncio's
``Task.cancel()``) with the clock's limits and, from the cancellation on, at most
:attr:`S3Sink.abort_timeout` seconds more: stored, the write reports success under a cancel
scope (which cancels the next checkpoint) and raises asyncio's own cancellation (delivered once,
what its timeouts and task groups count on: never swallowed); given up after that time, the
cancellation is raised and the upload aborted if still pending; if the store completed it anyway
the object stays, since a cancellation cannot undo a write.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import operator
import ssl
import zlib
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import SupportsIndex, Unpack, cast
from urllib.parse import quote
from xml.sax.saxutils import escape

import anyio

from ..._util import seen_through
from ...errors import (
    ArgumentTypeError,
    TransportError,
    UnsupportedSinkError,
    UsageError,
    redact,
)
from ..base import Sink
from ..http import (
    ClientUser,
    HTTPClient,
    HTTPNotFoundError,
    HTTPStatusError,
    outcome_unknown,
    raise_for_status,
    summary,
    xml_field,
)
from ..http.client import _dropped
from ..http.retry import Retries
from ..options import Clock, LimitOptions, Limits
from .config import S3Config, parse_s3_url

__all__ = ["MIN_PART_SIZE", "S3Sink"]

MIN_PART_SIZE = 5 << 20
MAX_PART_SIZE = 5 << 30

_ABORT_RETRIES = Retries(count=4, backoff=0.25)
"""How an AbortMultipartUpload answered with a status worth retrying (a 5xx, a 429: a busy
store, or one racing a part it is still storing) is sent again, as a read's request is: it is
idempotent. The clean-up's :attr:`S3Sink.abort_timeout` bounds the attempts in all."""

_ONCE = Retries(count=0, backoff=0.0)
"""A request sent once, whatever its answer: one that is not idempotent."""

_PART_RETRIES = Retries(count=3, backoff=0.25)
"""How an UploadPart, or the single PutObject, answered with a status worth retrying is sent
again, as a read's request is (its defaults): the same bytes under the same part number (or
key), idempotent. An UploadPart whose connection dropped before its answer came is sent again
too, within the same count. A PutObject's lost answer is not: it stores the object, and is seen
through as CompleteMultipartUpload is, which is never sent again (see :meth:`S3Sink._settle`);
nor is CreateMultipartUpload, which would make another upload."""


class _ErrorIn200(TransportError):
    """A 200 carrying an S3 ``<Error>`` (:meth:`S3Sink._call`): the store answered, with an
    error."""


def _refusal(exc: Exception) -> bool:
    """Whether ``exc`` is the store's clear refusal of a request (a redirect or a 4xx): the request
    was not carried out. A 5xx or a lost answer leaves that open."""
    return isinstance(exc, HTTPStatusError) and exc.status < 500


def _md5_etag(data: bytes) -> str:
    return hashlib.md5(data, usedforsecurity=False).hexdigest()


def _crc32(data: bytes) -> str:
    """The ``x-amz-checksum-crc32`` value of ``data``: its CRC32, big-endian, in base64."""
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def _checked(checksum: str) -> dict[str, str]:
    """The headers that have the store check a body against its CRC32 ``checksum``."""
    return {"x-amz-sdk-checksum-algorithm": "CRC32", "x-amz-checksum-crc32": checksum}


def _part_size(value: object) -> int:
    """``part_size`` as an ``int`` (numpy's integers too) from :data:`MIN_PART_SIZE` to
    :data:`MAX_PART_SIZE`: :class:`~stream_st.ArgumentTypeError` for any other type (a float, a
    string, a bool), :class:`~stream_st.UsageError` outside that range (S3 refuses a larger part,
    or a single PUT, only once it has been sent)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        size = operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise ArgumentTypeError(
            f"part_size must be an integer number of bytes, at least {MIN_PART_SIZE} "
            f"(S3's minimum), got {value!r}"
        ) from None
    if size < MIN_PART_SIZE:
        raise UsageError(
            f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum), got {size}"
        )
    if size > MAX_PART_SIZE:
        raise UsageError(
            f"part_size must be at most {MAX_PART_SIZE} bytes (S3's largest part and PUT), got "
            f"{size}"
        )
    return size


def _body(part: io.BytesIO) -> bytes:
    """The bytes written to ``part``, which is written no more, as a request's body: its own
    buffer, cut where writing stopped and handed over (``getvalue`` copies nothing while no view
    of the buffer is held), so a part is in memory once; a part sent again sends these bytes."""
    part.truncate()
    return part.getvalue()


def _splice(part: io.BytesIO, start: int, head: memoryview) -> None:
    """Copy over ``part`` (the message's bytes from ``start``) what ``head`` (its first bytes)
    holds for that range."""
    with part.getbuffer() as view:
        piece = head[start : start + len(view)]
        view[: len(piece)] = piece


class S3Sink(ClientUser, Sink):
    """An object in an S3-compatible store, written by multipart upload. See the module docstring
    for what a failure leaves behind. ``url`` is ``s3://bucket/key``; ``config`` (an
    :class:`~stream_st.S3Config`) defaults to the AWS environment, as :class:`~stream_st.S3Source`'s
    does. ``headers`` go (signed) with every request; ``client``, ``ssl_context`` and ``limits``
    (``timeout``, ``deadline``, ``speed_limit``, ``speed_time``) as in
    :class:`~stream_st.HttpSource`; the limits are used unless the writer is given its own. The
    bytes go up in parts of ``part_size`` (default 16 MiB; from 5 MiB to 5 GiB, S3's bounds;
    larger for a message announced as more than :attr:`max_parts` parts hold)."""

    abort_timeout: float = 15.0
    """Seconds the clean-up after a failure may take in all, whatever ``timeout`` is; also what
    the request that commits the object still gets once the write is cancelled."""

    max_parts: int = 10_000
    """The most parts a multipart upload may have (S3's limit)."""

    def __init__(
        self,
        url: str,
        *,
        config: S3Config | None = None,
        client: HTTPClient | None = None,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        part_size: int = 16 << 20,
        **limits: Unpack[LimitOptions],
    ) -> None:
        super().__init__()
        part_size = _part_size(part_size)
        self.name = redact(url)
        self.bucket, self.key = parse_s3_url(url, UnsupportedSinkError)
        if self.key.endswith("/"):  # a prefix, as a directory is: no object named like one
            raise UsageError(
                f"the destination {self.name} names a directory (it ends in '/'): "
                "name the file to write in it"
            )
        self.config = config or S3Config.resolve()
        self._use_client(client, headers, ssl_context, limits)
        self._part_size = part_size
        self._part = io.BytesIO()  # the part filling, written up to its tell(); see _new_part
        self._size: int | None = None
        self._upload_id: str | None = None
        # Why an upload CreateMultipartUpload may have made has no known id; None if none may
        self._unnamed: str | None = None
        # The final request, sent before a cancellation: its name, the ETag it stores, and
        # whether its answer came (it stored the object)
        self._final: tuple[str, str | None, bool] | None = None
        self._etags: dict[int, str] = {}  # by part number
        self._checksums: dict[int, str] = {}  # by part number: what the store checked
        self._cut = 0  # parts cut from the message so far
        self._head = 0  # the message's first bytes, to be patched before the commit
        self._held: dict[int, io.BytesIO] = {}  # by part number: parts holding the head

    def _upload_query(self, upload_id: str) -> str:
        return f"uploadId={quote(upload_id, safe='')}"

    async def _call(
        self,
        method: str,
        query: str,
        body: bytes | None = None,
        *,
        key: str | None = None,
        headers: Mapping[str, str] | None = None,
        retries: Retries = _ONCE,
        dropped: bool = False,
        position: int = 0,
    ) -> tuple[dict[str, str], bytes]:
        """Send one signed request about the object (``key=""``: about the bucket): the answer's
        headers and body.

        A redirect or an error status raises :class:`HTTPStatusError` (404:
        :class:`HTTPNotFoundError`); a 200 carrying an S3 ``<Error>`` (S3 reports some failed
        completions that way) raises :class:`TransportError`.

        With ``retries`` (an idempotent request), a status worth retrying has the request sent
        again, signed anew, after the ``Retry-After`` the store asks for or the back-off, as a
        read's is; so has a connection reset or closed before the answer came, with
        ``dropped``, after the back-off (a request the store may have carried out: one sent
        again must do no more than once). Not when that wait would pass the write's deadline
        (:class:`~stream_st.ReadTimeoutError` at ``position``, the message's offset of ``body``)
        or the scope's (the clean-up's time: the status, or the connection's error, is raised),
        nor a ``Retry-After`` over 5 minutes without a deadline (the status is raised).
        """
        url = self.config.object_url(self.bucket, self.key if key is None else key, query)
        for attempt in range(retries.count + 1):
            last = attempt == retries.count
            await self.config.ready(self.clock, self.name)
            signed = self.config.sign(method, url, {**self._headers, **(headers or {})})
            lost: TransportError | None = None  # the connection's error, if it dropped
            wait: float | None = None  # what the store asks to wait, if it does
            try:
                response = await self._request(method, url, signed, body, follow_redirects=False)
            except TransportError as exc:
                if last or not dropped or not _dropped(exc):
                    raise
                lost = exc
            else:
                if last or not retries.retryable(response.status):
                    break
                wait = await retries.server_wait(response, self.clock, self.name, position)
            if wait is None:
                wait = retries.delay(attempt + 1)
            if anyio.current_time() + wait >= anyio.current_effective_deadline():
                if lost is not None:
                    raise lost
                break  # the time would run out waiting (wait is inf: too long): the status
            if lost is None:
                await response.discard()
            await retries.back_off(self.clock, attempt + 1, self.name, position, wait)
        await raise_for_status(response, name=self.name)
        async with response:
            answer = await response.read_all()
        if b"<Error>" in answer:
            raise _ErrorIn200(f"S3 refused the request: {summary(answer)}", url=self.name)
        return response.headers, answer

    async def allocate(self, size: int) -> None:
        """Take the message's ``size``, announced before its first byte: parts are made larger
        if ``size`` needs more than :attr:`max_parts` of them (:class:`~stream_st.UsageError` if
        even parts of :data:`MAX_PART_SIZE` cannot hold it)."""
        self._size = size
        least = -(-size // self.max_parts)
        if least <= self._part_size:
            return
        if least > MAX_PART_SIZE or self._cut:
            raise UsageError(
                f"{self.name}: {size} bytes need more than {self.max_parts} parts (S3's most) "
                f"of {MAX_PART_SIZE if self._cut == 0 else self._part_size} bytes"
            )
        self._part_size = -(-least // (1 << 20)) << 20

    async def hold_head(self, size: int) -> bool:
        """Hold back the parts holding the first ``size`` bytes until the commit."""
        self._head = size
        return True

    async def patch_head(self, buffer: memoryview) -> None:
        """Rewrite the first bytes: in the parts held back, or in the part still filling."""
        for number, part in self._held.items():
            _splice(part, (number - 1) * self._part_size, buffer)
        _splice(self._part, self._cut * self._part_size, buffer)

    async def send(self, buffer: memoryview) -> None:
        """Append ``buffer`` to the part filling, cutting each part as it fills. A full part is
        cut at once unless the announced size fits in one part (kept for a single PUT), and then
        as soon as a byte more comes: :meth:`allocate` is a hint, and a message that outgrows it
        goes up as a multipart upload, as one of unknown size does."""
        view = buffer.cast("B") if buffer.format != "B" else buffer
        while view:
            if not self._part.tell():
                self._part = self._new_part()
            room = self._part_size - self._part.tell()
            self._part.write(view[:room])
            view = view[room:]
            if self._part.tell() == self._part_size and (
                view or self._size is None or self._size > self._part_size
            ):
                await self._cleaning_up_on_failure(self._cut_part())
        self.position += len(buffer)

    def _new_part(self) -> io.BytesIO:
        """The buffer of a part starting, made at once as large as the part will be (a whole part,
        or the rest of a message announced as smaller) and written over in place: a buffer grown
        as bytes come may be copied as it grows, and sent, it would be copied again
        (:func:`_body` hands it over)."""
        size = self._part_size
        if self._size is not None:
            size = min(size, self._size - self._cut * self._part_size)
        return io.BytesIO(bytes(max(size, 0)))

    async def _create(self) -> None:
        """CreateMultipartUpload, seen through as the commit is (:meth:`_through`): a
        cancellation meanwhile waits for the upload's id, to abort that upload."""
        await self._through(self._send_create)

    async def _send_create(self) -> None:
        """Send CreateMultipartUpload and take the id of the upload it made; on a failure, note
        in :attr:`_unnamed` why an upload it may have made has none."""
        self._unnamed = "its answer was lost"  # until one is read
        sending = self._client.sending
        try:
            _, answer = await self._call(
                "POST", "uploads=", headers={"x-amz-checksum-algorithm": "CRC32"}
            )
        except HTTPStatusError as exc:
            self._unnamed = (
                None  # refused: no upload was made
                if _refusal(exc)
                else f"the store answered it with HTTP {exc.status}, which does not say "
                "whether it made the upload"
            )
            raise
        except _ErrorIn200:
            self._unnamed = (
                "the store's answer (HTTP 200) carried an <Error>, which does not say whether "
                "it made the upload"
            )
            raise
        except BaseException:
            if self._client.sending == sending:  # never sent (no connection): no upload made
                self._unnamed = None
            raise
        upload_id = xml_field(answer, "UploadId")
        if upload_id is None:
            self._unnamed = "the store's answer (HTTP 200) named no UploadId"
            raise TransportError(
                "no UploadId in the answer to CreateMultipartUpload", url=self.name
            )
        self._upload_id, self._unnamed = upload_id, None

    async def _cut_part(self) -> None:
        """The part filling is complete: upload it, or hold it back if it holds the head."""
        if self._cut == self.max_parts:
            raise UsageError(
                f"{self.name}: more than {self.max_parts} parts (S3's most) of {self._part_size} "
                "bytes written, the message's size not announced up front; give a larger "
                "part_size"
            )
        self._cut += 1
        part, self._part = self._part, io.BytesIO()
        if (self._cut - 1) * self._part_size < self._head:
            self._held[self._cut] = part
        else:
            await self._upload_part(self._cut, _body(part))

    async def _upload_part(self, number: int, body: bytes) -> None:
        """UploadPart ``number`` (creating the upload first if need be), sent again while the
        store answers a status worth retrying, or the connection drops before the answer
        (:data:`_PART_RETRIES`)."""
        if self._upload_id is None:
            await self._create()
        assert self._upload_id is not None
        query = f"partNumber={number}&{self._upload_query(self._upload_id)}"
        checksum = _crc32(body)
        headers, _ = await self._call(
            "PUT",
            query,
            body,
            headers=_checked(checksum),
            retries=_PART_RETRIES,
            dropped=True,
            position=(number - 1) * self._part_size,
        )
        etag = headers.get("etag")
        if not etag:
            raise TransportError(f"no ETag in the answer to UploadPart {number}", url=self.name)
        self._etags[number], self._checksums[number] = etag, checksum

    async def prepare(self) -> bool:
        """Upload every part, even of a message that fits in one (a multipart upload of one part
        then): :meth:`aclose` only completes the upload, and until then nothing is at the key."""
        await self._cleaning_up_on_failure(self._upload_rest())
        return True

    async def _upload_rest(self) -> None:
        """Upload the part filling (if any, or if nothing else is) and the parts held back."""
        if self._part.tell() or not (self._upload_id or self._held):
            await self._cut_part()
        held, self._held = self._held, {}
        for number, part in held.items():
            await self._upload_part(number, _body(part))

    async def aclose(self) -> None:
        try:
            await self._cleaning_up_on_failure(self._commit())
        finally:
            self._part = io.BytesIO()
            with self._bounded():  # committed and cancelled: the write is done all the same
                await self._close_client()

    async def _commit(self) -> None:
        if self._upload_id is None and not self._held:  # it all fits in one part: one PUT
            body = _body(self._part)
            await self._last(
                "PutObject",
                lambda: self._call(
                    "PUT", "", body, headers=_checked(_crc32(body)), retries=_PART_RETRIES
                ),
                lambda: _md5_etag(body),
            )
            return
        await self._upload_rest()
        await self._last("CompleteMultipartUpload", self._complete, self._multipart_etag)
        self._upload_id = None

    async def _complete(self) -> None:
        assert self._upload_id is not None
        parts = "".join(
            f"<Part><PartNumber>{i}</PartNumber><ETag>{escape(self._etags[i])}</ETag>"
            f"<ChecksumCRC32>{self._checksums[i]}</ChecksumCRC32></Part>"
            for i in sorted(self._etags)
        )
        body = f"<CompleteMultipartUpload>{parts}</CompleteMultipartUpload>".encode()
        _, answer = await self._call("POST", self._upload_query(self._upload_id), body)
        if b"CompleteMultipartUploadResult" not in answer:
            raise TransportError(
                "no CompleteMultipartUploadResult in the answer to CompleteMultipartUpload",
                url=self.name,
            )
        self._upload_id = None  # stored: nothing left to abort, should a cancellation follow

    async def _last(
        self,
        request: str,
        call: Callable[[], Awaitable[object]],
        etag: Callable[[], str | None],
    ) -> None:
        """Send ``request``, the one that stores the object (``call()``), and see it through
        (:meth:`_through`); if it fails without a clear refusal, once sent (a request that never
        went out, its connection refused, stored nothing), find out from the store
        (:meth:`_settle`) whether it stored the object, whose ETag would be ``etag()``.

        A cancellation before it is sent raises here (the upload is then aborted); once sent it
        is the commit point: a cancellation lets it finish (stored, nothing is left to abort),
        then goes on as :func:`~stream_st._util.seen_through` says."""
        answered = False  # whether the store's answer came: then it stored the object

        async def answer() -> None:
            nonlocal answered
            await call()
            answered = True

        await anyio.lowlevel.checkpoint_if_cancelled()
        sending = self._client.sending
        try:
            await self._through(answer)
        except Exception as exc:
            if _refusal(exc) or self._client.sending == sending:
                raise
            await self._settle(request, exc, etag())
        except BaseException:  # cancelled, its answer waited for abort_timeout at most
            if self._client.sending != sending:  # sent: the clean-up says what it did
                self._final = (request, etag(), answered)
            raise

    async def _through(self, call: Callable[[], Awaitable[object]]) -> None:
        """Await ``call()`` shielded from cancellation, in a task of its own so that a
        cancellation (an anyio one, or asyncio's ``Task.cancel()``, which goes through anyio's
        shields) is seen: from then on the request has :attr:`abort_timeout` more seconds (the
        clock's limits apply as always); see :func:`~stream_st._util.seen_through`. The
        credentials are looked for first, unshielded: a cancellation while they are (a credential
        process that hangs) ends the write at once, no request having gone out."""

        def bound(shield: anyio.CancelScope) -> None:
            shield.deadline = anyio.current_time() + self.abort_timeout

        await self.config.ready(self.clock, self.name)
        await seen_through(call, bound)

    def _multipart_etag(self) -> str | None:
        """The ETag S3 gives the completed object: the MD5 of the parts' MD5s, ``-`` their count;
        None if a part's ETag is not an MD5 (as with some encryption settings)."""
        try:
            digests = b"".join(
                bytes.fromhex(self._etags[i].strip('"')) for i in sorted(self._etags)
            )
        except ValueError:
            return None
        return f"{_md5_etag(digests)}-{len(self._etags)}"

    async def _settle(self, request: str, failure: Exception, etag: str | None) -> None:
        """After ``request``, the last one, failed without a clear refusal: return if the object
        at the key is the one sent (its ETag is ``etag``), raise ``failure`` when the store
        certainly did not store it, :class:`OutcomeUnknownError` when that cannot be told.

        A pending multipart upload is aborted first: if that works, nothing was stored.
        """
        upload_id, self._upload_id = self._upload_id, None
        aborted: bool | None = None  # whether the store still had the upload pending
        with self._bounded():
            if upload_id is not None:
                with contextlib.suppress(TransportError):
                    aborted = await self._delete(upload_id)
                if aborted:
                    raise failure
            with contextlib.suppress(TransportError):
                if etag is not None and await self._stored_etag() == etag:
                    return
        pending = upload_id is not None and aborted is None
        more = "; the multipart upload may still be pending" if pending else ""
        raise outcome_unknown(request, failure, self.name, more) from failure

    @contextlib.contextmanager
    def _bounded(self) -> Iterator[anyio.CancelScope]:
        """The scope a clean-up runs in: shielded from cancellation, ending after
        ``abort_timeout`` seconds whatever ``timeout`` is. The write's deadline and speed guard,
        which may be what ended it, do not apply to its clean-up; its timeout still does."""
        clock, self.clock = self.clock, Clock(Limits(timeout=self.clock.limits.timeout))
        try:
            with anyio.CancelScope(
                deadline=anyio.current_time() + self.abort_timeout, shield=True
            ) as scope:
                yield scope
        finally:
            self.clock = clock

    async def _stored_etag(self) -> str | None:
        """The ETag of the object at the key (without quotes); None if there is none."""
        try:
            headers, _ = await self._call("HEAD", "")
        except HTTPNotFoundError:
            return None
        return headers.get("etag", "").strip('"')

    async def _delete(self, upload_id: str) -> bool:
        """Abort the multipart upload ``upload_id``: True if it was pending, False if gone (or
        aborted by an attempt whose answer was a status worth retrying: see
        :data:`_ABORT_RETRIES`; an attempt is made only if its wait ends before the clean-up's
        time does, else what the store said is raised)."""
        try:
            await self._call("DELETE", self._upload_query(upload_id), retries=_ABORT_RETRIES)
        except HTTPNotFoundError:
            return False
        return True

    async def _cleaning_up_on_failure(self, step: Awaitable[None]) -> None:
        """Await ``step``; on any failure or cancellation clean up at once and re-raise, with a
        note on the error (or the cancellation) when the clean-up could not finish."""
        try:
            await step
        except BaseException as exc:
            problem = await self._clean_up()
            if problem is not None:
                exc.add_note(problem)
            raise

    async def _clean_up(self) -> str | None:
        """Abort the upload, shielded and within ``abort_timeout``: None once nothing of this
        write is pending, else what may be, or what the final request, sent before a
        cancellation, did."""
        upload_id, self._upload_id = self._upload_id, None
        unnamed, self._unnamed = self._unnamed, None
        final, self._final = self._final, None
        self._part, self._held = io.BytesIO(), {}
        problem = None
        if unnamed is not None:
            problem = (
                f"CreateMultipartUpload for {self.name}: {unnamed}; the upload it may have "
                "made has no known id and cannot be told from another writer's upload of the "
                "key, so it was not aborted and may still be pending (list the key's multipart "
                "uploads to abort it, or let a lifecycle rule do so)"
            )
        gone = True if upload_id is None else None  # whether no upload is pending (None: unknown)
        with self._bounded() as scope:
            try:
                if upload_id is not None:
                    gone = not await self._delete(upload_id)
                if final is not None and gone:  # no upload left: the request's outcome
                    problem = await self._outcome(*final)
            except Exception as exc:  # a TransportError, or no credentials to sign the abort
                problem = (
                    f"aborting multipart upload {upload_id} of {self.name} failed ({exc}): it "
                    "may still be pending"
                )
            finally:
                await self._close_client()
        if scope.cancelled_caught and gone is None:
            problem = (
                f"aborting multipart upload {upload_id} of {self.name} took over "
                f"{self.abort_timeout} s: it may still be pending"
            )
        return problem

    async def _outcome(self, request: str, etag: str | None, answered: bool) -> str:
        """The note on the cancellation of a write whose final request, ``request``, was sent
        before it: carried out when its answer came (``answered``) or the object at the key has
        the ``etag`` it stores (asked of the store), else an unknown outcome."""
        carried_out = (
            f"the {request} sent before the cancellation was carried out: the object at "
            f"{self.name} is the one written"
        )
        if answered:
            return carried_out
        with contextlib.suppress(TransportError):
            if etag is not None and await self._stored_etag() == etag:
                return f"{carried_out} (its answer did not come within {self.abort_timeout} s)"
        return (
            f"the {request} sent before the cancellation had no answer within "
            f"{self.abort_timeout} s: the object at {self.name} may or may not be the one written"
        )

    async def abort(self) -> None:
        """Abort the multipart upload, if one was started; see the module docstring. Raises
        :class:`TransportError` when it may be left pending."""
        problem = await self._clean_up()
        if problem is not None:
            raise TransportError(problem)


async def sink_for(url: str, clock: Clock, fsync: bool) -> Sink:
    """The registry's factory: a multipart upload to ``s3://bucket/key``."""
    return S3Sink(url)
