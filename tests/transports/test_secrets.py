"""Secrets never show, and credentials in a URL are used.

A URL's ``user:password@`` is sent as HTTP Basic credentials, as curl and requests send it: to
that URL's origin only, never after a redirect to another one. Nothing prints a secret: not an
error's message or ``url``, not a transport's ``name``, not the ``repr`` of a configuration that
holds keys or tokens. The servers are tests/servers/http_server.py's (127.0.0.1, and 127.0.0.2 for
another host).
"""

from __future__ import annotations

import base64
import json
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
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
    SafetensorsError,
    UsageError,
)
from stream_st.core.layout import framed_header
from stream_st.core.shards import shard_address
from stream_st.errors import TransportError, redact
from stream_st.integrations.dataset import Piece, describe_dataset, read_piece, read_shard_rows
from stream_st.tools.model_checks import ModelConfig
from stream_st.transports.cache.config import Cache
from stream_st.transports.cache.keys import object_key
from stream_st.transports.http.proxy import Proxy
from stream_st.transports.http.source import HttpSource
from stream_st.transports.hub import HubClient, HubSource
from stream_st.transports.options import Transport
from stream_st.transports.s3.config import Keys, S3Config
from stream_st.transports.store import write_object

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer

SECRET = "S3cr3tPw"
ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "a": np.arange(50_000, dtype=np.float32),
    "b": np.full(300, 7, np.uint8),
}
FILE = reference_numpy.save(ARRAYS)


@dataclass
class BasicAuthServer(RangeHTTPServer):
    """A :class:`RangeHTTPServer` whose every answer needs HTTP Basic ``credentials``
    (``user:password``): 401 without them, as a protected static server answers."""

    credentials: str = f"alice:{SECRET}"

    def _answer(
        self, connection: socket.socket, reader: Any, method: str, target: str, headers: Any
    ) -> bool:
        expected = "Basic " + base64.b64encode(self.credentials.encode()).decode()
        if headers.get("authorization") == expected:
            return super()._answer(connection, reader, method, target, headers)
        self.headers_seen.append((method, target, headers))
        if method in ("PUT", "POST"):
            self._read_body(reader, headers)
        body = b"authentication required"
        head = {"WWW-Authenticate": 'Basic realm="models"', "Content-Length": str(len(body))}
        self._send_head(connection, 401, head)
        connection.sendall(body)
        return True


def with_credentials(url: str, userinfo: str = f"alice:{SECRET}") -> str:
    return url.replace("http://", f"http://{userinfo}@", 1)


@pytest.fixture
def protected() -> Iterator[BasicAuthServer]:
    running = BasicAuthServer()
    with running:
        running.objects["/m.safetensors"] = FILE
        yield running


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as running:
        running.objects["/m.safetensors"] = FILE
        yield running


@pytest.fixture
def other_host() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(host="127.0.0.2") as running:
        running.objects["/m.safetensors"] = FILE
        yield running


async def load(source: Any, **kwargs: Any) -> dict[str, Any]:
    with anyio.fail_after(20):
        return await stream_st.load(source, **kwargs)


def seen(server: RangeHTTPServer, name: str) -> list[str | None]:
    """The value of header ``name`` on each request the server got."""
    server.settle()
    return [headers.get(name) for _, _, headers in server.headers_seen]


def assert_hidden(*texts: str, secrets: tuple[str, ...] = (SECRET,)) -> None:
    for text in texts:
        for secret in secrets:
            assert secret not in text, text


# --------------------------------------------------------------------------- URL credentials


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_url_credentials_are_sent_as_basic_auth(
    protected: BasicAuthServer, concurrency: int
) -> None:
    url = with_credentials(protected.url("/m.safetensors"))
    assert_same_arrays(await load(url, concurrency=concurrency), ARRAYS)
    assert_same_arrays(await load(url, include=["b"]), {"b": ARRAYS["b"]})
    assert None not in seen(protected, "authorization")


async def test_url_credentials_are_percent_decoded(protected: BasicAuthServer) -> None:
    protected.credentials = "al ice:p@ss:w/rd"
    url = with_credentials(protected.url("/m.safetensors"), "al%20ice:p%40ss%3Aw%2Frd")
    assert_same_arrays(await load(url), ARRAYS)


async def test_url_credentials_are_sent_with_an_upload(protected: BasicAuthServer) -> None:
    url = with_credentials(protected.url("/up.safetensors"))
    with anyio.fail_after(20):
        await stream_st.save(url, ARRAYS)
    assert protected.objects["/up.safetensors"] == FILE


async def test_given_authorization_wins_over_url_credentials(server: RangeHTTPServer) -> None:
    url = with_credentials(server.url("/m.safetensors"))
    source = HttpSource(url, headers={"Authorization": "Bearer mine"})
    assert_same_arrays(await load(source), ARRAYS)
    assert set(seen(server, "authorization")) == {"Bearer mine"}


async def test_url_credentials_follow_a_redirect_within_the_origin_only(
    server: RangeHTTPServer, other_host: RangeHTTPServer
) -> None:
    server.redirects["/same"] = server.url("/m.safetensors")
    server.redirects["/away"] = other_host.url("/m.safetensors")
    assert_same_arrays(await load(with_credentials(server.url("/same"))), ARRAYS)
    basic = "Basic " + base64.b64encode(f"alice:{SECRET}".encode()).decode()
    assert set(seen(server, "authorization")) == {basic}  # the redirect and where it led
    assert_same_arrays(await load(with_credentials(server.url("/away"))), ARRAYS)
    assert set(seen(other_host, "authorization")) == {None}


async def test_a_location_with_credentials_is_followed_without_them(
    server: RangeHTTPServer, other_host: RangeHTTPServer
) -> None:
    server.redirects["/away"] = with_credentials(other_host.url("/m.safetensors"), "bob:pw")
    assert_same_arrays(await load(server.url("/away")), ARRAYS)
    assert set(seen(other_host, "authorization")) == {None}


# --------------------------------------------------------------------------- what errors show


