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

import pytest
from anyio.from_thread import BlockingPortal

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
