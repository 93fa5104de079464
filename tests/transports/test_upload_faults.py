"""Uploads whose answers get lost: S3 multipart and HTTP upload sinks against real servers (moto,
tests/servers/http_server.py) behind a proxy that drops, resets, stalls or replaces chosen answers.

After every failure: no pending multipart upload of the key, nothing (or the whole object) at the
key, a cancellation that stays a cancellation, a clean-up that ends on its own whatever the
timeout, and an error that says when the writer cannot know whether the object was stored.
"""

from __future__ import annotations

import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import OutcomeUnknownError, TensorSpec, TransportError
from stream_st.transports.http import HTTPStatusError
from stream_st.transports.http.retry import Retries
from stream_st.transports.http.sink import HttpSink
from stream_st.transports.s3 import sink as s3_sink_module
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.sink import MAX_PART_SIZE, MIN_PART_SIZE, S3Sink

from ..servers.http_server import RangeHTTPServer
from ..servers.lossy_proxy import DelayingProxy, LossyProxy
from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._s3_faults import bucket_store
from ._s3_faults import proxy as proxy

pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]

Arrays = dict[str, np.ndarray[Any, Any]]
BUCKET = "faults"
# Two parts of MIN_PART_SIZE: the second one is sent with the completion.
TWO_PARTS: Arrays = {f"w{i}": np.random.default_rng(i).random(400_000) for i in range(2)}
ONE_PART = np.ones(MIN_PART_SIZE // 8 + 1000)  # a tensor over one part
SMALL: Arrays = {"a": np.arange(12, dtype=np.float32)}

# The requests of a multipart upload: method and a pattern of the query string.
CREATE = ("POST", "^uploads")
PART = ("PUT", "partNumber=")
COMPLETE = ("POST", "^uploadId=")
ABORT = ("DELETE", "uploadId=")
PUT = ("PUT", "^$")
ERROR = b"<Error><Code>InternalError</Code><Message>We encountered an error.</Message></Error>"
ERROR_IN_200 = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(ERROR), ERROR)
ANSWER_500 = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"
SLOW_DOWN = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate.</Message></Error>"
ANSWER_503 = b"HTTP/1.1 503 Slow Down\r\nContent-Length: %d\r\n\r\n%s" % (
    len(SLOW_DOWN),
    SLOW_DOWN,
)


def answer(status: int, reason: str, retry_after: str | None = None) -> bytes:
    """An S3 error answer with ``status`` (and a ``Retry-After``)."""
    head = f"HTTP/1.1 {status} {reason}\r\n" + (
        f"Retry-After: {retry_after}\r\n" if retry_after else ""
    )
    return b"%sContent-Length: %d\r\n\r\n%s" % (head.encode(), len(SLOW_DOWN), SLOW_DOWN)


ANSWER_503_AFTER_1 = answer(503, "Slow Down", "1")
REDIRECT = (
    b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://elsewhere.invalid/\r\n"
    b"Content-Length: 0\r\n\r\n"
)


store = bucket_store(BUCKET)


def s3_sink(proxy: LossyProxy, key: str, bucket: str = BUCKET, **kwargs: Any) -> S3Sink:
    config = S3Config.resolve(
        endpoint_url=proxy.url,
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        environ={},
    )
    sink = S3Sink(f"s3://{bucket}/{key}", config=config, part_size=MIN_PART_SIZE, **kwargs)
    sink.abort_timeout = 1.0
    return sink


def pending(store: MotoS3Server, key: str, bucket: str = BUCKET) -> list[str]:
    """Upload ids of the multipart uploads of exactly ``key`` still pending."""
    answer = store.client().list_multipart_uploads(Bucket=bucket, Prefix=key)
    return [u["UploadId"] for u in answer.get("Uploads", []) if u["Key"] == key]


def stored(store: MotoS3Server, key: str, bucket: str = BUCKET) -> bytes | None:
    client = store.client()
    try:
        return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


async def write(sink: Any, arrays: Arrays) -> None:
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    async with stream_st.open_writer(sink, plan) as writer:
        for name, array in arrays.items():
            await writer.write(name, array)