async def test_errors_and_names_hide_the_url_password(protected: BasicAuthServer) -> None:
    url = with_credentials(protected.url("/missing.safetensors"))
    source = HttpSource(url)
    assert_hidden(source.name)
    assert "alice" in source.name  # whose credentials, still said
    with pytest.raises(HTTPNotFoundError) as info:
        await load(source)
    assert_hidden(str(info.value), repr(info.value), info.value.url)
    assert "alice:***@" in str(info.value)


async def test_a_refused_connection_hides_the_url_password() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(TransportError) as info:
        await load(f"http://alice:{SECRET}@127.0.0.1:{port}/m.safetensors")
    assert_hidden(str(info.value), info.value.url)


async def test_misuse_errors_hide_the_url_password() -> None:
    with pytest.raises(UsageError) as usage:
        HttpSource(f"http://alice:{SECRET}@127.0.0.1:1/m", concurrency=0)
    with pytest.raises(SafetensorsError) as scheme:
        await load(f"gopher://alice:{SECRET}@127.0.0.1/m.safetensors")
    assert_hidden(str(usage.value), str(scheme.value))


@pytest.mark.parametrize("mark", ["/", "?", "#"])
async def test_a_password_cut_short_by_a_delimiter_is_hidden(
    monkeypatch: pytest.MonkeyPatch, mark: str
) -> None:
    """An unescaped '/', '?' or '#' in a password ends the URL's authority there: its start is
    read as a port, which Python's reason quotes; no piece of it shows, of a source's URL or a
    proxy's."""
    password = f"{SECRET[:4]}{mark}{SECRET[4:]}"
    with pytest.raises(UsageError, match="invalid URL") as source:
        await load(f"http://alice:{password}@127.0.0.1:8080/m.safetensors")
    monkeypatch.setenv("http_proxy", f"http://me:{password}@127.0.0.1:3128")
    with pytest.raises(UsageError, match="invalid proxy URL") as proxy:
        await load("http://127.0.0.1:8080/m.safetensors")
    for error in (source.value, proxy.value):
        assert_hidden(str(error), repr(error), secrets=(SECRET[:4], SECRET[4:]))
        assert error.__cause__ is None and error.__suppress_context__  # no ValueError shown


