"""The command stopped by SIGTERM or SIGHUP cleans up as for SIGINT: nothing left at the
destination (no temporary file, no pending multipart upload), exit status 128 + the signal."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from stream_st.cli import main

from ..servers.s3_server import CREDENTIALS, MotoS3Server
from ._cli import COMMAND, write_model

STOPS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT]


@contextmanager
def trickling(fifo: Path, data: bytes, first: int) -> Iterator[threading.Event]:
    """``fifo`` giving the first ``first`` bytes of ``data``, then nothing until the block ends:
    a source stalled in the middle of a copy. The event is set once the reader took them (all
    but what the pipe holds)."""
    os.mkfifo(fifo)
    done = threading.Event()
    fed = threading.Event()

    def feed() -> None:
        with contextlib.suppress(BrokenPipeError), fifo.open("wb") as f:  # the reader stopped
            f.write(data[:first])
            f.flush()
            fed.set()
            done.wait(120)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    try:
        yield fed
    finally:
        done.set()
        feeder.join(timeout=30)


def _wait_for(what: str, found: Callable[[], bool], process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while not found():
        assert process.poll() is None, (what, process.communicate())
        assert time.monotonic() < deadline, f"no {what} within a minute"
        time.sleep(0.05)


def _stopped(process: subprocess.Popen[bytes], signum: int) -> tuple[int, str]:
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=60)
    return process.returncode, stderr.decode()


@pytest.mark.parametrize("into", ["copy.safetensors", "new/dir/"], ids=["a file", "a new dir"])
@pytest.mark.parametrize("signum", STOPS, ids=[s.name for s in STOPS])
def test_stopped_copy_to_a_file_leaves_nothing(tmp_path: Path, signum: int, into: str) -> None:
    """Nothing left, not even the directories made for the copy (``cp SRC new/dir/``)."""
    model = write_model(tmp_path / "model.safetensors", {"w": np.ones(1 << 20, np.float32)})
    out = tmp_path / "out"
    out.mkdir()
    fifo = tmp_path / "slow"
    with trickling(fifo, model.read_bytes(), 1 << 20) as fed:
        process = subprocess.Popen(
            [COMMAND, "cp", "-q", str(fifo), f"{out}/{into}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        _wait_for("copy under way", fed.is_set, process)  # its temporary file may be nameless
        time.sleep(0.2)
        status, stderr = _stopped(process, signum)
    assert status == 128 + signum, stderr
    assert list(out.iterdir()) == [], "debris left next to the destination"
    assert "Traceback" not in stderr and len(stderr.splitlines()) == 1, stderr


@pytest.mark.parametrize("signum", STOPS[:2], ids=[s.name for s in STOPS[:2]])
def test_stopped_copy_to_s3_leaves_no_pending_upload(
    tmp_path: Path, moto_s3: MotoS3Server, signum: int
) -> None:
    tensors = {f"w{i:02}": np.full(1 << 18, i, np.float32) for i in range(24)}  # 1 MiB each
    model = write_model(tmp_path / "model.safetensors", tensors)
    client = moto_s3.client()
    bucket = f"stop-{signum}"
    client.create_bucket(Bucket=bucket)
    fifo = tmp_path / "slow"

    def pending() -> bool:
        return bool(client.list_multipart_uploads(Bucket=bucket).get("Uploads"))

    env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": moto_s3.endpoint_url}
    with trickling(fifo, model.read_bytes(), 20 << 20):  # past the first 16 MiB part
        process = subprocess.Popen(
            [COMMAND, "cp", "-q", str(fifo), f"s3://{bucket}/m.safetensors"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        _wait_for("multipart upload", pending, process)
        status, stderr = _stopped(process, signum)
    assert status == 128 + signum, stderr
    assert not pending(), "a multipart upload left pending"
    assert "Contents" not in client.list_objects_v2(Bucket=bucket)


def _signal_handled(process: subprocess.Popen[bytes], signum: int) -> bool:
    """Whether the command's handler took ``signum`` in: it puts back the default action of
    every stopping signal, so the process no longer catches it (``SigCgt`` in /proc)."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    caught = int(status.partition("\nSigCgt:")[2].split()[0], 16)
    return not caught >> (signum - 1) & 1


