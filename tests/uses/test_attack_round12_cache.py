"""Attack round 12 on ``cache=``: objects told apart only by their query, odd records, a copy
given up that kept its lock, a killed writer's leftovers, a Hub blob huggingface_hub downloaded.

Real servers on 127.0.0.1 (the Python test server, the fake Hub) and real processes: the
command, and a writer killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.cache import Cache
from stream_st.transports.cache.keys import object_key
from stream_st.transports.cache.manage import entries, prune
from stream_st.transports.cache.store import EntryLock

from .._util import assert_same_arrays, run_command
from ..servers.http_server import RangeHTTPServer
from ..servers.hub_server import FakeHub
from ..transports.test_cache import downloaded_by_huggingface_hub, read, read_as

Arrays = dict[str, np.ndarray[Any, Any]]
ROOT = Path(__file__).resolve().parents[2]


def arrays_of(seed: int, size: int) -> Arrays:
    return {f"t{i}": np.random.default_rng(seed * 10 + i).random(size + i) for i in range(4)}


A = arrays_of(1, 40_000)
B = arrays_of(2, 50_000)
DATA_A, DATA_B = reference_numpy.save(A), reference_numpy.save(B)


class DownloadServer(RangeHTTPServer):
    """A download API: ``/get?file=NAME&token=...`` is the object ``/get/NAME`` (each with an
    ETag of its own); the token only authorizes."""

    def _answer(self, connection: Any, reader: Any, method: str, target: str, headers: Any) -> bool:
        path, _, query = target.partition("?")
        names = [v for n, _, v in (p.partition("=") for p in query.split("&")) if n == "file"]
        return super()._answer(
            connection, reader, method, f"{path}/{names[0]}" if names else path, headers
        )

    def _validators(self, path: str) -> dict[str, str]:
        headers = super()._validators(path)
        headers["ETag"] = f'"{path.rsplit("/", 1)[-1]}"'
        return headers


command = run_command


# ------------------------------------------------------------------ 1: the query names the object


async def test_objects_told_apart_by_a_query_beside_a_token_are_two_copies(
    tmp_path: Path,
) -> None:
    """``?file=a&token=X`` and ``?file=b&token=Y`` were one entry (a signed query was dropped
    whole): offline, A was answered with B's bytes; read at once, B with A's."""
    objects = {"/get/a": DATA_A, "/get/b": DATA_B}
    with DownloadServer(objects=objects, etag="strong") as running:
        url_a = running.url("/get?file=a&token=s3cr3tAAA")
        url_b = running.url("/get?file=b&token=s3cr3tBBB")
        await read_as(url_a, A, "fetch", cache=tmp_path)
        await read_as(url_b, B, "fetch", cache=tmp_path)
        # the same object signed again (another token, another order) is the same copy
        await read_as(running.url("/get?token=other999&file=a"), A, "hit", cache=tmp_path)

        offline = dataclasses.replace(Cache.at(tmp_path), offline=True)
        for url, expected in ((url_a, A), (url_b, B)):
            await read_as(url, expected, "offline", cache=offline)

        running.rate = 2e6  # both at once: the second must not follow the first's copy
        both = tmp_path / "both"
        (got_a, _), (got_b, _) = await asyncio.gather(
            read(url_a, cache=both), read(url_b, cache=both)
        )
        assert_same_arrays(got_a, A)
        assert_same_arrays(got_b, B)

    listed = command("cache", "ls", "--json", "--dir", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    shown = [json.loads(line)["address"] for line in listed.stdout.splitlines()]
    assert sorted(shown) == [f"http://127.0.0.1:{running.port}/get"] * 2
    for file in (*tmp_path.rglob("*"), *tmp_path.rglob(".*")):
        assert "s3cr3t" not in str(file) and "other999" not in str(file)
        if file.is_file():
            assert b"s3cr3t" not in file.read_bytes()


def test_the_key_drops_only_what_signs() -> None:
    def key(address: str) -> str:
        return object_key(address).key

    s3 = "https://b.s3.amazonaws.com/m?X-Amz-Signature={}&X-Amz-Date={}&versionId={}"
    assert key(s3.format("aa", "1", "v1")) == key(s3.format("bb", "2", "v1"))
    assert key(s3.format("aa", "1", "v1")) != key(s3.format("aa", "1", "v2"))
    sas = "https://a.blob.core.windows.net/c/m?sv=2022&se={}&sp=r&sr=b&sig={}"
    unsigned = sas[: sas.index("?")]
    assert key(sas.format("2030", "x")) == key(sas.format("2031", "y")) == key(unsigned)
    front = "https://d.cloudfront.net/m?Expires={}&Signature={}&Key-Pair-Id=K&part=2"
    assert key(front.format(1, "s")) == key(front.format(2, "t")) != key(front.format(1, "s")[:-7])
    assert key("https://h/m?a=1&b=2") == key("https://h/m?b=2&a=1") != key("https://h/m?a=1")
    assert key("https://h/m?st=1") != key("https://h/m")  # no SAS here: not a signature's
    assert key("https://h/get?file=a&api_key=K1") == key("https://h/get?file=a&api_key=K2")
    assert key("https://h/get?file=a&sig=1") != key("https://h/get?file=b&sig=1")


# ------------------------------------------------------------------ 2: odd records


@pytest.mark.parametrize(
    ("field", "value"),
    [
        *(("size", None), ("size", "1234"), ("size", True), ("shown", None), ("shown", 7)),
        *(("extra", []), ("extra", {"repo_id": 5}), ("fingerprint", "x"), ("created", "x")),
    ],
)
def test_a_record_with_a_field_of_another_type_is_damage(
    tmp_path: Path, field: str, value: object
) -> None:
    """``"size": null``, ``"shown": 7``, a list for ``extra``... made ``cache ls`` and
    ``cache rm`` fail with an internal error (exit 3)."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA_A}, etag="strong") as running:
        url = running.url("/m.safetensors")
        asyncio.run(read(url, cache=tmp_path))
        (record,) = (tmp_path / "objects").glob("*/*.json")
        data = json.loads(record.read_text())
        data[field] = value
        record.write_text(json.dumps(data))
        assert entries(Cache.at(tmp_path)) == []  # not a copy the cache can describe
        for args in (["ls"], ["ls", "--json"], ["rm", "--all"], ["prune", "--max-size", "0"]):
            done = command("cache", *args, "--dir", str(tmp_path))
            assert done.returncode in (0, 1), (args, done.stderr)
            assert "internal error" not in done.stderr
        arrays, state = asyncio.run(read(url, cache=tmp_path))
        assert state == "fetch"  # the damaged copy is not trusted
        assert_same_arrays(arrays, A)
    assert command("cache", "ls", "--dir", str(tmp_path)).returncode == 0