@pytest.mark.parametrize(
    "password",
    [
        f"it's-{SECRET}",
        f'it"{SECRET}',
        f"<{SECRET}>",
        f"it {SECRET}",
        f"it\t{SECRET}",
        f"it\n{SECRET}",
        f"{SECRET}\n",
        f"it\r\n{SECRET}",
    ],
    ids=[
        "quote",
        "double quote",
        "angle brackets",
        "space",
        "tab",
        "line break",
        "trailing line break",
        "CRLF",
    ],
)
async def test_a_password_with_a_quote_white_space_or_a_line_break_is_hidden(
    password: str,
) -> None:
    """A quote is allowed unescaped in a URL's userinfo (RFC 3986), and URL parsers take a
    double quote, an angle bracket, a space or a tab there too, and drop a line break (a
    password read from a file with its trailing newline works): the mask stopped at it, and
    nothing was masked (``alice:it's-...`` shown whole, in the message, ``url`` and ``name``)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://alice:{password}@127.0.0.1:{port}/m.safetensors"
    with pytest.raises(TransportError) as info:
        await load(url)
    shown = (str(info.value), info.value.url, HttpSource(url).name, redact(url))
    assert_hidden(*shown)
    for text in shown:
        assert f"http://alice:***@127.0.0.1:{port}/m.safetensors" in text, text


@pytest.mark.parametrize("mark", ["'", '"', " ", "<"])
async def test_a_signed_parameter_with_a_quote_or_white_space_is_hidden(
    server: RangeHTTPServer, mark: str
) -> None:
    """A token's value was masked up to a quote, a space or an angle bracket in it, and its
    tail shown (``token=***'S3cr3tPw``)."""
    source = HttpSource(server.url(f"/missing.safetensors?token=ab{mark}{SECRET}&file=m"))
    with pytest.raises(HTTPNotFoundError) as info:
        await load(source)
    shown = (str(info.value), info.value.url, source.name)
    assert_hidden(*shown)
    for text in shown:
        assert "/missing.safetensors?token=***&file=m" in text, text


@pytest.mark.parametrize(
    ("address", "shown"),
    [
        (f"alice:it {SECRET}@127.0.0.1:99999/m", "alice:***@127.0.0.1:99999/m"),
        (f"alice:it's {SECRET}@127.0.0.1:99999/m", "alice:***@127.0.0.1:99999/m"),
        (f"127.0.0.1:99999/m?token=ab {SECRET}&b=1", "127.0.0.1:99999/m?token=***&b=1"),
    ],
)
async def test_an_invalid_url_with_a_space_in_a_secret_hides_it(address: str, shown: str) -> None:
    """``invalid URL '...'`` quotes the address as given: a space in its password or in a
    signed parameter's value ended the mask there, and the message showed the rest."""
    with pytest.raises(UsageError, match="invalid URL") as info:
        await load(f"http://{address}")
    assert_hidden(str(info.value), repr(info.value))
    assert f"http://{shown}" in str(info.value)


PRESIGNED = (
    "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIDEXAMPLE%2F20240101%2Fus-east-1"
    "&X-Amz-Date=20240101T000000Z&X-Amz-Expires=60&X-Amz-Security-Token=SESSIONTOKEN"
    "&X-Amz-Signature=5ec2e7de0fa1"
)
PRESIGNED_SECRETS = ("AKIDEXAMPLE", "SESSIONTOKEN", "5ec2e7de0fa1")


async def test_errors_hide_a_presigned_urls_signature(server: RangeHTTPServer) -> None:
    source = HttpSource(server.url(f"/missing.safetensors?{PRESIGNED}"))
    with pytest.raises(HTTPNotFoundError) as info:
        await load(source)
    shown = (str(info.value), info.value.url, source.name)
    assert_hidden(*shown, secrets=PRESIGNED_SECRETS)
    assert "X-Amz-Signature=***" in str(info.value)
    assert "X-Amz-Date=20240101T000000Z" in str(info.value)  # not a secret: kept


async def test_a_refused_redirect_hides_where_it_pointed(server: RangeHTTPServer) -> None:
    server.redirects["/m"] = f"ftp://alice:{SECRET}@127.0.0.2/m?{PRESIGNED}"
    with pytest.raises(HTTPProtocolError) as info:
        await load(server.url("/m"))
    assert_hidden(str(info.value), secrets=(SECRET, *PRESIGNED_SECRETS))


async def test_an_unusable_redirect_hides_a_long_password(server: RangeHTTPServer) -> None:
    """The refused Location was cut to 200 characters before it was masked: a password running
    past them had lost its ``@``, and was shown."""
    server.redirects["/m"] = f"http://user:{SECRET}{'p' * 300}@127.0.0.1:99999/x"
    with pytest.raises(HTTPProtocolError, match="unusable address") as info:
        await load(server.url("/m"))
    assert_hidden(str(info.value), repr(info.value), secrets=(SECRET, "ppp"))
    assert "'http://user:***@127.0.0.1:99999/x'" in str(info.value)


MASKED_PRESIGNED = (
    "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=***&X-Amz-Date=20240101T000000Z"
    "&X-Amz-Expires=60&X-Amz-Security-Token=***&X-Amz-Signature=***"
)
SHARD = reference_numpy.save({"a": np.arange(10, dtype=np.float32)})


def _index(weight_map: dict[str, str]) -> bytes:
    """An index of shards assigning them the tensors of ``weight_map``."""
    return json.dumps({"weight_map": weight_map}).encode()


def _manifest(*shards: str, size: int = len(SHARD)) -> bytes:
    """A dataset's manifest listing ``shards``, each of ``size`` bytes."""
    entries = [{"shard_path": shard, "bytes": size} for shard in shards]
    return json.dumps({"shards": entries}).encode()


@pytest.fixture
def signed() -> Iterator[RangeHTTPServer]:
    """Checkpoints, datasets and shards that each fail to read, for presigned URLs (the server
    ignores the query)."""
    entry = '"k__n":{{"dtype":"I64","shape":[],"data_offsets":[{},{}]}}'
    twice = f"{{{entry.format(0, 8)},{entry.format(8, 16)}}}"  # a KV key listed twice
    unparsable = '{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}'
    with RangeHTTPServer(etag="strong") as running:
        running.objects.update({
            "/a.safetensors": SHARD,
            "/ab.safetensors": reference_numpy.save({**ARRAYS, "a": np.zeros(3, np.float32)}),
            "/trailing.safetensors": SHARD + b"zz",
            "/junk.safetensors": b"\xff" * 64,
            "/twice.safetensors": framed_header(twice.encode()) + bytes(16),
            "/unparsable.safetensors": framed_header(unparsable.encode()) + bytes(8),
            "/lacking.safetensors.index.json": _index({"a": "a.safetensors", "b": "a.safetensors"}),
            "/junk.safetensors.index.json": _index({"a": "junk.safetensors"}),
            "/climbing.safetensors.index.json": _index({"a": "../a.safetensors"}),
            "/list.safetensors.index.json": b"[]",
            "/broken.safetensors.index.json": b"{",
            "/sized/dataset_manifest.json": _manifest("a.safetensors", size=99),
            "/sized/a.safetensors": SHARD,
            "/twice/dataset_manifest.json": _manifest("a.safetensors", "b.safetensors"),
            "/twice/a.safetensors": SHARD,
            "/twice/b.safetensors": SHARD,
        })  # fmt: skip
        yield running


@dataclass
class _Signed:
    """What a reading of :data:`SIGNED_READINGS` is given: ``url(path)``, the presigned URL of
    ``path`` on ``server``; ``tmp``, a folder of its own."""

    server: RangeHTTPServer
    tmp: Path

    def url(self, path: str) -> str:
        """The presigned URL of ``path`` on the server."""
        return self.server.url(f"{path}?{PRESIGNED}")


async def _rewritten(at: _Signed) -> object:
    """Rows of a shard described by another header: rewritten since the dataset was."""
    other = await stream_st.read_header(at.url("/ab.safetensors"))
    return await read_piece(Piece(at.url("/a.safetensors"), ("a",), 0, 5), other)


async def _another_version(at: _Signed) -> object:
    """Rows of a shard answering with another ETag than its digests were checked at."""
    described = await stream_st.read_header(at.url("/a.safetensors"))
    return await read_piece(Piece(at.url("/a.safetensors"), ("a",), 0, 5), described, ('"old"', ""))


async def _rows(at: _Signed, path: str, size: int | None = None) -> object:
    """The KV rows of the shard at ``path`` (``size``: the bytes its manifest gives it)."""
    pytest.importorskip("pyarrow")  # a KV shard's header is read a field at a time with it
    return await read_shard_rows(at.url(path), ["n"], "__", size=size)


async def _config(at: _Signed) -> object:
    """A model's configuration, named by the presigned URL it was read from, lacking numbers."""
    return ModelConfig.from_json({}, source=at.url("/config.json"))


SIGNED_READINGS: dict[str, tuple[Callable[[_Signed], Awaitable[object]], str]] = {
    "a shard unlike the index": (
        lambda at: stream_st.load(at.url("/lacking.safetensors.index.json")),
        "/a.safetensors?...: the shard's tensors differ from those the index assigns it",
    ),
    "a shard of another size": (
        lambda at: stream_st.load(at.url("/sized/dataset_manifest.json")),
        "/a.safetensors?...: the manifest says 99 bytes, the shard's header describes",
    ),
    "a shard not safetensors": (
        lambda at: stream_st.load(at.url("/junk.safetensors.index.json")),
        "/junk.safetensors?...: its header is larger than max_header_size allows",
    ),
    "an index not an object": (
        lambda at: stream_st.load(at.url("/list.safetensors.index.json")),
        ".index.json?...: the index must be a JSON object",
    ),
    "an index not JSON": (
        lambda at: stream_st.load(at.url("/broken.safetensors.index.json")),
        ".index.json?...: the index is not valid JSON",
    ),
    "a shard outside": (
        lambda at: stream_st.load(at.url("/climbing.safetensors.index.json")),
        ".index.json?...: shard name '../a.safetensors' has an empty, '.' or '..' part",
    ),
    "a tensor in two shards": (
        lambda at: stream_st.load(at.url("/twice/dataset_manifest.json")),
        "/dataset_manifest.json?...: tensor 'a' is in more than one shard",
    ),
    "KV rows of another size": (
        lambda at: _rows(at, "/a.safetensors", 99),
        "/a.safetensors?...: the manifest says 99 bytes, the shard's header describes",
    ),
    "KV rows, bytes after": (
        lambda at: _rows(at, "/trailing.safetensors"),
        "/trailing.safetensors?...: 2 bytes follow the last tensor",
    ),
    "KV rows, a key twice": (
        lambda at: _rows(at, "/twice.safetensors"),
        "/twice.safetensors?...: tensor 'k__n' is listed twice",
    ),
    "KV rows, a bad header": (
        lambda at: _rows(at, "/unparsable.safetensors"),
        "/unparsable.safetensors?...: tensor 'a': shape [2] x F32 needs 8 bytes",
    ),
    "rows rewritten": (_rewritten, "/a.safetensors?... changed since the dataset was described"),
    "rows of another version": (
        _another_version,
        "/a.safetensors?... changed since its digests were checked",
    ),
    "rows of other lengths": (
        lambda at: read_piece(Piece(at.url("/ab.safetensors"), ("a", "b"), 0, 2)),
        "/ab.safetensors?...: the columns hold different numbers of samples",
    ),
    "a dataset not written there": (
        lambda at: write_object(at.url("/out/part-00000.safetensors"), b""),
        "/part-00000.safetensors?...: a dataset is written to a path or an s3:// URL",
    ),
    "a folder of no shards": (
        lambda at: describe_dataset(f"{at.tmp.as_uri()}/?{PRESIGNED}"),
        "/?...: no dataset_manifest.json and no shards",
    ),
    "not in the offline cache": (
        lambda at: stream_st.load(
            f"hf://org/repo/m.safetensors?{PRESIGNED}",
            cache=Cache(at.tmp / "objects", at.tmp / "hub", offline=True),
        ),
        "/m.safetensors?... is not in the cache (HF_HUB_OFFLINE or cache='offline')",
    ),
    "a model config": (_config, "/config.json?...: num_attention_heads must be a positive"),
}


@pytest.mark.parametrize(
    ("reading", "said"), list(SIGNED_READINGS.values()), ids=list(SIGNED_READINGS)
)
async def test_an_error_beginning_with_a_signed_address_keeps_its_reason(
    signed: RangeHTTPServer,
    tmp_path: Path,
    reading: Callable[[_Signed], Awaitable[object]],
    said: str,
) -> None:
    """A message beginning with the address it is about, one holding a signed parameter (a
    presigned shard of an index or manifest, a shard of a dataset), showed the masked address
    alone, its reason masked as the signature's value (``.../a.safetensors?...&X-Amz-Signature=
    ***``); a shard that is no safetensors file showed the signature itself. It now shows the
    masked address, then the reason."""
    with pytest.raises(SafetensorsError) as info:
        with anyio.fail_after(20):
            await reading(_Signed(signed, tmp_path))
    text = str(info.value)
    assert_hidden(text, repr(info.value), secrets=PRESIGNED_SECRETS)
    assert said.replace("?...", f"?{MASKED_PRESIGNED}") in text, text


def test_a_shard_outside_a_signed_index_keeps_its_reason() -> None:
    """A shard resolving outside a presigned index's directory (an index with no path) showed
    the masked index address alone, the reason masked as the signature's value; it now shows
    the masked index, then the reason, the shard's address masked too."""
    with pytest.raises(stream_st.HeaderError) as info:
        shard_address(f"http://host?{PRESIGNED}", "a.safetensors")
    text = str(info.value)
    assert_hidden(text, repr(info.value), secrets=PRESIGNED_SECRETS)
    assert text == (
        f"http://host?{MASKED_PRESIGNED}: shard 'a.safetensors' resolves to "
        f"http://host/a.safetensors?{MASKED_PRESIGNED} outside the index"
    ), text


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"http://alice:{SECRET}@host/m", "http://alice:***@host/m"),
        (f"see https://a:{SECRET}@b@host:8/x?y=1 and s3://b/k", "see https://a:***@host:8/x?y=1 and s3://b/k"),
        (f"'http://a:{SECRET[:4]}/{SECRET[4:]}@host:8/m': x", "'http://a:***@host:8/m': x"),
        (f"http://a:{SECRET[:4]}?#{SECRET[4:]}@host/m?b=1", "http://a:***@host/m?b=1"),
        ("https://h/x?t=1:2&mail=a@b", "https://h/x?t=1:2&mail=a@b"),  # no userinfo: kept
        ("https://b.example/k?sig=abc&se=2&sv=1", "https://b.example/k?sig=***&se=2&sv=1"),
        ("https://h/x?Signature=abc&Key-Pair-Id=K1", "https://h/x?Signature=***&Key-Pair-Id=K1"),
        ("https://h/x?access_token=abc&api_key=def", "https://h/x?access_token=***&api_key=***"),
        ("https://h/x?X-Goog-Signature=abc&X-Goog-Credential=def", "https://h/x?X-Goog-Signature=***&X-Goog-Credential=***"),
        ("http://alice@host/m", "http://alice@host/m"),  # a user name alone is no secret
        ("user@example.com wrote /tmp/a:b@c", "user@example.com wrote /tmp/a:b@c"),
        ("http://h/p@x?token=", "http://h/p@x?token="),
        ("https://h/x#access_token=abc&b=1", "https://h/x#access_token=***&b=1"),  # a fragment
        ("https://h/x?sig=abc#part", "https://h/x?sig=***#part"),
        ("https://h/x?%74oken=abc&X%2DAmz%2DSignature=d", "https://h/x?%74oken=***&X%2DAmz%2DSignature=***"),
        ("https://h/x?a=1;token=abc;b=2&c=3", "https://h/x?a=1;token=***&c=3"),  # ";" splits too
        ("https://h/x?token%3Dabc&c=3", "https://h/x?token%3D***&c=3"),  # "=" escaped
        ("https://h/x?a=b;c&d=%3D&e%3D", "https://h/x?a=b;c&d=%3D&e%3D"),  # no secret: kept
        ("https://h/x?x%3Dtoken=abc&c=3", "https://h/x?x%3Dtoken=***&c=3"),  # parse_qsl's x=token
        ("https://h/x?a%3Dx%26token=abc", "https://h/x?a%3Dx%26token=***"),
        ("https://h/x?a=1%26token%3Dabc&c=3", "https://h/x?a=1%26token%3D***&c=3"),  # decoded first
        ("Denied. x-amz-security-token: FQoGZXIvYXdzE", "Denied. x-amz-security-token: ***"),
        ("<pre>Cookie: session=abc; id=2</pre>", "<pre>Cookie: ***</pre>"),
        ("X-Api-Key:k123\r\nPrivate-Token: glpat-1", "X-Api-Key:***\r\nPrivate-Token: ***"),
        ("x-amz-security-token: T0K authorization: x", "x-amz-security-token: ***"),  # to the end
        ("Proxy-Authorization: Basic YWxpY2U6c2VjcmV0", "Proxy-Authorization: ***"),
        ("x-amz-server-side-encryption-customer-key: a2V5=",
         "x-amz-server-side-encryption-customer-key: ***"),  # an SSE-C key
        ("X-Amz-Copy-Source-Server-Side-Encryption-Customer-Key:a2V5=",
         "X-Amz-Copy-Source-Server-Side-Encryption-Customer-Key:***"),
        ("x-amz-server-side-encryption-customer-key-MD5: bWQ1",
         "x-amz-server-side-encryption-customer-key-MD5: bWQ1"),  # its digest: no secret
    ],
)  # fmt: skip
def test_redact(text: str, shown: str) -> None:
    assert redact(text) == shown
    assert redact(shown) == shown  # masking again changes nothing


