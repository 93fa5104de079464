"""What a cached read's copy says (stream_st.transports.cache.tee) shows no secret of the address.

An ``hf://`` address may carry signed parameters (``?X-Amz-Signature=...``); the copy of a Hub
file was named by the address as given, so its warnings (a copy given up, one kept but not
linked, one that could not be moved into place) printed the signature, and its error (bytes not
matching the Hub's SHA-256) began with the raw address: read as one address by the error's own
masking, its reason was masked as the signature's value. Each now shows the masked address, its
host and path intact, then the reason. The servers are tests/servers/hub_server.py's (the Hub on
127.0.0.1, its CDN on 127.0.0.2).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import CacheWarning, IntegrityError

from .._util import assert_same_arrays
from ..servers.hub_server import FakeHub

ROOT = Path(__file__).resolve().parents[2]
ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "a": np.arange(50_000, dtype=np.float32),
    "b": np.full(300, 7, np.uint8),
}
DATA = reference_numpy.save(ARRAYS)
SHA = hashlib.sha256(DATA).hexdigest()
SECRETS = ("AKIDEXAMPLE", "SESSIONTOKEN", "5ec2e7de0fa1")
SIGNED = (
    "X-Amz-Credential=AKIDEXAMPLE&X-Amz-Date=20240101T000000Z"
    "&X-Amz-Security-Token=SESSIONTOKEN&X-Amz-Signature=5ec2e7de0fa1"
)
MASKED = "X-Amz-Credential=***&X-Amz-Date=20240101T000000Z&X-Amz-Security-Token=***"
FILE = f"model.safetensors?{SIGNED}"
ADDRESS = f"hf://org/model/{FILE}"
SHOWN = f"hf://org/model/model.safetensors?{MASKED}"
"""The address as every message shows it: host and path kept, the secrets masked."""


@pytest.fixture
def signed_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """The test Hub holding ``DATA`` as :data:`FILE`, served from its CDN as an LFS file
    (``X-Linked-Etag``: its SHA-256, which the copy is checked against)."""
    monkeypatch.setattr(hub, "is_lfs", lambda path: path == FILE)
    hub.push("org/model", {FILE: DATA})
    return hub


def storage(tmp_path: Path) -> Path:
    """Where the Hub cache (the ``hub`` fixture's ``HF_HUB_CACHE``) keeps org/model's files."""
    return tmp_path / "hub-cache" / "models--org--model"


def assert_shown(text: str, reason: str) -> None:
    """``text`` names the address masked (no secret, its host and path there) and ``reason``."""
    for secret in SECRETS:
        assert secret not in text, text
    assert SHOWN in text, text
    assert reason in text, text


async def test_a_copy_not_matching_the_hubs_digest_says_why(
    signed_hub: FakeHub, tmp_path: Path
) -> None:
    """The CDN serves other bytes than the Hub's SHA-256: the error named the address alone,
    its reason masked as the signature's value; it now says why, and the address masked."""
    damaged = bytearray(DATA)
    damaged[-3] ^= 1
    signed_hub.cdn.objects[f"/{SHA}"] = bytes(damaged)  # other bytes than the Hub's SHA-256
    with pytest.raises(IntegrityError) as info:
        await stream_st.load(ADDRESS, cache=True)
    assert_shown(str(info.value), "the bytes received do not match the sha256 the server gave")
    assert_shown(repr(info.value), "no copy was kept")
    assert info.value.source is not None
    assert_shown(info.value.source, "")
    assert not list(storage(tmp_path).rglob("blobs/*"))


async def test_a_copy_that_cannot_be_moved_into_place_says_why(
    signed_hub: FakeHub, tmp_path: Path
) -> None:
    """A file where the folder of blobs goes: the read goes on, its copy given up with a
    warning that printed the signature."""
    storage(tmp_path).mkdir(parents=True)
    (storage(tmp_path) / "blobs").write_bytes(b"")  # no folder of blobs can be made
    with pytest.warns(CacheWarning) as caught:
        assert_same_arrays(await stream_st.load(ADDRESS, cache=True), ARRAYS)
    (warning,) = caught
    assert_shown(str(warning.message), ": keeping the copy failed: ")


async def test_a_copy_kept_but_not_linked_says_why(signed_hub: FakeHub, tmp_path: Path) -> None:
    """A file where the snapshot's folder goes: the copy is kept, with a warning that printed
    the signature."""
    commit = signed_hub.repos[("model", "org/model")].refs["main"]
    snapshots = storage(tmp_path) / "snapshots"
    snapshots.mkdir(parents=True)
    (snapshots / commit).write_bytes(b"")  # no snapshot folder can be made
    with pytest.warns(CacheWarning) as caught:
        assert_same_arrays(await stream_st.load(ADDRESS, cache=True), ARRAYS)
    (warning,) = caught
    assert_shown(str(warning.message), "the copy is kept, but linking it to its revision failed")
    assert (storage(tmp_path) / "blobs" / SHA).read_bytes() == DATA


async def test_a_snapshot_link_that_cannot_be_made_says_why(
    signed_hub: FakeHub, tmp_path: Path
) -> None:
    """A folder where the snapshot link goes: the copy is kept, with a warning whose reason (the
    system's error) named the link and its temporary file, signed values and all."""
    commit = signed_hub.repos[("model", "org/model")].refs["main"]
    (storage(tmp_path) / "snapshots" / commit / FILE).mkdir(parents=True)
    with pytest.warns(CacheWarning) as caught:
        assert_same_arrays(await stream_st.load(ADDRESS, cache=True), ARRAYS)
    (warning,) = caught
    assert_shown(str(warning.message), "the copy is kept, but linking it to its revision failed")
    assert "Is a directory" in str(warning.message)
    assert (storage(tmp_path) / "blobs" / SHA).read_bytes() == DATA


CHILD = """
import asyncio, json, resource, signal, sys, warnings
import stream_st

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file grown past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))

async def main():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arrays = await stream_st.load(sys.argv[1], cache=True)
    sums = {name: float(array.sum()) for name, array in arrays.items()}
    print(json.dumps({"sums": sums, "warnings": [str(w.message) for w in caught]}))

asyncio.run(main())
"""


def test_a_copy_given_up_says_why(signed_hub: FakeHub) -> None:
    """No room for the copy (a file size limit, in a child process): the read goes on, with a
    warning that printed the signature."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, ADDRESS],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
    )
    result = json.loads(done.stdout)
    assert result["sums"] == {name: float(array.sum()) for name, array in ARRAYS.items()}
    (warning,) = result["warnings"]
    assert_shown(warning, ": not keeping a copy: no room for the copy: ")
