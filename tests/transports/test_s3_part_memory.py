"""An S3 upload holds each part in memory once: the bytes gathered for a part are the bytes sent.

A real S3-compatible server (moto, in a child process). The memory is measured in a fresh Python
process of its own: its peak resident size (``VmHWM``, reset through ``/proc/self/clear_refs``)
while it writes, over what it held before. Before, a part was sent as a copy of the buffer it
was gathered in, both alive until its answer came: two parts in memory, where the sink promises
one. A part the store answers with a 500 is sent again, the same bytes, from that one buffer.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import TensorSpec
from stream_st.sinks import S3Sink
from stream_st.sources import S3Source
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.sink import MIN_PART_SIZE

from ..servers.lossy_proxy import LossyProxy
from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._s3_faults import bucket_store
from ._s3_faults import proxy as proxy

pytestmark = [
    pytest.mark.filterwarnings("error::ResourceWarning"),
    pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
]

Arrays = dict[str, np.ndarray[Any, Any]]
BUCKET = "part-memory"
MIB = 1 << 20
PART_MIB = 32
FIRST_PART = ("PUT", "partNumber=1&")
ANSWER_500 = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n"

# Run in a fresh process: argv is the endpoint, the bucket, the key, the part size and the
# count of 1 MiB tensors, and "checksums" or "plain". It writes once to warm up (imports,
# connections, a multipart upload and a single PUT), then prints the peak resident MiB of the
# measured write over what the process held before it.
MEASURE = """
import asyncio, sys
import numpy as np
import stream_st
from stream_st.sinks import S3Sink
from stream_st.transports.s3.config import S3Config

endpoint, bucket, key, part_size, count, mode = sys.argv[1:]
MIB = 1 << 20


def status(field):
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) >> 10


async def write(key, part_size, count):
    config = S3Config.resolve(
        endpoint_url=endpoint, access_key_id="testing", secret_access_key="testing", environ={}
    )
    plan = [stream_st.TensorSpec(f"t{i}", "U8", (MIB,)) for i in range(count)]
    sink = S3Sink(f"s3://{bucket}/{key}", config=config, part_size=part_size)
    checksums = mode == "checksums"
    async with stream_st.open_writer(sink, plan, checksums=checksums) as writer:
        for i in range(count):
            await writer.write(f"t{i}", np.full(MIB, i, np.uint8))


for warm, warm_count in (("warm-multipart", 12), ("warm-put", 2)):
    asyncio.run(write(f"{key}-{warm}", 5 * MIB, warm_count))
before = status("VmRSS")
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak (VmHWM) starts again from the resident size now
asyncio.run(write(key, int(part_size), int(count)))
print(status("VmHWM") - before)
"""


@pytest.fixture(autouse=True)
def no_instance_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing asks a cloud's instance metadata service for credentials."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


store = bucket_store(BUCKET)


def config(endpoint_url: str) -> S3Config:
    """The test store's configuration, reached at ``endpoint_url``."""
    return S3Config.resolve(
        endpoint_url=endpoint_url,
        access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        environ={},
    )


def stored(store: MotoS3Server, key: str) -> bytes:
    """The object at ``key`` of the test bucket."""
    return bytes(store.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())


def peak_writing(store: MotoS3Server, key: str, count: int, mode: str) -> int:
    """The peak resident MiB, over what it held before, of a fresh process writing ``count``
    tensors of 1 MiB to ``key`` in parts of :data:`PART_MIB` (``mode``: "checksums" or "plain")."""
    root = Path(stream_st.__file__).resolve().parents[1]
    environ = {**os.environ, **CREDENTIALS, "PYTHONPATH": str(root)}
    argv = [store.endpoint_url, BUCKET, key, str(PART_MIB * MIB), str(count), mode]
    done = subprocess.run(
        [sys.executable, "-B", "-c", MEASURE, *argv],
        env=environ,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(
    not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux's /proc/self/clear_refs"
)
@pytest.mark.parametrize(
    ("count", "mode", "held"),
    [(80, "plain", PART_MIB), (30, "plain", 30), (40, "checksums", 40)],
    ids=["multipart", "single-put", "head-held"],
)
def test_a_part_is_held_in_memory_once(
    store: MotoS3Server, key: str, count: int, mode: str, held: int
) -> None:
    """The write's peak memory is what the sink must hold (``held`` MiB: a part filling and
    sent; the whole message sent as a single PUT; the first part held back until the commit,
    which patches its header, and the last part) and less than half a part more, never a second
    copy of a part (two full parts and a rest, one PUT, a held part and a rest); the object
    stored is the one written."""
    peak = peak_writing(store, key, count, mode)
    assert peak < held + PART_MIB // 2, f"{peak} MiB over the baseline, {held} MiB held"
    got = reference_numpy.load(stored(store, key))
    assert sorted(got) == sorted(f"t{i}" for i in range(count))
    for name, array in got.items():
        assert array.shape == (MIB,) and (array == int(name[1:])).all()


@pytest.mark.parametrize("checksums", [False, True], ids=["sent-as-filled", "head-held"])
async def test_a_part_answered_500_is_sent_again_with_the_same_bytes(
    store: MotoS3Server, proxy: LossyProxy, key: str, checksums: bool
) -> None:
    """The first part (with ``checksums``, the one held back and patched with the digests)
    answered 500 once is sent again, the same bytes under the same number: the object stored
    is the one written, read back as it was (its digests checked, with ``checksums``)."""
    arrays: Arrays = {f"w{i}": np.random.default_rng(i).random(400_000) for i in range(4)}
    proxy.lose(*FIRST_PART, ANSWER_500, forward=True)
    sink = S3Sink(f"s3://{BUCKET}/{key}", config=config(proxy.url), part_size=MIN_PART_SIZE)
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    with anyio.fail_after(60):
        async with stream_st.open_writer(sink, plan, checksums=checksums) as writer:
            for name, array in arrays.items():
                await writer.write(name, array)
    data = stored(store, key)
    sent = [target for method, target, _ in proxy.requests if method == "PUT"]
    first = [target for target in sent if "partNumber=1&" in target]
    assert len(sent) == -(-len(data) // MIN_PART_SIZE) + 1 and len(first) == 2  # it, twice
    if not checksums:
        assert data == reference_numpy.save(arrays)
    got = await stream_st.load(S3Source(f"s3://{BUCKET}/{key}", config=config(store.endpoint_url)))
    assert sorted(got) == sorted(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(got[name], array)