DIGEST = 'Digest username="u", realm="r", nonce="n", uri="/m", response="6629fae49393a0"'


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"""open "http://a:it's-{SECRET}@h/m": refused""", 'open "http://a:***@h/m": refused'),
        (f"""'http://a:it\\'s"{SECRET}@h/m', url=http://h/m""", "'http://a:***@h/m', url=http://h/m"),
        (f"<http://a:<{SECRET}>@h/m>", "<http://a:***@h/m>"),
        (f"'http://a:it's/{SECRET}@h:8/m': x", "'http://a:***@h:8/m': x"),  # cut short too
        (f"""'https://h/x?sig=a"{SECRET}': HTTP 403, x""", "'https://h/x?sig=***': HTTP 403, x"),
        (f"""<a href="https://h/x?token=ab'{SECRET}">here</a>""", '<a href="https://h/x?token=***">here</a>'),
        (f"('https://h/x?token=ab'{SECRET}'), next", "('https://h/x?token=***'), next"),
        (f"https://h/x?token=ab {SECRET}&file=m", "https://h/x?token=***&file=m"),  # one address
        (f"https://h/x?token=ab<{SECRET}>", "https://h/x?token=***"),
        ("https://h/x?token=*** holds 9 bytes", "https://h/x?token=*** holds 9 bytes"),  # a name
        ("'https://h/x?a=1' (it's 'b=2')", "'https://h/x?a=1' (it's 'b=2')"),  # no secret: kept
        (f"Authorization: bearer hf_{SECRET}", "Authorization: bearer ***"),
        (f"authorization: token ghp_{SECRET} range: bytes=0-9", "authorization: token ***"),
        (f"Authorization: Token 9944b0{SECRET}", "Authorization: Token ***"),
        (f"Authorization: {DIGEST}\r\nHost: h", "Authorization: Digest ***\r\nHost: h"),
        (f"Authorization: Negotiate YII{SECRET}==", "Authorization: Negotiate ***"),
        (f"Authorization: SharedKey acct:{SECRET}=", "Authorization: SharedKey ***"),
        (f"<td>Authorization: {SECRET}</td>", "<td>Authorization: ***</td>"),  # no scheme
        (f"Authorization: ghp_{SECRET} Range: bytes=0-9", "Authorization: ***"),  # nor here
        (f'{{"Authorization": "token {SECRET}"}}', '{"Authorization": "token ***"}'),  # JSON
        (f"<p>BEARER hf_{SECRET}</p>", "<p>BEARER ***</p>"),  # any case
        (f'Cookie: session="{SECRET}"', "Cookie: ***"),
        ("basic authentication failed", "basic authentication failed"),
    ],
)  # fmt: skip
def test_redact_masks_through_quotes_and_any_authorization_scheme(text: str, shown: str) -> None:
    """A quote, a space or an angle bracket ended a password, a parameter's value or a header's
    value where the mask stopped, and the rest was shown; an ``Authorization`` value was masked
    only for ``Bearer``, ``Basic`` (so spelt) and AWS's scheme. A quote that closes the text's
    own quoting stays, and so does the text after an address."""
    assert redact(text) == shown
    assert redact(shown) == shown  # masking again changes nothing


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        (f"invalid URL 'http://a:it {SECRET}@h:9/m': x", "invalid URL 'http://a:***@h:9/m': x"),
        (f"""invalid URL "http://a:it's {SECRET}@h/m\"""", 'invalid URL "http://a:***@h/m"'),
        (f'{{"url": "https://h/x?token=ab {SECRET}&file=m"}}', '{"url": "https://h/x?token=***&file=m"}'),
        (f"see 'https://h/x?sig=a b{SECRET}#top' (retry)", "see 'https://h/x?sig=***#top' (retry)"),
        (f"url=http://a:b\\n{SECRET}@h/m", "url=http://a:***@h/m"),  # a repr's line break
        ("the proxy http://me@127.0.0.1:32791 refused CONNECT: user:password@ in its URL",
         "the proxy http://me@127.0.0.1:32791 refused CONNECT: user:password@ in its URL"),
        ("the proxy 'http://me@h:32791' refused CONNECT: user:password@ in its URL",
         "the proxy 'http://me@h:32791' refused CONNECT: user:password@ in its URL"),
        ("'http://h/m' (it's 'a b@c'), \"https://h/x?a=1 2\" ok",
         "'http://h/m' (it's 'a b@c'), \"https://h/x?a=1 2\" ok"),  # no secret: kept
        ("http://h:80 refused\nmail a@h.org", "http://h:80 refused\nmail a@h.org"),  # a text
        (f"1.http://a:{SECRET}@h/m", "1.http://a:***@h/m"),
        (f"x_http://a:{SECRET}@h/m", "x_http://a:***@h/m"),
        ("{'cookie': 'abc', 'url': 'http://h/x', 'status': 403}",
         "{'cookie': '***', 'url': 'http://h/x', 'status': 403}"),  # the cookie's quotes end it
        (f'{{"authorization":"Bearer {SECRET}","status":401}}',
         '{"authorization":"Bearer ***","status":401}'),
        (f"{{'Authorization': 'Digest response=\"{SECRET}\"', 'status': 401}}",
         "{'Authorization': 'Digest ***', 'status': 401}"),
        (f'{{"Authorization": "Digest response=\\"{SECRET}\\"", "status": 401}}',
         '{"Authorization": "Digest ***", "status": 401}'),  # an escaped quote is the value's
        ("Authorization: sk-abcdef ghijkl", "Authorization: ***"),  # no scheme: all masked
        ("Authorization: FQoGZXIvYXdzE", "Authorization: ***"),
        (f'{{"url":"http://u:p w{SECRET}@h/x","a":1}}', '{"url":"http://u:***@h/x","a":1}'),
        (f"['http://u:p w{SECRET}@h/x']", "['http://u:***@h/x']"),
        (f'{{"url":"https://h/x?token={SECRET}","a":1}}', '{"url":"https://h/x?token=***","a":1}'),
    ],
)  # fmt: skip
def test_redact_reads_a_quoted_address_or_credential_whole(text: str, shown: str) -> None:
    """A text quoting an address (``invalid URL '...'``, JSON) showed the tail of a password or
    a signed parameter's value after a space in it; an address quoted bare still ends at white
    space (a sentence goes on after it), and a line break ends a text's address. The fields of a
    dict after a quoted cookie or ``Authorization`` were masked to the end of the line, and an
    ``Authorization`` value's first word was kept as its scheme whatever it was
    (``sk-abcdef``): a credential is masked up to the quote that ends it, the text around it
    kept."""
    assert redact(text) == shown
    assert redact(shown) == shown  # masking again changes nothing


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("https://h/m?token=***: tensor 'a' declares 80 bytes",
         "https://h/m?token=***: tensor 'a' declares 80 bytes"),  # a masked name quoted
        (f"reading https://h/m?sig={SECRET}: refused", "reading https://h/m?sig=***: refused"),
        (f"reading https://h/m?sig={SECRET}:\tx", "reading https://h/m?sig=***:\tx"),
        (f"reading https://h/m?sig=a:{SECRET}: x", "reading https://h/m?sig=***: x"),  # its ":"
        (f"https://h/m?token=ab: {SECRET}", "https://h/m?token=***"),  # one address: read whole
        (f"https://h/m?token=ab {SECRET}: x", "https://h/m?token=***"),
    ],
)  # fmt: skip
def test_a_colon_after_a_masked_value_is_the_messages(text: str, shown: str) -> None:
    """A message naming an address, ``{address}: reason``, lost the ``:`` after a masked value
    (``?token=*** reason``): it was read as the value's last character. An address alone is
    still read whole, a ``: `` in a value masked with it."""
    assert redact(text) == shown
    assert redact(shown) == shown  # masking again changes nothing


