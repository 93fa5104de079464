"""The command with its standard streams as a shell may leave them: standard error closed, and
standard input ended by the hangup that stops it."""

from __future__ import annotations

import errno
import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

from stream_st.cli import commands, main

from ._cli import COMMAND, write_model


def _without_stderr(*args: str) -> subprocess.CompletedProcess[bytes]:
    """The command run with standard error closed (``2>&-``), its standard output captured."""
    return subprocess.run(
        [COMMAND, *args],
        stdout=subprocess.PIPE,
        preexec_fn=lambda: os.close(2),
        timeout=120,
        check=False,
    )


def test_a_copy_with_standard_error_closed_is_made(tmp_path: Path) -> None:
    source = write_model(tmp_path / "a.safetensors")
    done = _without_stderr("cp", str(source), str(tmp_path / "b.safetensors"))
    assert done.returncode == 0
    assert (tmp_path / "b.safetensors").read_bytes() == source.read_bytes()
    piped = _without_stderr("cp", str(source), "-")
    assert piped.returncode == 0
    assert piped.stdout == source.read_bytes()  # no traceback, no message among the bytes


def test_an_error_with_standard_error_closed_stays_out_of_standard_output(tmp_path: Path) -> None:
    done = _without_stderr("inspect", str(tmp_path / "missing.safetensors"))
    assert done.returncode == 2
    assert done.stdout == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize(
    ("argv", "status"),
    [
        pytest.param(["cp", "-q", "--dtype", "f16", "{big}", "{out}"], 0, id="cp-warning"),
        pytest.param(["ls", "{missing}"], 2, id="ls-missing"),
        pytest.param(["diff", "{big}", "{missing}"], 2, id="diff-missing"),
        pytest.param(["ls", "--timeout", "-1", "{big}"], 2, id="bad-option"),
    ],
)
def test_standard_error_that_cannot_be_written_changes_no_exit_status(
    argv: list[str], status: int, tmp_path: Path
) -> None:
    """Standard error on a full disk (``2>/dev/full``): a copy that warned failed with exit
    status 1, leaving no file, and an error exited with 1 (``diff``'s "different"), where 2 is
    an error's; what standard error cannot take is dropped, as for one closed."""
    big = write_model(tmp_path / "big.safetensors", {"a": np.array([1e10, 1.0], np.float32)})
    out = tmp_path / "out.safetensors"
    paths = {"big": big, "out": out, "missing": tmp_path / "missing.safetensors"}
    with open("/dev/full", "w") as full:
        done = subprocess.run(
            [COMMAND, *(arg.format(**paths) for arg in argv)],
            stdout=subprocess.DEVNULL,
            stderr=full,
            timeout=120,
            check=False,
        )
    assert done.returncode == status
    assert out.exists() == (argv[0] == "cp")


def test_an_internal_error_with_standard_error_unwritable_exits_3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The traceback of an internal error, which standard error could not take, raised from
    the handler printing it: the exit status was 1, not 3."""

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    async def broken(*args: Any, **kwargs: Any) -> None:
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(commands, "headers_of", broken)
    monkeypatch.setattr(sys, "stderr", Full())
    assert main(["inspect", str(write_model(tmp_path / "a.safetensors"))]) == 3


def _feed(stdin: IO[bytes], data: bytes) -> None:
    """``data`` written to ``stdin`` a MiB at a time, as a slow link brings it."""
    try:
        for start in range(0, len(data), 1 << 20):
            stdin.write(data[start : start + (1 << 20)])
            stdin.flush()
            time.sleep(0.01)
    except (BrokenPipeError, ValueError, OSError):
        pass


def test_a_hangup_that_ends_standard_input_is_reported_as_the_hangup(tmp_path: Path) -> None:
    """``ssh host stream-st hash --content -`` cut off: SIGHUP and the end of standard input come
    together; the command reports the signal (129), not the short input it caused (2). The race
    went to the short input in about 8 runs of 10: three runs."""
    source = tmp_path / "big.safetensors"
    reference_numpy.save_file({"big": np.zeros(8 << 20, np.float32)}, str(source))
    data = source.read_bytes()
    for _ in range(3):
        process = subprocess.Popen(
            [COMMAND, "hash", "--content", "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert process.stdin is not None and process.stderr is not None

        feeder = threading.Thread(target=_feed, args=(process.stdin, data[: len(data) // 2]))
        feeder.start()
        feeder.join()  # half the file sent: the command waits for the rest
        process.send_signal(signal.SIGHUP)
        process.stdin.close()  # the hangup ends the input too
        error = process.stderr.read().decode()
        assert process.wait(timeout=60) == 128 + signal.SIGHUP, error
        assert error.strip().splitlines()[-1] == "stream-st: stopped by SIGHUP"


def test_a_signal_the_command_was_started_ignoring_stays_ignored(tmp_path: Path) -> None:
    """``nohup stream-st ...`` (SIGHUP ignored), a shell's background job (SIGINT ignored): the
    command took the signal as a stop all the same, where it should go on to its end."""
    source = write_model(tmp_path / "m.safetensors")
    data = source.read_bytes()
    process = subprocess.Popen(
        [COMMAND, "hash", "--content", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: [
            signal.signal(s, signal.SIG_IGN) for s in (signal.SIGHUP, signal.SIGINT)
        ],
    )
    assert process.stdin is not None
    process.stdin.write(data[:16])
    process.stdin.flush()
    time.sleep(1)  # the command is up, waiting for the rest (an early signal is ignored too)
    for signum in (signal.SIGHUP, signal.SIGINT):
        process.send_signal(signum)
    out, err = process.communicate(data[16:], timeout=60)
    assert process.returncode == 0, err
    assert out.split() and out.split()[0] != b""


def test_standard_input_a_file_read_past_its_start_is_refused(tmp_path: Path) -> None:
    """``-`` opened /dev/stdin, which reads a regular file from its start: where the shell's
    reads had left it part read (``(head -c 8 >/dev/null; stream-st hash --file -) < f``), the
    command hashed or showed the bytes already read too. It is refused, saying so."""
    model = write_model(tmp_path / "m.safetensors")
    for args in (["hash", "--file", "-"], ["show", "-", "model.embed_tokens.weight"]):
        with model.open("rb") as stdin:
            os.lseek(stdin.fileno(), 8, os.SEEK_SET)
            done = subprocess.run(
                [COMMAND, *args], stdin=stdin, capture_output=True, text=True, timeout=120
            )
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        assert "standard input is a file read up to byte 8 already" in done.stderr
        with model.open("rb") as stdin:  # from its start, as before
            whole = subprocess.run([COMMAND, *args], stdin=stdin, capture_output=True, timeout=120)
        assert whole.returncode == 0, whole.stderr
