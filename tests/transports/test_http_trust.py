"""What real servers, CDNs, proxies and object stores do, against the HTTP client and source:
redirects to other hosts (credentials stay behind), objects replaced during a read (pinned by
their validators), compressed answers, error pages and S3 error documents (one-line messages),
Retry-After, and the limits of a source given as an object.

The servers are tests/servers/http_server.py's (127.0.0.1, and 127.0.0.2 for another host) and moto.
"""

from __future__ import annotations

import email.utils
import re
import socket
import time
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import (
    HTTPNotFoundError,
    HTTPProtocolError,
    HTTPStatusError,
    ReadTimeoutError,
    SourceChangedError,
)
from stream_st.transports.http import retry_after, summary
from stream_st.transports.http.source import HttpSource
from stream_st.transports.s3.config import S3Config
from stream_st.transports.s3.source import S3Source

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from ..servers.s3_server import MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]

# ``b`` sits beyond the first 64 KiB answer: reading it alone takes a second, ranged request.
SPLIT: Arrays = {"a": np.zeros(100_000, np.uint8), "b": np.full(1000, 7, np.uint8)}
SPLIT_FILE: bytes = reference_numpy.save(SPLIT)
# The same layout with other values: a replacement only the validators can tell apart.
OTHER_FILE: bytes = reference_numpy.save(
    {"a": np.ones(100_000, np.uint8), "b": np.full(1000, 9, np.uint8)}
)
BIG: Arrays = {f"t{i}": np.random.default_rng(i).random(40_000) for i in range(6)}  # ~2 MB
BIG_FILE: bytes = reference_numpy.save(BIG)
BIG_OTHER: bytes = reference_numpy.save({name: array + 1 for name, array in BIG.items()})

SECRETS = {
    "Authorization": "Bearer hf_secret",
    "Cookie": "session=secret",
    "Proxy-Authorization": "Basic c2VjcmV0",
    "X-Api-Key": "key-secret",
    "Api-Key": "azure-secret",
    "Private-Token": "glpat-secret",
    "X-Auth-Token": "swift-secret",
    "X-Goog-Security-Token": "goog-secret",
}


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as running:
        running.objects["/m.safetensors"] = SPLIT_FILE
        running.objects["/big.safetensors"] = BIG_FILE
        yield running


@pytest.fixture
def cdn() -> Iterator[RangeHTTPServer]:
    """Another host (127.0.0.2), where downloads are redirected."""
    with RangeHTTPServer(host="127.0.0.2") as running:
        running.objects["/m.safetensors"] = SPLIT_FILE
        yield running


async def load(source: Any, **kwargs: Any) -> Arrays:
    with anyio.fail_after(20):
        return await stream_st.load(source, **kwargs)


def seen(server: RangeHTTPServer, name: str) -> list[str | None]:
    """The value of header ``name`` on each request the server got."""
    server.settle()
    return [headers.get(name) for _, _, headers in server.headers_seen]


# --------------------------------------------------------------------------- redirects


@pytest.mark.parametrize("other", ["host", "port"])
async def test_credentials_do_not_follow_a_redirect_to_another_origin(
    server: RangeHTTPServer, cdn: RangeHTTPServer, other: str
) -> None:
    target = cdn if other == "host" else server
    if other == "port":
        second = RangeHTTPServer().start()
        second.objects["/m.safetensors"] = SPLIT_FILE
        target = second
    try:
        server.redirects["/hub/m.safetensors"] = target.url("/m.safetensors")
        headers = {**SECRETS, "X-Request-Id": "kept"}
        source = HttpSource(server.url("/hub/m.safetensors"), headers=headers)
        assert_same_arrays(await load(source), SPLIT)
        for name in SECRETS:  # the origin asked has them, the other none
            assert seen(server, name.lower())[0] == SECRETS[name], name
            assert set(seen(target, name.lower())) == {None}, name
        assert set(seen(target, "x-request-id")) == {"kept"}
    finally:
        if other == "port":
            target.stop()


async def test_same_origin_redirect_keeps_credentials(server: RangeHTTPServer) -> None:
    server.redirects["/old.safetensors"] = server.url("/m.safetensors")
    source = HttpSource(server.url("/old.safetensors"), headers=SECRETS)
    assert_same_arrays(await load(source, include=["b"]), {"b": SPLIT["b"]})
    assert set(seen(server, "authorization")) == {"Bearer hf_secret"}
    assert set(seen(server, "cookie")) == {"session=secret"}


