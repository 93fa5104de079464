"""``-`` where standard output is a socket, as inetd, systemd socket activation and ``socat
EXEC:`` start the command: written like a ``tcp://`` peer, bounded by ``--timeout`` and stopped
by SIGINT, the socket's file description (the shell's too) left as it was, blocking."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ._cli import COMMAND, write_model

LIMIT = 20
"""Seconds a command given ``--timeout 1`` or stopped by SIGINT has to exit: one that hangs
(blocked in a write or a read the event loop never gets back from) fails the test."""


@pytest.fixture
def peers() -> Iterator[tuple[socket.socket, socket.socket]]:
    """A connected pair of sockets: the command's end (its standard input or output), kept open
    here as a shell keeps the one it hands on, and the peer's."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.settimeout(LIMIT)
        yield ours, theirs


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A 4 MiB model: more than a socket's buffers hold."""
    return write_model(tmp_path / "model.safetensors", {"w": np.ones(1 << 20, np.float32)})


def _started(
    args: list[str], *, stdin: socket.socket | None = None, stdout: socket.socket | None = None
) -> subprocess.Popen[bytes]:
    """The command with ``args``, its standard input or output the socket given, its standard
    error captured (standard output too, where it is not the socket)."""
    return subprocess.Popen(
        [COMMAND, *args],
        stdin=subprocess.DEVNULL if stdin is None else stdin.fileno(),
        stdout=subprocess.PIPE if stdout is None else stdout.fileno(),
        stderr=subprocess.PIPE,
    )


def _ended(process: subprocess.Popen[bytes]) -> tuple[int, str]:
    """The exit status and standard error of ``process``, which must end within :data:`LIMIT`
    (killed, else)."""
    try:
        _, stderr = process.communicate(timeout=LIMIT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"still running {LIMIT} s on: a socket's write or read blocked the command")
    return process.returncode, stderr.decode()


def _received(sock: socket.socket, count: int) -> bytes:
    """``count`` bytes from ``sock`` (fewer where it ends first)."""
    data = bytearray()
    while len(data) < count and (chunk := sock.recv(count - len(data))):
        data += chunk
    return bytes(data)


def _blocking(sock: socket.socket) -> bool:
    """Whether the file description of ``sock`` is blocking (no ``O_NONBLOCK``): the command
    must not change it, the shell's and every other holder's too."""
    return os.get_blocking(sock.fileno())


def test_copies_to_standard_output_that_is_a_socket_arrive_whole_one_after_the_other(
    model: Path, peers: tuple[socket.socket, socket.socket]
) -> None:
    """``{ stream-st cp m -; stream-st cp m -; }`` on one socket: each copy whole, the first
    leaving the socket open for the second (no shutdown of a socket others hold)."""
    ours, theirs = peers
    data = model.read_bytes()
    for _ in range(2):
        process = _started(["cp", "-q", str(model), "-"], stdout=ours)
        assert _received(theirs, len(data)) == data
        assert _ended(process) == (0, "")
    assert _blocking(ours)


def test_a_copy_to_a_socket_nobody_reads_times_out(
    model: Path, peers: tuple[socket.socket, socket.socket]
) -> None:
    ours, theirs = peers
    process = _started(["cp", "-q", "--timeout", "1", str(model), "-"], stdout=ours)
    assert theirs.recv(1, socket.MSG_PEEK)  # writing
    status, stderr = _ended(process)
    assert status == 2, stderr
    assert "(timeout), url=standard output" in stderr
    assert _blocking(ours)


def test_sigint_stops_a_copy_to_a_socket_nobody_reads(
    model: Path, peers: tuple[socket.socket, socket.socket]
) -> None:
    ours, theirs = peers
    process = _started(["cp", "-q", str(model), "-"], stdout=ours)
    assert theirs.recv(1, socket.MSG_PEEK)  # writing, and soon waiting for the peer to read
    process.send_signal(signal.SIGINT)
    assert _ended(process)[0] == 130
    assert _blocking(ours)
