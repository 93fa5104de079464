"""Reading over HTTP(S) from nginx as deployed (``tests/servers/nginx_server.py``), against the
reference safetensors' reading of the same files: header only, everything, ``include=``, parallel
ranges, TLS with the fixture's CA, gzip, rate limits, stalls and a file replaced on the server
mid-read. The forward proxy fixture (``tests/servers/proxy_server.py``) is smoke-tested against
the same nginx.

One nginx serves the whole module; each test starts with an empty access log, which tells what
each read cost.
"""

from __future__ import annotations

import gzip
import itertools
import os
import re
import shutil
import socket
import ssl
import threading
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import (
    HTTPClient,
    HTTPNotFoundError,
    HttpSource,
    ReadTimeoutError,
    SafetensorsError,
    SourceChangedError,
    TransportError,
    tools,
)
from stream_st.transports.http.source import FIRST_RANGE

from .._util import assert_same_arrays, sample_tensors
from ..drivers.test_sharded import ALL as SHARDED
from ..drivers.test_sharded import write_checkpoint
from ..servers.daemon import running
from ..servers.nginx_server import (
    TRICKLE_AFTER,
    LoggedRequest,
    NginxServer,
    certificates_by_cryptography,
    certificates_by_openssl,
)
from ..servers.proxy_server import ForwardProxy

Arrays = dict[str, np.ndarray[Any, Any]]

RATE = 256 << 10
"""Bytes per second per connection under /slow/."""


def _random(seed: int) -> Arrays:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.random(32_000 + i) for i in range(4)}  # 4 x 256 kB


BIG = _random(0)
# A header past the first 64 KiB answer: header-only needs a second request.
WIDE: Arrays = {f"layers.{i:05d}.attention.weight": np.full(4, i, np.uint16) for i in range(2000)}
FILES: dict[str, Arrays] = {
    "small.safetensors": sample_tensors(),
    "big.safetensors": BIG,
    "wide.safetensors": WIDE,
    "name with spaces & ünïcode.safetensors": sample_tensors(),
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served folder: FILES by the reference writer, a gzip of big.safetensors beside it,
    an empty file and a sharded checkpoint."""
    folder = tmp_path_factory.mktemp("served")
    for name, arrays in FILES.items():
        reference_numpy.save_file(arrays, str(folder / name), metadata={"file": name})
    big = folder / "big.safetensors"
    (folder / "big.safetensors.gz").write_bytes(gzip.compress(big.read_bytes()))
    (folder / "empty.safetensors").write_bytes(b"")
    (folder / "sharded").mkdir()
    write_checkpoint(folder / "sharded")
    return folder


@pytest.fixture(scope="module")
def running_nginx(tmp_path_factory: pytest.TempPathFactory, root: Path) -> Iterator[NginxServer]:
    with running(NginxServer(root, tmp_path_factory.mktemp("nginx"), rate=RATE)) as server:
        yield server


@pytest.fixture
def nginx(running_nginx: NginxServer) -> NginxServer:
    running_nginx.clear_log()
    return running_nginx


@pytest.fixture
async def client(nginx: NginxServer) -> AsyncIterator[HTTPClient]:
    """An HTTP client that trusts the fixture's CA (it serves http:// as well)."""
    async with HTTPClient(ssl_context=nginx.client_context()) as opened:
        yield opened


def reference(root: Path, name: str) -> Arrays:
    arrays: Arrays = reference_numpy.load_file(str(root / name))
    return arrays


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


def gets(nginx: NginxServer) -> list[LoggedRequest]:
    return [request for request in nginx.requests() if request.method == "GET"]


def byte_range(request: LoggedRequest) -> tuple[int, int]:
    """The bytes a logged ``Range: bytes=a-b`` asked for, as [a, b + 1)."""
    match = re.fullmatch(r"bytes=(\d+)-(\d+)", request.range)
    assert match is not None, request
    return int(match[1]), int(match[2]) + 1


TLS = pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])


# ---------------------------------------------------------------- reading what nginx serves


@TLS
@pytest.mark.parametrize("name", sorted(FILES))
async def test_whole_file_in_one_request(
    nginx: NginxServer, client: HTTPClient, root: Path, name: str, tls: bool
) -> None:
    source = HttpSource(nginx.url(name, tls=tls), client=client)
    assert_same_arrays(await read_all(source), reference(root, name))
    assert [(r.scheme, r.range, r.status) for r in gets(nginx)] == [
        ("https" if tls else "http", "bytes=0-", 206)
    ]


