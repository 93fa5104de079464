"""A server program from the system (nginx, tinyproxy) run as a child process on loopback.

A :class:`Daemon` subclass writes the program's configuration into its folder for the ports it
is given and names the command line. :meth:`Daemon.start` picks free ports on 127.0.0.1, runs
the program in the foreground and waits until every port accepts connections; a program that
exits first (another process took a port between the pick and its bind) is started again on
other ports. :meth:`Daemon.stop` ends it. Nothing runs as another user and nothing is written
outside the folder.

In a fixture, ``with running(daemon):`` starts and stops it, and skips the test, saying how to
install it, where the program is missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, Self, TypeVar

import pytest

SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")
"""Where Debian installs servers; not on every user's PATH."""

ATTEMPTS = 5
"""Starts tried, each on fresh ports, before giving up."""

READY_WITHIN = 10.0
"""Seconds a start may take until every port accepts connections."""

D = TypeVar("D", bound="Daemon")


def find_program(name: str) -> str | None:
    """The path of the program ``name`` on PATH or in the sbin folders, or None."""
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SBIN]))


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports on 127.0.0.1 that were free a moment ago."""
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(count)]
    try:
        return [listener.getsockname()[1] for listener in listeners]
    finally:
        for listener in listeners:
            listener.close()


def _accepts(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5):
        return True
    return False


class Daemon:
    """A server program run in the foreground, configured in ``folder`` (see the module)."""

    program: ClassVar[str]
    """The program's name, looked up with :func:`find_program`."""

    port_count: ClassVar[int] = 1

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ports: list[int] = []
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        """The first port."""
        return self.ports[0]

    def configure(self, ports: list[int]) -> list[str]:
        """Write the configuration for ``ports``; the program's arguments."""
        raise NotImplementedError

    def start(self) -> Self:
        executable = find_program(self.program)
        if executable is None:
            raise RuntimeError(f"{self.program} is not installed")
        output = self.folder / f"{self.program}.out"
        for _ in range(ATTEMPTS):
            ports = free_ports(self.port_count)
            arguments = self.configure(ports)
            with output.open("wb") as sink:
                process = subprocess.Popen(
                    [executable, *arguments],
                    stdin=subprocess.DEVNULL,
                    stdout=sink,
                    stderr=subprocess.STDOUT,
                    cwd=self.folder,
                )
            self._process = process
            if self._ready(process, ports):
                self.ports = ports
                return self
            self._end()
        self.stop()
        raise RuntimeError(
            f"{self.program} did not start: {output.read_text(errors='replace').strip()[-2000:]}"
        )

    @staticmethod
    def _ready(process: subprocess.Popen[bytes], ports: list[int]) -> bool:
        """Wait until every port accepts connections: False if ``process`` exits first."""
        waiting = list(ports)
        give_up = time.monotonic() + READY_WITHIN
        while time.monotonic() < give_up and process.poll() is None:
            waiting = [port for port in waiting if not _accepts(port)]
            if not waiting:
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        """End the program and release what the daemon holds."""
        self._end()

    def _end(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def running(daemon: D) -> Iterator[D]:
    """``daemon`` started, then stopped; the test is skipped where its program is missing."""
    if find_program(daemon.program) is None:
        pytest.skip(
            f"{daemon.program} is not installed (apt-get install {daemon.program}; .ci/run does)"
        )
    with daemon:
        yield daemon
