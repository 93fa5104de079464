"""``stream_st.serving`` / ``stream-st serve``: a file, a sharded checkpoint or tensors in memory
served over HTTP on 127.0.0.1 as one safetensors object, read back through real sockets by a
plain HTTP client (``http.client``) and by stream_st's readers."""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import http.client
import json
import logging
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.to_thread
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st.server.app import Server
from stream_st.server.conditions import UNSATISFIABLE, Answer, answer, byte_range, etags
from stream_st.tools import cp

from ._cli import COMMAND

pytest.importorskip("aiohttp")

TOKEN = "s3cr3t-t0ken-for-tests"


def tensors() -> dict[str, np.ndarray[Any, Any]]:
    """A few tensors of mixed dtypes and sizes (one empty)."""
    rng = np.random.default_rng(7)
    return {
        "embed.weight": rng.standard_normal((64, 32)).astype(np.float32),
        "layers.0.bias": np.arange(7, dtype=np.float16),
        "layers.0.mask": rng.integers(0, 2, (5, 3)).astype(np.bool_),
        "layers.1.index": np.arange(33, dtype=np.int64),
        "scale": np.array(0.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.int8),
    }


def fetch(
    url: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One request on a fresh connection: status, headers (lower-case names), body."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=30)
    try:
        connection.request(method, parts.path or "/", headers=headers or {})
        response = connection.getresponse()
        body = response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, body
    finally:
        connection.close()


async def afetch(
    url: str, method: str = "GET", headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    return await anyio.to_thread.run_sync(fetch, url, method, headers)


async def check_ranges(url: str, expected: bytes, count: int = 40) -> None:
    """Random ranges of every form, and the whole, equal to ``expected``'s bytes."""
    status, headers, body = await afetch(url)
    assert (status, body) == (200, expected)
    assert headers["accept-ranges"] == "bytes"
    assert headers["content-length"] == str(len(expected))
    size = len(expected)
    rng = random.Random(size)
    for _ in range(count):
        a, b = sorted(rng.randrange(size) for _ in range(2))
        form = rng.choice(["a-b", "a-", "-n"])
        value, lo, hi = {
            "a-b": (f"bytes={a}-{b}", a, b + 1),
            "a-": (f"bytes={a}-", a, size),
            "-n": (f"bytes=-{b + 1}", size - b - 1, size),
        }[form]
        status, headers, body = await afetch(url, headers={"Range": value})
        assert status == 206, value
        assert headers["content-range"] == f"bytes {lo}-{hi - 1}/{size}"
        assert body == expected[lo:hi], value


def write_sharded(folder: Path, parts: list[dict[str, np.ndarray[Any, Any]]]) -> Path:
    """Shards written by the reference and their index; the index's path."""
    weight_map = {}
    for number, part in enumerate(parts, 1):
        shard = f"model-{number:05d}-of-{len(parts):05d}.safetensors"
        reference_numpy.save_file(part, str(folder / shard), metadata={"format": "np"})
        weight_map.update(dict.fromkeys(part, shard))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


# ---------------------------------------------------------------- the object and its bytes


async def test_a_file_is_served_as_it_is(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    reference_numpy.save_file(tensors(), str(path), metadata={"kind": "test"})
    async with stream_st.serving(path) as server:
        assert server.url.endswith("/model.safetensors")
        await check_ranges(server.url, path.read_bytes())
        loaded = await stream_st.load(server.url)
    assert sorted(loaded) == sorted(tensors())
    for name, array in tensors().items():
        np.testing.assert_array_equal(loaded[name], array)


async def test_tensors_in_memory_are_the_reference_writers_file(tmp_path: Path) -> None:
    async with stream_st.serving(tensors(), checksums=False, name="kv") as server:
        assert server.path == "/kv.safetensors"
        await check_ranges(server.url, reference_numpy.save(tensors()))
    async with stream_st.serving(tensors(), metadata={"step": "3"}) as server:
        recorded = server.header.metadata
        assert recorded["stream_st.digest"] == "xxh3-128"
        assert recorded["step"] == "3"
        saved = tmp_path / "saved.safetensors"  # as save() writes them, digests and all
        await stream_st.save(saved, tensors(), metadata={"step": "3"}, checksums=True)
        await check_ranges(server.url, saved.read_bytes())
        async with stream_st.serving(tensors(), metadata={"step": "3"}) as again:
            assert again.etag == server.etag  # the same tensors with digests: the same ETag


async def test_a_name_with_url_characters_is_served_at_its_url() -> None:
    for name in ("a b#c", "a?b", "a%41"):
        async with stream_st.serving(tensors(), checksums=False, name=name) as server:
            assert server.path == f"/{name}.safetensors"
            assert set(await stream_st.load(server.url)) == set(tensors())


async def test_a_sharded_checkpoint_is_served_as_its_merged_file(tmp_path: Path) -> None:
    everything = tensors()
    names = sorted(everything)
    parts = [{n: everything[n] for n in names[:3]}, {n: everything[n] for n in names[3:]}]
    index = write_sharded(tmp_path, parts)
    merged = tmp_path / "merged.safetensors"
    await cp(str(index), str(merged))
    async with stream_st.serving(tmp_path) as server:  # the directory: its index
        assert server.path == "/model.safetensors"
        expected = merged.read_bytes()
        await check_ranges(server.url, expected, count=60)
        # one range over the header, both shards' data and the end
        status, _, body = await afetch(server.url, headers={"Range": "bytes=10-"})
        assert (status, body) == (206, expected[10:])
        loaded = await stream_st.load(server.url)
    assert sorted(loaded) == names
    for name in names:
        np.testing.assert_array_equal(loaded[name], everything[name])


async def test_head_conditions_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    size = path.stat().st_size
    async with stream_st.serving(path) as server:
        url, etag = server.url, server.etag
        assert etag.startswith('"') and not etag.startswith('W/"')
        status, headers, body = await afetch(url, "HEAD")
        assert (status, body, headers["content-length"], headers["etag"]) == (
            200,
            b"",
            str(size),
            etag,
        )
        for unsatisfiable in (f"bytes={size}-", f"bytes={size + 5}-{size + 9}", "bytes=-0"):
            status, headers, _ = await afetch(url, headers={"Range": unsatisfiable})
            assert (status, headers["accept-ranges"]) == (416, "bytes"), unsatisfiable
            assert headers["content-range"] == f"bytes */{size}"
        status, headers, body = await afetch(url, headers={"If-None-Match": f'"x", {etag}'})
        assert (status, body, headers["accept-ranges"]) == (304, b"", "bytes")
        assert "content-length" not in headers  # a 304 has none (RFC 9110), as the manual says
        status, _, body = await afetch(url, headers={"If-None-Match": '"other"'})
        assert status == 200 and len(body) == size
        status, headers, _ = await afetch(url, headers={"If-Match": '"other"'})
        assert (status, headers["accept-ranges"]) == (412, "bytes")
        status, _, body = await afetch(url, headers={"Range": "bytes=0-9", "If-Range": etag})
        assert (status, len(body)) == (206, 10)
        status, _, body = await afetch(url, headers={"Range": "bytes=0-9", "If-Range": '"old"'})
        assert (status, len(body)) == (200, size)
        base = url.rsplit("/", 1)[0]
        for other in ("/", "/other.safetensors", "/m.safetensors/x"):
            status, headers, _ = await afetch(base + other)
            assert (status, headers["accept-ranges"]) == (404, "bytes")  # it had none
        status, headers, _ = await afetch(url, "POST")
        assert (status, headers["allow"], headers["accept-ranges"]) == (405, "GET, HEAD", "bytes")


async def test_several_ranges_at_once_get_the_whole_object(tmp_path: Path) -> None:
    """No multipart/byteranges: a request for several ranges is answered 200 with the whole
    object, as RFC 9110 allows (no safetensors reader asks for several at once)."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    expected = path.read_bytes()
    async with stream_st.serving(path) as server:
        for several in ("bytes=0-9,20-29", "bytes=0-9, 5-15", "bytes=-5,0-1"):
            status, headers, body = await afetch(server.url, headers={"Range": several})
            assert (status, body) == (200, expected), several
            assert "content-range" not in headers, headers
            assert not headers.get("content-type", "").startswith("multipart/"), headers
            assert headers["content-length"] == str(len(expected))


def test_conditions_edge_cases() -> None:
    assert byte_range("bytes=0-0", 10) == (0, 1)
    assert byte_range("bytes=5-100", 10) == (5, 10)
    assert byte_range("bytes=-100", 10) == (0, 10)
    assert byte_range("BYTES = 2 - 3", 10) == (2, 4)
    assert byte_range("bytes=10-", 10) == UNSATISFIABLE
    assert byte_range("bytes=-0", 10) == UNSATISFIABLE
    huge = "9" * 5000  # beyond int()'s digit limit: ignored, not an error
    for ignored in (
        "bytes=5-2",
        "bytes=-",
        "items=0-1",
        "bytes=0-1,2-3",
        "bytes=a-b",
        "",
        f"bytes={huge}-",
        f"bytes=-{huge}",
        f"bytes=0-{huge}",
    ):
        assert byte_range(ignored, 10) is None, ignored[:40]
    assert etags('"a", W/"b"') == [(False, '"a"'), (True, '"b"')]
    assert etags(" * ") == "*"
    assert etags("a") is None
    assert answer("GET", 10, '"e"', if_match='W/"e"') == Answer(412)
    assert answer("GET", 10, '"e"', if_match="*") == Answer(200, 0, 10)
    assert answer("HEAD", 10, '"e"', if_none_match='W/"e"') == Answer(304)
    assert answer("HEAD", 10, '"e"', range_="bytes=0-1") == Answer(200, 0, 10)
    assert answer("GET", 10, '"e"', range_="bytes=0-1", if_range='W/"e"') == Answer(200, 0, 10)


# ---------------------------------------------------------------- readers, at once


async def test_four_replicas_load_at_once_and_checksums_are_verified() -> None:
    served = tensors()
    async with stream_st.serving(served) as server:
        loads = [stream_st.load(server.url) for _ in range(4)]
        results: list[dict[str, Any]] = [{} for _ in loads]
        async with anyio.create_task_group() as group:
            for slot, load in enumerate(loads):

                async def one(slot: int = slot, load: Any = load) -> None:
                    results[slot] = await load

                group.start_soon(one)
        for loaded in results:
            assert sorted(loaded) == sorted(served)
            for name, array in served.items():
                np.testing.assert_array_equal(loaded[name], array)
        # Digests were computed when serving began: a tensor changed in memory since is
        # caught by the reader, never delivered.
        served["embed.weight"][0, 0] += 1
        with pytest.raises(stream_st.IntegrityError, match=r"embed\.weight"):
            await stream_st.load(server.url)


async def test_a_files_own_digests_are_served_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "sums.safetensors"
    header = await stream_st.save(path, tensors(), checksums=True)
    data = bytearray(path.read_bytes())
    data[header.data_start + header["embed.weight"].start] ^= 0xFF
    path.write_bytes(data)
    async with stream_st.serving(path) as server:
        status, _, body = await afetch(server.url)
        assert (status, body) == (200, bytes(data))  # as it is
        with pytest.raises(stream_st.IntegrityError, match=r"embed\.weight"):
            await stream_st.load(server.url)
        assert (await stream_st.load(server.url, verify=False)).keys() == tensors().keys()
    plain = tmp_path / "plain.safetensors"
    reference_numpy.save_file(tensors(), str(plain))
    async with stream_st.serving(plain, checksums=True) as server:  # computed at start
        assert server.header.metadata["stream_st.digest"] == "xxh3-128"
        expected = await stream_st.load(str(plain))
        loaded = await stream_st.load(server.url)
        assert loaded.keys() == expected.keys()
    with pytest.raises(stream_st.IntegrityError, match=r"embed\.weight"):  # checked, not dropped
        async with stream_st.serving(path, checksums=False):
            pass
    await stream_st.save(path, tensors(), checksums=True)
    async with stream_st.serving(path, checksums=False) as server:  # dropped
        assert "stream_st.digest" not in server.header.metadata
        assert (await stream_st.load(server.url)).keys() == tensors().keys()


async def test_torch_readers_load_from_a_served_state_dict() -> None:
    torch = pytest.importorskip("torch")
    import stream_st.torch as st_torch

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    async with stream_st.serving(model.state_dict(), name="model") as server:
        loaded = await anyio.to_thread.run_sync(st_torch.load_file, server.url)
        replica = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
        missing, unexpected = await anyio.to_thread.run_sync(
            st_torch.load_model, replica, server.url
        )
    assert (missing, unexpected) == (set(), [])
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded[name], tensor)
        assert torch.equal(replica.state_dict()[name], tensor)


# ---------------------------------------------------------------- the token


async def test_a_bearer_token_is_asked_for_and_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    async with stream_st.serving(path, token=TOKEN) as server:
        assert TOKEN not in repr(server) and TOKEN not in str(vars(server))
        for given in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            status, headers, body = await afetch(server.url, headers=given)
            assert (status, headers["accept-ranges"]) == (401, "bytes"), given
            assert headers["www-authenticate"] == "Bearer"
            assert TOKEN.encode() not in body and TOKEN not in str(headers)
        status, headers, body = await afetch(
            server.url, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert (status, body) == (200, path.read_bytes())
        assert TOKEN not in str(headers)
        with pytest.raises(stream_st.HTTPStatusError) as refused:
            await stream_st.load(server.url)
        assert refused.value.status == 401 and TOKEN not in str(refused.value)
        bearer = {"Authorization": f"Bearer {TOKEN}"}
        loaded = await stream_st.load(server.url, headers=bearer)
        assert loaded.keys() == tensors().keys()
    with pytest.raises(stream_st.UsageError):
        async with stream_st.serving(path, token=""):
            pass


@pytest.mark.parametrize("token", ["s3cr\udce9t", "sécret", "two words", "tab\there", " pad"])
async def test_a_token_is_visible_ascii(tmp_path: Path, token: str) -> None:
    """A token of other characters is refused, never shown: one not UTF-8 (a byte of a Latin-1
    secret store, kept by Python as a surrogate) failed with UnicodeEncodeError, and one like
    'sécret' was never admitted from a client sending it as its header's Latin-1."""
    path = tmp_path / "model.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    with pytest.raises(stream_st.UsageError, match="the bearer token is") as refused:
        async with stream_st.serving(path, token=token):
            pass
    assert token.strip() not in str(refused.value)


@pytest.mark.parametrize("given", ["argument", "environment"])
def test_the_command_refuses_a_token_not_visible_ascii(tmp_path: Path, given: str) -> None:
    """``--token $'s3cr\\xe9t'`` (or the variable holding it) was an internal error (exit 3)
    that showed a character of the token."""
    path = tmp_path / "model.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    token = b"s3cr\xe9t"
    argv = [COMMAND.encode(), b"serve", bytes(path), b"--port", b"0"]
    env = {os.fsencode(k): os.fsencode(v) for k, v in os.environ.items()}
    if given == "argument":
        argv += [b"--token", token]
    else:
        env[b"STREAM_ST_SERVE_TOKEN"] = token
    result = subprocess.run(argv, capture_output=True, timeout=30, env=env)
    assert (result.returncode, result.stdout) == (2, b""), result.stderr
    assert b"not visible ASCII" in result.stderr and result.stderr.count(b"\n") == 1
    assert b"\xe9" not in result.stderr and b"s3cr" not in result.stderr


# ---------------------------------------------------------------- errors


async def test_bad_sources_a_taken_port_and_a_changed_file(tmp_path: Path) -> None:
    with pytest.raises(stream_st.SourceNotFoundError):
        async with stream_st.serving(tmp_path / "missing.safetensors"):
            pass
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file at all")
    with pytest.raises(stream_st.HeaderError):
        async with stream_st.serving(junk):
            pass
    with pytest.raises(stream_st.UsageError, match="URL"):
        async with stream_st.serving("http://example.com/m.safetensors"):
            pass
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(stream_st.TransportError, match="cannot listen"):
            async with stream_st.serving(path, port=port):
                pass
    async with stream_st.serving(path) as server:
        assert (await afetch(server.url))[0] == 200
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # modified since
        status, headers, body = await afetch(server.url)
        assert status == 409 and b"changed" in body and headers["accept-ranges"] == "bytes"
        with pytest.raises(stream_st.HTTPStatusError) as refused:
            await stream_st.load(server.url)
        assert refused.value.status == 409


SHORT_OF_DESCRIPTORS = """
import asyncio, logging, os, resource, sys
import stream_st

class Said503(logging.Handler):
    def emit(self, record):  # each 503 answered, as it goes out: a line the test waits for
        print("503", flush=True)

logging.getLogger("stream_st.serve").addHandler(Said503())

async def main(path):
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    async with stream_st.serving(path) as server:
        held = []
        try:
            while True:
                held.append(os.open(path, os.O_RDONLY))
        except OSError:
            os.close(held.pop())  # one descriptor free: a client's connection takes it
        loop = asyncio.get_running_loop()
        lines = asyncio.Queue()
        loop.add_reader(0, lambda: lines.put_nowait(os.read(0, 64)))
        print(server.url, flush=True)
        await lines.get()
        for fd in held:
            os.close(fd)
        print("released", flush=True)
        await lines.get()
        loop.remove_reader(0)

asyncio.run(main(sys.argv[1]))
"""


def test_a_server_short_of_descriptors_answers_503_before_any_byte(tmp_path: Path) -> None:
    """A server whose process has no descriptor free for the file answers 503 with Retry-After
    (and closes the connection, giving its descriptor back), where it sent 200 and its headers,
    then cut the body; a reader waits as asked and gets the object once descriptors are free."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    process = subprocess.Popen(
        [sys.executable, "-c", SHORT_OF_DESCRIPTORS, str(path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdin is not None and process.stdout is not None
    stdin, stdout = process.stdin, process.stdout
    lines: queue.Queue[str] = queue.Queue()  # the child's, read with a time limit: never a hang

    def pump() -> None:
        for line in stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    loading = concurrent.futures.ThreadPoolExecutor(1)
    try:
        url = lines.get(timeout=30).strip()
        assert url.startswith("http://"), url
        status, headers, body = fetch(url)
        assert status == 503 and headers["retry-after"] == "1", (status, headers)
        assert headers["connection"] == "close" and b"try again" in body
        assert lines.get(timeout=30) == "503\n"
        assert fetch(url, "HEAD")[0] == 200  # no file to open

        started = time.monotonic()
        loaded = loading.submit(stream_st.numpy.load_file, url)
        assert lines.get(timeout=30) == "503\n"  # the load's first request had its 503
        stdin.write("release\n")
        stdin.flush()
        while (line := lines.get(timeout=30)) == "503\n":
            pass  # a retry that came before the release was done (a loaded machine)
        assert line == "released\n"
        assert loaded.result(timeout=30).keys() == tensors().keys()
        assert time.monotonic() - started >= 0.9  # it waited as asked, then asked again
    finally:
        loading.shutdown(wait=False)
        stdin.close()
        process.wait(timeout=30)
    assert process.returncode == 0


def fetch_while(url: str, meanwhile: Any) -> bytes:
    """A GET whose answer is left whole in the socket's receive buffer (so the server has sent
    its last byte) while ``meanwhile()`` runs, and only then read: the body."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname or "", parts.port or 80), timeout=30) as sock:
        sock.sendall(f"GET {parts.path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(1)  # the head, and not a byte more
        length = int(data.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        deadline = time.monotonic() + 20
        while int.from_bytes(fcntl.ioctl(sock, termios.FIONREAD, bytes(4)), "little") < length:
            assert time.monotonic() < deadline, "the answer never arrived whole"
            time.sleep(0.01)
        meanwhile()
        body = b""
        while chunk := sock.recv(1 << 16):
            body += chunk
    return body


@pytest.mark.parametrize("how", ["rename", "truncate"])
async def test_a_file_replaced_after_its_answer_went_out_reaches_the_client_whole(
    tmp_path: Path, how: str
) -> None:
    """``sendfile`` queues the file's pages, not copies; a file replaced as the manual advises
    (a new file renamed over it) or truncated and rewritten leaves those pages as they were, so
    the answer still in the socket is the old file, whole (a write in place is not: see
    docs/serve.md)."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file({"a": np.zeros(32 << 10, np.uint8)}, str(path))
    old = path.read_bytes()
    new = old.replace(bytes(32 << 10), b"\x01" * (32 << 10))

    def replace() -> None:
        if how == "rename":
            (tmp_path / "new").write_bytes(new)
            os.replace(tmp_path / "new", path)
        else:
            path.write_bytes(new)  # opened "wb": truncated, then written

    async with stream_st.serving(path, checksums=False) as server:
        assert await anyio.to_thread.run_sync(fetch_while, server.url, replace) == old


# ---------------------------------------------------------------- clients gone, requests not HTTP


async def exchange(port: int, data: bytes) -> bytes:
    """``data`` sent on a fresh connection to 127.0.0.1:``port``, then what comes back until the
    server closes it."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    answer = b""
    async with stream:
        await stream.send(data)
        with contextlib.suppress(anyio.EndOfStream, anyio.BrokenResourceError):
            while True:
                answer += await stream.receive()
    return answer


def ask_and_leave(port: int, data: bytes) -> None:
    """``data`` sent on a fresh connection to 127.0.0.1:``port``, closed at once: the client is
    gone before its answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as client:
        client.sendall(data)


MALFORMED = (
    b"GET * HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nBad Header\r\n\r\n",
    b"GET /" + b"a" * 10000 + b" HTTP/1.1\r\n\r\n",
    b"GET /m.safetensors HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
    b"GET / HTTP/9.9\r\n\r\n",
)
"""Requests aiohttp cannot parse: a target that is not a path, a header line without a colon,
a request line over 8 KiB, a negative length, an HTTP version that does not exist."""


async def test_a_client_gone_before_its_answer_is_dropped_quietly(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client that asks for the object (GET or HEAD) and closes its connection at once is
    dropped without a word, where aiohttp logged "Error handling request" with a traceback at
    ERROR (the answer's headers written to a closed connection) as the request's handler
    ended: the log is looked at once both handlers have ended."""
    ended: list[str] = []
    both = anyio.Event()
    handle = Server._handle

    async def counted(self: Server, request: Any) -> Any:
        try:
            return await handle(self, request)
        finally:
            ended.append(request.method)
            if len(ended) == 2:
                both.set()

    monkeypatch.setattr(Server, "_handle", counted)
    async with stream_st.serving(tensors(), name="m") as server:
        for method in ("GET", "HEAD"):
            request = f"{method} {server.path} HTTP/1.1\r\nHost: x\r\n\r\n"
            ask_and_leave(server.port, request.encode())
        with anyio.fail_after(30):  # a hang guard
            await both.wait()
        assert sorted(ended) == ["GET", "HEAD"]
        assert (await afetch(server.url))[0] == 200
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_request_not_http_is_logged_in_one_line_and_real_errors_in_full(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request aiohttp cannot parse gets its 400 and one line in the server's log, at INFO,
    where it logged a traceback at ERROR (printed on ``stream-st serve``'s standard error); an
    error of the server's own still gets its traceback at ERROR."""
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    async with stream_st.serving(tensors(), name="m") as server:
        for data in MALFORMED:
            caplog.clear()
            answer = await exchange(server.port, data)
            assert answer.startswith(b"HTTP/1.0 400 Bad Request\r\n"), (data[:40], answer)
            said = [(r.levelno, r.exc_info, r.getMessage()) for r in caplog.records]
            assert len(said) == 1 and said[0][:2] == (logging.INFO, None), (data[:40], said)
            assert "\n" not in said[0][2] and "400" in said[0][2], said

        async def broken(*_: object) -> None:
            raise RuntimeError("a bug of the server's")

        monkeypatch.setattr("stream_st.server.app.Server._answer", broken)
        caplog.clear()
        assert (await afetch(server.url))[0] == 500
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None
    assert isinstance(record.exc_info[1], RuntimeError)


async def test_a_request_for_no_path_is_answered_as_every_other() -> None:
    """``CONNECT host:port`` (a host, no path) and ``OPTIONS *`` are asked for the token (401),
    and with it refused as other methods and paths are (405, 404), with ``Accept-Ranges``, where
    aiohttp's router answered its own 404 without looking at the token."""
    async with stream_st.serving(tensors(), name="m", token=TOKEN) as server:
        for target, refused in (("CONNECT x:443", 405), ("OPTIONS *", 404)):
            for given, status in (("", 401), (f"Authorization: Bearer {TOKEN}\r\n", refused)):
                request = f"{target} HTTP/1.1\r\nHost: x\r\n{given}Connection: close\r\n\r\n"
                answer = await exchange(server.port, request.encode())
                head = answer.partition(b"\r\n\r\n")[0].decode().lower().split("\r\n")
                assert head[0].startswith(f"http/1.1 {status} "), (target, given, head)
                assert "accept-ranges: bytes" in head, (target, head)
                expected = {401: "www-authenticate: bearer", 405: "allow: get, head"}
                assert status == 404 or expected[status] in head, (target, head)


# ---------------------------------------------------------------- the command


@contextlib.contextmanager
def command_serving(path: Path, **env: str) -> Iterator[subprocess.Popen[str]]:
    """``stream-st serve PATH --port 0`` running (``env`` added to its environment), killed
    on the way out if still running; the caller ends it with a signal and ``communicate()``."""
    process = subprocess.Popen(
        [COMMAND, "serve", str(path), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def sockets(pid: int) -> int:
    """How many sockets process ``pid`` holds (``/proc``)."""
    held = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            held += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return held


def done_with_every_connection(pid: int, port: int, idle: int) -> bool:
    """Whether the server ``pid`` has taken every connection made to its ``port`` (the
    listening socket's queue is empty: ``/proc/net/tcp``), then closed each (it holds no more
    sockets than ``idle``, its count before them): aiohttp closes a connection once it has
    logged what its request raised."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table][1:]
    listening = [row for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A"]
    return all(row[4].endswith(":00000000") for row in listening) and sockets(pid) <= idle


def test_the_command_serves_until_sigterm(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    with command_serving(path, STREAM_ST_SERVE_TOKEN=TOKEN) as process:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert line.startswith("serving http://127.0.0.1:"), line
        assert "token required" in line and TOKEN not in line
        url = line.split()[1]
        assert fetch(url)[0] == 401
        loaded = stream_st.numpy.load_file(url, headers={"Authorization": f"Bearer {TOKEN}"})
        assert loaded.keys() == tensors().keys()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in err
    assert TOKEN not in out + err


def test_the_command_prints_no_traceback_for_a_client(tmp_path: Path) -> None:
    """``stream-st serve``'s standard error stays free of tracebacks for what a client does: a
    request the client leaves before its answer, requests aiohttp cannot parse; looked at once
    the server has taken and closed every connection of theirs."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    with command_serving(path) as process:
        assert process.stdout is not None
        url = process.stdout.readline().split()[1]
        port = urlsplit(url).port
        assert port is not None
        idle = sockets(process.pid)
        for data in (b"HEAD /m.safetensors HTTP/1.1\r\nHost: x\r\n\r\n", *MALFORMED):
            ask_and_leave(port, data)  # gone before the answer, or before its 400
        deadline = time.monotonic() + 30  # a hang guard
        while not done_with_every_connection(process.pid, port, idle):
            assert time.monotonic() < deadline, "the server still holds a client's connection"
            time.sleep(0.01)
        assert fetch(url)[0] == 200
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=30)
    assert "Traceback" not in err and "Error handling request" not in err, err


def test_import_stream_st_does_not_import_aiohttp() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, stream_st; stream_st.serving; print('aiohttp' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.stdout.strip() == "False", done.stderr


async def test_a_range_sent_on_two_lines_asks_for_several_ranges(tmp_path: Path) -> None:
    """Two ``Range`` lines are one field of two ranges (RFC 9110 combines a field sent twice):
    answered whole, as several ranges on one line are, where the first line alone gave a 206
    for it and dropped the other unsaid."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file(tensors(), str(path))
    expected = path.read_bytes()
    async with stream_st.serving(path) as server:
        host, port = server.url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        stream = await anyio.connect_tcp(host, int(port))
        async with stream:
            await stream.send(
                f"GET /{server.url.split('/', 3)[3]} HTTP/1.1\r\nHost: {host}\r\n"
                "Range: bytes=0-3\r\nRange: bytes=5-9\r\nConnection: close\r\n\r\n".encode()
            )
            answer = b""
            with contextlib.suppress(anyio.EndOfStream):
                while True:
                    answer += await stream.receive()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 200 OK", head
    assert body == expected