@TLS
@pytest.mark.parametrize(("name", "requests"), [("small.safetensors", 1), ("wide.safetensors", 2)])
async def test_header_only_costs_at_most_two_requests(
    nginx: NginxServer, client: HTTPClient, root: Path, name: str, requests: int, tls: bool
) -> None:
    header = await stream_st.read_header(HttpSource(nginx.url(name, tls=tls), client=client))
    assert header == await stream_st.read_header(root / name)
    assert header.metadata == {"file": name}
    logged = gets(nginx)
    assert len(logged) == requests
    assert byte_range(logged[0]) == (0, FIRST_RANGE)
    assert sum(r.sent for r in logged) <= header.data_start + FIRST_RANGE


async def test_inspect_reads_only_the_header(nginx: NginxServer, root: Path) -> None:
    remote = await tools.inspect(nginx.url("wide.safetensors"))
    local = await tools.inspect(root / "wide.safetensors")
    assert {**remote.to_json(), "source": ""} == {**local.to_json(), "source": ""}
    assert len(gets(nginx)) == 2


@TLS
async def test_include_fetches_only_the_selected_tensors(
    nginx: NginxServer, client: HTTPClient, root: Path, tls: bool
) -> None:
    source = HttpSource(nginx.url("big.safetensors", tls=tls), client=client)
    got = await read_all(source, include=["t1", "t3"])
    expected = reference(root, "big.safetensors")
    assert_same_arrays(got, {name: expected[name] for name in ("t1", "t3")})
    logged = gets(nginx)
    assert len(logged) == 3  # the first 64 KiB, then one range per selected tensor
    assert sum(r.sent for r in logged) <= FIRST_RANGE + BIG["t1"].nbytes + BIG["t3"].nbytes


@TLS
async def test_parallel_ranges_cover_the_data_once(
    nginx: NginxServer, client: HTTPClient, root: Path, tls: bool
) -> None:
    part = 64 << 10
    url = nginx.url("big.safetensors", tls=tls)
    source = HttpSource(url, client=client, concurrency=4, part_size=part)
    assert_same_arrays(await read_all(source), reference(root, "big.safetensors"))
    logged = gets(nginx)
    assert {r.status for r in logged} == {206}
    ranges = sorted(byte_range(r) for r in logged)
    assert all(end - start <= max(part, FIRST_RANGE) for start, end in ranges)
    size = (root / "big.safetensors").stat().st_size
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # no overlap


async def test_every_answer_closing_its_connection(nginx: NginxServer, root: Path) -> None:
    """``keepalive_timeout 0``: each answer says ``Connection: close``; reads go on, on new
    connections."""
    url = nginx.url("big.safetensors", location="/close/")
    expected = reference(root, "big.safetensors")
    assert_same_arrays(
        await read_all(url, include=["t0", "t2"]), {n: expected[n] for n in ("t0", "t2")}
    )
    source = HttpSource(url, concurrency=3, part_size=100_000)
    assert_same_arrays(await read_all(source), expected)


async def test_sharded_checkpoint(nginx: NginxServer) -> None:
    assert_same_arrays(
        await stream_st.load(nginx.url("sharded/model.safetensors.index.json")), SHARDED
    )


async def test_tools_agree_with_the_local_file(
    nginx: NginxServer, client: HTTPClient, root: Path
) -> None:
    local = root / "big.safetensors"
    remote = await tools.hash(nginx.url("big.safetensors"), content=True)
    assert {**remote, "source": ""} == {**await tools.hash(local, content=True), "source": ""}
    source = HttpSource(nginx.url("big.safetensors", tls=True), client=client)
    difference = await tools.diff(source, local, content=True)
    assert difference.equal and difference.content_compared


async def test_missing_file(nginx: NginxServer) -> None:
    url = nginx.url("nothing.safetensors")
    with pytest.raises(HTTPNotFoundError, match="404") as info:
        await stream_st.read_header(url)
    assert info.value.url == url


async def test_missing_file_message_is_one_line(nginx: NginxServer) -> None:
    with pytest.raises(HTTPNotFoundError) as info:
        await stream_st.read_header(nginx.url("nothing.safetensors"))
    assert "\n" not in str(info.value)


async def test_empty_file(nginx: NginxServer) -> None:
    """nginx answers a range of an empty file with 200 and no body (not 416)."""
    with pytest.raises(SafetensorsError) as info:
        await stream_st.read_header(nginx.url("empty.safetensors"))
    assert "\n" not in str(info.value)
    assert [(r.status, r.sent) for r in gets(nginx)] == [(200, 0)]