async def test_s3_signature_does_not_follow_a_redirect(
    server: RangeHTTPServer, cdn: RangeHTTPServer
) -> None:
    """SigV4 headers (and the session token) are not sent, nor signed again, for another host."""
    config = S3Config(
        endpoint_url=server.url(""),
        region="us-east-1",
        access_key_id="AKIDEXAMPLE",
        secret_access_key="secret",
        session_token="token-secret",
    )
    server.redirects["/bucket/m.safetensors"] = cdn.url("/m.safetensors")
    source = S3Source("s3://bucket/m.safetensors", config=config)
    assert_same_arrays(await load(source, include=["b"]), {"b": SPLIT["b"]})
    assert seen(server, "x-amz-security-token")[0] == "token-secret"
    assert seen(server, "authorization")[0] is not None
    cdn.settle()
    for _, _, headers in cdn.headers_seen:
        assert "authorization" not in headers
        assert not [name for name in headers if name.startswith("x-amz-")]


async def test_redirect_loop_is_not_retried(server: RangeHTTPServer) -> None:
    server.redirects["/loop"] = server.url("/loop")
    with pytest.raises(HTTPProtocolError, match="more than 5 redirects"):
        await load(HttpSource(server.url("/loop"), backoff=0.01))
    assert len(seen(server, "host")) == 6


@pytest.mark.parametrize(
    "location",
    [
        "ftp://127.0.0.1/m.safetensors",
        "http://h:99999/x",
        "http://[::1/x",  # a bracket left open, or never opened: no URL at all
        "https://[",
        "http://]/",
        "http://",  # a scheme and no host: not the URL redirected from again (a loop)
        "http:x",
    ],
)
async def test_redirect_to_an_unusable_address(server: RangeHTTPServer, location: str) -> None:
    server.redirects["/m.safetensors"] = location
    with pytest.raises(HTTPProtocolError, match="redirect to an unusable address"):
        await load(server.url("/m.safetensors"))


# --------------------------------------------------------------------------- validators

VALIDATORS = {
    "strong ETag": {"etag": "strong", "last_modified": True},
    "strong ETag, conditionals ignored": {"etag": "strong", "conditionals": False},
    "weak ETag and Last-Modified": {"etag": "weak", "last_modified": True},
    "Last-Modified only": {"last_modified": True},
    "Last-Modified, conditionals ignored": {"last_modified": True, "conditionals": False},
    "weak ETag only": {"etag": "weak"},
}


def replaced_during(server: RangeHTTPServer, read: str) -> tuple[HttpSource, dict[str, Any]]:
    """A source whose object the server replaces during a ``read`` ("include": between the
    header and a tensor's range; "parallel": among parallel parts; "resumed": before a broken
    transfer is resumed), and the options to load it with."""
    if read == "include":
        server.replace_after["/m.safetensors"] = (1, OTHER_FILE)
        return HttpSource(server.url("/m.safetensors")), {"include": ["b"]}
    url = server.url("/big.safetensors")
    if read == "parallel":
        server.replace_after["/big.safetensors"] = (3, BIG_OTHER)
        return HttpSource(url, concurrency=4, part_size=100_000), {}
    server.close_after, server.close_once = 500_000, True
    server.replace_after["/big.safetensors"] = (1, BIG_OTHER)
    return HttpSource(url, backoff=0.01), {}


@pytest.mark.parametrize("read", ["include", "parallel", "resumed"])
@pytest.mark.parametrize("options", VALIDATORS.values(), ids=VALIDATORS.keys())
async def test_object_replaced_during_a_read(
    server: RangeHTTPServer, options: dict[str, Any], read: str
) -> None:
    """Each version alone is a valid file: only the validators tell that the tensors would mix
    bytes of both."""
    for name, value in options.items():
        setattr(server, name, value)
    source, load_options = replaced_during(server, read)
    with pytest.raises(SourceChangedError, match="changed on the server") as info:
        await load(source, **load_options)
    assert info.value.url == source.url
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("validator", ["etag", "last_modified"])
async def test_object_replaced_by_one_whose_answers_drop_the_validator(
    server: RangeHTTPServer, validator: str
) -> None:
    """The first answer pinned the version with a validator; a later answer without it (a
    replaced object, a server ignoring ``If-Match``) could be any version: a change."""
    setattr(server, validator, "strong" if validator == "etag" else True)
    server.conditionals = False
    server.unvalidated_new = True
    server.replace_after["/m.safetensors"] = (1, OTHER_FILE)
    with pytest.raises(SourceChangedError, match="then none"):
        await load(server.url("/m.safetensors"), include=["b"])