async def write_cancelled_at(
    sink: Any,
    arrays: Arrays,
    proxy: LossyProxy,
    request: tuple[str, str],
    notes: list[str] | None = None,
) -> anyio.CancelScope:
    """Write, cancelling once the server has seen ``request`` (and the proxy lost its answer);
    the notes the cancellation carries out of the write are added to ``notes``."""

    async def cancel_when_seen(scope: anyio.CancelScope) -> None:
        await anyio.to_thread.run_sync(proxy.wait_for, *request)
        scope.cancel()

    with anyio.fail_after(60), anyio.CancelScope() as scope:  # fail_after: a hang guard
        async with anyio.create_task_group() as group:
            group.start_soon(cancel_when_seen, scope)
            try:
                await write(sink, arrays)
            except anyio.get_cancelled_exc_class() as exc:
                (notes if notes is not None else []).extend(getattr(exc, "__notes__", []))
                raise
    return scope


# ---------------------------------------------------------------- part_size


@pytest.mark.parametrize("part_size", [MAX_PART_SIZE + 1, 8 << 30, 64 << 30])
def test_a_part_size_over_s3s_largest_is_a_usage_error(part_size: int) -> None:
    """S3 takes parts (and a single PutObject) of at most 5 GiB: a larger ``part_size`` is
    refused as the sink is made, where it was taken (a plan over 10,000 parts of 5 GiB then
    opened, a file over 5 GiB was planned as one PUT, and each part was held in memory)."""
    with pytest.raises(stream_st.UsageError, match=f"part_size must be at most {MAX_PART_SIZE}"):
        S3Sink(f"s3://{BUCKET}/big", part_size=part_size)


async def test_a_plan_past_10000_parts_of_s3s_largest_is_refused_before_sending() -> None:
    """With parts of S3's largest (5 GiB), a 6 GiB file goes in two parts, never one PUT, and a
    plan over 10,000 of them is a :class:`~stream_st.UsageError` before any byte is sent (the
    store, nowhere, is never asked)."""
    config = S3Config.resolve(
        endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b", environ={}
    )
    sink = S3Sink(f"s3://{BUCKET}/big", config=config, part_size=MAX_PART_SIZE)
    await sink.allocate(6 << 30)
    assert sink._part_size == MAX_PART_SIZE  # a 6 GiB file: more than one part
    await sink.abort()
    plan = [TensorSpec("x", "U8", (60 << 40,))]
    sink = S3Sink(f"s3://{BUCKET}/big", config=config, part_size=MAX_PART_SIZE)
    with pytest.raises(stream_st.UsageError, match="more than 10000 parts"):
        async with stream_st.open_writer(sink, plan):
            raise AssertionError("opened")  # pragma: no cover


# ---------------------------------------------------------------- CreateMultipartUpload


UNPROVEN = (
    r"CreateMultipartUpload for \S+: {}.*; the upload it may have made has no known id .* not "
    r"aborted and may still be pending"
)
ANSWER_429 = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n%s" % (
    len(SLOW_DOWN),
    SLOW_DOWN,
)


def abort_all(store: MotoS3Server, key: str) -> list[str]:
    """Abort every upload of ``key`` still pending (what a lost answer left): their ids."""
    left = pending(store, key)
    for upload_id in left:
        store.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)
    return left


