"""``-`` where standard input or output is a socket, as inetd, systemd socket activation and
``socat EXEC:`` start the command: read and written like a ``tcp://`` peer, bounded by
``--timeout`` and stopped by SIGINT, the socket's file description (the shell's too) left as it
was, blocking."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
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


STOPS = {
    "timeout": (["--timeout", "1"], None, 2, "(timeout), url="),
    "sigint": ([], signal.SIGINT, 130, None),
}
"""How a command stalled on a socket is stopped: its options, the signal sent (if any), the exit
status and what its standard error says (followed by the socket's name)."""


@pytest.mark.parametrize("how", sorted(STOPS))
def test_a_copy_to_a_socket_nobody_reads_is_stopped(
    model: Path, peers: tuple[socket.socket, socket.socket], how: str
) -> None:
    options, signum, expected, said = STOPS[how]
    ours, theirs = peers
    process = _started(["cp", "-q", *options, str(model), "-"], stdout=ours)
    assert theirs.recv(1, socket.MSG_PEEK)  # writing, and soon waiting for the peer to read
    if signum is not None:
        process.send_signal(signum)
    status, stderr = _ended(process)
    assert status == expected, stderr
    if said is not None:
        assert said + "standard output" in stderr
    assert _blocking(ours)


def _fed(theirs: socket.socket, data: bytes) -> None:
    """``data`` sent by the peer, then nothing: returns once the command has taken all but what
    the sockets' buffers hold, as it reads. A command that refused the socket takes nothing:
    the send times out (the socket stays open here) and the command's status says why."""
    with contextlib.suppress(TimeoutError):
        theirs.sendall(data)


@pytest.mark.parametrize(
    ("args", "sent", "shown"),
    [
        pytest.param(["inspect", "-"], 100, b"/dev/stdin\n  1 tensor, 16 parameters", id="inspect"),
        pytest.param(["hash", "--json", "/dev/stdin"], None, b'"source":"/dev/stdin"', id="hash"),
    ],
)
def test_standard_input_that_is_a_socket_is_read(
    tmp_path: Path,
    peers: tuple[socket.socket, socket.socket],
    args: list[str],
    sent: int | None,
    shown: bytes,
) -> None:
    """``inspect`` reading the header alone (the peer sends a header's worth and keeps the
    socket open), ``hash`` the whole file, up to the peer's end; the source named as a pipe's
    is."""
    ours, theirs = peers
    small = write_model(tmp_path / "small.safetensors", {"w": np.ones(16, np.float32)})
    theirs.sendall(small.read_bytes()[:sent])  # within a socket's buffers
    if sent is None:
        theirs.shutdown(socket.SHUT_WR)
    done = subprocess.run(
        [COMMAND, *args], stdin=ours.fileno(), capture_output=True, timeout=LIMIT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert shown in done.stdout
    assert _blocking(ours)


def test_a_copy_from_standard_input_that_is_a_socket_is_whole(
    model: Path, peers: tuple[socket.socket, socket.socket], tmp_path: Path
) -> None:
    ours, theirs = peers
    data = model.read_bytes()
    copy = tmp_path / "copy.safetensors"
    process = _started(["cp", "-q", "-", str(copy)], stdin=ours)
    _fed(theirs, data)
    theirs.shutdown(socket.SHUT_WR)
    assert _ended(process) == (0, "")
    assert copy.read_bytes() == data
    assert _blocking(ours)


@pytest.mark.parametrize("how", sorted(STOPS))
def test_a_read_of_a_socket_that_stalls_is_stopped(
    model: Path, peers: tuple[socket.socket, socket.socket], tmp_path: Path, how: str
) -> None:
    options, signum, expected, said = STOPS[how]
    ours, theirs = peers
    copy = tmp_path / "copy.safetensors"
    process = _started(["cp", "-q", *options, "-", str(copy)], stdin=ours)
    _fed(theirs, model.read_bytes()[: 1 << 20])
    if signum is not None:
        process.send_signal(signum)
    status, stderr = _ended(process)
    assert status == expected, stderr
    if said is not None:
        assert said + "/dev/stdin" in stderr
    assert not copy.exists()
    assert _blocking(ours)


def test_standard_input_that_is_a_socket_with_no_descriptor_left_is_an_error(
    peers: tuple[socket.socket, socket.socket], model: Path
) -> None:
    """Out of descriptors when standard input (a socket) is duplicated: an ``EMFILE`` was
    swallowed and the command said ``No such device or address``; it names the failure."""
    ours, _ = peers
    script = (
        "import os, resource, sys\n"
        "from stream_st.cli import main\n"
        f"main(['inspect', {str(model)!r}])  # every module the command needs imported\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, "
        "(len(os.listdir('/proc/self/fd')) - 1 + 5, hard))  # 5: loop, signals\n"
        "sys.exit(main(['inspect', '-']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        stdin=ours.fileno(),
        capture_output=True,
        text=True,
        timeout=LIMIT,
    )
    assert done.returncode == 2, done.stderr
    assert "cannot use /dev/stdin: Too many open files" in done.stderr


def test_a_copy_to_a_tcp_socket_the_command_alone_holds_arrives_whole(model: Path) -> None:
    """Standard output a TCP connection only the command holds (inetd, ``socat EXEC:``, systemd
    ``Accept=yes``) whose peer sent a greeting the command never reads, and reads slowly: the
    command's exit closed the socket with those bytes unread, so the kernel reset the
    connection and dropped the copy's tail still queued, after an exit status of 0. It waits
    for the kernel to have sent everything first, so the peer gets the whole copy."""
    data = model.read_bytes()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
    with peer:
        peer.settimeout(LIMIT)
        peer.sendall(b"HELLO\n")  # a greeting the command never reads
        with served:
            process = _started(["cp", "-q", str(model), "-"], stdout=served)
        got = bytearray()
        with contextlib.suppress(ConnectionResetError):  # reported as a short copy below
            while len(got) < len(data) and (chunk := peer.recv(64 << 10)):
                got += chunk
                time.sleep(0.002)  # a reader slower than the loopback
        assert _ended(process) == (0, "")
        assert len(got) == len(data)
        assert got == data


def test_a_unix_socket_read_after_the_command_ends_gets_the_whole_copy(
    tmp_path: Path, peers: tuple[socket.socket, socket.socket]
) -> None:
    """A UNIX socket keeps what was sent in the peer's queue whatever the close finds unread:
    the command ends at once (no wait for a reader that comes later), and the copy is whole."""
    ours, theirs = peers
    small = write_model(tmp_path / "small.safetensors", {"w": np.ones(16, np.float32)})
    theirs.sendall(b"HELLO\n")  # unread by the command
    done = subprocess.run(
        [COMMAND, "cp", str(small), "-"],
        stdout=ours.fileno(),
        capture_output=False,
        stderr=subprocess.PIPE,
        timeout=LIMIT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert _received(theirs, small.stat().st_size) == small.read_bytes()
