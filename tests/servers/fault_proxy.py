"""A byte-level TCP proxy on 127.0.0.1 that forwards to a real server and injects one fault.

    with FaultProxy(("127.0.0.1", server_port), Fault("flip", "down", offset=1234)) as proxy:
        proxy.port            # connect here instead of to the server
        proxy.fired           # whether the fault happened (the traffic reached its offset)
        proxy.carried         # bytes forwarded so far, per direction

Directions: ``"up"`` is client to server, ``"down"`` server to client. ``offset`` counts the
bytes of that direction over all connections, in the order the proxy forwarded them, and the fault
happens once, at that byte (with ``every_connection`` it counts per connection and happens on
each). Kinds:

* ``reset``: forward the bytes before the offset, then close both sockets with an RST;
* ``stall``: forward the bytes before the offset, then nothing more in that direction (the
  connection stays open; the other direction goes on);
* ``truncate``: forward the bytes before the offset, then close both sockets cleanly (FIN);
* ``flip``: XOR ``count`` bytes from the offset with ``mask``;
* ``drop``: leave out ``count`` bytes from the offset;
* ``duplicate``: send ``count`` bytes from the offset twice;
* ``none``: forward everything (for measuring the traffic of a clean run).

The proxy knows nothing of the protocol it carries, so it serves HTTP, S3 and raw safetensors
streams alike. One thread per direction and connection, blocking sockets.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass
from typing import Literal

__all__ = ["Direction", "Fault", "FaultKind", "FaultProxy"]

FaultKind = Literal["none", "reset", "stall", "truncate", "flip", "drop", "duplicate"]
Direction = Literal["up", "down"]

CUTS: frozenset[str] = frozenset({"reset", "stall", "truncate"})
"""Kinds that end a direction's traffic at the offset."""

CORRUPTIONS: frozenset[str] = frozenset({"flip", "drop", "duplicate"})
"""Kinds that change the bytes delivered and go on."""


@dataclass(frozen=True)
class Fault:
    """One fault: what, in which direction, at which byte (see the module docstring)."""

    kind: FaultKind = "none"
    direction: Direction = "down"
    offset: int = 0
    count: int = 1
    mask: int = 0xFF
    every_connection: bool = False


class _Link:
    """One client connection and its connection to the server."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.carried = {"up": 0, "down": 0}
        self.pumps = 2  # directions still forwarding
        self.settled = threading.Event()  # both directions ended, or one stalls for good

    def close(self, *, reset: bool = False) -> None:
        """Close both sockets (waking the other direction's thread): with FIN, or with RST."""
        self.settled.set()
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                if reset:  # linger 0: close() sends RST instead of FIN; SHUT_RD sends nothing
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.shutdown(socket.SHUT_RD)
                else:
                    sock.shutdown(socket.SHUT_RDWR)
            sock.close()


class FaultProxy:
    """Forward connections on 127.0.0.1 to ``target``, applying ``fault``. A context manager."""

    def __init__(self, target: tuple[str, int], fault: Fault | None = None) -> None:
        self.target = target
        self.fault = fault or Fault()
        self.carried = {"up": 0, "down": 0}
        self.fired = False
        self.connections = 0
        self.port = 0
        self._listener: socket.socket | None = None
        self._links: list[_Link] = []
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._idle = threading.Event()  # the accept thread is waiting for a connection

    def url(self, scheme: str = "http", path: str = "") -> str:
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def start(self) -> FaultProxy:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self._listener.getsockname()[1]
        self._spawn(self._accept_loop)
        return self

    def stop(self, grace: float = 2.0) -> None:
        """Close the listener; give each connection up to ``grace`` seconds to pass on what it
        still carries and end; then close every connection and wait for every thread."""
        deadline = time.monotonic() + grace
        while self._listener is not None and time.monotonic() < deadline:
            self._idle.wait(grace)  # connections made but not yet accepted are taken first
            if not select.select([self._listener], [], [], 0)[0]:
                break
            time.sleep(0.001)
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.settled.wait(grace)
        self._stopping.set()
        for link in links:
            link.close()
        for thread in list(self._threads):
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            self._idle.set()
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._idle.clear()
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            link = _Link(client, server)
            with self._lock:
                self._links.append(link)
                self.connections += 1
            self._spawn(self._pump, link, "up")
            self._spawn(self._pump, link, "down")

    def _take(self, link: _Link, direction: Direction, size: int) -> int | None:
        """Book ``size`` bytes about to be forwarded; where in them the fault falls, if it does."""
        fault = self.fault
        with self._lock:
            counter = link.carried if fault.every_connection else self.carried
            at = counter[direction]
            counter[direction] += size
            if fault.every_connection:
                self.carried[direction] += size
            due = fault.kind != "none" and fault.direction == direction
            due = due and (fault.every_connection or not self.fired)
            if due and at <= fault.offset < at + size:
                self.fired = True
                return fault.offset - at
        return None

    def _pump(self, link: _Link, direction: Direction) -> None:
        source, sink = link.client, link.server
        if direction == "down":
            source, sink = sink, source
        fault = self.fault
        try:
            while True:
                chunk = bytearray(source.recv(65536))
                if not chunk:
                    with contextlib.suppress(OSError):  # pass the end on: half-close
                        sink.shutdown(socket.SHUT_WR)
                    with self._lock:
                        link.pumps -= 1
                        done = link.pumps == 0
                    if done:
                        link.close()
                    return
                at = self._take(link, direction, len(chunk))
                if at is None:
                    sink.sendall(chunk)
                    continue
                end = at + fault.count
                if fault.kind in CUTS:
                    sink.sendall(chunk[:at])
                    if fault.kind == "stall":
                        link.settled.set()
                        self._stopping.wait()
                    link.close(reset=fault.kind == "reset")
                    return
                if fault.kind == "flip":
                    chunk[at:end] = bytes(b ^ fault.mask for b in chunk[at:end])
                elif fault.kind == "drop":
                    del chunk[at:end]
                else:  # duplicate
                    chunk[at:at] = chunk[at:end]
                sink.sendall(chunk)
        except OSError:
            link.close(reset=True)  # one side went away: so does the other