@pytest.mark.parametrize(
    ("action", "what"),
    [
        ("reset", "its answer was lost"),
        (ANSWER_503, "the store answered it with HTTP 503, which does not say whether it made"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", r"the store's answer \(HTTP 200\) "),
        (ERROR_IN_200, r"the store's answer \(HTTP 200\) carried an <Error>, which does not say"),
    ],
    ids=["reset", "503", "no-upload-id", "error-in-200"],
)
async def test_create_answer_lost_leaves_the_upload_and_says_so(
    store: MotoS3Server, proxy: LossyProxy, key: str, action: str | bytes, what: str
) -> None:
    """The store made an upload whose id never came back (or came back a 5xx, which does not
    say whether it did): S3's listing cannot tell it from another writer's upload of the key, so
    it is left, never guessed at, and the error's note says so and what the answer was, where a
    503, a 200 without an UploadId and a 200 carrying an ``<Error>`` were said to be lost
    answers."""
    proxy.lose(*CREATE, action, forward=True)
    with pytest.raises(TransportError) as info:
        await write(s3_sink(proxy, key), TWO_PARTS)
    notes = getattr(info.value, "__notes__", [])
    assert len(notes) == 1 and re.search(UNPROVEN.format(what), notes[0]), notes
    assert len(abort_all(store, key)) == 1 and stored(store, key) is None


@pytest.mark.parametrize("action", [ANSWER_429, REDIRECT], ids=["429", "redirect"])
async def test_create_refused_leaves_nothing_and_no_note(
    store: MotoS3Server, proxy: LossyProxy, key: str, action: bytes
) -> None:
    """A CreateMultipartUpload refused (a 429, a redirect) made no upload: nothing is pending
    and no note says one may be."""
    proxy.lose(*CREATE, action)
    with pytest.raises(HTTPStatusError) as info:
        await write(s3_sink(proxy, key), TWO_PARTS)
    assert not getattr(info.value, "__notes__", None)
    assert pending(store, key) == [] and stored(store, key) is None


@pytest.mark.parametrize("arrays", [TWO_PARTS, SMALL], ids=["create", "put"])
async def test_a_first_request_never_sent_is_a_plain_failure(arrays: Arrays) -> None:
    """A store nothing listens at: CreateMultipartUpload never went out (the connection was
    refused), so no upload can be pending, where the error's note said one may be; nor did a
    single PutObject, which was an :class:`OutcomeUnknownError` (the object "may or may not have
    been stored")."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    config = S3Config.resolve(
        endpoint_url=f"http://127.0.0.1:{port}",
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        environ={},
    )
    sink = S3Sink(f"s3://{BUCKET}/never", config=config, part_size=MIN_PART_SIZE)
    with pytest.raises(TransportError, match="cannot connect") as info:
        await write(sink, arrays)
    assert not isinstance(info.value, OutcomeUnknownError)
    assert not getattr(info.value, "__notes__", None)


async def test_cancelled_during_its_create_a_write_aborts_its_own_upload_only(
    store: MotoS3Server, key: str
) -> None:
    """A write cancelled while its CreateMultipartUpload is on its way waits for the answer (at
    most abort_timeout) and aborts the upload it names, where it aborted every upload of the key
    begun since it listed them (another writer's, which then failed) and left its own, made
    after that, pending."""
    others: list[str] = []

    async def another_writer_then_cancel(slow: DelayingProxy, scope: anyio.CancelScope) -> None:
        await anyio.to_thread.run_sync(slow.seen.wait)
        upload = store.client().create_multipart_upload(Bucket=BUCKET, Key=key)
        others.append(upload["UploadId"])
        scope.cancel()

    creating = b"?uploads="  # held before the store sees it
    slow = DelayingProxy(store.port, b"POST", lambda target: target.endswith(creating), 0.5)
    with slow:
        sink = s3_sink(slow, key)
        sink.abort_timeout = 10.0  # time enough for the answer, however busy the machine
        with anyio.fail_after(60), anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(another_writer_then_cancel, slow, scope)
                await write(sink, TWO_PARTS)
        assert scope.cancelled_caught
        assert [m for m, _, _ in slow.requests] == ["POST", "DELETE"]  # its own upload's abort
    assert abort_all(store, key) == others
    assert stored(store, key) is None


# ---------------------------------------------------------------- UploadPart


@pytest.mark.parametrize(
    ("at", "action", "error"),
    [
        (PART, "reset", "Connection reset"),
        (PART, "refuse", "Connection reset"),
        (PART, ANSWER_500, "HTTP 500"),
        (PART, REDIRECT, r"HTTP 307.*elsewhere\.invalid"),
        (COMPLETE, ANSWER_500, "HTTP 500"),
        (COMPLETE, ERROR_IN_200, "InternalError"),
        (COMPLETE, REDIRECT, "HTTP 307"),
    ],
    ids=["part-reset", "part-refuse", "part-500", "part-redirect", "500", "error", "redirect"],
)
async def test_failure_aborts_the_upload(
    store: MotoS3Server,
    proxy: LossyProxy,
    key: str,
    at: tuple[str, str],
    action: str | bytes,
    error: str,
) -> None:
    """A lost part, a part the store keeps refusing, or a completion the store did not carry
    out: the upload is aborted and the error says what happened."""
    proxy.lose(*at, action, times=None)
    with pytest.raises(TransportError, match=error) as info:
        await write(s3_sink(proxy, key), TWO_PARTS)
    assert not isinstance(info.value, OutcomeUnknownError)
    assert pending(store, key) == []
    assert stored(store, key) is None


@pytest.mark.parametrize(
    ("at", "arrays", "action", "forward"),
    [
        (PART, TWO_PARTS, ANSWER_503_AFTER_1, False),
        (PART, TWO_PARTS, ANSWER_429, False),
        (PART, TWO_PARTS, ANSWER_500, True),
        (PART, TWO_PARTS, answer(502, "Bad Gateway"), False),
        (PART, TWO_PARTS, answer(504, "Gateway Timeout"), True),
        (PUT, SMALL, ANSWER_503_AFTER_1, False),
        (PUT, SMALL, ANSWER_500, True),
    ],
    ids=["part-503", "part-429", "part-500", "part-502", "part-504", "put-503", "put-500"],
)
async def test_a_part_or_put_the_store_is_too_busy_for_is_sent_again(
    store: MotoS3Server,
    proxy: LossyProxy,
    key: str,
    at: tuple[str, str],
    arrays: Arrays,
    action: bytes,
    forward: bool,
) -> None:
    """An UploadPart (or a single PutObject) answered once with a 429 or a 5xx (S3's
    ``SlowDown``) is sent again, the same bytes under the same part number, after the
    ``Retry-After`` the store asked for: the write succeeds, where the whole upload was aborted."""
    proxy.lose(*at, action, forward=forward)
    began = time.monotonic()
    with anyio.fail_after(60):
        await write(s3_sink(proxy, key), arrays)
    waited = time.monotonic() - began
    assert stored(store, key) == reference_numpy.save(arrays)
    assert pending(store, key) == []
    sent = [target for method, target, _ in proxy.requests if method == at[0]]
    assert len(sent) == len(set(sent)) + 1 and sent[0] == sent[1]  # the first one, twice
    if b"Retry-After: 1" in action:
        assert waited >= 1.0  # as long as the store asked, not the back-off's quarter second


async def test_a_part_the_store_keeps_refusing_is_tried_a_bounded_number_of_times(
    store: MotoS3Server, proxy: LossyProxy, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every attempt answered 503: after the retries the upload is aborted and the store's
    answer raised."""
    monkeypatch.setattr(s3_sink_module, "_PART_RETRIES", Retries(count=2, backoff=0.01))
    proxy.lose(*PART, ANSWER_503, times=None)
    with anyio.fail_after(60), pytest.raises(HTTPStatusError, match=r"HTTP 503.*SlowDown") as info:
        await write(s3_sink(proxy, key), TWO_PARTS)
    assert info.value.status == 503
    parts = [target for method, target, _ in proxy.requests if method == "PUT"]
    assert len(parts) == 3 and len(set(parts)) == 1
    assert pending(store, key) == [] and stored(store, key) is None


@pytest.mark.parametrize(
    ("retry_after", "deadline", "error", "said"),
    [
        (
            "30",
            5.0,
            stream_st.ReadTimeoutError,
            r"retry after 30 s \(Retry-After\), past the deadline",
        ),
        ("600", None, HTTPStatusError, r"HTTP 503.*SlowDown"),
    ],
    ids=["past-the-deadline", "over-5-minutes"],
)
async def test_a_retry_after_too_long_is_not_waited_for(
    store: MotoS3Server,
    proxy: LossyProxy,
    key: str,
    retry_after: str,
    deadline: float | None,
    error: type[Exception],
    said: str,
) -> None:
    """A part's ``Retry-After`` past the write's deadline ends the write at once (a
    :class:`~stream_st.ReadTimeoutError` saying so, not the deadline's own once waited for), as
    does one over 5 minutes without a deadline (the store's answer): the part is never sent
    again, and the upload is aborted."""
    proxy.lose(*PART, answer(503, "Slow Down", retry_after), times=None)
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in TWO_PARTS.items()]
    with anyio.fail_after(60), pytest.raises(error, match=said) as info:
        async with stream_st.open_writer(s3_sink(proxy, key), plan, deadline=deadline) as writer:
            for name, array in TWO_PARTS.items():
                await writer.write(name, array)
    assert type(info.value) is error
    parts = [(target, action) for method, target, action in proxy.requests if method == "PUT"]
    assert len(parts) == 1 and "Retry-After" in parts[0][1], parts  # the refused one, alone
    assert pending(store, key) == [] and stored(store, key) is None


async def test_cancel_with_a_stalled_store_and_no_timeout_ends(
    store: MotoS3Server, proxy: LossyProxy, key: str
) -> None:
    """timeout=None waits forever for each answer, but the shielded abort still gives up."""
    proxy.lose(*PART, "stall", times=None)
    proxy.lose(*ABORT, "stall", times=None)
    scope = await write_cancelled_at(s3_sink(proxy, key, timeout=None), TWO_PARTS, proxy, PART)
    assert scope.cancelled_caught
    proxy.wait_for(*ABORT, given_up=True)  # the abort gave up by itself, before the proxy did
    for upload_id in pending(store, key):
        store.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)