# ------------------------------------------------------------------ 3: a copy given up


async def test_a_copy_given_up_releases_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A writer that could not reserve room for its copy gave it up but kept the entry's lock
    for its whole read: every other reader of the object waited for it."""
    from stream_st.transports.cache import tee

    allocate = tee._allocate
    refused: list[int] = []

    def no_room_once(fd: int, size: int, reserve: bool) -> None:
        if not refused:
            refused.append(size)
            raise OSError(errno.ENOSPC, "No space left on device")
        allocate(fd, size, reserve)

    monkeypatch.setattr(tee, "_allocate", no_room_once)
    with RangeHTTPServer(objects={"/m.safetensors": DATA_A}, etag="strong") as running:
        url = running.url("/m.safetensors")
        first = stream_st.open_stream(url, cache=tmp_path)
        tensors = aiter(first)
        with pytest.warns(RuntimeWarning, match="not keeping a copy: no room"):
            name, array = await anext(tensors)
        assert refused and getattr(first, "cache_state", None) == "fetch"
        np.testing.assert_array_equal(array, A[name])
        try:
            (lock,) = (tmp_path / "objects").glob("*/lock")
            probe = EntryLock(lock)
            assert probe.try_acquire()  # nobody holds it: the first writes no copy
            probe.release()
            arrays, state = await asyncio.wait_for(read(url, cache=tmp_path), 20)
            assert state == "fetch"  # by itself, and keeps the copy
            assert_same_arrays(arrays, A)
            rest = {n: a async for n, a in tensors}
            assert_same_arrays({name: array, **rest}, A)
        finally:
            await first.aclose()
        arrays, state = await read(url, cache=tmp_path)
        assert state == "hit"


# ------------------------------------------------------------------ 4: a killed writer's leftovers

WRITER = """
import asyncio, sys
import stream_st
cache = True if sys.argv[2] == "default" else sys.argv[2]  # default: the environment's
asyncio.run(stream_st.load(sys.argv[1], cache=cache))
"""


def kill_while_writing(url: str, cache: Path, part: str, *, default: bool = False) -> None:
    """A process reading ``url`` through ``cache`` (``default``: the environment's cache, in
    ``cache``), killed once files ``part`` appear under it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    where = "default" if default else str(cache)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, url, where], env=env)
    give_up = time.monotonic() + 30
    while not list(cache.rglob(part)) and time.monotonic() < give_up:
        time.sleep(0.01)
    time.sleep(0.3)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert list(cache.rglob(part))


def on_disk(root: Path) -> int:
    return sum(p.lstat().st_blocks * 512 for p in root.rglob("*") if p.is_file())


