"""``cache=`` on ``s3://``: the store's checksum of the object is checked against the copy once
it is complete; bytes damaged on the wire (a real proxy flipping one) leave no copy behind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import IntegrityError

from .._util import assert_same_arrays
from ..servers.fault_proxy import Fault, FaultProxy
from ..servers.s3_server import CREDENTIALS, MotoS3Server

BUCKET = "cache-checked"
Arrays = dict[str, np.ndarray[Any, Any]]
ARRAYS: Arrays = {
    "a": np.random.default_rng(3).random(50_000),
    "b": np.arange(1000, dtype=np.int32),
}
DATA = reference_numpy.save(ARRAYS)  # no digests of stream_st's own: only the store's checksum


@pytest.fixture
def store(moto_s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> MotoS3Server:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    client = moto_s3.client()
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="m", Body=DATA, ChecksumAlgorithm="CRC32")
    return moto_s3


async def cached_read(cache: Path) -> Arrays:
    return {name: a async for name, a in stream_st.open_stream(f"s3://{BUCKET}/m", cache=cache)}


async def test_a_copy_not_matching_the_stores_checksum_is_not_kept(
    store: MotoS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    with FaultProxy(("127.0.0.1", store.port)) as proxy:  # a clean run: its traffic
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url())
        assert_same_arrays(await cached_read(tmp_path / "clean"), ARRAYS)
        traffic = proxy.carried["down"]
    assert len(list((tmp_path / "clean").rglob("*.safetensors"))) == 1
    fault = Fault("flip", "down", traffic - 2000)  # in tensor a's last bytes
    with FaultProxy(("127.0.0.1", store.port), fault) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url())
        with pytest.raises(IntegrityError, match=r"CRC32.*no copy was kept"):
            await cached_read(tmp_path / "damaged")
        assert proxy.fired
    assert not [p for p in (tmp_path / "damaged").rglob("*") if p.is_file() and p.name != "lock"]
