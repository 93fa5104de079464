"""A real HTTP/1.1 server on 127.0.0.1 for tests and benchmarks: Range, uploads, faults.

It serves in-memory objects (``server.objects[path] = data``) over blocking sockets, one thread
per connection, with keep-alive. What it honours:

* ``GET``/``HEAD`` with a single ``Range: bytes=a-b`` / ``bytes=a-`` / ``bytes=-n`` (206 with
  ``Content-Range``; 416 when unsatisfiable), else 200 with ``Content-Length``;
* ``PUT``/``POST`` with ``Content-Length`` or chunked bodies: the body is stored (201), or with
  ``?reject`` answered 500 after reading it;

and, per server, faults and shaping: ``no_range`` (ignore Range: always 200), ``chunked``
(send 200 bodies chunked, without length), ``status_for[path] = code`` (answer that status, with
the ``status_body`` ``(content type, bytes)`` if set), ``fail_first`` (answer the first that many
GETs with ``fail_status``, 503 by default, and a ``Retry-After: retry_after`` if set),
``close_after`` (close the connection after that many body bytes; only once with
``close_once``), ``stall_after`` (stop sending after that many body bytes, keep the connection
open), ``latency`` (seconds before each response), ``rate`` (bytes per second per connection).

What real servers, CDNs and object stores do: ``redirects[path] = url`` (answer GETs with a
``redirect_status``, 302 by default, to ``url``), validators (``etag`` "strong" or "weak",
``last_modified``; each object has a version, counted from 0) honoured in ``If-Match``,
``If-Unmodified-Since`` (412), ``If-None-Match`` (304) and ``If-Range`` (a stale one gets the
whole new object, 200) unless ``conditionals`` is False, ``replace_after[path] = (n, data)``
(the object is replaced by ``data``, a new version, after n GETs of it; with
``unvalidated_new`` answers about a replaced object carry no validator), ``range_cap`` (a range
is answered with at most that many bytes, its ``Content-Range`` saying so), ``gzip`` ("asked":
a request whose ``Accept-Encoding`` names gzip gets the whole object gzip-compressed, like
nginx's ``gzip on``; "always": every 200 or 206 body is sent compressed, labelled
``Content-Encoding: gzip``).

Each request is logged in ``requests`` as ``(method, path, range header, body bytes sent)``,
and its headers (lower-case names) in ``headers_seen`` as ``(method, path, headers)``.

Run standalone (for benchmarks):
``python -m tests.servers.http_server FILE [--latency S] [--rate B/S]``
serves FILE at ``/FILE-NAME`` and prints the port.
"""

from __future__ import annotations

