"""A synchronous drop-in call waiting on a stalled server stops when asked: Ctrl-C (SIGINT)
surfaces as KeyboardInterrupt at once, also from code run under an event loop (a notebook cell,
which goes through a Bridge, a loop in a thread of its own), and a ``safe_open`` closed from
another thread ends the read it was waiting in (``File is closed``, as a closed handle answers).
Each runs in a process of its own, bounded: a
regression times out instead of hanging the suite."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
from anyio.from_thread import BlockingPortal

import stream_st.numpy
from stream_st.compat import _sync

CHILD = textwrap.dedent(
    """
    import asyncio, os, signal, sys, threading, time
    import numpy as np, safetensors.numpy as reference
    import stream_st.numpy as st_np
    from tests.servers.http_server import RangeHTTPServer

    how = sys.argv[1]
    data = reference.save({"w": np.ones(1 << 20, np.float32)})
    with RangeHTTPServer(objects={"/m": data}, stall_after=100_000) as server:
        url = server.url("/m")

        def interrupt():
            time.sleep(1)
            os.kill(os.getpid(), signal.SIGINT)

        began = time.monotonic()
        try:
            if how == "close":  # closed from another thread while its get_tensor waits
                handle = st_np.safe_open(url, "np")

                def read():
                    try:
                        handle.get_tensor("w")
                    except Exception as exc:
                        cause = exc.__cause__
                        print("read failed:", type(exc).__name__, exc, "from", repr(cause))

                reader = threading.Thread(target=read)
                reader.start()
                time.sleep(1)
                handle.close()
                reader.join()
            else:
                threading.Thread(target=interrupt, daemon=True).start()
                if how == "cell":  # a sync call from code under a running loop, as in Jupyter
                    async def cell():
                        return st_np.load_file(url)
                    asyncio.new_event_loop().run_until_complete(cell())
                else:
                    with st_np.safe_open(url, "np") as handle:
                        handle.get_tensor("w")
            print("returned")
        except KeyboardInterrupt:
            print("interrupted")
        names = [thread.name for thread in threading.enumerate()]
        print(f"after {time.monotonic() - began:.1f} s, threads {names}")
    """
)


def _run(how: str) -> str:
    """The child's output for ``how``; it must end within 30 s (a hang fails the test)."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, how],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("how", ["cell", "safe_open"])
def test_ctrl_c_stops_a_call_waiting_on_a_stalled_server(how: str) -> None:
    out = _run(how)
    assert out.startswith("interrupted\n"), out
    assert "blocking_portal" not in out, out  # the bridge's loop thread is gone


def test_safe_open_closed_from_another_thread_ends_its_read() -> None:
    out = _run("close")
    assert "read failed: FileClosedError File is closed from TransportError" in out, out
    assert "closed on this side" in out, out  # the read cut short, what the error chains from
    assert "blocking_portal" not in out, out