def test_a_killed_writers_leftovers_are_listed_and_pruned(tmp_path: Path) -> None:
    """A SIGKILLed writer's preallocated ``.part`` and ``.growing`` were never seen by
    ``cache ls``, ``prune`` or the cap: the object's size on disk for good."""
    big = reference_numpy.save(arrays_of(3, 500_000))  # 16 MB, preallocated
    with RangeHTTPServer(objects={"/m.safetensors": big}, etag="strong", rate=2e6) as running:
        url = running.url("/m.safetensors")
        kill_while_writing(url, tmp_path, "objects/*/*.part")
    assert on_disk(tmp_path) >= len(big)
    cache = Cache.at(tmp_path)
    (left,) = entries(cache)
    assert left.leftover and not left.complete and left.size >= len(big)
    assert left.shown.startswith(url)
    listed = command("cache", "ls", "--dir", str(tmp_path))
    assert listed.returncode == 0 and "leftover" in listed.stdout, listed.stderr

    held = EntryLock(left.lock) if left.lock is not None else None
    assert held is not None and held.try_acquire()  # a live writer's: left alone
    try:
        (writing,) = entries(cache)  # listed as being written
        assert writing.writing and not writing.leftover
        assert prune(cache, 1 << 40) == []
    finally:
        held.release()

    pruned = command("cache", "prune", "--max-size", "1T", "--dir", str(tmp_path))
    assert pruned.returncode == 0 and "removed 1 copies" in pruned.stdout, pruned.stdout
    assert on_disk(tmp_path) < 4096 * 4
    assert [p.name for p in (tmp_path / "objects").glob("*/*")] == ["lock"]


def test_a_cap_evicts_a_killed_writers_leftovers(tmp_path: Path) -> None:
    big = reference_numpy.save(arrays_of(3, 500_000))
    with RangeHTTPServer(objects={"/m.safetensors": big}, etag="strong", rate=2e6) as running:
        kill_while_writing(running.url("/m.safetensors"), tmp_path, "objects/*/*.part")
        running.rate = None
        running.objects["/o.safetensors"] = DATA_A
        capped = dataclasses.replace(Cache.at(tmp_path), max_size=10 << 20)
        asyncio.run(read(running.url("/o.safetensors"), cache=capped))
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob(".growing"))
    (kept,) = entries(Cache.at(tmp_path))
    assert kept.complete and kept.shown.endswith("/o.safetensors")


def test_a_killed_hub_writers_leftover_is_pruned(hub: FakeHub, tmp_path: Path) -> None:
    big = reference_numpy.save(arrays_of(3, 500_000))
    hub.push("org/model", {"model.safetensors": big})
    hub.cdn.rate = 2e6
    part = "hub-cache/*/.stream_st/*.part"
    kill_while_writing("hf://org/model/model.safetensors", tmp_path, part, default=True)
    cache = Cache.default()
    (killed,) = entries(cache)
    assert killed.leftover and killed.lock is not None
    held = EntryLock(killed.lock)
    assert held.try_acquire()  # as a live writer of the blob holds it: being written
    try:
        (writing,) = entries(cache)
        assert writing.writing and "being written" in writing.shown
        assert prune(cache, 0) == []
    finally:
        held.release()
    hub.cdn.rate = None
    hub.push("org/model", {"model.safetensors": DATA_A})  # the file changes: another blob
    asyncio.run(read("hf://org/model/model.safetensors", cache=True))
    left = [e for e in entries(cache) if e.leftover]
    assert len(left) == 1 and left[0].size >= len(big)
    listed = command("cache", "ls")
    assert listed.returncode == 0 and "leftover" in listed.stdout
    assert len(prune(cache, 1 << 40)) == 1
    assert not list(tmp_path.rglob("*.part"))
    (kept,) = entries(cache)
    assert kept.complete and kept.shown.startswith("hf://org/model@")


# ------------------------------------------------------------------ 5: a blob huggingface_hub got


def test_a_blob_huggingface_hub_downloaded_is_listed_by_its_address(
    hub: FakeHub, tmp_path: Path
) -> None:
    """Checked by stream_st, it was recorded as a bare path (``model.safetensors``): listed so,
    and ``cache rm 'hf://org/model@*'`` missed it."""
    commit = hub.push("org/model", {"model.safetensors": DATA_A})
    downloaded_by_huggingface_hub(hub, tmp_path)
    asyncio.run(read_as("hf://org/model/model.safetensors", A, "hit", cache=True))
    (entry,) = entries(Cache.default())
    assert entry.shown == f"hf://org/model@{commit}/model.safetensors"
    removed = command("cache", "rm", "hf://org/model@*")
    assert removed.returncode == 0, removed.stderr
    assert entries(Cache.default()) == []