@contextmanager
def holding_commits(target: int) -> Iterator[tuple[str, threading.Event, threading.Event]]:
    """An HTTP relay to the S3 server on port ``target``: (its endpoint, ``sent``, ``release``).
    The request that stores an object (CompleteMultipartUpload, or a single PUT) is carried out
    by the server, then ``sent`` is set and its answer held until ``release`` is."""
    sent, release = threading.Event(), threading.Event()

    class Relay(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            upstream = http.client.HTTPConnection("127.0.0.1", target, timeout=60)
            upstream.request(self.command, self.path, body, dict(self.headers.items()))
            answer = upstream.getresponse()
            data = answer.read()
            upstream.close()
            query = self.path.partition("?")[2]
            if (self.command, query.startswith("uploadId=")) == ("POST", True) or (
                self.command == "PUT" and not query
            ):
                sent.set()
                release.wait(60)
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in ("content-length", "connection", "date", "server"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = relay

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", sent, release
    finally:
        release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("size", [1 << 10, 17 << 20], ids=["single PUT", "multipart"])
@pytest.mark.parametrize("signum", STOPS[::2], ids=[s.name for s in STOPS[::2]])
def test_a_signal_during_the_commit_lets_the_copy_complete(
    tmp_path: Path, moto_s3: MotoS3Server, signum: int, size: int
) -> None:
    """A stop that comes while the request storing the object is under way: the object is
    stored (the commit point is passed), so the command says so and exits with 0."""
    model = write_model(tmp_path / "model.safetensors", {"w": np.ones(size // 4, np.float32)})
    client = moto_s3.client()
    bucket = f"commit-{signum}-{size}"
    client.create_bucket(Bucket=bucket)
    client.put_object(Bucket=bucket, Key="m.safetensors", Body=b"older")
    with holding_commits(moto_s3.port) as (endpoint, sent, release):
        env = {**os.environ, **CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        process = subprocess.Popen(
            [COMMAND, "cp", "-q", str(model), f"s3://{bucket}/m.safetensors"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        _wait_for("the commit", sent.is_set, process)
        assert not _signal_handled(process, signum)
        process.send_signal(signum)
        # Handled while the answer is held: not a fixed wait, which a loaded machine outlasts.
        _wait_for("the signal handled", lambda: _signal_handled(process, signum), process)
        release.set()
        _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    name = signal.Signals(signum).name
    assert stderr.decode() == (
        f"stream-st: {name} came once the command had committed its work: it completed\n"
    )
    stored = client.get_object(Bucket=bucket, Key="m.safetensors")["Body"].read()
    assert stored == model.read_bytes()
    assert not client.list_multipart_uploads(Bucket=bucket).get("Uploads")


@pytest.mark.parametrize("signum", STOPS, ids=[s.name for s in STOPS])
def test_signals_once_the_copy_is_done_leave_its_exit_status(tmp_path: Path, signum: int) -> None:
    """The signals were given their former handlers as soon as the copy was done, a tenth of
    a second before the process exited: one then killed it, or said 'interrupted' (130). Now
    the signals from the 'copied' line on, however many, leave the exit status 0, one line at
    most saying they came once the copy was done."""
    model = write_model(tmp_path / "model.safetensors")
    copy = tmp_path / "copy.safetensors"
    process = subprocess.Popen(
        [COMMAND, "cp", str(model), str(copy)], stderr=subprocess.PIPE, text=True
    )
    assert process.stderr is not None
    assert process.stderr.readline().startswith("copied ")
    while process.poll() is None:  # every moment until it exits gets one: no timing to hit
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)
        time.sleep(0.005)
    assert process.returncode == 0, process.stderr.read()
    name = signal.Signals(signum).name
    said = f"stream-st: {name} came once the command had committed its work: it completed\n"
    assert process.stderr.read() in ("", said)
    assert copy.read_bytes() == model.read_bytes()


def test_a_callers_signal_handlers_are_back_once_the_command_is_done(tmp_path: Path) -> None:
    """main given its arguments (a caller's run, in a process that goes on) sets back the
    handlers the stopping signals had, which the command holds once its work is done."""
    before = {signum: signal.getsignal(signum) for signum in STOPS}
    model = write_model(tmp_path / "model.safetensors")
    assert main(["cp", "-q", str(model), str(tmp_path / "copy.safetensors")]) == 0
    assert {signum: signal.getsignal(signum) for signum in STOPS} == before


INTERRUPT_WHILE_LOADING = """
import os, signal, sys

class Interrupt:
    # Sends this process SIGINT as the module named in argv[1] starts loading; 'wrapped:NAME'
    # raises what Python 3.11 makes of one that lands in a class's __set_name__.
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            os.kill(os.getpid(), signal.SIGINT)
        if "wrapped:" + name == sys.argv[1]:
            raise RuntimeError("Error calling __set_name__") from KeyboardInterrupt()
        return None

sys.meta_path.insert(0, Interrupt())
from stream_st.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    "module", ["stream_st.cli.app", "stream_st.cli.parser", "anyio", "wrapped:stream_st.errors"]
)
def test_interrupted_while_the_command_loads_says_so_in_one_line(
    tmp_path: Path, module: str
) -> None:
    """Ctrl-C while the command's modules load (a third of a second, more on a cold disk) ends
    it as one during its work does: exit status 130, one line, no traceback."""
    model = write_model(tmp_path / "model.safetensors")
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPT_WHILE_LOADING, module, "inspect", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 130, done.stderr
    assert done.stderr == "stream-st: interrupted\n"
    assert done.stdout == ""
