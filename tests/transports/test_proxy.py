"""Forward proxies from the environment: tinyproxy in front of nginx (plain requests in absolute
form, ``CONNECT`` tunnels for https), ``NO_PROXY``, refusals (407) and unsupported proxies."""

from __future__ import annotations

import base64
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import numpy as reference_numpy

import stream_st
from stream_st.errors import HTTPProtocolError, TransportError, UsageError
from stream_st.transports.http import Target
from stream_st.transports.http.proxy import proxy_for

from ..servers._loopback import LoopbackServer
from ..servers.nginx_server import NginxServer
from ..servers.proxy_server import ForwardProxy

pytestmark = pytest.mark.anyio

PROXY_VARIABLES = [
    f"{name}_proxy" for name in ("http", "https", "all", "no", "HTTP", "HTTPS", "ALL", "NO")
]


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test sets the variables it means: none come from the machine running the tests."""
    for name in [*PROXY_VARIABLES, "REQUEST_METHOD"]:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def nginx(small_nginx: NginxServer) -> NginxServer:
    return small_nginx


def assert_equal(loaded: dict[str, np.ndarray[Any, Any]], file: Path) -> None:
    expected = reference_numpy.load_file(str(file))
    assert loaded.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_array_equal(loaded[name], array)


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RefusingProxy(LoopbackServer):
    """A proxy that answers every request (``CONNECT`` included) with 407 (or ``status``; None:
    it closes the connection without an answer), and records the ``Proxy-Authorization`` header
    of each; with ``bare_lf``, its lines end in a bare LF and it keeps the connection open until
    the client closes it."""

    def __init__(
        self, *, bare_lf: bool = False, status: bytes | None = b"407 Proxy Authentication Required"
    ) -> None:
        self.credentials: list[str | None] = []
        self.bare_lf = bare_lf
        self.status = status
        super().__init__()

    def handle(self, connection: socket.socket) -> None:
        with connection.makefile("rb") as reader:
            lines = iter(lambda: reader.readline().decode("latin-1").strip(), "")
            headers = dict(line.partition(":")[::2] for line in lines)
            auth = headers.get("Proxy-Authorization")
            self.credentials.append(auth.strip() if auth else None)
            if self.status is None:
                return
            answer = (
                b"HTTP/1.1 " + self.status + b"\r\nContent-Length: 0\r\n"
                b'Proxy-Authenticate: Basic realm="p"\r\nConnection: close\r\n\r\n'
            )
            if self.bare_lf:
                connection.sendall(answer.replace(b"\r\n", b"\n").replace(b"close", b"keep-alive"))
                while connection.recv(4096):
                    pass
            else:
                connection.sendall(answer)


@pytest.fixture
def refusing_proxy() -> Iterator[RefusingProxy]:
    proxy = RefusingProxy()
    yield proxy
    proxy.close()


# ---------------------------------------------------------------- through a real proxy


async def test_plain_http_goes_through_the_proxy(
    forward_proxy: ForwardProxy, nginx: NginxServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("http_proxy", forward_proxy.url)
    url = nginx.url("m.safetensors")
    loaded = await stream_st.load(url)
    assert_equal(loaded, nginx.root / "m.safetensors")
    assert f"GET {url}" in forward_proxy.log()  # absolute form, as a proxy expects


async def test_https_is_tunnelled_through_the_proxy(
    forward_proxy: ForwardProxy, nginx: NginxServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTPS_PROXY", forward_proxy.url)
    url = nginx.url("m.safetensors", tls=True)
    loaded = await stream_st.load(url, ssl_context=nginx.client_context())
    assert_equal(loaded, nginx.root / "m.safetensors")
    assert f"CONNECT 127.0.0.1:{nginx.tls_port}" in forward_proxy.log()


async def test_all_proxy_is_the_fallback(
    forward_proxy: ForwardProxy, nginx: NginxServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ALL_PROXY", forward_proxy.url)
    url = nginx.url("m.safetensors")
    await stream_st.read_header(url)
    assert f"GET {url}" in forward_proxy.log()


async def test_no_proxy_goes_direct(nginx: NginxServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy that does not exist: only a direct connection succeeds."""
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("no_proxy", f"example.com, 127.0.0.1:{nginx.port},127.0.0.0/8")
    await stream_st.read_header(nginx.url("m.safetensors"))
    await stream_st.read_header(
        nginx.url("m.safetensors", tls=True), ssl_context=nginx.client_context()
    )