# ---------------------------------------------------------------- AbortMultipartUpload


STOPS = ["failure", "misuse", "cancel", "cancel-in-part"]


async def stopped(sink: S3Sink, proxy: LossyProxy, how: str) -> BaseException:
    """What a write raises that is stopped once its upload is made: by a failure (a part
    answered 500), a misuse (a tensor written twice), or a cancellation, in the ``async with``
    body or while the store holds a part unanswered."""
    plan = [TensorSpec(name, ONE_PART.dtype, ONE_PART.shape) for name in "ab"]
    if how == "failure":
        proxy.lose(*PART, ANSWER_500, times=None)
    elif how == "cancel-in-part":
        proxy.lose(*PART, "stall")
    caught: list[BaseException] = []

    async def cancel_in_part(scope: anyio.CancelScope) -> None:
        await anyio.to_thread.run_sync(proxy.wait_for, *PART)
        scope.cancel()

    with anyio.fail_after(60), anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            if how == "cancel-in-part":
                group.start_soon(cancel_in_part, scope)
            try:
                async with stream_st.open_writer(sink, plan) as writer:
                    await writer.write("a", ONE_PART)  # more than a part: the upload is made
                    if how == "cancel":
                        scope.cancel()
                        await anyio.sleep(1)
                    await writer.write("a" if how == "misuse" else "b", ONE_PART)
            except BaseException as exc:
                caught.append(exc)
                if isinstance(exc, anyio.get_cancelled_exc_class()):
                    raise
    assert scope.cancelled_caught == how.startswith("cancel")
    (raised,) = caught
    expected = {"failure": TransportError, "misuse": stream_st.WriterError}
    assert isinstance(raised, expected.get(how, anyio.get_cancelled_exc_class()))
    return raised


