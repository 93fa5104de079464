"""A TCP server on 127.0.0.1 for the tests' own peers and proxies: one thread per connection."""

from __future__ import annotations

import contextlib
import socket
import threading

__all__ = ["LoopbackServer"]


class LoopbackServer:
    """Accepts on 127.0.0.1 (an ephemeral ``port``) from construction on, and runs
    :meth:`handle` for each connection in a thread of its own; the connection is closed after it,
    and an ``OSError`` (a reset) just ends it."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port: int = self._listener.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            self._start(connection)

    def _start(self, connection: socket.socket) -> None:
        thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _serve(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError):
            self.handle(connection)

    def handle(self, connection: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop accepting; connections being served go on until they end, and so do those the
        kernel completed but the accepting thread has not taken yet (a quick client may have
        connected, sent everything and closed before that thread ran)."""
        with contextlib.suppress(OSError):
            self._listener.setblocking(False)
            while True:
                self._start(self._listener.accept()[0])
        with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()

    def stop(self) -> None:
        """Stop accepting and wait (a few seconds at most each) for every connection's thread."""
        self.close()
        for thread in self._threads:
            thread.join(timeout=5)