@pytest.mark.parametrize(
    "text",
    [
        "HTTP 403 for https://h/m: Authorization: the signature does not match; offset 5",
        "expected header 'authorization': got none, retry",
        "Authorization: failed for tensor 'x' at offset 10",
        "tensor 'basic model.layers.10.weight' not found",
        "the basic block_attention_weights_v2 is missing",
        "bearer instruments_for_tests ok",
        '{"url":"http://host","email":"a@b.com"}',
        "{'url': 'http://host', 'email': 'a@b.com'}",
        "authorization: Bearer",
    ],
)
def test_redact_keeps_text_that_holds_no_credential(text: str) -> None:
    """A text naming ``Authorization`` in prose (``Authorization: the signature does not
    match``), a tensor named ``basic ...`` and the fields of compact JSON after an address were
    masked, to the end of the line or up to the next ``@``."""
    assert redact(text) == text


@pytest.mark.parametrize(
    "name",
    [
        "%74oken",
        "access%5Ftoken",
        "%53ignature",
        "X%2DAmz%2DCredential",
        "pass%77ord",
        "a+token",
        "%66ile",
        "x%3Dtoken",
        "%3Dtoken",
        "a%3Dx%26token",
    ],
)
def test_redact_and_the_cache_key_read_an_escaped_name_alike(name: str) -> None:
    """A parameter's name is read percent-decoded, as a server reads it, by both: one the cache
    key drops as a secret's (``?%74oken=``, a server's ``token=``) is masked in every message,
    and one it keeps (``?%66ile=``) is shown."""
    url = f"https://h/m?{name}={SECRET}"
    dropped = object_key(url).key == object_key(f"https://h/m?{name}=other").key
    assert (SECRET not in redact(url)) == dropped
    assert dropped == (name != "%66ile")