def test_ctrl_c_while_a_bridge_starts_stops_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interrupted while waiting for its thread's loop to start (the thread scheduled late, on a
    busy machine), a Bridge stops that loop and joins its thread before the KeyboardInterrupt
    goes on: no one holds the bridge to close it."""
    serve = _sync._serve

    def late(started: Future[BlockingPortal]) -> None:
        time.sleep(0.05)
        serve(started)

    class Interrupted(Future[BlockingPortal]):
        waits = 0

        def result(self, timeout: float | None = None) -> BlockingPortal:
            Interrupted.waits += 1
            if Interrupted.waits == 1:  # Ctrl-C while the bridge waits for its thread's loop
                raise KeyboardInterrupt
            return super().result(timeout)

    before = set(threading.enumerate())
    monkeypatch.setattr(_sync, "_serve", late)
    monkeypatch.setattr(_sync, "Future", Interrupted)
    with pytest.raises(KeyboardInterrupt):
        _sync.Bridge()
    assert [t for t in threading.enumerate() if t not in before] == []


@pytest.mark.parametrize("started", [True, False], ids=["thread-started", "not-started"])
def test_ctrl_c_inside_the_bridge_threads_start_leaves_no_thread(
    monkeypatch: pytest.MonkeyPatch, started: bool
) -> None:
    """Interrupted inside ``Thread.start`` (which waits for the new thread to run: where a
    Ctrl-C lands in 1 of 20 here), a Bridge left its thread's loop serving for ever, with its
    descriptors, since the wait for the loop was the only part that cleaned up. Interrupted
    before the thread ran at all, there is nothing to stop."""

    class Interrupted(threading.Thread):
        def start(self) -> None:
            if started:
                super().start()
            raise KeyboardInterrupt

    before = set(threading.enumerate())
    monkeypatch.setattr(threading, "Thread", Interrupted)  # the module _sync starts it from
    with pytest.raises(KeyboardInterrupt):
        _sync.Bridge()
    deadline = time.monotonic() + 10
    while [t for t in threading.enumerate() if t not in before] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [t for t in threading.enumerate() if t not in before] == []


def test_a_call_while_anyio_run_starts_or_ends_its_loop_goes_through_a_bridge() -> None:
    """While ``anyio.run`` sets up or tears down its loop (a signal handler or a ``__del__``
    running there), no loop runs, but anyio.run refuses another: a synchronous call failed with
    anyio's bare RuntimeError "Already running asyncio in this thread"."""
    sniffio = pytest.importorskip("sniffio")
    data = stream_st.numpy.save({"a": np.arange(3, dtype=np.float32)})
    token = sniffio.current_async_library_cvar.set("asyncio")  # the state in that window
    try:
        loaded = stream_st.numpy.load(data)
    finally:
        sniffio.current_async_library_cvar.reset(token)
    assert loaded["a"].tolist() == [0, 1, 2]


RAISING_HANDLER = textwrap.dedent(
    """
    import os, signal, sys, tempfile, threading
    import numpy as np
    import stream_st.numpy as st_np

    class Alarm(Exception):
        pass

    def alarm(signum, frame):
        raise Alarm

    tensors = {f"t{i}": np.full(1 << 20, i, np.float32) for i in range(8)}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "w.safetensors")
        st_np.save_file(tensors, path, timeout=60)  # the imports done
        signal.signal(signal.SIGALRM, alarm)
        raised = 0
        for attempt in range(40):
            try:  # the timer set and cleared inside: it may ring before the call, or after it
                signal.setitimer(signal.ITIMER_REAL, 0.0005 + 0.0005 * attempt)
                if attempt % 2:
                    st_np.save_file(tensors, path, timeout=60)
                else:
                    st_np.load_file(path)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except Alarm:
                raised += 1
            assert st_np.load_file(path)["t7"][0] == 7  # the old file or the new one, whole
            assert os.listdir(folder) == ["w.safetensors"], os.listdir(folder)
        assert signal.getsignal(signal.SIGALRM) is alarm
    for thread in threading.enumerate():  # those of the last call end (none for ever)
        if thread is not threading.main_thread():
            thread.join(10)
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print("raised", raised, "threads left", left)
    """
)


def test_a_signal_handler_that_raises_stops_a_call_as_it_would_a_plain_function() -> None:
    """A Python signal handler that raises (a SIGALRM timeout) runs between any two bytecodes,
    inside the call's event loop: what it raised failed a callback there, which asyncio logged
    and dropped, and the call waited for ever for what that callback would have delivered (or
    left worker threads that kept the process from exiting). Its exception now stops the call
    and reaches the caller, with nothing left behind."""
    result = subprocess.run(
        [sys.executable, "-c", RAISING_HANDLER],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "threads left []" in result.stdout, result.stdout
    assert "raised 0 " not in result.stdout  # the handler's exception reached the caller
    assert "Exception in callback" not in result.stderr, result.stderr[-3000:]