async def test_tls_refuses_a_server_it_does_not_trust(nginx: NginxServer) -> None:
    with pytest.raises(TransportError, match="certificate"):
        await stream_st.read_header(HttpSource(nginx.url("small.safetensors", tls=True), retries=0))


async def test_certificate_failure_is_not_retried(nginx: NginxServer) -> None:
    accepted = nginx.status()[0]
    with pytest.raises(TransportError, match="certificate"):
        await stream_st.read_header(nginx.url("small.safetensors", tls=True))
    assert nginx.status()[0] - accepted == 2  # one handshake, then this status query


async def test_limits_of_a_source_with_a_client(nginx: NginxServer, client: HTTPClient) -> None:
    url = nginx.url("small.safetensors", location="/stall/")
    with anyio.fail_after(2), pytest.raises(ReadTimeoutError, match="timeout"):
        await stream_st.read_header(HttpSource(url, client=client, retries=0, timeout=0.2))


async def test_a_shared_client_keeps_no_deadline(nginx: NginxServer, client: HTTPClient) -> None:
    url = nginx.url("small.safetensors")
    await stream_st.read_header(HttpSource(url, client=client), deadline=0.1)
    await anyio.sleep(0.2)
    await stream_st.read_header(HttpSource(url, client=client))  # no limits at all


# ---------------------------------------------------------------- slow and stalled servers


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"deadline": 0.5}, "deadline"),
        ({"speed_limit": 4 * RATE, "speed_time": 0.5}, "speed_limit"),
    ],
    ids=["deadline", "speed_limit"],
)
async def test_rate_limited_read_is_stopped(
    nginx: NginxServer, limits: dict[str, float], message: str
) -> None:
    url = nginx.url("big.safetensors", location="/slow/")
    with pytest.raises(ReadTimeoutError, match=message) as info:
        await read_all(HttpSource(url, retries=0), **limits)
    assert info.value.url == url


@pytest.mark.parametrize("location", ["/stall/", "/trickle/"])
async def test_stalled_server_times_out(nginx: NginxServer, location: str) -> None:
    """No answer at all (a silent upstream), or a body that stops after 16 KiB."""
    url = nginx.url("big.safetensors", location=location)
    with pytest.raises(ReadTimeoutError, match="timeout"):
        await read_all(HttpSource(url, retries=1, backoff=0.01), timeout=0.5)


async def test_stall_in_a_ranged_answer_reports_the_offset_in_the_file(
    nginx: NginxServer, root: Path
) -> None:
    header = await stream_st.read_header(root / "big.safetensors")
    start = header.data_start + header["t3"].start  # a ranged request from here stalls
    url = nginx.url("big.safetensors", location="/trickle/")
    with pytest.raises(ReadTimeoutError) as info:
        await read_all(HttpSource(url, retries=0), include=["t3"], timeout=0.5)
    assert info.value.position is not None
    assert start < info.value.position <= start + TRICKLE_AFTER


# ---------------------------------------------------------------- being fixed


async def test_asks_for_identity_encoding(nginx: NginxServer, root: Path) -> None:
    """Even where the caller asks for gzip: its bodies are read as the bytes of the file."""
    url = nginx.url("big.safetensors", location="/gzip/")
    assert_same_arrays(await read_all(url, include=["t1"]), {"t1": BIG["t1"]})
    source = HttpSource(url, headers={"Accept-Encoding": "gzip"})
    assert_same_arrays(await read_all(source, include=["t1"]), {"t1": BIG["t1"]})
    assert {r.accept_encoding for r in gets(nginx)} == {"identity"}


async def test_refuses_an_encoded_answer(nginx: NginxServer) -> None:
    """nginx labels a pre-compressed file ``Content-Encoding: gzip`` whatever was asked."""
    url = nginx.url("big.safetensors", location="/precompressed/")
    source = HttpSource(url)
    with pytest.raises(TransportError, match="Content-Encoding") as info:
        await stream_st.read_header(source)
    assert "\n" not in str(info.value)


def replace(path: Path, arrays: Arrays) -> None:
    """Put a new version of the file at ``path`` the way deployments do: written beside it, then
    renamed over it; its modification time differs by a minute, as nginx's ETag has seconds."""
    new = path.with_name(path.name + ".new")
    reference_numpy.save_file(arrays, str(new))
    later = path.stat().st_mtime + 60
    os.utime(new, (later, later))
    os.replace(new, path)


