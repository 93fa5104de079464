"""An HTTP-aware proxy on 127.0.0.1 that forwards requests to a real server and can lose answers.

    with LossyProxy(upstream_port) as proxy:
        proxy.lose("POST", r"^uploads", "reset")  # the next CreateMultipartUpload
        proxy.url                                 # http://127.0.0.1:PORT, in place of the server's

Each client connection carries one request; every answer passed on says ``Connection: close``.
A rule matches a request by method and a regular expression searched in its query string, for the
next ``times`` matching requests (``None``: all of them). What happens to a matching request:

* ``"reset"`` / ``"close"``: it reaches the server, whose answer is replaced by a TCP reset or an
  orderly close: the client cannot know what the server did;
* ``"stall"``: it reaches the server, and the client gets no answer until it gives up (its
  method and target are then logged in ``given_up``) or ``hold`` seconds pass (then a TCP reset);
* ``"refuse"``: a TCP reset, and the server never sees the request;
* raw bytes: the client gets these instead of an answer, and the server never sees the request;
  with ``forward=True`` it does, and its answer is dropped.

``requests`` logs ``(method, target, action)`` for each request once the server has answered it
(at once for the actions that do not forward it), the action being ``"pass"`` when no rule
matched (raw bytes are logged as their ``str``).
"""

from __future__ import annotations

import re
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ._loopback import LoopbackServer

_LENGTH = re.compile(rb"\r\ncontent-length:\s*(\d+)", re.IGNORECASE)


@dataclass
class _Rule:
    method: str
    query: re.Pattern[str]
    action: str | bytes
    times: int | None
    forward: bool


def _read_message(connection: socket.socket, *, answer: bool) -> bytes:
    """One HTTP message: its head and ``Content-Length`` body; without one, no body for a
    request and everything until the peer closes for an ``answer``."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = connection.recv(65536)
        if not more:
            return data
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    match = _LENGTH.search(head)
    if match is None and not answer:
        return head + b"\r\n\r\n"
    while match is None or len(body) < int(match[1]):
        more = connection.recv(1 << 20)
        if not more:
            break
        body += more
    return head + b"\r\n\r\n" + body


def _reset(connection: socket.socket) -> None:
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    connection.close()


class LossyProxy(LoopbackServer):
    """See the module docstring. Use as a context manager."""

    def __init__(self, upstream_port: int, *, hold: float = 10.0) -> None:
        self.upstream_port = upstream_port
        self.hold = hold
        self.requests: list[tuple[str, str, str]] = []
        self.given_up: list[tuple[str, str]] = []
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._logged = threading.Condition(self._lock)
        self._stopping = threading.Event()
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def lose(
        self,
        method: str,
        query: str,
        action: str | bytes = "reset",
        *,
        times: int | None = 1,
        forward: bool = False,
    ) -> None:
        """Apply ``action`` to the next ``times`` ``method`` requests whose query has ``query``."""
        with self._lock:
            self._rules.append(_Rule(method, re.compile(query), action, times, forward))

    def _match(self, method: str, query: str) -> _Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.method == method and rule.query.search(query):
                    if rule.times is not None:
                        rule.times -= 1
                        if rule.times == 0:
                            self._rules.remove(rule)
                    return rule
        return None

    def wait_for(
        self, method: str, query: str, *, given_up: bool = False, timeout: float = 30.0
    ) -> None:
        """Block until a ``method`` request whose query has ``query`` is logged in ``requests``
        (in ``given_up`` with ``given_up=True``)."""

        def seen() -> bool:
            log = self.given_up if given_up else self.requests
            return any(
                entry[0] == method and re.search(query, entry[1].partition("?")[2]) for entry in log
            )

        with self._logged:
            if not self._logged.wait_for(seen, timeout):
                raise TimeoutError(f"no {method} request with {query!r} within {timeout} s")

    def __enter__(self) -> LossyProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self.stop()

    def handle(self, connection: socket.socket) -> None:
        request = _read_message(connection, answer=False)
        if not request:
            return
        method, target, _ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
        rule = self._match(method, target.partition("?")[2])
        action = "pass" if rule is None else rule.action
        silent = rule is not None and (
            action == "refuse" or (isinstance(action, bytes) and not rule.forward)
        )
        answer = b"" if silent else self._forward(request)
        with self._logged:
            self.requests.append((method, target, str(action)))
            self._logged.notify_all()
        if action == "pass":
            connection.sendall(answer)
        elif isinstance(action, bytes):
            connection.sendall(action)
        elif action in ("reset", "refuse"):
            _reset(connection)
        elif action == "stall" and self._hold(connection):
            with self._logged:
                self.given_up.append((method, target))
                self._logged.notify_all()

    def _forward(self, request: bytes) -> bytes:
        """Send ``request`` to the server (asking it to close afterwards); its whole answer."""
        head, _, body = request.partition(b"\r\n\r\n")
        with socket.create_connection(("127.0.0.1", self.upstream_port)) as upstream:
            upstream.sendall(head + b"\r\nConnection: close\r\n\r\n" + body)
            answer = _read_message(upstream, answer=True)
        head, _, body = answer.partition(b"\r\n\r\n")
        lines = [x for x in head.split(b"\r\n") if not x.lower().startswith(b"connection:")]
        return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n" + body

    def _hold(self, connection: socket.socket) -> bool:
        """Keep ``connection`` open, unanswered: True if the client closed it within ``hold``
        seconds, else False after a TCP reset (or at once when the proxy stops)."""
        deadline = time.monotonic() + self.hold
        while not self._stopping.is_set() and time.monotonic() < deadline:
            readable, _, _ = select.select([connection], [], [], 0.05)
            if readable and not connection.recv(65536):
                return True
        _reset(connection)
        return False


class DelayingProxy(LossyProxy):
    """A :class:`LossyProxy` that holds each request ``method`` whose target ``matches`` for
    ``delay`` seconds: before the server sees it, or (``after``) once the server has answered
    it, before the answer goes back. ``seen`` is set once such a request arrives."""

    def __init__(
        self,
        upstream_port: int,
        method: bytes,
        matches: Callable[[bytes], bool],
        delay: float,
        *,
        after: bool = False,
    ) -> None:
        super().__init__(upstream_port)
        self.method, self.matches, self.delay, self.after = method, matches, delay, after
        self.seen = threading.Event()

    def _forward(self, request: bytes) -> bytes:
        method, target, _ = request.split(b" ", 2)
        held = method == self.method and self.matches(target)
        if held:
            self.seen.set()
            if not self.after:
                time.sleep(self.delay)
        answer = super()._forward(request)
        if held and self.after:
            time.sleep(self.delay)
        return answer
