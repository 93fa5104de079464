"""Transport options (``headers``, ``ssl_context``, the limits) reach every entry point that takes
a URL: reads, headers, loads, saves, writers, an index and each of its shards, the tools and the
``stream-st`` commands; checked once, with one-line errors."""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import numpy as reference_numpy

import stream_st
from stream_st import HttpSink, HttpSource, tools
from stream_st.cli import main
from stream_st.errors import HTTPStatusError, UsageError

from ..servers.http_server import RangeHTTPServer
from ..servers.nginx_server import NginxServer

pytestmark = pytest.mark.anyio

TOKEN = {"Authorization": "Bearer s3cret"}
ARRAYS = {"a": np.arange(10, dtype=np.float32), "b": np.ones(3, dtype=np.int64)}


class PrivateServer(RangeHTTPServer):
    """Answers 403 to any request without ``Authorization: Bearer s3cret``; records the headers
    of each request."""

    seen: list[dict[str, str]]

    def _answer(
        self,
        connection: socket.socket,
        reader: Any,
        method: str,
        target: str,
        headers: dict[str, str],
    ) -> bool:
        self.seen.append(headers)
        if headers.get("authorization") != TOKEN["Authorization"]:
            self._send_head(connection, 403, {"Content-Length": "0", "Connection": "close"})
            return False
        return super()._answer(connection, reader, method, target, headers)


def encoded(arrays: dict[str, Any]) -> bytes:
    return bytes(reference_numpy.save(arrays))


@pytest.fixture
def private() -> Iterator[PrivateServer]:
    server = PrivateServer()
    server.seen = []
    server.objects["/m.safetensors"] = encoded(ARRAYS)
    server.objects["/s/one.safetensors"] = encoded({"a": ARRAYS["a"]})
    server.objects["/s/two.safetensors"] = encoded({"b": ARRAYS["b"]})
    index = {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}
    server.objects["/s/model.safetensors.index.json"] = json.dumps(index).encode()
    with server:
        yield server


async def test_a_private_index_and_its_shards(private: PrivateServer) -> None:
    url = private.url("/s/model.safetensors.index.json")
    with pytest.raises(HTTPStatusError, match="403"):
        await stream_st.load(url)
    loaded = await stream_st.load(url, headers=TOKEN)
    np.testing.assert_array_equal(loaded["b"], ARRAYS["b"])
    found = await tools.inspect(url, headers=TOKEN, timeout=10)
    assert found.tensor_count == 2


async def test_headers_on_every_entry_point(private: PrivateServer) -> None:
    url = private.url("/m.safetensors")
    assert sorted((await stream_st.read_header(url, headers=TOKEN)).names()) == ["a", "b"]
    async with stream_st.open_stream(url, headers=TOKEN) as stream:
        assert sorted([name async for name, _ in stream]) == ["a", "b"]
    await stream_st.save(private.url("/up.safetensors"), ARRAYS, headers=TOKEN)
    assert private.objects["/up.safetensors"] == encoded(ARRAYS)
    assert (await tools.hash(url, content=True, headers=TOKEN))["tensor_count"] == 2


async def test_call_headers_go_on_top_of_a_given_sources(private: PrivateServer) -> None:
    source = HttpSource(private.url("/m.safetensors"), headers={"X-Own": "1", "authorization": "x"})
    await stream_st.read_header(source, headers=TOKEN)
    assert private.seen[-1]["x-own"] == "1"
    assert private.seen[-1]["authorization"] == TOKEN["Authorization"]
    sink = HttpSink(private.url("/given.safetensors"), headers={"X-Own": "2"})
    await stream_st.save(sink, ARRAYS, headers=TOKEN)
    assert private.seen[-1]["x-own"] == "2"
    assert "/given.safetensors" in private.objects


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"headers": [("a", "b")]}, "headers must be a mapping"),
        ({"headers": {"a": 1}}, "headers must map str to str"),
        ({"headers": {"a": "b\r\nX-Injected: 1"}}, "line break"),
        ({"headers": {"bad name": "v"}}, "no valid name"),
        ({"headers": {"X-Note": "a\x01b"}}, "'X-Note' holds a line break or another control"),
        ({"headers": {"X-Note": "snow \u2603"}}, "'X-Note' holds characters beyond Latin-1"),
        ({"headers": {"content-LENGTH": "16"}}, "'content-LENGTH' frames the request"),
        ({"ssl_context": "/etc/ssl/ca.pem"}, "ssl_context must be an ssl.SSLContext"),
        ({"proxy": "http://p"}, "unknown option"),
    ],
)
async def test_bad_options_are_usage_errors(options: dict[str, Any], message: str) -> None:
    """Refused as the call is made, before any request; a header's value never shown (a
    control character other than a line break was sent, and a character beyond Latin-1 refused
    by each request, shown in the message)."""
    with pytest.raises(UsageError, match=message) as info:
        await stream_st.read_header("http://127.0.0.1:9/m.safetensors", **options)
    assert "\n" not in str(info.value) and "\u2603" not in str(info.value)
    with pytest.raises(UsageError, match=message):
        stream_st.open_writer("http://127.0.0.1:9/m.safetensors", [], **options)