@pytest.mark.parametrize(
    "text",
    [
        "a=b;" * 16000,
        ";token=" * 16000 + "x",
        "?x" + "%3" * 30000,
        "?" + "a%26" * 16000 + "=x",
        "?" + "a%3D" * 16000,
    ],
)
def test_parameters_are_masked_in_time_linear_in_the_text(text: str) -> None:
    """Each value is searched for parameters (``?a=1;token=...``) and read to its end only to
    be masked: reading every value to the next ``&`` took seconds for 64 kB of ``a=b;``."""
    started = time.process_time()
    redact(text)
    assert time.process_time() - started < 1.0


# --------------------------------------------------------------------------- reprs


def test_no_secret_in_a_repr_or_str() -> None:
    config = S3Config(
        endpoint_url=f"http://minio:{SECRET}@127.0.0.1:9000",
        region="us-east-1",
        access_key_id="AKIDEXAMPLE",
        secret_access_key=SECRET,
        session_token=f"token-{SECRET}",
    )
    holders: list[object] = [
        config,
        Keys("AKIDEXAMPLE", SECRET, f"token-{SECRET}"),
        Transport.of({"Authorization": f"Bearer {SECRET}"}),
        Proxy.parse(f"http://me:{SECRET}@127.0.0.1:3128", "http_proxy"),
        HubClient("http://127.0.0.1:1", f"hf_{SECRET}"),
        HubSource("hf://org/repo/m.safetensors", endpoint="http://127.0.0.1:1", token=SECRET),
        HttpSource(f"http://alice:{SECRET}@127.0.0.1:1/m", headers={"Cookie": SECRET}),
    ]
    for holder in holders:
        assert_hidden(repr(holder), str(holder))
    assert "AKIDEXAMPLE" in repr(config)  # which keys: still said
    assert "secret_access_key='***'" in repr(config)