@pytest.mark.parametrize("concurrency", [None, 1, 3])
async def test_a_server_that_caps_its_ranges_is_read_whole(
    server: RangeHTTPServer, concurrency: int | None
) -> None:
    """Each range answered with at most 64 KiB (a valid, short 206): the rest of a part is asked
    for next, in a window of parts as in one stream, never taken for the object's end."""
    server.etag = "strong"
    server.range_cap = 64 << 10
    source = HttpSource(server.url("/big.safetensors"), concurrency=concurrency, part_size=300_000)
    assert_same_arrays(await load(source), BIG)


async def test_object_replaced_by_one_of_another_size(server: RangeHTTPServer) -> None:
    """No validators at all: the size in Content-Range still tells."""
    server.replace_after["/m.safetensors"] = (1, OTHER_FILE + b"x" * 100)
    with pytest.raises(SourceChangedError, match=f"{len(SPLIT_FILE)} bytes, then"):
        await load(server.url("/m.safetensors"), include=["b"])


async def test_unchanged_object_is_read_with_its_version_pinned(server: RangeHTTPServer) -> None:
    server.etag = "strong"
    source = HttpSource(server.url("/big.safetensors"), concurrency=3, part_size=200_000)
    assert_same_arrays(await load(source), BIG)
    conditions = seen(server, "if-match")
    assert conditions[0] is None and len(conditions) > 2
    assert set(conditions[1:]) == {'"v0"'}
    server.etag, server.last_modified = "weak", True
    server.headers_seen.clear()
    assert_same_arrays(await load(server.url("/m.safetensors"), include=["b"]), {"b": SPLIT["b"]})
    assert seen(server, "if-match") == [None, None]  # a weak ETag is no validator for bytes
    assert seen(server, "if-unmodified-since")[1] == email.utils.formatdate(1.7e9, usegmt=True)