@pytest.mark.parametrize("how", STOPS)
async def test_an_abort_answered_503_is_retried(
    store: MotoS3Server, proxy: LossyProxy, key: str, how: str
) -> None:
    """AbortMultipartUpload is idempotent: a busy store's 503 (or any 5xx, a 429) is asked again,
    where one 503 left the upload pending and the caller told nothing."""
    proxy.lose(*ABORT, ANSWER_503)
    raised = await stopped(s3_sink(proxy, key), proxy, how)
    assert not getattr(raised, "__notes__", None)
    aborts = [action for method, _, action in proxy.requests if method == "DELETE"]
    assert aborts == [str(ANSWER_503), "pass"]
    assert pending(store, key) == [] and stored(store, key) is None


@pytest.mark.parametrize("how", STOPS)
async def test_an_upload_the_store_keeps_refusing_to_abort_is_told(
    store: MotoS3Server, proxy: LossyProxy, key: str, how: str
) -> None:
    """Every attempt answered 503: the original error (or cancellation) is raised with a note
    that the upload may still be pending, where a misuse's and a cancellation's had none."""
    proxy.lose(*ABORT, ANSWER_503, times=None)
    raised = await stopped(s3_sink(proxy, key), proxy, how)
    notes = getattr(raised, "__notes__", [])
    assert len(notes) == 1
    assert re.search(r"HTTP 503.*SlowDown.*may still be pending", notes[0]), notes
    (upload_id,) = pending(store, key)
    store.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)