def test_a_bad_header_value_is_not_shown() -> None:
    with pytest.raises(UsageError) as info:
        Transport.of({"Authorization": f"Bearer {SECRET}\n"})  # a token file's newline
    assert_hidden(str(info.value))
    assert "Authorization" in str(info.value)


async def test_an_error_body_echoing_the_request_keeps_no_session_token(
    server: RangeHTTPServer,
) -> None:
    """An S3 ``SignatureDoesNotMatch`` page echoes the request it refused, the session token
    stream_st sent with it included (as text, and as hex): the body kept on the error
    (``.body``, which a caller may log) has them masked, as the message has."""
    token = SECRET.encode()
    server.status_for["/m.safetensors"] = 403
    server.status_body = (
        "application/xml",
        b"<Error><Code>SignatureDoesNotMatch</Code><CanonicalRequest>GET\n/m.safetensors\n\n"
        b"x-amz-security-token:"
        + token
        + b"\n</CanonicalRequest><CanonicalRequestBytes>"
        + token.hex(" ").encode()
        + b"</CanonicalRequestBytes></Error>",
    )
    with pytest.raises(HTTPStatusError) as info:
        await load(server.url("/m.safetensors"))
    body = info.value.body
    assert token not in body and token.hex(" ").encode() not in body
    assert b"<Code>SignatureDoesNotMatch</Code>" in body and b"x-amz-security-token:***" in body


class SignatureMismatchServer(RangeHTTPServer):
    """Answers every request but a HEAD 403 ``SignatureDoesNotMatch``, echoing the canonical
    request with every header it got, one a line, as text and as hex, as S3 does."""

    def _answer(
        self, connection: socket.socket, reader: Any, method: str, target: str, headers: Any
    ) -> bool:
        if method == "HEAD":
            return super()._answer(connection, reader, method, target, headers)
        if method in ("PUT", "POST"):
            self._read_body(reader, headers)
        lines = "".join(f"{name}:{value}\n" for name, value in sorted(headers.items()))
        canonical = f"{method}\n{target.partition('?')[0]}\n\n{lines}\n{';'.join(sorted(headers))}"
        body = (
            "<Error><Code>SignatureDoesNotMatch</Code>"
            f"<CanonicalRequest>{canonical}\nUNSIGNED-PAYLOAD</CanonicalRequest>"
            f"<CanonicalRequestBytes>{canonical.encode().hex(' ')}</CanonicalRequestBytes></Error>"
        ).encode()
        head = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
        self._send_head(connection, 403, head)
        connection.sendall(body)
        return True


SSE_C_KEY = base64.b64encode(f"{SECRET}-a-customer-key-of-32-by".encode()).decode()
"""An SSE-C key, as ``headers=`` gives it (Base64 of 32 bytes): whoever holds it reads the
object."""


async def _refused_signature(
    operation: str, headers: dict[str, str]
) -> tuple[HTTPStatusError, int]:
    """The error reading (``operation`` ``"read"``) or writing ``s3://bkt/m.safetensors`` with
    ``headers`` raises from a :class:`SignatureMismatchServer`, and that server's port."""
    url = "s3://bkt/m.safetensors"
    with SignatureMismatchServer() as server:
        server.objects["/bkt/m.safetensors"] = FILE
        config = S3Config.resolve(
            endpoint_url=server.url(""),
            access_key_id="AKIDEXAMPLE",
            secret_access_key="x",
            session_token=f"token-{SECRET}",
            environ={},
        )
        with pytest.raises(HTTPStatusError) as info, anyio.fail_after(20):
            if operation == "read":
                await stream_st.load(stream_st.S3Source(url, config=config, headers=headers))
            else:
                await stream_st.save(stream_st.S3Sink(url, config=config, headers=headers), ARRAYS)
    return info.value, server.port


@pytest.mark.parametrize("operation", ["read", "write"])
@pytest.mark.parametrize(
    "name",
    [
        "x-amz-server-side-encryption-customer-key",
        "x-amz-copy-source-server-side-encryption-customer-key",
    ],
)
async def test_an_error_body_echoing_the_request_keeps_no_sse_c_key(
    operation: str, name: str
) -> None:
    """An S3 ``SignatureDoesNotMatch`` page echoes every header of the request it refused, all
    signed (stream_st signs every header given): an SSE-C key given in ``headers=`` (to read or
    write an object encrypted with it, or to copy one) showed in full in the error's ``body``,
    where the session token was masked, and so did a credential under a name stream_st does not
    know. The request's echoed headers show only the values that are no secret (host, date)."""
    headers = {name: SSE_C_KEY, f"{name}-MD5": "bWQ1", "cf-access-client-secret": SECRET}
    error, port = await _refused_signature(operation, headers)
    body = error.body.decode("latin-1")
    assert_hidden(body, str(error), repr(error), secrets=(SECRET, SSE_C_KEY))
    assert f"\n{name}:***\n" in body and "\ncf-access-client-secret:***\n" in body
    assert f"\nhost:127.0.0.1:{port}\n" in body and "\nx-amz-date:20" in body
    assert "<Code>SignatureDoesNotMatch</Code>" in body