@pytest.mark.parametrize(
    "name",
    [
        "Host",
        "Content-Length",
        "transfer-encoding",
        "Connection",
        "TE",
        "Trailer",
        "Upgrade",
        "Expect",
        "Keep-Alive",
        "Proxy-Connection",
        "rAnGe",
        "If-Range",
    ],
)
async def test_a_header_that_frames_the_request_is_refused(
    private: PrivateServer, name: str
) -> None:
    """A header the client frames the request or its connection with is refused as the call
    is made, naming it: a Content-Length given beside the client's own made a server store the
    object cut short and answer 201, and the save succeed; a Range went out beside the
    client's own, asking a server that honours the first for other bytes."""
    with pytest.raises(UsageError, match=f"header '{name}' frames the request"):
        await stream_st.save(private.url("/f.safetensors"), ARRAYS, headers={**TOKEN, name: "1"})
    with pytest.raises(UsageError, match=f"header '{name}' frames the request"):
        HttpSink(private.url("/f.safetensors"), headers={name: "1"})
    assert private.seen == [] and "/f.safetensors" not in private.objects


def test_a_header_value_may_hold_a_tab_and_latin1_text(private: PrivateServer) -> None:
    """RFC 9110 field values hold tabs and bytes 0x80-0xFF (obs-text): ``-H`` sends them, where
    it refused a tab (and a no-break space) as a control character."""
    for value in ("a\tb", "caf\u00e9\u00a0x"):
        auth = f"Authorization: {TOKEN['Authorization']}"
        argv = [
            "inspect",
            "-q",
            "-H",
            auth,
            "-H",
            f"X-Note: {value}",
            private.url("/m.safetensors"),
        ]
        assert main(argv) == 0
        assert private.seen[-1]["x-note"] == value


# ---------------------------------------------------------------- TLS


@pytest.fixture
def nginx(small_nginx: NginxServer) -> NginxServer:
    return small_nginx


async def test_ssl_context_for_a_custom_ca(nginx: NginxServer) -> None:
    url = nginx.url("m.safetensors", tls=True)
    with pytest.raises(stream_st.TransportError, match="certificate"):
        await stream_st.read_header(HttpSource(url, retries=0))
    header = await stream_st.read_header(url, ssl_context=nginx.client_context())
    assert sorted(header.names()) == ["a", "b"]
    given = HttpSource(url, retries=0)  # no context of its own: the call's applies
    assert (await stream_st.read_header(given, ssl_context=nginx.client_context())).names()


# ---------------------------------------------------------------- the command line


def test_cli_header(private: PrivateServer, capsys: pytest.CaptureFixture[str]) -> None:
    url = private.url("/s/model.safetensors.index.json")
    assert main(["inspect", url]) == 2
    assert main(["inspect", "--json", "-H", "Authorization: Bearer s3cret", url]) == 0
    assert json.loads(capsys.readouterr().out)["tensor_count"] == 2
    assert main(["hash", "--header", "Authorization: Bearer s3cret", "--content", url]) == 0


def test_cli_ca_bundle(nginx: NginxServer, capsys: pytest.CaptureFixture[str]) -> None:
    url = nginx.url("m.safetensors", tls=True)
    assert main(["inspect", "--ca-bundle", str(nginx.ca_file), url]) == 0
    assert "a" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        (["--header", "no colon here"], "expected 'Name: value'"),
        (["--header", ": value"], "expected 'Name: value'"),
        (["-H", "Content-Length: 16"], "header 'Content-Length' frames the request"),
        (["-H", "Range: bytes=0-9"], "header 'Range' frames the request"),
        (["--ca-bundle", "/nonexistent/ca.pem"], "cannot use '/nonexistent/ca.pem' as a CA bundle"),
    ],
)
def test_cli_bad_transport_arguments(
    argument: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["cp", *argument, "http://127.0.0.1:9/a.safetensors", "b.safetensors"])
    assert info.value.code == 2
    error = capsys.readouterr().err
    assert message in error and error.count("\n") == 1


def test_cli_unusable_ca_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("not a certificate\n")
    with pytest.raises(SystemExit) as info:
        main(["inspect", "--ca-bundle", str(bundle), "https://127.0.0.1:9/a.safetensors"])
    assert info.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_ssl_module_is_what_the_cli_builds(nginx: NginxServer) -> None:
    from stream_st.cli.options import ca_bundle

    assert isinstance(ca_bundle(str(nginx.ca_file)), ssl.SSLContext)
