"""An S3 upload given more bytes than :meth:`S3Sink.allocate` announced stores them all.

A real S3-compatible server (moto, in a child process). ``allocate`` is a hint: a message
announced as fitting in one part (so meant for a single PUT) that outgrows it goes up as a
multipart upload, each full part cut as it is for a message of unknown size. Before, the part
filled, the cut was skipped (the announced size fit in one part) and ``send`` looped forever
without awaiting, so no timeout, deadline or cancellation could end it. The write runs in a
thread of its own, so that such a loop fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import threading

import anyio
import pytest

from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink

from ..servers.s3_server import MotoS3Server
from ._s3_faults import bucket_store

pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]

BUCKET = "sink-overrun"
SENT = os.urandom(MIN_PART_SIZE * 5 // 2)  # two and a half parts

store = bucket_store(BUCKET)


@pytest.fixture(autouse=True)
def no_instance_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing asks a cloud's instance metadata service for credentials."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


async def write(store: MotoS3Server, key: str, announced: int, chunk: int) -> None:
    """Announce ``announced`` bytes, then send :data:`SENT` in sends of ``chunk`` bytes and
    commit, within a time limit."""
    sink = S3Sink(f"s3://{BUCKET}/{key}", config=store.config(), part_size=MIN_PART_SIZE)
    with anyio.fail_after(30):
        await sink.allocate(announced)
        for start in range(0, len(SENT), chunk):
            await sink.send(memoryview(SENT)[start : start + chunk])
        await sink.aclose()


def write_in_a_thread(store: MotoS3Server, key: str, announced: int, chunk: int) -> None:
    """Run :func:`write` on an event loop in a thread of its own and wait for it a while: a
    ``send`` that never awaits would spin there for good, where its time limit cannot end it."""
    failures: list[BaseException] = []

    def run() -> None:
        try:
            anyio.run(write, store, key, announced, chunk)
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(45)
    assert not thread.is_alive(), "the write neither ended nor failed within 45 s"
    if failures:
        raise failures[0]


@pytest.mark.parametrize("announced", [1, MIN_PART_SIZE], ids=["one-byte", "one-part"])
@pytest.mark.parametrize(
    "chunk", [len(SENT), MIN_PART_SIZE // 2], ids=["one-send", "sends-ending-on-a-part"]
)
def test_more_bytes_than_announced_are_all_stored(
    store: MotoS3Server, key: str, announced: int, chunk: int
) -> None:
    """Two and a half parts sent after announcing one byte, or one part (in one send, or in
    sends of which one ends where a part fills): the write ends, the object is every byte sent,
    and no multipart upload is left pending."""
    write_in_a_thread(store, key, announced, chunk)
    client = store.client()
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == SENT
    uploads = client.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads", [])
    assert [u for u in uploads if u["Key"] == key] == []