async def test_s3_object_replaced_during_a_read(
    moto_s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    client = moto_s3.client()
    client.create_bucket(Bucket="changing")
    client.put_object(Bucket="changing", Key="m.safetensors", Body=SPLIT_FILE)
    config = moto_s3.config()
    source = S3Source("s3://changing/m.safetensors", config=config)
    with pytest.raises(SourceChangedError, match=re.escape("s3://changing/m.safetensors")):
        async with stream_st.open_stream(source, include=["b"]) as stream:
            assert stream.header.names() == ["a", "b"]
            client.put_object(Bucket="changing", Key="m.safetensors", Body=OTHER_FILE)
            async for _ in stream:
                pass


# --------------------------------------------------------------------------- encodings


async def test_bodies_are_asked_for_as_they_are(server: RangeHTTPServer) -> None:
    """An Accept-Encoding given by the caller is replaced: a compressing server (nginx with
    ``gzip on``) must send the bytes themselves."""
    server.gzip = "asked"
    source = HttpSource(server.url("/m.safetensors"), headers={"Accept-Encoding": "gzip, br"})
    assert_same_arrays(await load(source), SPLIT)
    assert set(seen(server, "accept-encoding")) == {"identity"}


@pytest.mark.parametrize("include", [None, ["b"]])
async def test_encoded_answer_is_refused(
    server: RangeHTTPServer, include: list[str] | None
) -> None:
    server.gzip = "always"
    with pytest.raises(HTTPProtocolError, match="Content-Encoding: gzip") as info:
        await load(server.url("/m.safetensors"), include=include)
    assert info.value.url == server.url("/m.safetensors")
    assert len(seen(server, "host")) == 1  # not retried: the answer would be the same


# --------------------------------------------------------------------------- error messages

NGINX_403 = (
    b"<html>\r\n<head><title>403 Forbidden</title></head>\r\n<body>\r\n"
    b"<center><h1>403 Forbidden</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n"
    b"</html>\r\n"
)


async def test_html_error_page_is_one_line(server: RangeHTTPServer) -> None:
    server.status_for["/m.safetensors"] = 403
    server.status_body = ("text/html", NGINX_403)
    with pytest.raises(HTTPStatusError) as info:
        await load(server.url("/m.safetensors"))
    message = str(info.value)
    assert message.startswith("HTTP 403 Forbidden: 403 Forbidden 403 Forbidden nginx, url=")
    assert info.value.body == NGINX_403


async def test_long_error_body_is_cut_short(server: RangeHTTPServer) -> None:
    body = ("Traceback (most recent call last):\n" + "  frame\n" * 2000).encode()
    server.status_for["/m.safetensors"] = 500
    server.status_body = ("text/plain", body)
    with pytest.raises(HTTPStatusError) as info:
        await load(HttpSource(server.url("/m.safetensors"), retries=0))
    message = str(info.value)
    assert "\n" not in message and len(message) < 300
    assert "Traceback (most recent call last): frame frame" in message
    assert info.value.body == body


async def test_s3_error_document_is_one_line(
    moto_s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    moto_s3.client().create_bucket(Bucket="errors")
    config = moto_s3.config()
    with pytest.raises(HTTPNotFoundError) as info:
        await load(S3Source("s3://errors/missing.safetensors", config=config))
    assert str(info.value) == (
        "HTTP 404 NOT FOUND: NoSuchKey: The specified key does not exist., "
        "url=s3://errors/missing.safetensors"
    )
    assert b"<Code>NoSuchKey</Code>" in info.value.body


def test_summary_of_bodies() -> None:
    xml = (
        b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
        b"<Message>Access Denied &amp; more</Message><RequestId>1</RequestId></Error>"
    )
    assert summary(xml) == "AccessDenied: Access Denied & more"
    assert summary(b"<Error><Code>SlowDown</Code></Error>") == "SlowDown"
    assert summary(b"  plain\r\n\ttext  ") == "plain text"
    assert summary(b"") == ""
    assert len(summary(b"x" * 5000)) == 200


def test_summary_of_a_body_of_unclosed_markup_is_quick() -> None:
    """An error page of "<" with no ">" (hostile or cut short) was summarised in time quadratic in
    its length: 64 KiB, the most kept, took seconds; 1 MiB now takes well under the bound of CPU
    time below, where the quadratic reading takes minutes."""
    started = time.process_time()
    assert summary(b"<" * (1 << 20)) == "<" * 197 + "..."
    assert time.process_time() - started < 10
    assert summary(b"<p>a <b>bold</b> < c</p>") == "a bold < c"


async def test_redirect_of_a_get_not_followed_is_an_error(server: RangeHTTPServer) -> None:
    """A 3xx is no object: with no Location (S3's wrong-region answer) it cannot be followed."""
    server.status_for["/m.safetensors"] = 301
    server.status_body = (
        "application/xml",
        b"<Error><Code>PermanentRedirect</Code><Message>Use the specified endpoint.</Message>"
        b"</Error>",
    )
    with pytest.raises(HTTPStatusError, match="PermanentRedirect: Use the specified endpoint"):
        await load(server.url("/m.safetensors"))


# --------------------------------------------------------------------------- Retry-After


@pytest.mark.parametrize("status", [429, 503])
async def test_retry_after_is_honoured(server: RangeHTTPServer, status: int) -> None:
    server.fail_first, server.fail_status, server.retry_after = 1, status, "1"
    assert_same_arrays(await load(server.url("/m.safetensors")), SPLIT)
    assert len(seen(server, "host")) == 2


@pytest.mark.parametrize("when", ["seconds", "date"])
async def test_retry_after_past_the_deadline_ends_the_read_at_once(
    server: RangeHTTPServer, when: str
) -> None:
    later = email.utils.formatdate(time.time() + 40, usegmt=True)
    server.fail_first, server.retry_after = 1, "40" if when == "seconds" else later
    with pytest.raises(ReadTimeoutError, match=r"retry after [0-9.]+ s \(Retry-After\), past the"):
        with anyio.fail_after(5):  # not a sleep until the deadline either
            await stream_st.load(server.url("/m.safetensors"), deadline=4)
    assert len(seen(server, "host")) == 1


async def test_very_long_retry_after_without_a_deadline_gives_up(server: RangeHTTPServer) -> None:
    server.fail_first, server.retry_after = 1, "3600"
    with pytest.raises(HTTPStatusError) as info:
        await load(server.url("/m.safetensors"))
    assert info.value.status == 503
    assert len(seen(server, "host")) == 1


def test_retry_after_values() -> None:
    assert retry_after({"retry-after": "7"}) == 7
    assert retry_after({"retry-after": email.utils.formatdate(0, usegmt=True)}) == 0
    soon = retry_after({"retry-after": email.utils.formatdate(time.time() + 100, usegmt=True)})
    assert soon is not None and 90 < soon <= 100
    for bad in ("", "soon", "-5", "1.5", "Mon, 99 Foo 2024 99:99:99 GMT"):
        assert retry_after({"retry-after": bad}) is None, bad
    assert retry_after({}) is None


# --------------------------------------------------------------------------- limits


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A server that takes connections and never answers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/m.safetensors"


async def test_timeout_applies_to_a_source_object(silent_url: str) -> None:
    with anyio.fail_after(10), pytest.raises(ReadTimeoutError):
        await stream_st.read_header(HttpSource(silent_url, retries=0), timeout=0.2)
    with anyio.fail_after(10), pytest.raises(ReadTimeoutError):
        await stream_st.read_header(HttpSource(silent_url, retries=0, timeout=0.2))