import argparse
import contextlib
import email.utils
import gzip as gzip_codec
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
    304: "Not Modified",
    301: "Moved Permanently",
    302: "Found",
    307: "Temporary Redirect",
    403: "Forbidden",
    404: "Not Found",
    412: "Precondition Failed",
    416: "Range Not Satisfiable",
    429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_EPOCH = 1_700_000_000  # Last-Modified of version 0 of every object; each version 10 s later


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
    status_body: tuple[str, bytes] | None = None
    fail_first: int = 0
    fail_status: int = 503
    retry_after: str | None = None
    redirects: dict[str, str] = field(default_factory=dict)
    redirect_status: int = 302
    etag: str = ""
    last_modified: bool = False
    conditionals: bool = True
    unvalidated_new: bool = False
    range_cap: int | None = None
    replace_after: dict[str, tuple[int, bytes]] = field(default_factory=dict)
    gzip: str = ""
    close_after: int | None = None
    close_once: bool = False
    stall_after: int | None = None
    latency: float = 0.0
    rate: float | None = None
    requests: list[tuple[str, str, str, int]] = field(default_factory=list)
    headers_seen: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 0

    def __post_init__(self) -> None:
        self._sock: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._busy = 0  # requests being answered right now
        self._versions: dict[str, int] = {}
        self._gets: dict[str, int] = {}

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
        self.headers_seen.append((method, path, headers))
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
        extra: dict[str, str] = {}
        with self._lock:  # a thread per connection: exactly fail_first GETs fail, in any order
            failing = self.fail_first > 0
            if failing:
                self.fail_first -= 1
        if failing:
            status = self.fail_status
            if self.retry_after is not None:
                extra["Retry-After"] = self.retry_after
        if path in self.redirects and status is None:
            status = self.redirect_status
            extra["Location"] = self.redirects[path]
        data = self._version_of(path)
        if status is None and data is None:
            status = 404
        if status is None:
            extra = self._validators(path)
            if not self._preconditions_hold(headers, extra):
                status = 412
            elif self._not_modified(headers, extra):
                self.requests.append((method, path, headers.get("range", ""), 0))
                self._send_head(connection, 304, extra)
                return True
        if status is not None:
            content_type, message = "text/plain", f"status {status} for {path}".encode()
            if self.status_body is not None and path in self.status_for:
                content_type, message = self.status_body
            self.requests.append((method, path, headers.get("range", ""), 0))
            extra.update({"Content-Type": content_type, "Content-Length": str(len(message))})
            self._send_head(connection, status, extra)
            if method != "HEAD":  # an answer to HEAD has no body, whatever its status
                connection.sendall(message)
            return True
        assert data is not None
        if self.gzip == "always" or (
            self.gzip == "asked" and "gzip" in headers.get("accept-encoding", "")
        ):
            data = gzip_codec.compress(bytes(data))
            extra["Content-Encoding"] = "gzip"
        size = len(data)
        start, end, code = 0, size, 200
        range_header = headers.get("range", "")
        if self.gzip == "asked" and "Content-Encoding" in extra:
            range_header = ""  # like nginx: a compressed answer is the whole object
        if not self._if_range_holds(headers, extra):
            range_header = ""
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
            if self.range_cap is not None:  # as some servers: at most so much of a range
                end = min(end, start + self.range_cap)
        extra["Accept-Ranges"] = "none" if self.no_range else "bytes"
        if code == 206:
            extra["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        chunked = self.chunked and code == 200
        if chunked:
            extra["Transfer-Encoding"] = "chunked"
        else:
            extra["Content-Length"] = str(end - start)
        if method == "HEAD":
            self.requests.append((method, path, range_header, 0))
            self._send_head(connection, code, extra)
            return True
        # Logged in the order requests arrive: a client may read an answer and send its next
        # request before this thread gets to log the first (a loaded machine).
        entry = (method, path, range_header, 0)
        self.requests.append(entry)
        self._send_head(connection, code, extra)
        sent = self._send_body(connection, memoryview(data)[start:end], chunked)
        with self._lock:
            for i in range(len(self.requests) - 1, -1, -1):
                if self.requests[i] is entry:
                    self.requests[i] = (method, path, range_header, sent)
                    break
        return sent == end - start

    def _version_of(self, path: str) -> Any:
        """The object at ``path`` now (None if there is none), replacing it when it is due."""
        with self._lock:
            if self.objects.get(path) is not None:
                self._gets[path] = count = self._gets.get(path, 0) + 1
                due, data = self.replace_after.get(path, (0, None))
                if data is not None and count > due:
                    del self.replace_after[path]
                    self.objects[path] = data
                    self._versions[path] = self._versions.get(path, 0) + 1
            return self.objects.get(path)

    def _validators(self, path: str) -> dict[str, str]:
        """The ETag and Last-Modified headers of the object at ``path``, as configured."""
        version = self._versions.get(path, 0)
        headers: dict[str, str] = {}
        if self.unvalidated_new and version:
            return headers
        if self.etag:
            headers["ETag"] = f'{"W/" if self.etag == "weak" else ""}"v{version}"'
        if self.last_modified:
            moment = _EPOCH + 10 * version
            headers["Last-Modified"] = email.utils.formatdate(moment, usegmt=True)
        return headers

    def _preconditions_hold(self, headers: dict[str, str], validators: dict[str, str]) -> bool:
        """False when ``If-Match`` or ``If-Unmodified-Since`` rules the request out (412)."""
        if not self.conditionals:
            return True
        etag = validators.get("ETag", "")
        wanted = headers.get("if-match")
        if wanted not in (None, "*") and (
            etag.startswith("W/") or etag not in {v.strip() for v in str(wanted).split(",")}
        ):
            return False
        since = headers.get("if-unmodified-since")
        modified = validators.get("Last-Modified")
        if since is not None and modified is not None:
            limit = email.utils.parsedate_to_datetime(since)
            return email.utils.parsedate_to_datetime(modified) <= limit
        return True

    def _not_modified(self, headers: dict[str, str], validators: dict[str, str]) -> bool:
        """True when ``If-None-Match`` names the object's ETag (weak comparison): 304."""
        wanted = headers.get("if-none-match")
        etag = validators.get("ETag", "")
        if wanted is None or not etag or not self.conditionals:
            return False
        tags = {v.strip().removeprefix("W/") for v in wanted.split(",")}
        return "*" in tags or etag.removeprefix("W/") in tags

    def _if_range_holds(self, headers: dict[str, str], validators: dict[str, str]) -> bool:
        """False when an ``If-Range`` names another version: the whole object is sent."""
        wanted = headers.get("if-range")
        if wanted is None or not self.conditionals:
            return True
        etag = validators.get("ETag", "")
        return wanted in (etag, validators.get("Last-Modified")) and not wanted.startswith("W/")

    def _send_head(self, connection: socket.socket, status: int, headers: dict[str, str]) -> None:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        connection.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))

    def _send_body(self, connection: socket.socket, body: memoryview, chunked: bool) -> int:
        limit = len(body)
        with self._lock:  # a thread per connection: with close_once, one answer only is cut
            close_after = self.close_after
            if self.close_once and close_after is not None and close_after < limit:
                self.close_after = None
        for cut in (close_after, self.stall_after):
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
