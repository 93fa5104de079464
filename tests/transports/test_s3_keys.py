"""S3 keys as the AWS CLI takes them (``?``, ``#``, ``%`` are part of the key), and bad
``s3://`` URLs and sink options refused before any request, against moto's server mode on
127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
from stream_st import TensorSpec
from stream_st.transports import store
from stream_st.transports.http import HTTPStatusError
from stream_st.transports.options import Clock, Limits
from stream_st.transports.s3.config import S3Config, parse_s3_url
from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink

from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]

BUCKET = "keys"
ODD_KEYS = [
    "ckpt/model?v=2.safetensors",
    "ckpt/model#1.safetensors",
    "ckpt/model?v=3#x&y=%41.safetensors",
    "ckpt/model%3Fv=2.safetensors",
]


@pytest.fixture
def s3(moto_s3: MotoS3Server) -> tuple[MotoS3Server, S3Config]:
    moto_s3.client().create_bucket(Bucket=BUCKET)
    config = moto_s3.config()
    return moto_s3, config


@pytest.fixture
def aws_env(
    s3: tuple[MotoS3Server, S3Config], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    s3_at(s3[0].endpoint_url, monkeypatch, tmp_path)


def s3_at(endpoint_url: str, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """The environment names ``endpoint_url`` as the S3 endpoint, with the test credentials."""
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint_url)
    monkeypatch.setenv("HOME", str(home))  # no stray ~/.aws files
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)


def keys_in(server: MotoS3Server, prefix: str = "") -> list[str]:
    answer = server.client().list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"] for item in answer.get("Contents", []))


def body_of(server: MotoS3Server, key: str) -> bytes:
    return bytes(server.client().get_object(Bucket=BUCKET, Key=key)["Body"].read())


# ---------------------------------------------------------------- the key, as written


@pytest.mark.parametrize("key", [*ODD_KEYS, "/leading/slash", "a b/ü é+!*'()[]~"])
def test_the_key_is_everything_after_the_bucket(key: str) -> None:
    assert parse_s3_url(f"s3://b/{key}") == ("b", key)
    assert parse_s3_url(f"S3://b.x-y_Z/{key}") == ("b.x-y_Z", key)


def test_object_url_percent_encodes_query_and_fragment_characters() -> None:
    config = S3Config("http://127.0.0.1:9", "us-east-1")
    assert config.object_url("b", "m?v=2#1%.st") == "http://127.0.0.1:9/b/m%3Fv%3D2%231%25.st"
    assert config.object_url("b", "m?v", "uploads=") == "http://127.0.0.1:9/b/m%3Fv?uploads="


def test_a_virtual_hosted_bucket_prefixes_the_host_not_the_user_info() -> None:
    """An endpoint with user info put the bucket in front of it (``b.user:pw@host``): the
    requests went to the endpoint's host, the bucket taken as part of the user name."""
    config = S3Config("http://user:pw@s3.example:9000", "us-east-1", path_style=False)
    assert config.object_url("b", "k") == "http://user:pw@b.s3.example:9000/k"
    plain = S3Config("http://s3.example:9000", "us-east-1", path_style=False)
    assert plain.object_url("b", "") == "http://b.s3.example:9000/"


@pytest.mark.parametrize(
    "url",
    ["s3://b", "s3://b/", "s3:///k", "s3:b/k", "http://b/k", "s3://b?x/k", "s3://b#x/k"],
)
def test_not_a_bucket_and_key(url: str) -> None:
    with pytest.raises(stream_st.UnsupportedSourceError, match="bucket"):
        parse_s3_url(url)
    with pytest.raises(stream_st.UnsupportedSinkError, match="bucket"):
        parse_s3_url(url, stream_st.UnsupportedSinkError)


async def test_query_and_fragment_characters_name_their_own_objects(
    s3: tuple[MotoS3Server, S3Config], aws_env: None
) -> None:
    server, _ = s3
    server.client().put_object(Bucket=BUCKET, Key="ckpt/model", Body=b"another object")
    written: dict[str, Arrays] = {}
    for i, key in enumerate(ODD_KEYS):
        written[key] = {"a": np.full(4, i, dtype=np.float32)}
        await stream_st.save(f"s3://{BUCKET}/{key}", written[key])
    assert keys_in(server, "ckpt/") == sorted(["ckpt/model", *ODD_KEYS])
    assert body_of(server, "ckpt/model") == b"another object"
    for key, arrays in written.items():
        got = await stream_st.load(f"s3://{BUCKET}/{key}")
        assert got["a"].tobytes() == arrays["a"].tobytes()
        header = await stream_st.read_header(f"s3://{BUCKET}/{key}")
        assert list(header.names()) == ["a"]


async def test_multipart_upload_to_a_key_with_query_characters(
    s3: tuple[MotoS3Server, S3Config],
) -> None:
    server, config = s3
    key = "big/m?part=1#frag.safetensors"
    arrays = {f"w{i}": np.random.default_rng(i).random(400_000) for i in range(3)}  # 9.6 MB
    sink = S3Sink(f"s3://{BUCKET}/{key}", config=config, part_size=MIN_PART_SIZE)
    plan = [TensorSpec(n, a.dtype, a.shape) for n, a in arrays.items()]
    async with stream_st.open_writer(sink, plan) as writer:
        for name, array in arrays.items():
            await writer.write(name, array)
    assert keys_in(server, "big/") == [key]
    assert server.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", []) == []
    got = await stream_st.load(stream_st.S3Source(f"s3://{BUCKET}/{key}", config=config))
    assert all(got[n].tobytes() == a.tobytes() for n, a in arrays.items())


