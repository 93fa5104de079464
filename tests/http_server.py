"""A real HTTP/1.1 server on 127.0.0.1 for tests and benchmarks: Range, uploads, faults.

It serves in-memory objects (``server.objects[path] = data``) over blocking sockets, one thread
per connection, with keep-alive. What it honours:

* ``GET``/``HEAD`` with a single ``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` (206 with
  ``Content-Range``; 416 when unsatisfiable), else 200 with ``Content-Length``;
* ``PUT``/``POST`` with ``Content-Length`` or chunked bodies: the body is stored (201), or with
  ``?reject`` answered 500 after reading it;

and, per server, faults and shaping: ``no_range`` (ignore Range: always 200), ``chunked``
(send 200 bodies chunked, without length), ``status_for[path] = code`` (answer that status),
``fail_first`` (answer the first that many GETs with 503), ``close_after`` (close the
connection after that many body bytes; only once with ``close_once``), ``stall_after`` (stop sending
after that many body bytes, keep the connection open), ``latency`` (seconds before each
response), ``rate`` (bytes per second per connection). Each request is logged in ``requests`` as
``(method, path, range header, body bytes sent)``.

Run standalone (for benchmarks): ``python -m tests.http_server FILE [--latency S] [--rate B/S]``
serves FILE at ``/FILE-NAME`` and prints the port.
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_RANGE = re.compile(r"bytes=(\d*)-(\d*)")
_REASONS = {
    200: "OK",
    201: "Created",
    206: "Partial Content",
    403: "Forbidden",
    404: "Not Found",
    416: "Range Not Satisfiable",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class Link:
    """Paces a sender to ``rate`` bytes/s like a network link: time lost while the receiver was
    not reading is lost, not made up afterwards by a burst above the rate."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._free_at = time.perf_counter()

    def wait(self, count: int) -> None:
        """Call before sending ``count`` bytes: sleeps until the link is free, then books it."""
        now = time.perf_counter()
        if self._free_at > now:
            time.sleep(self._free_at - now)
            now = self._free_at
        self._free_at = now + count / self.rate


