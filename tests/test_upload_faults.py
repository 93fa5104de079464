"""Uploads whose answers get lost: S3 multipart and HTTP upload sinks against real servers (moto,
tests/http_server.py) behind a proxy that drops, resets, stalls or replaces chosen answers.

After every failure: no pending multipart upload of the key, nothing (or the whole object) at the
key, a cancellation that stays a cancellation, a clean-up that ends on its own whatever the
timeout, and an error that says when the writer cannot know whether the object was stored.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import OutcomeUnknownError, TensorSpec
from stream_st._http import HTTPStatusError
from stream_st._s3 import S3Config
from stream_st.sinks.http import HttpSink
from stream_st.sinks.s3 import MIN_PART_SIZE, S3Sink

from .http_server import RangeHTTPServer
from .lossy_proxy import LossyProxy
from .s3_server import CREDENTIALS, MotoS3Server

pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]

Arrays = dict[str, np.ndarray[Any, Any]]
BUCKET = "faults"
# Two parts of MIN_PART_SIZE: the second one is sent with the completion.
TWO_PARTS: Arrays = {f"w{i}": np.random.default_rng(i).random(400_000) for i in range(2)}
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
REDIRECT = (
    b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://elsewhere.invalid/\r\n"
    b"Content-Length: 0\r\n\r\n"
)


@pytest.fixture(scope="module")
def store(moto_s3: MotoS3Server) -> MotoS3Server:
    moto_s3.client().create_bucket(Bucket=BUCKET)
    return moto_s3


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """An object key of the test's own."""
    return re.sub(r"[^\w.-]+", "-", request.node.name) + ".safetensors"


@pytest.fixture
def proxy(store: MotoS3Server) -> Iterator[LossyProxy]:
    with LossyProxy(store.port) as proxy:
        yield proxy


def s3_sink(proxy: LossyProxy, key: str, **kwargs: Any) -> S3Sink:
    config = S3Config.resolve(
        endpoint_url=proxy.url,
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        environ={},
    )
    sink = S3Sink(f"s3://{BUCKET}/{key}", config=config, part_size=MIN_PART_SIZE, **kwargs)
    sink.abort_timeout = 1.0
    return sink


def pending(store: MotoS3Server, key: str) -> list[str]:
    """Upload ids of the multipart uploads of exactly ``key`` still pending."""
    answer = store.client().list_multipart_uploads(Bucket=BUCKET, Prefix=key)
    return [u["UploadId"] for u in answer.get("Uploads", []) if u["Key"] == key]


def stored(store: MotoS3Server, key: str) -> bytes | None:
    client = store.client()
    try:
        return bytes(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


async def write(sink: Any, arrays: Arrays) -> None:
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    async with stream_st.open_writer(sink, plan) as writer:
        for name, array in arrays.items():
            await writer.write(name, array)


async def write_cancelled_at(
    sink: Any, arrays: Arrays, proxy: LossyProxy, request: tuple[str, str]
) -> anyio.CancelScope:
    """Write, cancelling once the server has seen ``request`` (and the proxy lost its answer)."""

    async def cancel_when_seen(scope: anyio.CancelScope) -> None:
        await anyio.to_thread.run_sync(proxy.wait_for, *request)
        scope.cancel()

    with anyio.fail_after(60), anyio.CancelScope() as scope:  # fail_after: a hang guard
        async with anyio.create_task_group() as group:
            group.start_soon(cancel_when_seen, scope)
            await write(sink, arrays)
    return scope


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