async def test_an_unreachable_proxy_is_named(
    nginx: NginxServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = closed_port()
    monkeypatch.setenv("http_proxy", f"http://user:hunter2@127.0.0.1:{port}")
    with pytest.raises(TransportError, match=f"proxy http://user@127.0.0.1:{port}") as info:
        await stream_st.read_header(stream_st.HttpSource(nginx.url("m.safetensors"), retries=0))
    assert "hunter2" not in str(info.value)


# ---------------------------------------------------------------- refusals


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_407_names_the_proxy_and_sends_the_credentials(
    refusing_proxy: RefusingProxy, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    monkeypatch.setenv(f"{scheme}_proxy", f"http://me:s%40cret@127.0.0.1:{refusing_proxy.port}")
    source = stream_st.HttpSource(f"{scheme}://198.51.100.7/m.safetensors", retries=0)
    with pytest.raises(TransportError) as info:
        await stream_st.read_header(source, timeout=5)
    message = str(info.value)
    assert f"the proxy http://me@127.0.0.1:{refusing_proxy.port} refused" in message
    assert "407" in message and "\n" not in message and "s@cret" not in message
    assert "CONNECT 198.51.100.7:443" in message if scheme == "https" else "GET http://" in message
    assert refusing_proxy.credentials == ["Basic " + base64.b64encode(b"me:s@cret").decode()]


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_proxy_refusal_is_not_retried(
    refusing_proxy: RefusingProxy, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """The same request gets the same 407: an HTTPProtocolError at once, where it was retried
    with back-off as a broken connection is."""
    monkeypatch.setenv(f"{scheme}_proxy", f"http://127.0.0.1:{refusing_proxy.port}")
    source = stream_st.HttpSource(f"{scheme}://198.51.100.7/m.safetensors", backoff=0.01)
    with pytest.raises(HTTPProtocolError, match=r"refused .*: HTTP 407"):
        await stream_st.read_header(source, timeout=5)
    assert len(refusing_proxy.credentials) == 1


async def test_a_proxy_busy_to_connect_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 503 to ``CONNECT`` may pass, as an origin's would: retried, then a TransportError."""
    proxy = RefusingProxy(status=b"503 Service Unavailable")
    try:
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.port}")
        source = stream_st.HttpSource("https://198.51.100.7/m.safetensors", retries=2, backoff=0.01)
        with pytest.raises(TransportError, match=r"refused CONNECT .*: HTTP 503") as info:
            await stream_st.read_header(source, timeout=5)
        assert not isinstance(info.value, HTTPProtocolError)
        assert len(proxy.credentials) == 3
    finally:
        proxy.close()


async def test_a_proxy_closing_before_answering_connect_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where it was reported as a connection lost during the TLS handshake, which never began."""
    proxy = RefusingProxy(status=None)
    try:
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.port}")
        source = stream_st.HttpSource("https://198.51.100.7/m.safetensors", retries=0)
        with pytest.raises(TransportError) as info:
            await stream_st.read_header(source, timeout=5)
        message = str(info.value)
        assert f"the proxy http://127.0.0.1:{proxy.port} closed the connection" in message
        assert "before answering CONNECT 198.51.100.7:443" in message and "TLS" not in message
    finally:
        proxy.close()


@pytest.mark.parametrize("scheme", ["http", "https"])
async def test_a_proxy_answering_in_bare_lf_lines_is_understood(
    monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """RFC 9112 2.2: a bare LF ends a line, the empty one too (a CONNECT answer was read until
    the timeout, waiting for a CRLF CRLF)."""
    proxy = RefusingProxy(bare_lf=True)
    try:
        monkeypatch.setenv(f"{scheme}_proxy", f"http://127.0.0.1:{proxy.port}")
        source = stream_st.HttpSource(f"{scheme}://198.51.100.7/m.safetensors", retries=0)
        with pytest.raises(TransportError, match=r"refused .*: HTTP 407 Proxy Authentication"):
            await stream_st.read_header(source, timeout=3)
    finally:
        proxy.close()


async def test_a_status_of_superscript_digits_is_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``HTTP/1.1 ²00 OK``: ``'²00'.isdigit()`` holds but ``int('²00')`` raised a bare
    ValueError."""
    proxy = RefusingProxy(status="\xb200 OK".encode("latin-1"))
    try:
        monkeypatch.setenv("https_proxy", f"http://127.0.0.1:{proxy.port}")
        source = stream_st.HttpSource("https://198.51.100.7/m.safetensors", retries=0)
        with pytest.raises(TransportError, match=r"refused CONNECT 198\.51\.100\.7:443: HTTP 0"):
            await stream_st.read_header(source, timeout=3)
    finally:
        proxy.close()


@pytest.mark.parametrize("proxy", ["socks5://127.0.0.1:1080", "socks5h://h:1", "https://p:3128"])
async def test_unsupported_proxies_are_refused(monkeypatch: pytest.MonkeyPatch, proxy: str) -> None:
    monkeypatch.setenv("HTTPS_PROXY", proxy)
    with pytest.raises(UsageError, match=r"HTTPS_PROXY: \w+:// proxies are not supported"):
        await stream_st.read_header("https://198.51.100.7/m.safetensors")


# ---------------------------------------------------------------- choosing the proxy


def chosen(url: str, **environ: str) -> str | None:
    proxy = proxy_for(Target.parse(url), environ)
    return None if proxy is None else proxy.name


def test_the_variable_follows_the_scheme() -> None:
    env = {"http_proxy": "p1:1", "https_proxy": "http://p2:2", "all_proxy": "p3:3"}
    assert chosen("http://h/x", **env) == "http://p1:1"
    assert chosen("https://h/x", **env) == "http://p2:2"
    assert chosen("https://h/x", all_proxy="p3") == "http://p3:1080"
    assert chosen("http://h/x") is None


def test_lower_case_wins_and_cgi_ignores_upper_case_http_proxy() -> None:
    assert chosen("http://h/", http_proxy="lower:1", HTTP_PROXY="upper:2") == "http://lower:1"
    assert chosen("http://h/", http_proxy="", HTTP_PROXY="upper:2") is None
    assert chosen("https://h/", HTTPS_PROXY="upper:2") == "http://upper:2"
    assert chosen("http://h/", HTTP_PROXY="upper:2") == "http://upper:2"
    assert chosen("http://h/", HTTP_PROXY="upper:2", REQUEST_METHOD="GET") is None
    assert chosen("http://h/", http_proxy="lower:1", REQUEST_METHOD="GET") == "http://lower:1"


@pytest.mark.parametrize(
    ("url", "no_proxy", "direct"),
    [
        ("http://example.com/", "example.com", True),
        ("http://a.b.example.com/", "example.com", True),
        ("http://a.example.com/", ".example.com", True),
        ("http://example.com/", ".example.com", True),
        ("http://badexample.com/", "example.com", False),
        ("http://EXAMPLE.com./", "example.COM", True),
        ("http://anything/", "*", True),
        ("http://anything/", "*.com", False),
        ("http://h:8080/", "h:8080", True),
        ("http://h:8081/", "h:8080", False),
        ("https://h/", "h:443", True),
        ("http://10.1.2.3/", "10.1.2.3", True),
        ("http://10.1.2.3/", "10.0.0.0/8", True),
        ("http://11.1.2.3/", "10.0.0.0/8", False),
        ("http://[::1]:81/", "[::1]:81", True),
        ("http://[::1]/", "::1", True),
        ("http://[fd00::5]/", "fd00::/8", True),
        ("http://h/", "a b,  ,h", True),
        ("http://h/", "", False),
        ("http://h:8080/", "h:x", True),  # a port that is no number: any port
        ("http://h:8080/", "h:\xb2", True),  # '²'.isdigit() holds; int('²') raised
        ("http://h:8080/", "h:" + "9" * 5000, True),  # more digits than int() reads
    ],
)
def test_no_proxy_rules(url: str, no_proxy: str, direct: bool) -> None:
    assert (chosen(url, all_proxy="p:1", NO_PROXY=no_proxy) is None) == direct
