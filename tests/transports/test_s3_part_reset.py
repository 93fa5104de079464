"""An S3 part whose connection is reset or dropped before its answer came is sent again.

A real S3-compatible server (moto, in a child process) behind a real proxy on 127.0.0.1 that
resets or closes the connection of chosen requests (:class:`LossyProxy`: once the server took the
request, or before it sees it), or resets one mid-request, in the middle of a part's body
(:class:`FaultProxy`). UploadPart is idempotent (the same bytes under the same number), so a
dropped connection costs an attempt of the part's retries, as a status worth retrying does; the
requests that are not (CreateMultipartUpload, CompleteMultipartUpload) are never sent twice. A
part whose every attempt is dropped fails the write with the connection's error, and its upload
is aborted.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import OutcomeUnknownError, TensorSpec, TransportError
from stream_st.transports.http.retry import Retries
from stream_st.transports.s3 import sink as s3_sink_module
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink

from ..servers.fault_proxy import Fault, FaultProxy
from ..servers.lossy_proxy import LossyProxy
from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._s3_faults import bucket_store
from ._s3_faults import proxy as proxy

pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]

Arrays = dict[str, np.ndarray[Any, Any]]
BUCKET = "part-reset"
# Two parts of MIN_PART_SIZE: the first is sent as it fills, the second with the completion.
TWO_PARTS: Arrays = {f"w{i}": np.random.default_rng(i).random(400_000) for i in range(2)}

# The requests of a multipart upload: method and a pattern of the query string.
CREATE = ("POST", "^uploads")
PART = ("PUT", "partNumber=")
COMPLETE = ("POST", "^uploadId=")


@pytest.fixture(autouse=True)
def no_instance_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing asks a cloud's instance metadata service for credentials."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


store = bucket_store(BUCKET)


def s3_sink(endpoint_url: str, key: str) -> S3Sink:
    """A sink writing ``key`` of the test bucket through ``endpoint_url``, in parts of S3's
    smallest size."""
    config = S3Config.resolve(
        endpoint_url=endpoint_url,
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        environ={},
    )
    sink = S3Sink(f"s3://{BUCKET}/{key}", config=config, part_size=MIN_PART_SIZE)
    sink.abort_timeout = 5.0
    return sink


async def write(sink: S3Sink, arrays: Arrays, deadline: float | None = None) -> None:
    """Write ``arrays`` to ``sink`` as one safetensors file, within a hang guard."""
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    with anyio.fail_after(60):
        async with stream_st.open_writer(sink, plan, deadline=deadline) as writer:
            for name, array in arrays.items():
                await writer.write(name, array)


def pending(store: MotoS3Server, key: str) -> list[str]:
    """Upload ids of the multipart uploads of exactly ``key`` still pending."""
    answer = store.client().list_multipart_uploads(Bucket=BUCKET, Prefix=key)
    return [u["UploadId"] for u in answer.get("Uploads", []) if u["Key"] == key]


def stored(store: MotoS3Server, key: str) -> bytes | None:
    """The object at ``key``; None if there is none."""
    client = store.client()
    try:
        return bytes(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    except client.exceptions.NoSuchKey:
        return None


def sent(proxy: LossyProxy, request: tuple[str, str]) -> list[str]:
    """The targets of the ``request``s the proxy passed on or acted on, in order."""
    method, query = request
    return [
        target
        for seen, target, _ in proxy.requests
        if seen == method and re.search(query, target.partition("?")[2])
    ]


@pytest.mark.parametrize("action", ["reset", "close", "refuse"])
async def test_a_part_whose_connection_drops_before_its_answer_is_sent_again(
    store: MotoS3Server, proxy: LossyProxy, key: str, action: str
) -> None:
    """The first UploadPart's connection is reset (or closed) once the store took the part, or
    reset before the store saw it: the part is sent again, the same bytes under the same number,
    and the write succeeds, where the whole upload was aborted and the write failed."""
    proxy.lose(*PART, action)
    await write(s3_sink(proxy.url, key), TWO_PARTS)
    assert stored(store, key) == reference_numpy.save(TWO_PARTS)
    assert pending(store, key) == []
    parts = sent(proxy, PART)
    assert len(parts) == 3 and parts[0] == parts[1] != parts[2]  # the first one, twice
    assert len(sent(proxy, CREATE)) == 1 and len(sent(proxy, COMPLETE)) == 1


async def test_a_part_reset_in_the_middle_of_its_body_is_sent_again(
    store: MotoS3Server, key: str
) -> None:
    """A reset while the first part's body is on its way (1 MiB into the bytes sent: past the
    short CreateMultipartUpload, inside the first part's 5 MiB) loses the request, not the
    write: the part is sent again on a new connection."""
    fault = Fault("reset", "up", offset=1 << 20)
    with FaultProxy(("127.0.0.1", store.port), fault) as proxy:
        await write(s3_sink(proxy.url(), key), TWO_PARTS)
        assert proxy.fired
    assert stored(store, key) == reference_numpy.save(TWO_PARTS)
    assert pending(store, key) == []


async def test_a_part_whose_every_attempt_drops_fails_and_is_aborted(
    store: MotoS3Server, proxy: LossyProxy, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every attempt reset: after the part's retries the write fails with the connection's error
    (not an unknown outcome: nothing was completed) and the upload is aborted."""
    monkeypatch.setattr(s3_sink_module, "_PART_RETRIES", Retries(count=2, backoff=0.01))
    proxy.lose(*PART, "reset", times=None)
    with pytest.raises(TransportError, match="Connection reset") as info:
        await write(s3_sink(proxy.url, key), TWO_PARTS)
    assert isinstance(info.value, stream_st.SafetensorsError)
    assert not isinstance(info.value, OutcomeUnknownError)
    parts = sent(proxy, PART)
    assert len(parts) == 3 and len(set(parts)) == 1  # one part, tried three times
    assert pending(store, key) == [] and stored(store, key) is None