# ---------------------------------------------------------------- CompleteMultipartUpload


@pytest.mark.parametrize(
    "action", ["reset", "close", ANSWER_500, ERROR_IN_200], ids=["reset", "close", "500", "error"]
)
async def test_complete_done_but_answer_lost_is_a_success(
    store: MotoS3Server, proxy: LossyProxy, key: str, action: str | bytes
) -> None:
    """The store completed the object: the writer finds that out and reports success."""
    proxy.lose(*COMPLETE, action, forward=True)
    await write(s3_sink(proxy, key), TWO_PARTS)
    assert stored(store, key) == reference_numpy.save(TWO_PARTS)
    assert pending(store, key) == []


async def test_complete_and_abort_lost_is_an_unknown_outcome(
    store: MotoS3Server, proxy: LossyProxy, key: str
) -> None:
    proxy.lose(*COMPLETE, "refuse")
    proxy.lose(*ABORT, "refuse", times=None)
    with pytest.raises(OutcomeUnknownError, match="may or may not") as info:
        await write(s3_sink(proxy, key), TWO_PARTS)
    assert info.value.url == f"s3://{BUCKET}/{key}"
    for upload_id in pending(store, key):  # the store could not be told: clean up here
        store.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)


# ---------------------------------------------------------------- cancellation


@pytest.mark.parametrize("at", [CREATE, PART, COMPLETE], ids=["create", "part", "complete"])
async def test_cancelled_while_waiting_for_an_answer(
    store: MotoS3Server, proxy: LossyProxy, key: str, at: tuple[str, str]
) -> None:
    """The request reached the store and its answer never comes: the cancellation stays one and
    nothing is left pending (an object the store completed anyway stays), but for the upload of
    a CreateMultipartUpload never answered."""
    proxy.lose(*at, "stall")
    scope = await write_cancelled_at(s3_sink(proxy, key), TWO_PARTS, proxy, at)
    assert scope.cancelled_caught
    # A create's answer never came: its upload cannot be told from another writer's, and stays.
    assert len(abort_all(store, key)) == (at == CREATE)
    if at != COMPLETE:
        assert stored(store, key) is None


@pytest.mark.parametrize(
    ("at", "arrays", "request_name"),
    [(COMPLETE, TWO_PARTS, "CompleteMultipartUpload"), (PUT, SMALL, "PutObject")],
    ids=["complete", "put"],
)
async def test_cancelled_once_the_final_request_stored_the_object_says_so(
    store: MotoS3Server,
    proxy: LossyProxy,
    key: str,
    at: tuple[str, str],
    arrays: Arrays,
    request_name: str,
) -> None:
    """The final request reached the store, which stored the object, and its answer never
    came: after abort_timeout the cancellation goes on with a note that the object at the key
    is the one written (the abort found no upload), where it went on bare, the object that was
    there replaced unsaid."""
    store.client().put_object(Bucket=BUCKET, Key=key, Body=b"the object that was there")
    proxy.lose(*at, "stall")
    notes: list[str] = []
    scope = await write_cancelled_at(s3_sink(proxy, key), arrays, proxy, at, notes)
    assert scope.cancelled_caught
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"the {request_name} sent before the cancellation was carried out")
    assert f"the object at s3://{BUCKET}/{key} is the one written" in notes[0]
    assert stored(store, key) == reference_numpy.save(arrays)
    assert pending(store, key) == []


# ---------------------------------------------------------------- a single PUT


async def test_put_answer_lost_after_storing_is_a_success(
    store: MotoS3Server, proxy: LossyProxy, key: str
) -> None:
    proxy.lose(*PUT, "reset")
    await write(s3_sink(proxy, key), SMALL)
    assert stored(store, key) == reference_numpy.save(SMALL)


async def test_put_answer_lost_is_an_unknown_outcome(
    store: MotoS3Server, proxy: LossyProxy, key: str
) -> None:
    proxy.lose(*PUT, "refuse")
    with pytest.raises(OutcomeUnknownError, match="may or may not"):
        await write(s3_sink(proxy, key), SMALL)
    assert stored(store, key) is None


