"""``stream-st cache prune`` and :func:`~stream_st.transports.cache.manage.prune` with a copy
whose entry another process holds (it is writing a new version of the object): the copy is
left, and said so, as ``cache rm`` says it.

A real server on 127.0.0.1, a real second process re-fetching the changed object, and the
entry's real ``flock``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import safetensors.numpy as reference_numpy

from stream_st.transports.cache import Cache
from stream_st.transports.cache.manage import Entry, entries, prune
from stream_st.transports.cache.store import EntryLock

from .._util import run_command
from ..servers.http_server import RangeHTTPServer
from .test_cache import DATA, read, reader

NEW = reference_numpy.save(
    {f"t{i}": np.random.default_rng(10 + i).random(40_000) for i in range(4)}
)  # the object's next version: 1.3 MB, about 6 s at RATE
RATE = 2e5  # bytes per second, while the next version is fetched


def _cached(tmp_path: Path, running: RangeHTTPServer) -> tuple[str, Entry]:
    """The object's address on ``running``, read once into the cache at ``tmp_path``, and
    the one copy the cache then lists."""
    url = running.url("/m.safetensors")
    asyncio.run(read(url, cache=tmp_path))
    (entry,) = entries(Cache.at(tmp_path))
    assert entry.complete and entry.shown == url
    return url, entry


def test_prune_says_which_copy_it_left_to_the_process_writing_it(tmp_path: Path) -> None:
    """prune --max-size 0 printed 'removed 0 copies, 0 B' and exited with 0, naming nothing,
    while another process re-fetching the changed object held the copy's entry."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        url, entry = _cached(tmp_path, running)
        running.replace_after["/m.safetensors"] = (0, NEW)  # changed: the next GET has v1
        running.rate = RATE
        writer = reader(url, tmp_path)
        give_up = time.monotonic() + 30
        while time.monotonic() < give_up and not list(tmp_path.rglob("*.part")):
            time.sleep(0.01)
        assert list(tmp_path.rglob("*.part")), "the second process began no copy"
        done = run_command("cache", "prune", "--max-size", "0", "--dir", str(tmp_path))
        kept = all(path.is_file() for path in entry.files)  # the writer's end replaces it
        _, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        f"left {url}: another process is writing it",
        "removed 0 copies, 0 B",
    ]
    assert kept


def test_prune_hands_back_the_copies_another_process_holds(tmp_path: Path) -> None:
    """prune(..., left=[]) collects the copies it did not remove because their entry's lock is
    held (here by another open file of this process: a ``flock`` is its open file's), and
    removes them once it is free; prune's value is what it removed, as before."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        _, entry = _cached(tmp_path, running)
    cache = Cache.at(tmp_path)
    held = EntryLock(entry.lock) if entry.lock is not None else None
    assert held is not None and held.try_acquire()
    left: list[Entry] = []
    try:
        assert prune(cache, 0, left=left) == [] and left == [entry]
        assert prune(cache, 1 << 40, left=left) == [] and left == [entry]  # under the cap
    finally:
        held.release()
    left = []
    assert prune(cache, 0, left=left) == [entry] and left == []
    assert entries(cache) == [] and not any(path.exists() for path in entry.files)