@pytest.mark.parametrize("operation", ["read", "write"])
async def test_an_error_body_echoing_the_request_masks_a_header_of_any_name(
    operation: str,
) -> None:
    """A header's name in ``headers=`` may hold any character of an HTTP token besides letters,
    digits and ``-`` (``x_my_token``, ``x.auth.key``), or another the headers take (``x/key``):
    the request S3 echoed showed those headers' values in full. Each is masked."""
    names = ["x_my_token", "x.auth.key", *(f"x{c}key" for c in "!#$%&'*+^`|~/@")]
    headers = {name: f"{SECRET}-{i}" for i, name in enumerate(names)}
    error, port = await _refused_signature(operation, headers)
    body = error.body.decode("latin-1")
    assert_hidden(body, str(error), repr(error))
    assert all(f"\n{name}:***\n" in body for name in names), body
    assert f"\nhost:127.0.0.1:{port}\n" in body and "\nx-amz-date:20" in body


class EchoServer(RangeHTTPServer):
    """Answers every request 401 with a body quoting its headers, one a line, as debugging
    gateways and echo services do."""

    def _answer(
        self, connection: socket.socket, reader: Any, method: str, target: str, headers: Any
    ) -> bool:
        body = "".join(f"{name}: {value}\r\n" for name, value in headers.items()).encode()
        self._send_head(connection, 401, {"Content-Length": str(len(body))})
        connection.sendall(body)
        return True


@pytest.mark.parametrize(
    "credential",
    [
        f"bearer hf_{SECRET}",
        f"token ghp_{SECRET}",
        f"Token {SECRET}",
        DIGEST.replace("6629fae49393a0", SECRET),
        f"Negotiate {SECRET}",
        f"SharedKey acct:{SECRET}",
    ],
)
async def test_an_echoed_authorization_of_any_scheme_is_masked(credential: str) -> None:
    """An error page echoing the request showed an ``Authorization`` value in full, in the
    error's message and ``body``, unless its scheme was spelt ``Bearer`` or ``Basic``."""
    with EchoServer() as echo, pytest.raises(HTTPStatusError) as info:
        await load(echo.url("/m.safetensors"), headers={"Authorization": credential})
    assert_hidden(str(info.value), info.value.body.decode("latin-1"))
    assert f"authorization: {credential.split()[0]} ***" in str(info.value)


@pytest.mark.parametrize("tail", [" @", "@", "a://b:c@" + "x"])
def test_masking_takes_time_linear_in_the_text(tail: str) -> None:
    """An error page (up to 64 KiB, kept on the error and masked) of many addresses with no
    ``@`` after them in the same run: a pattern that ran to the last ``@`` from every address
    took seconds on the event loop (96 kB: 9.8 s); linear, it takes milliseconds."""
    text = "x://x:" * 16000 + tail
    started = time.process_time()
    redact(text)
    assert time.process_time() - started < 1.0


ADVERSARIAL = 256 << 10
"""Characters of an adversarial text: four times the body of an error answer kept and masked.
Quadratic, masking one takes minutes; linear, milliseconds."""


@pytest.mark.parametrize(
    "text",
    [
        "x " + "a." * (ADVERSARIAL // 6) + "://" + "b" * (ADVERSARIAL * 2 // 3) + " @",
        "x " + "a-" * (ADVERSARIAL // 2) + "@",
        "x " + "a+" * (ADVERSARIAL // 2) + ":/@",
        "AWS4-HMAC-SHA256 " * (ADVERSARIAL // 17),
        "x '" + "a." * (ADVERSARIAL // 6) + "://" + "b" * (ADVERSARIAL * 2 // 3),
        "x " + "'a://b:c@" * (ADVERSARIAL // 9),
    ],
    ids=["scheme", "no scheme", "no scheme +", "AWS signature", "quoted", "quotes"],
)
def test_masking_adversarial_text_takes_time_linear_in_it(text: str) -> None:
    """A scheme was looked for from every word boundary of a run of letters and dots to its
    ``://`` (256 KiB: minutes), and an AWS signature from every ``AWS4-HMAC-SHA256`` to the end
    of its line: an error page of such text held the event loop for seconds."""
    started = time.process_time()
    redact(text)
    assert time.process_time() - started < 10.0


@pytest.mark.parametrize(
    "body",
    [
        b"<CanonicalRequest>" * (ADVERSARIAL // 18),
        b"<CanonicalRequest>" * 100 + b"x-k:v\n" * (ADVERSARIAL // 6) + b"</CanonicalRequest>",
        b"<CanonicalRequest>" + b"a-" * (ADVERSARIAL // 2) + b"</CanonicalRequest>",
        b"<CanonicalRequest>k:v</CanonicalRequest>" * (ADVERSARIAL // 39),
        b"<CanonicalRequest>" + b"x_.!~'*+^`|#$%&" * (ADVERSARIAL // 15) + b"</CanonicalRequest>",
        b"<CanonicalRequest>" + b"x_k:" * (ADVERSARIAL // 4) + b"</CanonicalRequest>",
    ],
    ids=["open tags", "headers", "one name", "requests", "token name", "colons"],
)
def test_masking_an_echoed_request_takes_time_linear_in_it(body: bytes) -> None:
    """The headers of a canonical request an error page echoes are each looked at once."""
    started = time.process_time()
    HTTPStatusError(403, "Forbidden", body=body)
    assert time.process_time() - started < 10.0


async def test_a_tcp_address_s_cut_password_is_hidden() -> None:
    """A ``tcp://`` address's password with a ``/`` in it ends its authority early, its start
    read as a port: Python's reason (``... as 's3cr'``) quoted it, and the message showed it."""
    with pytest.raises(UsageError) as info:
        await stream_st.read_header(f"tcp://alice:{SECRET[:4]}/{SECRET[4:]}@127.0.0.1:1")
    assert_hidden(str(info.value), repr(info.value), secrets=(SECRET[:4], SECRET[4:]))
    assert info.value.__cause__ is None
