"""``cache=`` under the eighth attack: cancellation, a second handle, hostile ``hf://`` names,
unusable cache folders, presigned versions, damaged records, full disks, sizes.

Real servers on 127.0.0.1 (the Python test server, the fake Hub, moto's S3)."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st
import stream_st.compat as compat
import stream_st.transports.cache.resolve as resolve_module
from stream_st.errors import UnsupportedSourceError, UsageError
from stream_st.transports.cache import parse_size
from stream_st.transports.cache.keys import object_key
from stream_st.transports.cache.store import RangeSet

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from ..servers.hub_server import FakeHub
from .test_cache import ARRAYS, DATA, ROOT, files_under, read

HUB_ADDRESS = "hf://org/model/model.safetensors"


def lock_free(root: Path) -> bool:
    (lock,) = root.rglob("lock")
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.mark.parametrize("how", ["with", "iterate"])
def test_a_read_cancelled_right_after_the_cache_resolved_lets_go_of_the_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """A cancel landing between the cache's answer ("fetch": the entry locked, the copy begun)
    and the stream's open left the lock held and the growing copy named: every later read
    waited 30 s as a follower and kept no copy."""
    original = resolve_module.resolve
    cancelled: list[bool] = []

    async def resolve_then_cancelled(*args: Any, **kwargs: Any) -> Any:
        resolved = await original(*args, **kwargs)
        if resolved.state == "fetch" and not cancelled:
            cancelled.append(True)
            task = asyncio.current_task()
            assert task is not None
            task.cancel()  # a timeout firing at this moment
        return resolved

    monkeypatch.setattr(resolve_module, "resolve", resolve_then_cancelled)
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")

        async def first() -> None:
            stream = stream_st.open_stream(url, cache=tmp_path)
            if how == "with":
                async with stream:
                    pytest.fail("opened")
            async for _ in stream:
                pytest.fail("iterated")

        with pytest.raises(asyncio.CancelledError):
            asyncio.run(first())
        assert cancelled and lock_free(tmp_path)
        assert [p.name for p in files_under(tmp_path)] == ["lock"]
        started = time.monotonic()
        arrays, state = asyncio.run(read(url, cache=tmp_path))
        assert state == "fetch" and time.monotonic() - started < 10
        assert_same_arrays(arrays, ARRAYS)
        assert asyncio.run(read(url, cache=tmp_path))[1] == "hit"


@pytest.mark.parametrize("scheme", ["http", "hf"])
def test_a_second_handle_in_the_process_reads_at_once_without_the_cache(
    tmp_path: Path, scheme: str, hub: FakeHub
) -> None:
    """Two safe_open handles on one address in one thread: the second waited for the first's
    lock, which is held until the first closes (hf://: for ever; http: 30 s as a follower of a
    copy that did not grow). It now reads the object itself within a second."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        hub.push("org/model", {"model.safetensors": DATA})
        address = server.url("/m.safetensors") if scheme == "http" else HUB_ADDRESS
        started = time.monotonic()
        with compat.safe_open(address, "np", cache=tmp_path) as first:
            assert np.array_equal(first.get_slice("t0")[:2], ARRAYS["t0"][:2])
            with compat.safe_open(address, "np", cache=tmp_path) as second:
                assert np.array_equal(second.get_tensor("t1"), ARRAYS["t1"])
            assert np.array_equal(first.get_tensor("t2"), ARRAYS["t2"])
        assert time.monotonic() - started < 10


