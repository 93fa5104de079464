"""S3 sources against a real S3-compatible server (moto's server mode) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import socket
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import boto3
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.http import HTTPNotFoundError, HTTPProtocolError, HTTPStatusError
from stream_st.transports.s3.config import S3Config, parse_s3_url
from stream_st.transports.s3.sink import MIN_PART_SIZE, S3Sink
from stream_st.transports.s3.source import S3Source, _parts_suffix

from .._util import assert_same_arrays, sample_file, sample_tensors
from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import CREDENTIALS, MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]
BOTO_CREDENTIALS = {
    "region_name": CREDENTIALS["AWS_DEFAULT_REGION"],
    "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
    "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
}
BIG: Arrays = {f"w{i}": np.random.default_rng(i).random(50_000) for i in range(4)}


@pytest.fixture(scope="module")
def s3(moto_s3: MotoS3Server) -> MotoS3Server:
    client = moto_s3.client()
    client.create_bucket(Bucket="models")
    client.put_object(Bucket="models", Key="small.safetensors", Body=sample_file({"k": "v"}))
    client.put_object(
        Bucket="models", Key="dir/big model.safetensors", Body=reference_numpy.save(BIG)
    )
    return moto_s3


@pytest.fixture
def aws_env(s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("HOME", str(tmp_path))  # no stray ~/.aws files
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


async def test_s3_url_from_the_environment(aws_env: None) -> None:
    assert_same_arrays(await read_all("s3://models/small.safetensors"), sample_tensors())
    assert_same_arrays(await read_all("s3://models/dir/big model.safetensors"), BIG)


async def test_s3_header_and_include(aws_env: None) -> None:
    header = await stream_st.read_header("s3://models/dir/big model.safetensors")
    assert sorted(header.names()) == sorted(BIG)
    got = await read_all("s3://models/dir/big model.safetensors", include=["w2"])
    assert_same_arrays(got, {"w2": BIG["w2"]})


async def test_s3_source_with_parallel_parts(aws_env: None) -> None:
    source = stream_st.S3Source(
        "s3://models/dir/big model.safetensors", concurrency=3, part_size=100_000, timeout=30
    )
    assert_same_arrays(await read_all(source), BIG)


async def test_s3_config_in_code_and_profiles(s3: MotoS3Server, tmp_path: Path) -> None:
    config = S3Config.resolve(
        endpoint_url=s3.endpoint_url, access_key_id="a", secret_access_key="b", environ={}
    )
    assert_same_arrays(
        await read_all(S3Source("s3://models/small.safetensors", config=config)), sample_tensors()
    )
    (tmp_path / "credentials").write_text(
        "[other]\naws_access_key_id = K\naws_secret_access_key = S\n"
    )
    (tmp_path / "config").write_text(
        f"[profile other]\nregion = eu-west-3\nendpoint_url = {s3.endpoint_url}\n"
    )
    env = {
        "AWS_PROFILE": "other",
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "credentials"),
        "AWS_CONFIG_FILE": str(tmp_path / "config"),
    }
    resolved = S3Config.resolve(environ=env)
    assert (resolved.access_key_id, resolved.secret_access_key) == ("K", "S")
    assert resolved.region == "eu-west-3"
    assert resolved.endpoint_url == s3.endpoint_url and resolved.path_style
    aws = S3Config.resolve(environ={"AWS_REGION": "eu-central-1", "HOME": str(tmp_path / "none")})
    assert aws.object_url("b", "k/x y") == "https://b.s3.eu-central-1.amazonaws.com/k/x%20y"
    assert (
        aws.object_url("b", "", "uploads=") == "https://b.s3.eu-central-1.amazonaws.com/?uploads="
    )
    assert config.object_url("b", "", "uploads=") == f"{s3.endpoint_url}/b?uploads="
    assert aws.access_key_id is None


def test_unreadable_config_files_are_one_line_errors(tmp_path: Path) -> None:
    (tmp_path / ".aws").mkdir()
    (tmp_path / ".aws" / "config").write_bytes(b"\xff\xfe[default]\x00\x81region = x\n")
    (tmp_path / "credentials").write_bytes(b"[default]\naws_access_key_id = \xc3\n")
    (tmp_path / "no-sections").write_text("region = x\n")
    env = {"HOME": str(tmp_path), "AWS_CONFIG_FILE": str(tmp_path / "none")}
    for name, value in (
        ("AWS_CONFIG_FILE", str(tmp_path / ".aws" / "config")),
        ("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials")),
        ("AWS_CONFIG_FILE", str(tmp_path / "no-sections")),
        ("AWS_CONFIG_FILE", str(tmp_path)),  # a directory
    ):
        with pytest.raises(stream_st.CredentialsError, match="cannot read the AWS file") as info:
            S3Config.resolve(environ={**env, name: value})
        assert "\n" not in str(info.value) and value in str(info.value)


@pytest.mark.parametrize(
    ("setting", "origin"),
    [
        ({"region": "x@127.0.0.1:18790/"}, "region="),
        ({"environ": {"AWS_REGION": "eu west 1"}}, "AWS_REGION"),
        ({"environ": {"AWS_DEFAULT_REGION": "-eu-west-1"}}, "AWS_DEFAULT_REGION"),
        ({"profile_region": "a/b"}, "the region of the profile 'p'"),
        ({"region": "r" * 64}, "region="),
    ],
)
def test_a_region_is_a_host_name_label(
    setting: dict[str, Any], origin: str, tmp_path: Path
) -> None:
    """A region goes into AWS's host name: one holding '@host:port/' sent the signed request
    and the session token to that host; any other than a DNS label is refused (as botocore
    does), naming where it came from, and no key is shown."""
    config = tmp_path / "config"
    config.write_text(f"[profile p]\nregion = {setting.pop('profile_region', 'us-east-1')}\n")
    environ = {
        "HOME": str(tmp_path),
        "AWS_CONFIG_FILE": str(config),
        "AWS_ACCESS_KEY_ID": "AKIDEXAMPLE",
        "AWS_SECRET_ACCESS_KEY": "KEY-SECRET",
        "AWS_SESSION_TOKEN": "TOKEN-SECRET",
        **setting.pop("environ", {}),
    }
    with pytest.raises(stream_st.CredentialsError, match="not a region name") as info:
        S3Config.resolve(**setting, profile="p", environ=environ)
    message = str(info.value)
    assert message.startswith(f"the AWS region from {origin}"), message
    assert "SECRET" not in message
    for region in ("eu-west-3", "us-gov-west-1", "a", "r" * 63):
        assert S3Config.resolve(region=region, environ=environ).region == region


@pytest.mark.parametrize(
    ("setting", "origin"),
    [
        ({"endpoint_url": "notaurl"}, "endpoint_url="),
        ({"environ": {"AWS_ENDPOINT_URL": "ftp://host"}}, "AWS_ENDPOINT_URL"),
        ({"environ": {"AWS_ENDPOINT_URL_S3": "http://[::1"}}, "AWS_ENDPOINT_URL_S3"),
        ({"endpoint_url": "https://user:pw@/"}, "endpoint_url="),
    ],
)
def test_an_endpoint_is_an_http_url(setting: dict[str, Any], origin: str, tmp_path: Path) -> None:
    """An endpoint that is no http(s) URL with a host is refused when resolved, naming where it
    came from (it failed on each request, quoting the object's address built on it), never
    shown (it may hold a password)."""
    environ = {"HOME": str(tmp_path), **setting.pop("environ", {})}
    with pytest.raises(stream_st.CredentialsError) as info:
        S3Config.resolve(**setting, environ=environ)
    assert str(info.value) == (
        f"the S3 endpoint from {origin} is not an http:// or https:// URL with a host"
    )


async def test_s3_missing_object_and_bucket(aws_env: None) -> None:
    with pytest.raises(HTTPNotFoundError) as info:
        await read_all("s3://models/nope.safetensors")
    assert info.value.url == "s3://models/nope.safetensors"
    assert "NoSuchKey" in str(info.value)
    with pytest.raises(HTTPNotFoundError, match="NoSuchBucket"):
        await read_all("s3://no-such-bucket/x.safetensors")
    with pytest.raises(stream_st.UnsupportedSourceError):
        await read_all("s3://bucket-only")


def test_parse_s3_url() -> None:
    assert parse_s3_url("s3://b/k/x.safetensors") == ("b", "k/x.safetensors")


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ('"abc-3"', 3),
        ("abc", None),
        ('"abc-0"', None),
        ('"abc-\xb2"', None),
        ("a-" + "9" * 5000, None),
    ],
)
def test_a_parts_suffix_is_ascii_digits(value: str, count: int | None) -> None:
    """``"abc-²"``: ``'²'.isdigit()`` holds but ``int('²')`` raised a bare ValueError."""
    assert _parts_suffix(value) == count


async def test_a_part_size_that_is_no_number_is_a_protocol_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A part's HEAD answered ``Content-Length: 12x``: a bare ValueError."""

    answer = SimpleNamespace(url="http://store/b/k?partNumber=1", headers={"content-length": "12x"})

    async def head(self: S3Source, part: int | None = None) -> Any:
        return answer

    monkeypatch.setattr(S3Source, "_head", head)
    config = S3Config.resolve(
        endpoint_url="http://store", access_key_id="a", secret_access_key="b", environ={}
    )
    with pytest.raises(HTTPProtocolError, match="malformed Content-Length '12x'"):
        await S3Source("s3://b/k", config=config)._uploaded_part_size(2)


def _upload_in_parts(client: Any, key: str, body: bytes, part_size: int) -> None:
    """``body`` as ``models/key``, uploaded in parts of ``part_size`` with a CRC32 each (a
    composite checksum)."""
    upload = client.create_multipart_upload(Bucket="models", Key=key, ChecksumAlgorithm="CRC32")
    parts = []
    for number, start in enumerate(range(0, len(body), part_size), 1):
        answer = client.upload_part(
            Bucket="models",
            Key=key,
            UploadId=upload["UploadId"],
            PartNumber=number,
            Body=body[start : start + part_size],
            ChecksumAlgorithm="CRC32",
        )
        parts.append(
            {"PartNumber": number, "ETag": answer["ETag"], "ChecksumCRC32": answer["ChecksumCRC32"]}
        )
    client.complete_multipart_upload(
        Bucket="models", Key=key, UploadId=upload["UploadId"], MultipartUpload={"Parts": parts}
    )


async def test_parts_sized_after_the_object_changed_are_a_change_not_damage(
    s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The object replaced (the same size and part count, parts of another size) between the
    read's first answer and the HEADs of its parts: the composite checksum was built with the
    new parts' size, and the intact bytes read were reported damaged (IntegrityError); the
    change is reported instead."""
    client = s3.client()
    first, then = ({"x": np.full(3 << 20, value, np.float32)} for value in (1, 2))  # 12 MiB
    old, new = reference_numpy.save(first), reference_numpy.save(then)
    _upload_in_parts(client, "replaced", old, MIN_PART_SIZE + (1 << 20))  # 6 + 6 + 0.x MiB
    head = S3Source._head

    async def replacing_head(self: S3Source, part: int | None = None) -> Any:
        stored = client.head_object(Bucket="models", Key="replaced")["ETag"]
        if part is not None and stored == self.validators[0]:  # once: before the first part's
            _upload_in_parts(client, "replaced", new, MIN_PART_SIZE)  # 5 + 5 + 2.x MiB
        return await head(self, part)

    monkeypatch.setattr(S3Source, "_head", replacing_head)
    with pytest.raises(stream_st.SourceChangedError, match="412 Precondition Failed"):
        await stream_st.load(S3Source("s3://models/replaced", config=s3.config(), concurrency=1))


@pytest.mark.parametrize(
    ("etag", "heads"),
    [('"e1-3"', 0), ('"0cc175b9c0f1b6a831c399e269772661"', 1), ('"e2-3"', None)],
    ids=["the-objects", "the-parts-own", "another-versions"],
)
async def test_the_parts_answers_are_of_the_version_read(
    monkeypatch: pytest.MonkeyPatch, etag: str, heads: int | None
) -> None:
    """The parts' HEADs answered with the ETag of the version read (as S3 gives a part the
    object's): their sizes are its parts'. With a part's own ETag (moto's): one HEAD of the
    object after them, pinned, says it is still that version. With another object's ETag: the
    object changed after the read's first answer."""
    asked: list[int | None] = []

    async def head(self: S3Source, part: int | None = None) -> Any:
        asked.append(part)
        size = "5" if part == 1 else "2"
        return SimpleNamespace(
            url="http://store/b/k", headers={"content-length": size, "etag": etag}
        )

    monkeypatch.setattr(S3Source, "_head", head)
    config = S3Config.resolve(
        endpoint_url="http://store", access_key_id="a", secret_access_key="b", environ={}
    )
    source = S3Source("s3://b/k", config=config)
    source.size = 12
    source._pin.seen = ('"e1-3"', "")
    if heads is None:
        with pytest.raises(stream_st.SourceChangedError, match="""ETag '"e1-3"', then '"e2-3"'"""):
            await source._uploaded_part_size(3)
        heads = 0
    else:
        assert await source._uploaded_part_size(3) == 5
    assert set(asked[:2]) == {1, 3}
    assert asked[2:] == [None] * heads


def test_sigv4_matches_the_documented_example() -> None:
    """AWS's published GET Object example (Signature Version 4, 'Example: GET Object')."""
    config = S3Config(
        endpoint_url="https://s3.amazonaws.com",
        region="us-east-1",
        access_key_id="AKIAIOSFODNN7EXAMPLE",
        secret_access_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        path_style=False,
    )
    headers = config.sign(
        "GET",
        "https://examplebucket.s3.amazonaws.com/test.txt",
        {"Range": "bytes=0-9"},
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
        now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC),
    )
    assert headers["Authorization"].endswith(
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41"
    )