@dataclass
class RangeHTTPServer:
    """See the module docstring. Use as a context manager, or ``start()`` / ``stop()``."""

    objects: dict[str, Any] = field(default_factory=dict)
    no_range: bool = False
    chunked: bool = False
    status_for: dict[str, int] = field(default_factory=dict)
    fail_first: int = 0
    close_after: int | None = None
    close_once: bool = False
    stall_after: int | None = None
    latency: float = 0.0
    rate: float | None = None
    requests: list[tuple[str, str, str, int]] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._busy = 0  # requests being answered right now

    def settle(self, timeout: float = 2.0) -> None:
        """Wait until no request is being answered, so ``requests`` is complete."""
        deadline = time.monotonic() + timeout
        while self._busy and time.monotonic() < deadline:
            time.sleep(0.005)

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"

    def start(self) -> RangeHTTPServer:
        self._sock = socket.create_server((self.host, self.port), backlog=64)
        self.port = self._sock.getsockname()[1]
        thread = threading.Thread(target=self._accept_loop, daemon=True)
        thread.start()
        self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._sock is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
                self._sock.shutdown(socket.SHUT_RDWR)
            self._sock.close()
        with self._lock:
            for connection in list(self._connections):
                with contextlib.suppress(OSError):
                    connection.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join(timeout=5)

    def __enter__(self) -> RangeHTTPServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while not self._stopping.is_set():
            try:
                connection, _ = self._sock.accept()
            except OSError:
                return
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._connections.add(connection)
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self, connection: socket.socket) -> None:
        reader = connection.makefile("rb")
        try:
            while not self._stopping.is_set():
                request_line = reader.readline(65536)
                if not request_line:
                    return
                method, target, _ = request_line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while True:
                    line = reader.readline(65536).decode("latin-1").rstrip("\r\n")
                    if not line:
                        break
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
                with self._lock:
                    self._busy += 1
                try:
                    if not self._answer(connection, reader, method, target, headers):
                        return
                finally:
                    with self._lock:
                        self._busy -= 1
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                self._connections.discard(connection)
            reader.close()
            connection.close()

    def _read_body(self, reader: Any, headers: dict[str, str]) -> bytes | None:
        """The request body, or None when the client stopped before its end."""
        if "chunked" in headers.get("transfer-encoding", ""):
            body = bytearray()
            while True:
                line = reader.readline()
                if not line.strip():
                    return None
                size = int(line.split(b";")[0].strip(), 16)
                if size == 0:
                    while reader.readline() not in (b"\r\n", b""):
                        pass
                    return bytes(body)
                piece = reader.read(size)
                if len(piece) < size:
                    return None
                body += piece
                reader.readline()
        length = int(headers.get("content-length", "0"))
        data = reader.read(length)
        return bytes(data) if len(data) == length else None

    def _answer(
        self,
        connection: socket.socket,
        reader: Any,
        method: str,
        target: str,
        headers: dict[str, str],
    ) -> bool:
        path, _, query = target.partition("?")
        if self.latency:
            time.sleep(self.latency)
        if method in ("PUT", "POST"):
            body = self._read_body(reader, headers)
            self.requests.append((method, path, "", 0))
            if body is None:  # an incomplete upload is never stored
                return False
            if "reject" in query:
                self._send_head(connection, 500, {"Content-Length": "0"})
                return True
            self.objects[path] = body
            self._send_head(connection, 201, {"Content-Length": "0"})
            return True
        status = self.status_for.get(path)
        if self.fail_first > 0:
            self.fail_first -= 1
            status = 503
        data = self.objects.get(path)
        if status is None and data is None:
            status = 404
        if status is not None:
            message = f"status {status} for {path}".encode()
            self.requests.append((method, path, headers.get("range", ""), 0))
            self._send_head(connection, status, {"Content-Length": str(len(message))})
            connection.sendall(message)
            return True
        assert data is not None
        size = len(data)
        start, end, code = 0, size, 200
        range_header = headers.get("range", "")
        match = _RANGE.fullmatch(range_header) if range_header and not self.no_range else None
        if match:
            first, last = match.groups()
            if first:
                start = int(first)
                end = min(size, int(last) + 1) if last else size
            elif last:
                start = max(0, size - int(last))
            if start >= size or start >= end:
                self.requests.append((method, path, range_header, 0))
                self._send_head(
                    connection, 416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"}
                )
                return True
            code = 206
        extra = {"Accept-Ranges": "none" if self.no_range else "bytes"}
        if code == 206:
            extra["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        chunked = self.chunked and code == 200
        if chunked:
            extra["Transfer-Encoding"] = "chunked"
        else:
            extra["Content-Length"] = str(end - start)
        self._send_head(connection, code, extra)
        if method == "HEAD":
            self.requests.append((method, path, range_header, 0))
            return True
        sent = self._send_body(connection, memoryview(data)[start:end], chunked)
        self.requests.append((method, path, range_header, sent))
        return sent == end - start

    def _send_head(self, connection: socket.socket, status: int, headers: dict[str, str]) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def _send_body(self, connection: socket.socket, body: memoryview, chunked: bool) -> int:
        limit = len(body)
        for cut in (self.close_after, self.stall_after):
            if cut is not None:
                limit = min(limit, cut)
        piece = 1 << 20 if self.rate is None else max(4096, int(self.rate / 100))
        link = None if self.rate is None else Link(self.rate)
        sent = 0
        while sent < limit:
            part = body[sent : min(limit, sent + piece)]
            if link is not None:
                link.wait(len(part))
            if chunked:
                connection.sendall(f"{len(part):x}\r\n".encode())
            connection.sendall(part)
            if chunked:
                connection.sendall(b"\r\n")
            sent += len(part)
        if sent < len(body):
            if self.close_once:
                self.close_after = None
            if self.stall_after is not None:
                self._stopping.wait()
            return sent
        if chunked:
            connection.sendall(b"0\r\n\r\n")
        return sent


def main() -> None:
    parser = argparse.ArgumentParser(description="Serve one file over HTTP with Range support.")
    parser.add_argument("file", type=Path)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--rate", type=float, default=None, help="bytes/s per connection")
    args = parser.parse_args()
    with args.file.open("rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    server = RangeHTTPServer(
        objects={"/" + args.file.name: data}, latency=args.latency, rate=args.rate
    ).start()
    print(server.port, flush=True)
    try:
        sys.stdin.read()  # serve until stdin closes
    finally:
        server.stop()


if __name__ == "__main__":
    main()