@pytest.fixture
def changing(root: Path) -> Iterator[Path]:
    """A copy of big.safetensors for a test to replace."""
    path = root / "changing.safetensors"
    shutil.copyfile(root / "big.safetensors", path)
    yield path
    path.unlink()


OTHER_SIZE = {**_random(1), "extra": np.ones(10)}


@pytest.mark.parametrize("new", [_random(1), OTHER_SIZE], ids=["same-size", "other-size"])
@pytest.mark.parametrize(
    ("options", "replaced_after"),
    [
        ({}, 0),
        ({"include": ["t1", "t3"]}, 0),
        ({"include": ["t1", "t3"]}, 1),
        ({"concurrency": 2}, 0),
        ({"concurrency": 2}, 1),
    ],
    ids=[
        "all-after-header",
        "include-after-header",
        "include-after-t1",
        "parallel-after-header",
        "parallel-after-t0",
    ],
)
async def test_file_replaced_mid_read(
    nginx: NginxServer,
    changing: Path,
    options: dict[str, Any],
    replaced_after: int,
    new: Arrays,
) -> None:
    """The header comes from the old file, which is replaced once ``replaced_after`` tensors are
    out; a later request that gets the new one must not be read on as the old. A read whose
    remaining bytes had all been fetched before the replacement delivers the old version whole."""
    concurrency = options.pop("concurrency", 1)
    source = HttpSource(nginx.url(changing.name), concurrency=concurrency, part_size=64 << 10)
    got: Arrays = {}
    try:
        async with stream_st.open_stream(source, **options) as stream:
            if replaced_after == 0:
                replace(changing, new)
            async for name, array in stream:
                got[name] = array
                if len(got) == replaced_after:
                    replace(changing, new)
    except SourceChangedError:
        return
    assert replaced_after > 0, "nothing was read before the replacement: it must be refused"
    assert_same_arrays(got, {name: BIG[name] for name in got})
    assert len(got) == len(options.get("include", BIG))


# ---------------------------------------------------------------- the forward proxy


@pytest.fixture
def proxy(forward_proxy: ForwardProxy) -> ForwardProxy:
    return forward_proxy


def test_proxy_forwards_plain_requests(proxy: ForwardProxy, nginx: NginxServer, root: Path) -> None:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({"http": proxy.url}))
    with opener.open(nginx.url("small.safetensors"), timeout=10) as answer:
        assert answer.read() == (root / "small.safetensors").read_bytes()


def test_proxy_tunnels_tls(proxy: ForwardProxy, nginx: NginxServer, root: Path) -> None:
    """A raw ``CONNECT`` to nginx's HTTPS port, then TLS and a ranged GET inside the tunnel."""
    authority = f"127.0.0.1:{nginx.tls_port}"
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as tunnel:
        tunnel.sendall(f"CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += tunnel.recv(1)  # exactly the proxy's answer: TLS starts after it
        assert re.match(rb"HTTP/1\.[01] 200 ", head), head
        with nginx.client_context().wrap_socket(tunnel, server_hostname="127.0.0.1") as tls:
            tls.sendall(
                b"GET /small.safetensors HTTP/1.1\r\nHost: %s\r\nRange: bytes=0-7\r\n"
                b"Connection: close\r\n\r\n" % authority.encode()
            )
            answer = b""
            while more := tls.recv(65536):
                answer += more
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 206 ")
    assert body == (root / "small.safetensors").read_bytes()[:8]
    assert f"CONNECT {authority}" in proxy.log()


# ---------------------------------------------------------------- the fixture's certificates


@pytest.mark.parametrize("maker", [certificates_by_cryptography, certificates_by_openssl])
def test_certificates_verify_strictly(
    tmp_path: Path, maker: Callable[[Path, Path, Path], None]
) -> None:
    if maker is certificates_by_openssl and shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    ca, cert, key = tmp_path / "ca.pem", tmp_path / "server.pem", tmp_path / "server.key"
    maker(ca, cert, key)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(ca))
    client.verify_flags |= ssl.VERIFY_X509_STRICT
    ours, theirs = socket.socketpair()
    serving = threading.Thread(target=lambda: server.wrap_socket(theirs, server_side=True).close())
    serving.start()
    with client.wrap_socket(ours, server_hostname="127.0.0.1") as verified:
        certificate = verified.getpeercert()
        assert certificate is not None
        assert ("IP Address", "127.0.0.1") in certificate["subjectAltName"]
    serving.join()