def test_sigv4_signs_the_host_the_request_carries() -> None:
    """The host signed is the Host header sent (lower case, IDNA, no user info, no default
    port): it was the endpoint as written, a signature every verifying server refused."""
    config = S3Config("http://127.0.0.1", "us-east-1", "a", "b")
    moment = dt.datetime(2024, 1, 2, tzinfo=dt.UTC)
    for plain, written in [
        ("http://127.0.0.1/b/k", "http://127.0.0.1:80/b/k"),
        ("https://s3.example/b/k", "https://S3.Example:443/b/k"),
        ("http://localhost:9000/b/k", "http://user:pw@LOCALHOST:9000/b/k"),
        ("http://xn--bcher-kva.example/b/k", "http://b\u00fccher.example/b/k"),
    ]:
        signed = config.sign("GET", written, {}, now=moment)["Authorization"]
        assert signed == config.sign("GET", plain, {}, now=moment)["Authorization"], written


@contextlib.contextmanager
def verifying_s3() -> Iterator[tuple[MotoS3Server, S3Config]]:
    """A moto server that checks each request's signature (moto checks none unless told), with
    the bucket ``checked`` holding ``small.safetensors``, and a config with a key it knows."""
    with MotoS3Server() as server:
        iam = boto3.client("iam", endpoint_url=server.endpoint_url, **BOTO_CREDENTIALS)
        iam.create_user(UserName="reader")
        policy = {"Effect": "Allow", "Action": "s3:*", "Resource": "*"}
        iam.put_user_policy(
            UserName="reader",
            PolicyName="s3",
            PolicyDocument=json.dumps({"Version": "2012-10-17", "Statement": [policy]}),
        )
        key = iam.create_access_key(UserName="reader")["AccessKey"]
        client = server.client()
        client.create_bucket(Bucket="checked")
        client.put_object(Bucket="checked", Key="small.safetensors", Body=sample_file({}))
        checking = urllib.request.Request(  # no request unchecked from now on
            f"{server.endpoint_url}/moto-api/reset-auth",
            data=b"0",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(checking, timeout=10):
            pass
        yield server, S3Config("", "us-east-1", key["AccessKeyId"], key["SecretAccessKey"])


async def test_an_endpoint_written_otherwise_is_signed_as_sent() -> None:
    """An endpoint in upper case, or with user info (accepted, as boto3 accepts them): every
    signed request was refused (SignatureDoesNotMatch) by a server that checks signatures; a
    read and a write succeed."""
    with verifying_s3() as (server, keys):
        for endpoint in (
            server.endpoint_url,
            f"http://LOCALHOST:{server.port}",
            f"http://user:pw@127.0.0.1:{server.port}",
        ):
            config = dataclasses.replace(keys, endpoint_url=endpoint)
            got = await read_all(S3Source("s3://checked/small.safetensors", config=config))
            assert_same_arrays(got, sample_tensors())
            await stream_st.save(S3Sink("s3://checked/written.safetensors", config=config), BIG)
            got = await read_all(S3Source("s3://checked/written.safetensors", config=config))
            assert_same_arrays(got, BIG)
        wrong = dataclasses.replace(keys, endpoint_url=server.endpoint_url, secret_access_key="x")
        with pytest.raises(HTTPStatusError, match="SignatureDoesNotMatch"):  # it does check
            await read_all(S3Source("s3://checked/small.safetensors", config=wrong))


async def test_wrong_credentials_are_refused_by_a_checking_server() -> None:
    # moto accepts any key; this checks the error path with a real 403 from our HTTP server.
    with RangeHTTPServer(status_for={"/b/k": 403}) as server:
        assert (await refusal(server)).status == 403


async def refusal(server: RangeHTTPServer) -> HTTPStatusError:
    """What a read of ``s3://b/k`` from ``server`` as the S3 endpoint is refused with."""
    config = S3Config.resolve(
        endpoint_url=f"http://127.0.0.1:{server.port}",
        access_key_id="a",
        secret_access_key="b",
        environ={},
    )
    with pytest.raises(HTTPStatusError) as info:
        await read_all(S3Source("s3://b/k", config=config))
    return info.value


class WrongRegion(RangeHTTPServer):
    """Answers as S3 does a bucket asked for in another region than its own: 301 with no
    Location, the bucket's region in ``x-amz-bucket-region`` unless ``header`` is off."""

    header = True

    def _send_head(self, connection: socket.socket, status: int, headers: dict[str, str]) -> None:
        if status == 301 and self.header:
            headers = {**headers, "x-amz-bucket-region": "eu-west-1"}
        super()._send_head(connection, status, headers)


@pytest.mark.parametrize("said", ["header", "body"])
async def test_a_bucket_in_another_region_is_named(said: str) -> None:
    """S3's 301 PermanentRedirect has no Location: the message names the bucket's region and
    endpoint (it said 'redirected to nowhere')."""
    endpoint = b"<Endpoint>b.s3.eu-west-1.amazonaws.com</Endpoint>" if said == "body" else b""
    body = b"<Error><Code>PermanentRedirect</Code><Message>Use the specified endpoint.</Message>"
    server = WrongRegion(status_for={"/b/k": 301}, status_body=("application/xml", body + endpoint))
    server.header = said == "header"
    with server:
        message = str(await refusal(server))
    named = "region eu-west-1" if said == "header" else "endpoint b.s3.eu-west-1.amazonaws.com"
    assert message.startswith(
        f"HTTP 301 Moved Permanently: the bucket is elsewhere ({named}): give its region"
    )
    assert "PermanentRedirect: Use the specified endpoint" in message
    assert "nowhere" not in message


async def test_sharded_checkpoint_on_s3(aws_env: None, s3: MotoS3Server) -> None:
    import json

    client = s3.client()
    shards = {"a.safetensors": {"x": np.ones(3)}, "b.safetensors": {"y": np.zeros(2)}}
    for shard, arrays in shards.items():
        client.put_object(Bucket="models", Key=f"ckpt/{shard}", Body=reference_numpy.save(arrays))
    weight_map = {"x": "a.safetensors", "y": "b.safetensors"}
    client.put_object(
        Bucket="models",
        Key="ckpt/model.safetensors.index.json",
        Body=json.dumps({"weight_map": weight_map}).encode(),
    )
    got = await read_all("s3://models/ckpt/model.safetensors.index.json", include=["y"])
    assert_same_arrays(got, {"y": np.zeros(2)})