async def test_a_part_reset_is_not_retried_past_the_deadline(
    store: MotoS3Server, proxy: LossyProxy, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A back-off that would pass the write's deadline ends the write at the deadline
    (:class:`~stream_st.ReadTimeoutError`) instead of sending the part again after it; the
    upload is aborted."""
    monkeypatch.setattr(s3_sink_module, "_PART_RETRIES", Retries(count=3, backoff=30.0))
    proxy.lose(*PART, "reset", times=None)
    with pytest.raises(stream_st.ReadTimeoutError, match="deadline"):
        await write(s3_sink(proxy.url, key), TWO_PARTS, deadline=2.0)
    assert len(sent(proxy, PART)) == 1
    assert pending(store, key) == [] and stored(store, key) is None


async def test_a_part_reset_is_not_retried_past_the_callers_time(
    store: MotoS3Server, proxy: LossyProxy, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A back-off that would outlast the caller's own time limit (a cancel scope's deadline)
    raises the connection's error at once, rather than a cancellation once waited for."""
    monkeypatch.setattr(s3_sink_module, "_PART_RETRIES", Retries(count=3, backoff=30.0))
    proxy.lose(*PART, "reset", times=None)
    began = anyio.current_time()
    with anyio.fail_after(20), pytest.raises(TransportError, match="Connection reset") as info:
        await write(s3_sink(proxy.url, key), TWO_PARTS)
    assert anyio.current_time() - began < 10
    assert not isinstance(info.value, stream_st.ReadTimeoutError)
    assert len(sent(proxy, PART)) == 1
    assert pending(store, key) == [] and stored(store, key) is None


@pytest.mark.parametrize("at", [CREATE, COMPLETE], ids=["create", "complete"])
async def test_requests_that_are_not_idempotent_are_not_sent_again(
    store: MotoS3Server, proxy: LossyProxy, key: str, at: tuple[str, str]
) -> None:
    """A reset of CreateMultipartUpload (which would make a second upload) or of
    CompleteMultipartUpload (seen through by asking the store instead) is never answered by
    sending the request again."""
    proxy.lose(*at, "reset")
    failing = pytest.raises(TransportError, match="Connection reset")
    with failing if at == CREATE else contextlib.nullcontext():  # a complete: the store says
        await write(s3_sink(proxy.url, key), TWO_PARTS)
    assert len(sent(proxy, at)) == 1
    if at == COMPLETE:  # completed by the store: the object written, found there
        assert stored(store, key) == reference_numpy.save(TWO_PARTS)
    for upload_id in pending(store, key):  # a create's lost answer leaves its upload: clean up
        store.client().abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=upload_id)