async def test_a_second_read_of_an_object_of_unknown_size_goes_on_by_itself(
    tmp_path: Path,
) -> None:
    """An object of unknown size (a chunked 200): its copy publishes no progress to follow, and
    a second read in the process, while the first stream stayed open, waited for the first's
    lock for ever (timeout= or not). It reads the object itself once the writer has written
    nothing for a second, as an hf:// read does."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, no_range=True, chunked=True) as server:
        url = server.url("/m.safetensors")
        async with stream_st.open_stream(url, cache=tmp_path) as first:
            await first.__aiter__().__anext__()
            assert getattr(first, "cache_state", None) == "fetch"
            with anyio.fail_after(20):
                arrays, state = await read(url, cache=tmp_path, timeout=2)
    assert state == "uncached"
    assert_same_arrays(arrays, ARRAYS)


@pytest.mark.parametrize("scheme", ["http", "hf"])
async def test_a_lock_another_process_holds_is_waited_for_at_most_the_timeout(
    tmp_path: Path, scheme: str, hub: FakeHub
) -> None:
    """A writer in another process that makes no progress was waited for 30 s (hf://) or for
    ever (http), whatever timeout= said: at most the timeout, then the object is read as it
    is."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        hub.push("org/model", {"model.safetensors": DATA})
        if scheme == "http":
            address = server.url("/m.safetensors")
            lock = tmp_path / "objects" / object_key(address).key / "lock"
        else:
            address = HUB_ADDRESS
            sha = hashlib.sha256(DATA).hexdigest()
            lock = tmp_path / "hub" / ".locks" / "models--org--model" / f"{sha}.lock"
        lock.parent.mkdir(parents=True)
        held = os.open(lock, os.O_RDONLY | os.O_CREAT)
        try:
            fcntl.flock(held, fcntl.LOCK_EX)  # not this process's EntryLock: as another's
            started = time.monotonic()
            with anyio.fail_after(20):
                arrays, state = await read(address, cache=tmp_path, timeout=1)
            assert time.monotonic() - started < 10
        finally:
            os.close(held)
    assert state == "uncached"
    assert_same_arrays(arrays, ARRAYS)


def test_an_hf_address_with_a_control_character_is_refused(hub: FakeHub) -> None:
    """An encoded NUL in a revision raised a bare ValueError from the cache's file names."""
    hub.push("org/model", {"model.safetensors": DATA})
    with pytest.raises(UnsupportedSourceError, match="a control character"):
        asyncio.run(read("hf://org/model@a%00b/model.safetensors", cache=True))


@pytest.mark.parametrize(
    "address",
    [
        "hf://org/model@..%2F..%2F..%2Fescaped/model.safetensors",
        "hf://org/model/../../../../escaped.safetensors",
        "hf://org/model/a//model.safetensors",
        "hf://org/../model.safetensors",
        "hf://org/model@./model.safetensors",
    ],
)
def test_an_hf_address_that_climbs_out_is_refused(
    tmp_path: Path, hub: FakeHub, address: str
) -> None:
    """A revision or path with '..' parts wrote a ref file and a link outside the cache."""
    hub.push("org/model", {"model.safetensors": DATA})
    with pytest.raises(UnsupportedSourceError, match=r"an empty, '\.' or '\.\.' part"):
        asyncio.run(read(address, cache=True))
    outside = [p for p in files_under(tmp_path) if "hub-cache" not in p.parts]
    assert not any("escaped" in p.name for p in outside)


@pytest.mark.parametrize(
    "address",
    [
        "hf://a/b--c/model.safetensors",
        "hf://a--b/c/model.safetensors",
        "hf://datasets/a/b..c/model.safetensors",
    ],
)
def test_an_hf_repository_name_holding_two_dashes_or_dots_is_refused(
    tmp_path: Path, hub: FakeHub, address: str
) -> None:
    """hf://a/b--c and hf://a--b/c were both kept in models--a--b--c: offline, a read of one
    was answered with the other's file. The Hub refuses such names, as huggingface_hub does."""
    hub.push("a/b--c", {"model.safetensors": DATA})
    hub.push("a--b/c", {"model.safetensors": DATA})
    with pytest.raises(UnsupportedSourceError, match=r"holding '--' or '\.\.'"):
        asyncio.run(read(address, cache=True))
    assert not [p for p in files_under(tmp_path) if "s--a" in str(p)]


def test_presigned_urls_of_two_versions_name_two_copies() -> None:
    """A signed query was dropped whole, versionId with it: offline, or with the server down,
    the URL of version 2 was answered with the copy of version 1."""
    base = "https://bucket.s3.amazonaws.com/m.safetensors?X-Amz-Signature={}&versionId={}"
    assert object_key(base.format("aa", "v1")).key == object_key(base.format("bb", "v1")).key
    assert object_key(base.format("aa", "v1")).key != object_key(base.format("aa", "v2")).key
    shown = object_key(base.format("aa", "v1")).shown
    assert shown == "https://bucket.s3.amazonaws.com/m.safetensors"


@pytest.mark.parametrize("name", ["key", "fileKey", "object_key"])
def test_a_key_parameter_of_an_unsigned_url_names_the_object(name: str) -> None:
    """Every name ending in 'key' was dropped from the object's identity, as a credential:
    ?key=a and ?key=b shared one copy, and offline, or with the server down, a read of one was
    answered with the other's. Beside a signature it still signs only; an API key or a token
    still authorizes only."""
    assert object_key(f"https://h/d?{name}=a").key != object_key(f"https://h/d?{name}=b").key
    signed = "https://h/d?X-Amz-Signature={}&" + name + "={}"
    assert object_key(signed.format("s", "a")).key == object_key(signed.format("t", "b")).key
    for credential in ("api_key", "token", "secret_key"):
        first, second = (f"https://h/d?f=1&{credential}={v}" for v in "ab")
        assert object_key(first).key == object_key(second).key


@pytest.mark.parametrize("damage", ["past the end", "no ranges"])
def test_a_partial_copy_record_reaching_past_the_object_is_not_trusted(
    tmp_path: Path, damage: str
) -> None:
    """Ranges past the object's size were taken as held: a mostly empty copy was committed
    and later handed out as a hit. A record without its ranges raised a bare KeyError."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        asyncio.run(read(url, cache=tmp_path, include=["t1"]))
        (record,) = tmp_path.rglob("*.part.json")
        state = json.loads(record.read_text())
        if damage == "no ranges":
            del state["ranges"]
        else:
            state["ranges"] = [[0, state["size"] + 1]]
        record.write_text(json.dumps(state))
        for expected in ("fetch", "hit"):
            arrays, state = asyncio.run(read(url, cache=tmp_path))
            assert state == expected
            assert_same_arrays(arrays, ARRAYS)
        (copy,) = tmp_path.rglob("*.safetensors")
        assert copy.read_bytes() == DATA


def tensor_at(name: str) -> int:
    """Where tensor ``name``'s bytes start in :data:`DATA`."""
    header_size = int.from_bytes(DATA[:8], "little")
    begin, _ = json.loads(DATA[8 : 8 + header_size])[name]["data_offsets"]
    return 8 + header_size + int(begin)


@pytest.mark.parametrize("scheme", ["http", "hf"])
def test_a_partial_copy_written_to_since_is_thrown_away(
    tmp_path: Path, hub: FakeHub, scheme: str
) -> None:
    """A partial copy whose bytes changed on disk was served as it was (hf:// too), and a full
    read of an http(s):// object committed it as a complete, checked copy: every later read
    was a hit with the damaged tensor."""
    hub.push("org/model", {"model.safetensors": DATA})
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        address = server.url("/m.safetensors") if scheme == "http" else HUB_ADDRESS
        asyncio.run(read(address, cache=tmp_path, include=["t1"]))
        (part,) = tmp_path.rglob("*.part")
        with open(part, "r+b") as file:
            file.seek(tensor_at("t1") + 100)
            file.write(b"\xff" * 64)
        arrays, _ = asyncio.run(read(address, cache=tmp_path, include=["t1"]))
        assert_same_arrays(arrays, {"t1": ARRAYS["t1"]})
        for expected in ("fetch", "hit"):
            arrays, state = asyncio.run(read(address, cache=tmp_path))
            assert state == expected
            assert_same_arrays(arrays, ARRAYS)


@pytest.mark.parametrize("scheme", ["http", "hf"])
def test_a_partial_copy_record_claiming_bytes_never_written_is_not_trusted(
    tmp_path: Path, hub: FakeHub, scheme: str
) -> None:
    """A record of a partial copy listing every byte as held, over a copy holding one tensor
    (what damage to its digits can leave), had a full read commit the zeros never written as
    a checked copy: the next read was a hit returning them."""
    hub.push("org/model", {"model.safetensors": DATA})
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        address = server.url("/m.safetensors") if scheme == "http" else HUB_ADDRESS
        asyncio.run(read(address, cache=tmp_path, include=["t1"]))
        (record,) = tmp_path.rglob("*.part.json")
        state = json.loads(record.read_text())
        state["ranges"] = [[0, len(DATA)]]
        record.write_text(json.dumps(state))
        for expected in ("fetch", "hit"):
            arrays, served = asyncio.run(read(address, cache=tmp_path))
            assert served == expected
            assert_same_arrays(arrays, ARRAYS)


def test_a_record_naming_an_unknown_digest_is_fetched_again(tmp_path: Path) -> None:
    """Was a UsageError on every read of the address, online too."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        asyncio.run(read(url, cache=tmp_path))
        (record,) = (p for p in tmp_path.rglob("*.json") if ".part" not in p.name)
        damaged = json.loads(record.read_text())
        damaged.update(algorithm="md5", fingerprint=[])
        record.write_text(json.dumps(damaged))
        for expected in ("fetch", "hit"):
            arrays, state = asyncio.run(read(url, cache=tmp_path))
            assert state == expected
            assert_same_arrays(arrays, ARRAYS)


@pytest.mark.parametrize("etag", ['"v0"\r\nX-Injected: 1', '"v0"\0', '"\u2603"'])
def test_a_record_whose_etag_no_header_can_carry_is_fetched_again(
    tmp_path: Path, etag: str
) -> None:
    """Every later read of the URL raised UsageError about a request header 'If-None-Match'
    the caller never gave: the damaged record's copy was used to ask the server."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        asyncio.run(read(url, cache=tmp_path))
        (record,) = (p for p in tmp_path.rglob("*.json") if ".part" not in p.name)
        damaged = json.loads(record.read_text())
        damaged["etag"] = etag
        record.write_text(json.dumps(damaged))
        for expected in ("fetch", "hit"):
            arrays, state = asyncio.run(read(url, cache=tmp_path))
            assert state == expected
            assert_same_arrays(arrays, ARRAYS)
        assert not any("x-injected" in headers for _, _, headers in server.headers_seen)


@pytest.mark.parametrize("text", ["9" * 400, "5iB", "\u0661\u0662\u0663", "1e3"])
def test_sizes_that_are_not_sizes_or_are_huge(text: str) -> None:
    """A huge size raised a bare OverflowError (the command: an internal error); 5iB and
    other scripts' digits were taken."""
    if text.isascii() and text.isdigit():
        assert parse_size(text) == int(text)
        return
    with pytest.raises(UsageError, match="not a size"):
        parse_size(text)


def test_range_sets_merge_as_before_and_stay_cheap() -> None:
    """Built by bisection (20k one-row reads through a cached handle took 19 s to record)."""
    ranges = RangeSet([(i * 10, i * 10 + 5) for i in range(20_000)])
    assert len(ranges.ranges) == 20_000 and ranges.total() == 100_000
    ranges.add(3, 200)  # touching (200, 205): merged
    assert ranges.ranges[0] == (0, 205) and len(ranges.ranges) == 19_980
    assert ranges.covers(100, 205) and not ranges.covers(100, 206)
    assert list(ranges.pieces(204, 212)) == [(204, 205, True), (205, 210, False), (210, 212, True)]
    assert RangeSet.recorded([(0, 11)], 10) is None and RangeSet.recorded([(0, 10)], 10)


def test_the_cache_warnings_are_stream_st_warnings(tmp_path: Path) -> None:
    """The cache warned with a plain RuntimeWarning: the filter the docs give to silence every
    warning of stream_st (``simplefilter("ignore", StreamStWarning)``) let it through."""
    (tmp_path / "afile").write_bytes(b"")
    served = RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong")
    with served as server, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", stream_st.StreamStWarning)
        asyncio.run(read(server.url("/m.safetensors"), cache=tmp_path / "afile"))
    assert [str(w.message) for w in seen] == []
    assert issubclass(stream_st.CacheWarning, RuntimeWarning)


def test_a_cache_folder_that_is_a_file_warns_and_reads_without_it(tmp_path: Path) -> None:
    """Was a bare NotADirectoryError (the command: an internal error), where the docs promise
    a RuntimeWarning and the read going on."""
    (tmp_path / "afile").write_bytes(b"")
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        with pytest.warns(RuntimeWarning, match="the cache cannot be used .*reading without it"):
            arrays, state = asyncio.run(read(url, cache=tmp_path / "afile"))
        assert state == "uncached"
        assert_same_arrays(arrays, ARRAYS)
        done = subprocess.run(
            [sys.executable, "-m", "stream_st.cli", "inspect", "--cache-dir", "afile", url],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert done.returncode == 0, done.stderr
        assert "the cache cannot be used" in done.stderr and "internal error" not in done.stderr


def test_a_partial_read_takes_only_the_room_of_what_it_holds(tmp_path: Path) -> None:
    """The copy's blocks were reserved for the whole object on any read: read_header of a
    70 GB model reserved 70 GB, which the size cap and cache ls did not count."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        asyncio.run(stream_st.read_header(url, cache=tmp_path))
        asyncio.run(read(url, cache=tmp_path, include=["t0"]))
        with compat.safe_open(url, "np", cache=tmp_path) as handle:  # reads on demand
            assert np.array_equal(handle.get_slice("t2")[:3], ARRAYS["t2"][:3])
        (part,) = (p for p in tmp_path.rglob("*.part") if p.is_file())
        info = part.stat()
        assert info.st_size == len(DATA)
        assert info.st_blocks * 512 < len(DATA) // 2  # t0 and the header: a quarter of it
        arrays, state = asyncio.run(read(url, cache=tmp_path))
        assert state == "fetch"
        assert_same_arrays(arrays, ARRAYS)


def test_a_copy_whose_record_cannot_be_written_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk at the commit left the copy under its final name with no record: unseen by
    cache ls and prune, kept for ever."""
    from stream_st.transports.cache.store import Record

    def full(self: Record, path: Path) -> None:
        raise OSError(28, "No space left on device", str(path))

    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        monkeypatch.setattr(Record, "save", full)
        with pytest.warns(RuntimeWarning, match="No space left"):
            arrays, _ = asyncio.run(read(url, cache=tmp_path))
        assert_same_arrays(arrays, ARRAYS)
        assert not list(tmp_path.rglob("*.safetensors"))
        monkeypatch.undo()
        assert asyncio.run(read(url, cache=tmp_path))[1] == "fetch"
        assert asyncio.run(read(url, cache=tmp_path))[1] == "hit"


def test_a_partial_copy_is_listed_and_removed_by_its_address(tmp_path: Path) -> None:
    """Was listed as "(partial copy <hash>)", which no address pattern of cache rm matched."""
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        asyncio.run(stream_st.read_header(url, cache=tmp_path))
        command = [sys.executable, "-m", "stream_st.cli", "cache"]
        options: dict[str, Any] = {"capture_output": True, "text": True, "cwd": ROOT}
        listed = subprocess.run([*command, "ls", "--dir", str(tmp_path)], **options)
        assert url in listed.stdout and "partial" in listed.stdout, listed
        removed = subprocess.run([*command, "rm", "--dir", str(tmp_path), url], **options)
        assert removed.returncode == 0 and f"removed {url}" in removed.stdout, removed
        assert not list(tmp_path.rglob("*.part"))


def test_a_second_handle_knows_the_first_however_the_folder_is_spelled(tmp_path: Path) -> None:
    """The lock held in this process was known by its path as spelled: through a symlinked or
    relative folder, the second handle waited 30 s."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with RangeHTTPServer(objects={"/m.safetensors": DATA}, etag="strong") as server:
        url = server.url("/m.safetensors")
        started = time.monotonic()
        with compat.safe_open(url, "np", cache=tmp_path / "real") as first:
            assert np.array_equal(first.get_slice("t0")[:2], ARRAYS["t0"][:2])
            with compat.safe_open(url, "np", cache=tmp_path / "link") as second:
                assert np.array_equal(second.get_tensor("t1"), ARRAYS["t1"])
        assert time.monotonic() - started < 10