async def test_put_redirected_is_a_failure(
    store: MotoS3Server, proxy: LossyProxy, key: str
) -> None:
    proxy.lose(*PUT, REDIRECT)
    with pytest.raises(HTTPStatusError, match=r"HTTP 307.*elsewhere\.invalid") as info:
        await write(s3_sink(proxy, key), SMALL)
    assert info.value.status == 307
    assert stored(store, key) is None


# ---------------------------------------------------------------- HTTP upload


@pytest.fixture
def http_proxy() -> Iterator[tuple[RangeHTTPServer, LossyProxy]]:
    with RangeHTTPServer() as server, LossyProxy(server.port) as proxy:
        yield server, proxy


@pytest.mark.parametrize("action", ["reset", "close", "stall"])
async def test_http_upload_answer_lost_is_an_unknown_outcome(
    http_proxy: tuple[RangeHTTPServer, LossyProxy], action: str
) -> None:
    server, proxy = http_proxy
    url = proxy.url + "/up/model.safetensors"
    proxy.lose("PUT", "", action)
    with pytest.raises(OutcomeUnknownError, match="may or may not") as info:
        await write(HttpSink(url, timeout=1), SMALL)
    assert info.value.url == url
    assert server.objects["/up/model.safetensors"] == reference_numpy.save(SMALL)


async def test_http_upload_refused_is_a_plain_failure(
    http_proxy: tuple[RangeHTTPServer, LossyProxy],
) -> None:
    _, proxy = http_proxy
    proxy.lose("PUT", "", b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
    with pytest.raises(HTTPStatusError) as info:
        await write(HttpSink(proxy.url + "/big.safetensors", timeout=5), TWO_PARTS)
    assert info.value.status == 413


async def test_a_write_ended_by_its_deadline_still_aborts_its_upload(
    store: MotoS3Server, proxy: LossyProxy, key: str
) -> None:
    """The deadline that ends a write does not stop the clean-up from reaching the store."""
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in TWO_PARTS.items()]
    sink = s3_sink(proxy, key)
    with anyio.fail_after(60), pytest.raises(stream_st.ReadTimeoutError, match="deadline"):
        async with stream_st.open_writer(sink, plan, deadline=1) as writer:
            await writer.write("w0", TWO_PARTS["w0"])
            async with writer.tensor("w1") as part:
                most = len(TWO_PARTS["w1"]) * 3 // 4
                await part.write(TWO_PARTS["w1"][:most])  # past one part: the upload exists
                await anyio.sleep(1.5)
                await part.write(TWO_PARTS["w1"][most:])
    proxy.wait_for(*ABORT, timeout=0)
    assert pending(store, key) == [] and stored(store, key) is None


class _SlowAnswer:
    """One HTTP upload stored once its whole body is in, answered ``delay`` seconds later."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.stored: bytes | None = None
        self.complete = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/m.safetensors"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        connection, _ = self._listener.accept()
        with connection:
            data = b""
            while b"\r\n\r\n" not in data:
                data += connection.recv(65536)
            head, _, body = data.partition(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length:\s*(\d+)", head)[1])  # type: ignore[index]
            while len(body) < length and (more := connection.recv(1 << 20)):
                body += more
            if len(body) == length:
                self.stored = body
                self.complete.set()
            time.sleep(self.delay)
            connection.sendall(b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n")

    def close(self) -> None:
        self._listener.close()
        self._thread.join(5)


async def test_http_upload_cancelled_after_its_whole_body_waits_for_the_answer() -> None:
    """The whole body went out (the commit point): a cancellation then lets the answer come, and
    the write reports success under the cancel scope, never a cancelled write the server
    stored."""
    server = _SlowAnswer(delay=0.5)
    written = False
    try:
        with anyio.fail_after(10), anyio.CancelScope() as scope:

            async def cancel_when_stored() -> None:
                await anyio.to_thread.run_sync(server.complete.wait)
                scope.cancel()

            async with anyio.create_task_group() as group:
                group.start_soon(cancel_when_stored)
                await write(HttpSink(server.url), SMALL)
                written = True
        assert written
        assert server.stored == reference_numpy.save(SMALL)
    finally:
        server.close()
