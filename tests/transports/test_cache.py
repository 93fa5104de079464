"""``cache=``: local copies of remote objects, kept while read (stream_st.transports.cache).

Real servers on 127.0.0.1 (the Python test server, nginx where installed, moto's S3, the fake
Hub and its CDN) and real processes: two readers at once, a writer killed with SIGKILL.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.cache import Cache, CacheMissError, parse_size
from stream_st.transports.cache.keys import object_key
from stream_st.transports.cache.layout import partner
from stream_st.transports.cache.manage import entries, prune, remove

from .._util import assert_same_arrays, run_command
from ..servers.http_server import RangeHTTPServer
from ..servers.hub_server import CDN_HOST, FakeHub
from ..servers.s3_server import CREDENTIALS, MotoS3Server

Arrays = dict[str, np.ndarray[Any, Any]]
ARRAYS: Arrays = {f"t{i}": np.random.default_rng(i).random(40_000 + i) for i in range(4)}
DATA = reference_numpy.save(ARRAYS)
OTHER: Arrays = {"t0": np.arange(1000, dtype=np.float32)}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def server() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        yield running


async def read(source: str, **options: Any) -> tuple[Arrays, str | None]:
    stream = stream_st.open_stream(source, **options)
    arrays = {name: array async for name, array in stream}
    return arrays, getattr(stream, "cache_state", None)


async def read_as(source: str, expected: Arrays, state: str, **options: Any) -> None:
    """:func:`read` ``source``: ``expected`` came, served by the cache as ``state``."""
    arrays, served = await read(source, **options)
    assert served == state
    assert_same_arrays(arrays, expected)


def body_bytes(server: RangeHTTPServer) -> int:
    server.settle()
    return sum(sent for _, _, _, sent in server.requests)


def files_under(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() or p.is_symlink())


# ------------------------------------------------------------------ http(s)://


async def test_first_read_keeps_a_copy_and_the_next_is_served_from_it(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    url = server.url("/m.safetensors")
    await read_as(url, ARRAYS, "fetch", cache=tmp_path)
    assert body_bytes(server) == len(DATA)
    copies = list((tmp_path / "objects").rglob("*.safetensors"))
    assert len(copies) == 1 and copies[0].read_bytes() == DATA
    assert not list(tmp_path.rglob("*.part")) and not list(tmp_path.rglob("*.tmp"))

    await read_as(url, ARRAYS, "hit", cache=tmp_path)
    server.settle()
    method, _, _, sent = server.requests[-1]
    assert (method, sent) == ("GET", 0)  # one conditional request, answered 304
    assert server.headers_seen[-1][2]["if-none-match"] == '"v0"'
    assert body_bytes(server) == len(DATA)


async def test_every_entry_point_takes_cache(server: RangeHTTPServer, tmp_path: Path) -> None:
    url = server.url("/m.safetensors")
    assert_same_arrays(await stream_st.load(url, cache=tmp_path), ARRAYS)
    header = await stream_st.read_header(url, cache=tmp_path)
    assert header.names() == list(ARRAYS)
    assert body_bytes(server) == len(DATA)


async def test_a_changed_object_is_fetched_again(tmp_path: Path) -> None:
    new = reference_numpy.save(OTHER)
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        url = running.url("/m.safetensors")
        await read(url, cache=tmp_path)
        running.replace_after["/m.safetensors"] = (0, new)  # a new version, a new ETag
        await read_as(url, OTHER, "fetch", cache=tmp_path)
        await read_as(url, OTHER, "hit", cache=tmp_path)
    copies = list((tmp_path / "objects").rglob("*.safetensors"))
    assert [c.read_bytes() for c in copies] == [new]  # the old version is gone


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_a_damaged_copy_is_never_handed_out(
    server: RangeHTTPServer, tmp_path: Path, damage: str
) -> None:
    url = server.url("/m.safetensors")
    await read(url, cache=tmp_path)
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    raw = bytearray(copy.read_bytes())
    if damage == "flip":
        raw[len(raw) // 2] ^= 0xFF
        copy.write_bytes(raw)
    else:
        copy.write_bytes(raw[: len(raw) // 2])
    offline = Cache(tmp_path, tmp_path / "hub", offline=True)
    with pytest.raises(CacheMissError):  # offline: the damaged copy is found out, not used
        await read(url, cache=offline)
    await read_as(url, ARRAYS, "fetch", cache=tmp_path)
    assert body_bytes(server) == 2 * len(DATA)
    await read_as(url, ARRAYS, "offline", cache=offline)


async def test_an_unchanged_touched_copy_is_checked_and_used(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    url = server.url("/m.safetensors")
    await read(url, cache=tmp_path)
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    copy.write_bytes(copy.read_bytes())  # same bytes, another fingerprint: hashed again
    await read_as(url, ARRAYS, "hit", cache=tmp_path)


async def test_a_stream_opened_from_two_tasks_at_once_asks_the_cache_once(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    """The second open() waits for the first one's and gets its header: each open asked the
    cache (a request each, the second reading the copy the first was writing, 'shared')."""
    url = server.url("/m.safetensors")
    for state in ("fetch", "hit"):
        stream = stream_st.open_stream(url, cache=tmp_path)
        first, second = await asyncio.gather(stream.open(), stream.open())
        assert first is second and getattr(stream, "cache_state", None) == state
        assert_same_arrays({name: array async for name, array in stream}, ARRAYS)
        await stream.aclose()  # opened before the iteration: not closed at its end
    server.settle()
    assert len(server.requests) == 2


async def test_a_stream_iterated_while_another_task_opens_it_asks_the_cache_once(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    """An iteration begun before open() opens the stream through open(): the open() another
    task calls meanwhile waits for it and gets its header. The iteration resolved the address
    itself, unseen by open(), which resolved it again: the cache asked twice (two requests),
    what the first resolve opened (the remote object's connection, the copy read ahead)
    dropped unclosed (a ResourceWarning)."""
    url = server.url("/m.safetensors")
    for state in ("fetch", "hit"):
        stream = stream_st.open_stream(url, cache=tmp_path)

        async def iterate(stream: stream_st.TensorStream = stream) -> Arrays:
            return {name: array async for name, array in stream}

        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            arrays, header = await asyncio.gather(iterate(), stream.open())
            gc.collect()
        assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
        assert_same_arrays(arrays, ARRAYS)
        assert header is stream.header and sorted(header.names()) == sorted(ARRAYS)
        assert getattr(stream, "cache_state", None) == state
    server.settle()
    assert len(server.requests) == 2


async def test_offline(
    server: RangeHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = server.url("/m.safetensors")
    offline = Cache(tmp_path, tmp_path / "hub", offline=True)
    with pytest.raises(CacheMissError) as missing:
        await read(url, cache=offline)
    assert isinstance(missing.value, stream_st.SafetensorsError)
    server.settle()
    assert server.requests == []
    await read(url, cache=tmp_path)
    server.settle()
    count = len(server.requests)
    await read_as(url, ARRAYS, "offline", cache=offline)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, state = await read(url, cache=tmp_path)
    assert state == "offline"
    server.settle()
    assert len(server.requests) == count  # no request at all


async def test_an_unreachable_server_leaves_the_copy_in_use(tmp_path: Path) -> None:
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        url = running.url("/m.safetensors")
        await read(url, cache=tmp_path)
    await read_as(url, ARRAYS, "stale", cache=tmp_path)  # the server is gone


async def test_a_read_stopped_part_way_leaves_no_copy_under_the_final_name(
    tmp_path: Path,
) -> None:
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong", no_range=True) as running:
        url = running.url("/m.safetensors")
        async with stream_st.open_stream(url, cache=tmp_path) as stream:
            async for _ in stream:
                break
        assert not list(tmp_path.rglob("*.safetensors"))
        assert not list(tmp_path.rglob("*.part"))  # no ranges: nothing to resume
        await read_as(url, ARRAYS, "fetch", cache=tmp_path)


async def test_an_etag_no_request_can_carry_is_no_validator_of_the_copy(
    server: RangeHTTPServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A server's ETag holding a NUL went into the copy's record, which then failed its own
    check (its ETag cannot be sent in If-None-Match): the copy, on disk, was listed by no
    cache ls, counted by no cap and never used. The ETag is no validator: the copy is listed
    (fetched again at each read, as a copy of no validator is)."""
    monkeypatch.setattr(server, "_validators", lambda path: {"ETag": '"a\x00b"'})
    url = server.url("/m.safetensors")
    await read_as(url, ARRAYS, "fetch", cache=tmp_path)
    (entry,) = entries(Cache.at(tmp_path))
    assert entry.complete and entry.shown == url
    await read_as(url, ARRAYS, "fetch", cache=tmp_path)
    assert len(entries(Cache.at(tmp_path))) == 1


async def test_include_keeps_what_it_fetched_and_a_full_read_fetches_the_rest(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    url = server.url("/m.safetensors")
    header = await stream_st.read_header(url)
    server.requests.clear()
    arrays, _ = await read(url, cache=tmp_path, include=["t1"])
    assert_same_arrays(arrays, {"t1": ARRAYS["t1"]})
    assert not list(tmp_path.rglob("*.safetensors"))
    assert len(list(tmp_path.rglob("*.part"))) == 1
    first = body_bytes(server)
    server.requests.clear()
    await read_as(url, ARRAYS, "fetch", cache=tmp_path)
    t1 = header["t1"]
    second = body_bytes(server)
    first_range = 64 << 10  # each read's first request (the freshness check) asks for 64 KiB
    assert second <= len(DATA) - t1.nbytes + first_range  # t1 came from the partial copy
    # Each byte fetched about once: the server may have sent a piece more of a range into the
    # socket than the reader took before it let the connection go (seen once in a loaded run).
    assert first + second <= len(DATA) + 3 * first_range
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    assert copy.read_bytes() == DATA
    arrays, state = await read(url, cache=tmp_path)
    assert state == "hit"


async def test_no_secret_reaches_the_disk(tmp_path: Path) -> None:
    path = "/m.safetensors"
    with RangeHTTPServer(objects={path: DATA}, etag="strong") as running:
        url = f"http://user:hunter2@127.0.0.1:{running.port}{path}?X-Amz-Signature=sekrit99&x=1"
        await read(url, cache=tmp_path)
        other = f"http://127.0.0.1:{running.port}{path}?x=1&X-Amz-Signature=another"
        _, state = await read(other, cache=tmp_path)
        assert state == "hit"  # the signature is not part of the object's name
    for file in files_under(tmp_path):
        for secret in ("hunter2", "sekrit99", "user:"):
            assert secret not in str(file)
            if file.suffix == ".json":
                assert secret not in file.read_text()
    assert object_key(url).shown == f"http://127.0.0.1:{running.port}{path}"


def test_sizes() -> None:
    assert parse_size("50G") == 50 << 30
    assert parse_size("1.5M") == 3 << 19
    assert parse_size("2GB") == 2_000_000_000
    assert parse_size("123") == 123
    with pytest.raises(stream_st.UsageError):
        parse_size("lots")
    with pytest.raises(stream_st.UsageError):
        stream_st.open_stream("http://127.0.0.1:1/x.safetensors", cache=3)  # type: ignore[call-overload]


def test_a_cap_that_is_no_size_names_the_variable(tmp_path: Path) -> None:
    """``STREAM_ST_CACHE_MAX=bogus`` was refused as ``not a size: 'bogus'``, by the library and
    the command alike, with no word of where the value came from."""
    refusal = "STREAM_ST_CACHE_MAX in the environment: not a size: 'bogus'"
    with pytest.raises(stream_st.UsageError, match=refusal):
        Cache.default({"STREAM_ST_CACHE": str(tmp_path), "STREAM_ST_CACHE_MAX": "bogus"})
    pruned = run_command(
        "cache", "prune", env={"STREAM_ST_CACHE": str(tmp_path), "STREAM_ST_CACHE_MAX": "bogus"}
    )
    assert pruned.returncode == 2 and f"stream-st: error: {refusal}" in pruned.stderr


async def test_the_cap_evicts_the_least_recently_used(tmp_path: Path) -> None:
    objects = {f"/m{i}.safetensors": DATA for i in range(3)}
    with RangeHTTPServer(objects=objects, etag="strong") as running:
        cache = Cache(tmp_path, tmp_path / "hub", max_size=2 * len(DATA) + 10)
        for i in range(3):
            await read(running.url(f"/m{i}.safetensors"), cache=cache)
            await asyncio.sleep(0.02)
        kept = sorted(e.shown.rsplit("/", 1)[1] for e in entries(cache))
        assert kept == ["m1.safetensors", "m2.safetensors"]
        _, state = await read(running.url("/m1.safetensors"), cache=cache)  # m1 used last
        assert state == "hit"
        await read(running.url("/m0.safetensors"), cache=cache)
        kept = sorted(e.shown.rsplit("/", 1)[1] for e in entries(cache))
        assert kept == ["m0.safetensors", "m1.safetensors"]
        assert prune(cache, 0) and entries(cache) == []


# ------------------------------------------------------------------ processes

READER = """
import asyncio, sys
import stream_st
async def main():
    arrays = await stream_st.load(sys.argv[1], cache=sys.argv[2])
    print(sum(float(a.sum()) for a in arrays.values()), flush=True)
asyncio.run(main())
"""


def reader(url: str, cache: Path, script: str = READER) -> subprocess.Popen[str]:
    """A process running ``script`` (by default a cached ``load``) on ``url`` and ``cache``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("HF_HUB_OFFLINE", None)
    return subprocess.Popen(
        [sys.executable, "-c", script, url, str(cache)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_two_processes_reading_at_once_fetch_the_object_once(tmp_path: Path) -> None:
    expected = sum(float(a.sum()) for a in ARRAYS.values())
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong", rate=2e6) as running:
        url = running.url("/m.safetensors")
        first, second = reader(url, tmp_path), reader(url, tmp_path)
        outs = [p.communicate(timeout=60) for p in (first, second)]
        for process, (out, err) in zip((first, second), outs, strict=True):
            assert process.returncode == 0, err
            assert float(out) == pytest.approx(expected)
        assert body_bytes(running) < len(DATA) + (128 << 10)  # fetched once


def writing(url: str, cache: Path) -> subprocess.Popen[str]:
    """A process reading ``url`` into ``cache``, once it has begun its copy and published its
    progress, which names the address (within 30 s; the copy is made and allocated first)."""
    process = reader(url, cache)
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up and not (
        list(cache.rglob("*.part")) and list(cache.rglob(".growing"))
    ):
        time.sleep(0.01)
    return process


def test_a_killed_writer_leaves_nothing_the_next_reader_trusts(tmp_path: Path) -> None:
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong", rate=1e6) as running:
        url = running.url("/m.safetensors")
        writer = writing(url, tmp_path)
        time.sleep(0.3)  # part way through the body
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
        assert list(tmp_path.rglob("*.part"))
        assert not list(tmp_path.rglob("*.safetensors"))
        running.rate = None
        arrays, state = asyncio.run(read(url, cache=tmp_path))
        assert state == "fetch"
        assert_same_arrays(arrays, ARRAYS)
    names = sorted(p.name.partition(".")[2] or p.name for p in files_under(tmp_path / "objects"))
    assert names == ["json", "lock", "safetensors"]  # the dead writer's partial copy is gone


KILLED_IN_THE_COMMIT = """
import asyncio, os, signal, sys
import stream_st
from stream_st.transports.cache import layout, store

def killed(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

if sys.argv[3] == "record":  # killed right after the copy is moved into place
    store.Record.save = killed
else:  # killed right after the first removal of an old version's file
    remove = layout.remove_quietly

    def remove_then_killed(*paths):
        remove(*paths)
        if any(path.name.endswith((".json", ".safetensors")) for path in paths):
            if not any(path.name.endswith(".part.json") for path in paths):
                killed()

    layout.remove_quietly = remove_then_killed
asyncio.run(stream_st.load(sys.argv[1], cache=sys.argv[2]))
"""


def killed_in_the_commit(url: str, cache: Path, where: str) -> None:
    """A cached ``load`` of ``url`` killed in its commit (``where``: "record", before the
    record is written; "clean", after the first removal of an old version's files)."""
    killed = reader(url, cache, KILLED_IN_THE_COMMIT.replace("sys.argv[3]", repr(where)))
    killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL


def test_a_copy_whose_writer_was_killed_before_its_record_is_a_leftover(tmp_path: Path) -> None:
    """Killed between the copy's move into place and its record's write, a writer left a whole
    copy no record names: listed as a leftover of 4 kB (its progress file), unseen by prune
    and rm, outside the cap, until the same address was read again."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        url = running.url("/m.safetensors")
        killed_in_the_commit(url, tmp_path, "record")
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    assert not copy.with_suffix(".json").exists()
    cache = Cache.at(tmp_path)
    (entry,) = entries(cache)
    assert entry.leftover and entry.shown == f"{url} (left by a killed writer)"
    assert copy in entry.files and entry.size >= len(DATA)  # counted at its size on disk
    assert prune(cache, 10 << 30) == [entry]
    assert not copy.exists() and entries(cache) == []


def test_a_writer_killed_removing_an_old_version_leaves_its_copy_not_its_record(
    tmp_path: Path,
) -> None:
    """The old version's files were removed in the folder's order: a writer killed between
    the two could leave the record of a copy that is gone. The record goes first."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        url = running.url("/m.safetensors")
        asyncio.run(read(url, cache=tmp_path))
        (old,) = (tmp_path / "objects").rglob("*.safetensors")
        running.replace_after["/m.safetensors"] = (0, reference_numpy.save(OTHER))  # new ETag
        killed_in_the_commit(url, tmp_path, "clean")
        assert old.exists() and not old.with_suffix(".json").exists()
        complete, left = sorted(entries(Cache.at(tmp_path)), key=lambda entry: entry.leftover)
        assert complete.complete and complete.shown == url
        assert left.leftover and old in left.files
        arrays, state = asyncio.run(read(url, cache=tmp_path))
        assert state == "hit"  # the new version, committed before the kill
        assert_same_arrays(arrays, OTHER)
    assert [entry.complete for entry in entries(Cache.at(tmp_path))] == [True]


def test_a_record_whose_copy_is_gone_is_a_leftover_not_a_copy(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    """A record left with no copy was listed as a complete copy of the object's size, counted
    by the cap (which could evict real copies for it), and "removed" by rm --all."""
    url = server.url("/m.safetensors")
    asyncio.run(read(url, cache=tmp_path))
    (copy,) = (tmp_path / "objects").rglob("*.safetensors")
    copy.unlink()
    cache = Cache.at(tmp_path)
    (entry,) = entries(cache)
    assert entry.leftover and not entry.complete
    assert entry.files == [copy.with_suffix(".json")] and entry.size < len(DATA)
    assert prune(cache, 10 << 30) == [entry] and entries(cache) == []
    assert asyncio.run(read(url, cache=tmp_path))[1] == "fetch"


@pytest.mark.parametrize(
    ("include", "ending", "command"),
    [(None, ".safetensors", ["rm", "--all"]), (["t1"], ".part", ["prune", "--max-size", "1G"])],
)
def test_a_folder_in_a_copy_s_place_is_damage_that_rm_and_prune_remove(
    server: RangeHTTPServer,
    tmp_path: Path,
    include: list[str] | None,
    ending: str,
    command: list[str],
) -> None:
    """A folder made in a copy's place (or a partial copy's) was listed as a copy, and cache rm
    --all failed ("Is a directory"), removing nothing; it is listed as damaged, and rm and
    prune remove it, its record and what the folder holds."""
    url = server.url("/m.safetensors")
    asyncio.run(read(url, cache=tmp_path, include=include))
    (copy,) = (tmp_path / "objects").rglob(f"*{ending}")
    record = copy.with_name(str(partner(copy.name)))
    copy.unlink()
    copy.mkdir()
    (copy / "kept").write_bytes(b"x")
    (entry,) = entries(Cache.at(tmp_path))
    assert entry.leftover and not entry.complete and entry.shown == f"{url} (damaged)"
    assert sorted(entry.files) == sorted([copy, record])
    done = run_command("cache", *command, "--dir", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert f"removed {url} (damaged)" in done.stdout
    assert not copy.exists() and not record.exists() and entries(Cache.at(tmp_path)) == []
    assert asyncio.run(read(url, cache=tmp_path))[1] == "fetch"


def test_a_first_copy_being_written_is_listed_and_left_alone(tmp_path: Path) -> None:
    """While a first copy was written, cache ls listed nothing and rm --all said the cache held
    no copy. The copy takes about 6 s (1.3 MB at 200 kB/s): the two commands run meanwhile
    take a second or two on a loaded machine."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong", rate=2e5) as running:
        url = running.url("/m.safetensors")
        writer = writing(url, tmp_path)
        cache = Cache.at(tmp_path)
        (entry,) = entries(cache)
        assert entry.writing and not entry.leftover and not entry.complete
        assert entry.shown == f"{url} (being written)"
        assert not remove(entry) and prune(cache, 0) == []
        listed = run_command("cache", "ls", "--cache-dir", str(tmp_path))
        assert listed.stdout.splitlines()[1].split()[-1] == "writing", listed.stdout
        listed = run_command("cache", "ls", "--cache-dir", str(tmp_path), "--json")
        assert json.loads(listed.stdout)["writing"] is True, listed.stdout
        _, err = writer.communicate(timeout=60)
        assert writer.returncode == 0, err
    (entry,) = entries(cache)
    assert entry.complete and entry.shown == url


# ------------------------------------------------------------------ nginx, S3


async def test_nginx(small_nginx: Any, tmp_path: Path) -> None:
    url = small_nginx.url("m.safetensors")
    first, state = await read(url, cache=tmp_path)
    assert state == "fetch"
    small_nginx.clear_log()
    again, state = await read(url, cache=tmp_path)
    assert state == "hit"
    assert_same_arrays(again, first)
    (logged,) = small_nginx.requests()
    assert (logged.status, logged.sent) == (304, 0)


@pytest.fixture
def aws_env(moto_s3: MotoS3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3.endpoint_url)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    client = moto_s3.client()
    client.create_bucket(Bucket="cached")
    client.put_object(Bucket="cached", Key="m.safetensors", Body=DATA)


async def test_s3(aws_env: None, moto_s3: MotoS3Server, tmp_path: Path) -> None:
    url = "s3://cached/m.safetensors"
    cache = tmp_path / "cache"
    await read_as(url, ARRAYS, "fetch", cache=cache)
    await read_as(url, ARRAYS, "hit", cache=cache)
    moto_s3.client().put_object(
        Bucket="cached", Key="m.safetensors", Body=reference_numpy.save(OTHER)
    )
    await read_as(url, OTHER, "fetch", cache=cache)
    (entry,) = entries(Cache.at(cache))
    assert entry.shown == url


# ------------------------------------------------------------------ hf://


async def test_hub_files_go_into_the_hugging_face_layout(hub: FakeHub, tmp_path: Path) -> None:
    commit = hub.push("org/model", {"model.safetensors": DATA})
    await read_as("hf://org/model/model.safetensors", ARRAYS, "fetch", cache=True)
    sha = hashlib.sha256(DATA).hexdigest()
    storage = tmp_path / "hub-cache" / "models--org--model"
    assert (storage / "blobs" / sha).read_bytes() == DATA
    assert (storage / "refs" / "main").read_text() == commit
    pointer = storage / "snapshots" / commit / "model.safetensors"
    assert pointer.is_symlink() and pointer.resolve() == (storage / "blobs" / sha)

    hub.log.clear()
    await read_as("hf://org/model/model.safetensors", ARRAYS, "hit", cache=True)
    seen = hub.seen()
    assert [(r.host, r.method) for r in seen] == [("127.0.0.1", "HEAD")]
    hub.log.clear()
    _, state = await read(f"hf://org/model@{commit}/model.safetensors", cache=True)
    assert state == "hit"
    assert hub.seen() == []  # a commit in the cache: no request at all
    for request in hub.log:
        assert request.host != CDN_HOST or "authorization" not in request.headers

    pytest.importorskip("huggingface_hub")  # which finds the file in that layout itself
    from huggingface_hub import hf_hub_download

    found = hf_hub_download(
        "org/model", "model.safetensors", cache_dir=tmp_path / "hub-cache", local_files_only=True
    )
    assert Path(found).read_bytes() == DATA


def downloaded_by_huggingface_hub(hub: FakeHub, tmp_path: Path) -> None:
    """``org/model``'s ``model.safetensors`` put in the cache (``tmp_path / "hub-cache"``) by
    ``huggingface_hub`` itself (the test skipped where it is not installed)."""
    pytest.importorskip("huggingface_hub")
    from huggingface_hub import hf_hub_download

    hf_hub_download(
        "org/model",
        "model.safetensors",
        cache_dir=tmp_path / "hub-cache",
        endpoint=hub.endpoint,
        token=hub.token,
    )


async def test_hub_reads_a_blob_huggingface_hub_downloaded(hub: FakeHub, tmp_path: Path) -> None:
    hub.push("org/model", {"model.safetensors": DATA})
    downloaded_by_huggingface_hub(hub, tmp_path)
    hub.log.clear()
    await read_as("hf://org/model/model.safetensors", ARRAYS, "hit", cache=True)
    assert [r.host for r in hub.seen()] == ["127.0.0.1"]


async def test_hub_damaged_blob_and_offline(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.push("org/model", {"model.safetensors": DATA})
    address = "hf://org/model/model.safetensors"
    await read(address, cache=True)
    (blob,) = (tmp_path / "hub-cache").rglob("blobs/*")
    raw = bytearray(blob.read_bytes())
    raw[-1] ^= 0xFF
    blob.write_bytes(raw)
    await read_as(address, ARRAYS, "fetch", cache=True)
    assert blob.read_bytes() == DATA
    hub.log.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _, state = await read(address, cache=True)
    assert state == "offline"
    assert hub.seen() == []
    with pytest.raises(CacheMissError):
        await read("hf://org/model/other.safetensors", cache=True)


async def test_a_snapshot_link_re_pointed_elsewhere_reads_the_blob(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A snapshot link re-pointed at a file outside the cache that bears the blob's name: the
    blob was checked, then the link (the outside file) was read, with no request at a pinned
    commit. The checked blob is what is read, pinned, offline and stale alike."""
    commit = hub.push("org/model", {"model.safetensors": DATA})
    await read("hf://org/model/model.safetensors", cache=True)
    pointer = tmp_path / "hub-cache" / "models--org--model" / "snapshots" / commit
    pointer = pointer / "model.safetensors"
    outside = tmp_path / "elsewhere" / Path(os.readlink(pointer)).name
    outside.parent.mkdir()
    outside.write_bytes(reference_numpy.save(OTHER))
    pointer.unlink()
    pointer.symlink_to(outside)
    hub.log.clear()
    arrays, state = await read(f"hf://org/model@{commit}/model.safetensors", cache=True)
    assert state == "hit" and hub.seen() == []
    assert_same_arrays(arrays, ARRAYS)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    arrays, state = await read("hf://org/model/model.safetensors", cache=True)
    assert state == "offline"
    assert_same_arrays(arrays, ARRAYS)


@pytest.mark.parametrize("status", [500, 503, 429, 404])
async def test_a_hub_failing_its_head_leaves_the_copy_in_use(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    """A Hub answering the ``HEAD`` 5xx (or 429) made the read fail after its retries, where
    an ``http(s)://`` server's 5xx leaves the copy in use ("stale"), as cache.md says; a 404
    still is the Hub's answer."""
    hub.push("org/model", {"model.safetensors": DATA})
    address = "hf://org/model/model.safetensors"
    await read(address, cache=True)
    with RangeHTTPServer() as failing:
        failing.status_for["/org/model/resolve/main/model.safetensors"] = status
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{failing.port}")
        if status == 404:
            with pytest.raises(stream_st.SafetensorsError):
                await read(address, cache=True)
        else:
            await read_as(address, ARRAYS, "stale", cache=True)


async def test_hub_wrong_bytes_are_not_kept(hub: FakeHub, tmp_path: Path) -> None:
    hub.push("org/model", {"model.safetensors": DATA})
    sha = hashlib.sha256(DATA).hexdigest()
    damaged = bytearray(DATA)
    damaged[-3] ^= 1
    hub.cdn.objects[f"/{sha}"] = bytes(damaged)  # the CDN serves other bytes than the Hub's sha
    with pytest.raises(stream_st.IntegrityError):
        await read("hf://org/model/model.safetensors", cache=True)
    assert not list((tmp_path / "hub-cache").rglob("blobs/*"))


async def test_a_hub_get_naming_another_etag_than_its_head_is_not_kept(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The Hub's ``HEAD`` named the file's ETag (``v1``, no digest to check the bytes
    against), its ``GET`` served other bytes under another (``v2``): they were kept as blob
    ``v1``, every later read a hit on them. The ``GET`` naming another ETag than the ``HEAD``
    is a SourceChangedError, and nothing is kept."""
    monkeypatch.setattr(hub, "is_lfs", lambda path: False)  # served by the Hub itself
    hub.push("org/model", {"model.safetensors": DATA})
    hub.hub.objects["/other"] = reference_numpy.save(OTHER)
    serve = hub.hub._serve_object

    def changing(request: Any, key: str, extra: dict[str, str]) -> bool:
        if request.method == "HEAD":
            return serve(request, key, {**extra, "ETag": '"v1"'})
        return serve(request, "/other", {**extra, "ETag": '"v2"'})

    monkeypatch.setattr(hub.hub, "_serve_object", changing)
    with pytest.raises(stream_st.SourceChangedError, match="ETag v1, then v2"):
        await read("hf://org/model/model.safetensors", cache=True)
    assert not files_under(tmp_path / "hub-cache" / "models--org--model" / "blobs")


@pytest.mark.parametrize("size", ["\xb2", "9" * 5000])
async def test_a_hub_size_of_no_ascii_digits_is_no_size(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, size: str
) -> None:
    """``X-Linked-Size: ²``: ``'²'.isdigit()`` holds but ``int('²')`` raised a bare ValueError;
    such a size (or one of more digits than ``int`` reads) is none, the object's own used."""
    hub.push("org/model", {"model.safetensors": DATA})
    reply = hub.hub._reply

    def sized(request: Any, status: int, headers: dict[str, str], body: bytes) -> bool:
        return reply(request, status, {**headers, "X-Linked-Size": size}, body)

    monkeypatch.setattr(hub.hub, "_reply", sized)
    await read_as("hf://org/model/model.safetensors", ARRAYS, "fetch", cache=True)


@pytest.mark.parametrize(
    "etag", ["abc\x00def", "abc\tdef", "ab\x85c", "e" * 201, "e" * 250, "\xe9" * 101, "e1.part"]
)
async def test_a_hub_etag_no_file_can_be_named_by_is_read_uncached(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, etag: str
) -> None:
    """An ETag holding a NUL gave a bare ValueError (embedded null byte) as the blob's file
    name; one too long for the blob's temporary files left a blob with no record ("keeping the
    copy failed"); control characters made file names; one ending in ``.part`` had its record
    named as the partial copy's record of another (``e1``). None names a blob: the object is
    read as it is, nothing kept."""
    hub.push("org/model", {"model.safetensors": DATA})
    reply = hub.hub._reply

    def tagged(request: Any, status: int, headers: dict[str, str], body: bytes) -> bool:
        return reply(request, status, {**headers, "X-Linked-Etag": f'"{etag}"'}, body)

    monkeypatch.setattr(hub.hub, "_reply", tagged)
    await read_as("hf://org/model/model.safetensors", ARRAYS, "uncached", cache=True)
    assert not files_under(tmp_path / "hub-cache")


async def test_a_hub_blob_whose_etag_holds_a_dot_is_listed_and_removed(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A blob named by an ETag holding a ``.`` (``1.abc``, as huggingface_hub names it too)
    was kept but never listed, counted by the cap, pruned or removed: its files were told
    apart by the first dot of their names. They are by their endings."""
    commit = hub.push("org/model", {"model.safetensors": DATA})
    reply = hub.hub._reply

    def tagged(request: Any, status: int, headers: dict[str, str], body: bytes) -> bool:
        return reply(request, status, {**headers, "X-Linked-Etag": '"1.abc"'}, body)

    monkeypatch.setattr(hub.hub, "_reply", tagged)
    await read_as("hf://org/model/model.safetensors", ARRAYS, "fetch", cache=True)
    storage = tmp_path / "hub-cache" / "models--org--model"
    left = storage / ".stream_st" / ".1.abc.json.999999999.tmp"  # a writer long gone
    left.write_bytes(b"{}")
    cache = Cache(tmp_path / "st-cache", tmp_path / "hub-cache")
    copy, leftover = sorted(entries(cache), key=lambda entry: entry.leftover)
    assert copy.shown == f"hf://org/model@{commit}/model.safetensors"
    assert copy.size == len(DATA) and copy.files[0] == storage / "blobs" / "1.abc"
    assert leftover.files == [left] and leftover.lock == storage.parent.joinpath(
        ".locks", "models--org--model", "1.abc.lock"
    )
    assert len(prune(cache, 0)) == 2
    assert not files_under(storage / "blobs") and not files_under(storage / "snapshots")


async def test_a_folder_in_a_hub_blob_s_place_is_no_copy(hub: FakeHub, tmp_path: Path) -> None:
    """A folder made in a Hub blob's place was listed as a complete copy of the blob; it is
    not listed, as a blob that is gone is not (the Hugging Face cache's files are not
    stream_st's to remove)."""
    hub.push("org/model", {"model.safetensors": DATA})
    await read_as("hf://org/model/model.safetensors", ARRAYS, "fetch", cache=True)
    (blob,) = (tmp_path / "hub-cache" / "models--org--model" / "blobs").iterdir()
    blob.unlink()
    blob.mkdir()
    assert entries(Cache(tmp_path / "st-cache", tmp_path / "hub-cache")) == []


@pytest.mark.parametrize("blocked", ["ref", "snapshot"])
async def test_a_hub_link_that_cannot_be_made_leaves_no_temporary_file(
    hub: FakeHub, tmp_path: Path, blocked: str
) -> None:
    """A folder where the ref or the snapshot link goes (the ref of branch ``refs``, once
    ``refs/pr/1`` was read): the temporary file made for it was left for good, and the warning
    said no copy was kept, the blob being kept. The temporary file goes; the warning says the
    copy is kept, unlinked, and it is."""
    commit = hub.push("org/model", {"model.safetensors": DATA}, revision="refs")
    storage = tmp_path / "hub-cache" / "models--org--model"
    if blocked == "ref":
        other = {"model.safetensors": reference_numpy.save(OTHER)}
        hub.push("org/model", other, revision="refs/pr/1")
        await read("hf://org/model@refs%2Fpr%2F1/model.safetensors", cache=True)
    else:
        (storage / "snapshots" / commit / "model.safetensors" / "in").mkdir(parents=True)
    with pytest.warns(stream_st.CacheWarning, match="the copy is kept, but linking it"):
        await read_as("hf://org/model@refs/model.safetensors", ARRAYS, "fetch", cache=True)
    assert not [path for path in files_under(storage) if path.name.endswith(".tmp")]
    kept = entries(Cache(tmp_path / "st-cache", tmp_path / "hub-cache"))
    assert [entry.shown for entry in kept][-1] == f"hf://org/model@{commit}/model.safetensors"


def test_a_temporary_file_of_no_ascii_pid_is_a_leftover(tmp_path: Path) -> None:
    """``.<etag>.json.².tmp`` in a Hub repository's folder: ``'²'.isdigit()`` holds but
    ``int('²')`` raised a bare ValueError in cache ls and prune."""
    mine = tmp_path / "hub" / "models--org--model" / ".stream_st"
    mine.mkdir(parents=True)
    (mine / ".e1.json.\xb2.tmp").write_bytes(b"{}")
    (entry,) = entries(Cache.at(tmp_path))
    assert entry.leftover and entry.files == [mine / ".e1.json.\xb2.tmp"]


def test_remove_leaves_an_entry_being_written(tmp_path: Path) -> None:
    from stream_st.transports.cache.store import EntryLock

    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as running:
        asyncio.run(read(running.url("/m.safetensors"), cache=tmp_path))
    (entry,) = entries(Cache.at(tmp_path))
    assert entry.lock is not None
    held = EntryLock(entry.lock)
    assert held.try_acquire()
    try:
        assert not remove(entry)
    finally:
        held.release()
    assert remove(entry) and entries(Cache.at(tmp_path)) == []


# ------------------------------------------------------------------ the command


def test_the_command(server: RangeHTTPServer, tmp_path: Path) -> None:
    # HF_HUB_OFFLINE is not in the environment (the suite's hermetic_environment)
    env = {"STREAM_ST_CACHE": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    url = server.url("/m.safetensors")
    run = functools.partial(run_command, env=env)

    assert run("inspect", "--offline", url).returncode == 2
    assert run("validate", "-q", "--cache", url).returncode == 0
    assert run("cp", "-q", "--cache", url, str(tmp_path / "out.safetensors")).returncode == 0
    assert (tmp_path / "out.safetensors").read_bytes() == DATA
    assert body_bytes(server) == len(DATA)  # cp read the copy
    listed = run("cache", "ls")
    assert listed.returncode == 0 and url in listed.stdout and "complete" in listed.stdout
    assert run("inspect", "--offline", url).returncode == 0
    assert run("cache", "rm", "http://nowhere/*").returncode == 1
    assert run("cache", "prune", "--max-size", "0").returncode == 0
    assert url not in run("cache", "ls").stdout


# ------------------------------------------------------------------ the drop-in functions


def test_drop_in_functions(server: RangeHTTPServer, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import stream_st.compat
    import stream_st.torch

    url = server.url("/m.safetensors")
    with stream_st.compat.safe_open(url, "np", cache=tmp_path) as handle:
        part = handle.get_slice("t2")[:100]
    np.testing.assert_array_equal(part, ARRAYS["t2"][:100])
    assert not list(tmp_path.rglob("*.safetensors"))  # a slice: a partial copy only
    loaded = stream_st.torch.load_file(url, cache=tmp_path)
    assert (tmp_path / "objects").exists() and list(tmp_path.rglob("*.safetensors"))
    for name, array in ARRAYS.items():
        np.testing.assert_array_equal(loaded[name].numpy(), array)
    sent = body_bytes(server)
    model = torch.nn.Module()
    for name, array in ARRAYS.items():
        model.register_buffer(name, torch.zeros(array.shape, dtype=torch.float64))
    stream_st.torch.load_model(model, url, cache=tmp_path)
    np.testing.assert_array_equal(model.t3.numpy(), ARRAYS["t3"])
    with stream_st.torch.safe_open(url, "pt", cache=tmp_path) as handle:
        np.testing.assert_array_equal(handle.get_tensor("t0").numpy(), ARRAYS["t0"])
    assert body_bytes(server) == sent  # both read the copy


@pytest.mark.parametrize(
    ("fields", "error", "message"),
    [
        ({"max_size": -5}, stream_st.UsageError, r"Cache.max_size must be an integer >= 0"),
        ({"max_size": float("nan")}, stream_st.ArgumentTypeError, "Cache.max_size"),
        ({"max_size": "1GB"}, stream_st.ArgumentTypeError, "Cache.max_size"),
        ({"offline": "no"}, stream_st.ArgumentTypeError, "Cache.offline must be True or False"),
        ({"directory": 5}, stream_st.ArgumentTypeError, "Cache.directory must be a str"),
        ({"hub_directory": None}, stream_st.ArgumentTypeError, "Cache.hub_directory"),
    ],
)
def test_a_cache_with_bad_fields_is_refused_as_it_is_made(
    tmp_path: Path, fields: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each was taken: a bare TypeError mid-read, a negative or NaN cap, "no" read as offline."""
    with pytest.raises(error, match=message):
        Cache(**{"directory": tmp_path, "hub_directory": tmp_path / "hub", **fields})


async def test_a_cache_given_str_directories_reads_through_them(
    server: RangeHTTPServer, tmp_path: Path
) -> None:
    """A str directory was kept as a str: the read failed with a bare TypeError (str / str)."""
    cache = Cache(str(tmp_path / "c"), hub_directory=str(tmp_path / "h"), max_size=10**9)
    assert cache.directory == tmp_path / "c" and isinstance(cache.hub_directory, Path)
    await read_as(server.url("/m.safetensors"), ARRAYS, "fetch", cache=cache)
    assert files_under(tmp_path / "c")