async def test_listing_moving_removing_under_a_prefix_with_query_characters(
    s3: tuple[MotoS3Server, S3Config], aws_env: None
) -> None:
    server, _ = s3
    client = server.client()
    for key in ("d?x#y/a", "d?x#y/b", "d?x#y/sub/c", "d/other", "d?x"):
        client.put_object(Bucket=BUCKET, Key=key, Body=key.encode())
    assert await store.list_names(f"s3://{BUCKET}/d?x#y") == ["a", "b"]
    await store.move(f"s3://{BUCKET}/d?x#y/a", f"s3://{BUCKET}/d?x#y/a?2")
    assert body_of(server, "d?x#y/a?2") == b"d?x#y/a"
    await store.remove_tree(f"s3://{BUCKET}/d?x#y")
    assert keys_in(server, "d") == ["d/other", "d?x"]


async def test_a_listing_that_fails_names_the_prefix(
    s3: tuple[MotoS3Server, S3Config], aws_env: None
) -> None:
    """A listing refused (a bucket that does not exist) names the prefix listed, where it named
    a key of its own making in it (``.../ds/_``)."""
    with pytest.raises(stream_st.SafetensorsError) as caught:
        await store.list_names("s3://no-such-bucket/ds")
    assert caught.value.url == "s3://no-such-bucket/ds/"  # type: ignore[attr-defined]


async def test_any_exists_asks_for_many_keys_at_once_and_finds_one(
    s3: tuple[MotoS3Server, S3Config], aws_env: None, tmp_path: Path
) -> None:
    """Keys asked about HEADS_AT_ONCE at a time (they were asked one after another: a round trip
    each before a mirror's commit), within the clock given (each request had a fresh one, so
    the mirror's deadline did not bound them)."""
    server, _ = s3
    keys = [f"s3://{BUCKET}/many/{i}" for i in range(3 * store.HEADS_AT_ONCE)]
    assert not await store.any_exists(keys, Clock())
    server.client().put_object(Bucket=BUCKET, Key="many/20", Body=b"x")
    assert await store.any_exists(keys, Clock())
    assert await store.any_exists([str(tmp_path / "none"), str(tmp_path), *keys[:3]])
    passed = Clock(Limits(deadline=0))
    passed.start()
    with pytest.raises(stream_st.ReadTimeoutError):  # as it is, not in a group
        await store.any_exists(keys, passed)


async def test_any_exists_raises_a_refused_head_as_it_is(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A 403 on the keys asked at once comes out as the HTTPStatusError a mirror's commit takes
    for "may not read the keys", not in an exception group, where no key was found. Credentials
    without s3:ListBucket get a 403 for a missing key and a 200 for one there: a key found among
    refused ones is an answer (the first 403 stopped the rest, the key last in the list never
    asked, and the 403 was raised: whether a mirror's commit removed the older index depended on
    which answer came first)."""
    keys = [f"k/{i}" for i in range(2 * store.HEADS_AT_ONCE)]
    refused = {f"/{BUCKET}/{key}": 403 for key in keys[:-1]}
    with RangeHTTPServer(objects={f"/{BUCKET}/{keys[-1]}": b"x"}, status_for=refused) as server:
        s3_at(f"http://127.0.0.1:{server.port}", monkeypatch, tmp_path)
        addresses = [f"s3://{BUCKET}/{key}" for key in keys]
        with pytest.raises(HTTPStatusError) as caught:
            await store.any_exists(addresses[:-1], Clock())
        assert await store.any_exists(addresses, Clock())
    assert caught.value.status == 403


# ---------------------------------------------------------------- refused before any request


@pytest.mark.parametrize("key", ["\udcff", "ok/\ud800.safetensors"])
async def test_a_key_that_is_not_unicode_text_is_refused_before_any_request(key: str) -> None:
    config = S3Config.resolve(  # nothing listens there: a request would be a TransportError
        endpoint_url="http://127.0.0.1:1", access_key_id="a", secret_access_key="b", environ={}
    )
    url = f"s3://{BUCKET}/{key}"
    with pytest.raises(stream_st.UnsupportedSinkError, match="not valid Unicode"):
        S3Sink(url, config=config)
    with pytest.raises(stream_st.UnsupportedSourceError, match="not valid Unicode"):
        stream_st.S3Source(url, config=config)
    with pytest.raises(stream_st.SafetensorsError, match="not valid Unicode"):
        await stream_st.save(url, {"a": np.zeros(1)}, timeout=2)
    with pytest.raises(stream_st.SafetensorsError, match="not valid Unicode"):
        await stream_st.load(url, timeout=2)


@pytest.mark.parametrize("part_size", ["x", 6e6, float(MIN_PART_SIZE), True, None, [1]])
def test_a_part_size_that_is_not_an_integer_is_refused_when_the_sink_is_built(
    part_size: Any,
) -> None:
    with pytest.raises(stream_st.ArgumentTypeError, match="part_size must be an integer"):
        S3Sink(f"s3://{BUCKET}/k", config=S3Config("http://127.0.0.1:1", "x"), part_size=part_size)


def test_part_size_bounds_and_numpy_integers() -> None:
    config = S3Config("http://127.0.0.1:1", "us-east-1", anonymous=True)
    for small in (MIN_PART_SIZE - 1, 0, -1, np.int64(MIN_PART_SIZE - 1)):
        with pytest.raises(stream_st.UsageError, match="part_size must be at least 5242880"):
            S3Sink(f"s3://{BUCKET}/k", config=config, part_size=small)  # type: ignore[arg-type]
    size: Any = np.int64(MIN_PART_SIZE)
    sink = S3Sink(f"s3://{BUCKET}/k", config=config, part_size=size)
    assert type(sink._part_size) is int and sink._part_size == MIN_PART_SIZE
