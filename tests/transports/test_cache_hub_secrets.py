"""A cached ``hf://`` read whose path holds signed parameters shows no secret of it.

The path of an ``hf://`` address is taken as written (``?`` included, sent to the Hub
percent-encoded as part of the file's name), and the Hugging Face cache names the file's
snapshot link by it: ``hf://org/model/model.safetensors?X-Amz-Signature=...`` is a file so
named, kept as ``snapshots/<commit>/model.safetensors?X-Amz-Signature=...``. What is shown of
it masks the signed values as every error does (:func:`stream_st.errors.redact`): ``stream-st
cache ls`` (and ``rm``) listed the address unmasked, and a snapshot link that could not be made
printed its file name unmasked in the warning the read goes on with. A wait for another
reader's lock that runs past the deadline already named the address masked; it is held to
that. The servers are tests/servers/hub_server.py's (the Hub on 127.0.0.1, its CDN on
127.0.0.2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import stream_st
from stream_st import CacheWarning, ReadTimeoutError
from stream_st.transports.cache.layout import HubEntry, repo_folder
from stream_st.transports.cache.store import EntryLock

from .._util import assert_same_arrays, run_command
from ..servers.hub_server import FakeHub
from .test_tee_messages import ADDRESS, ARRAYS, DATA, FILE, MASKED, SECRETS, SHA


@pytest.fixture
def signed_hub(hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """The test Hub holding ``DATA`` as :data:`FILE`, served from its CDN as an LFS file
    (``X-Linked-Etag``: its SHA-256, which names the blob)."""
    monkeypatch.setattr(hub, "is_lfs", lambda path: path == FILE)
    hub.push("org/model", {FILE: DATA})
    return hub


def entry_of(tmp_path: Path) -> HubEntry:
    """:data:`FILE` in the Hub cache (the ``hub`` fixture's ``HF_HUB_CACHE``)."""
    return HubEntry(tmp_path / "hub-cache", repo_folder("model", "org/model"), FILE)


def assert_masked(text: str, reason: str) -> None:
    """``text`` holds no secret, the masked parameters (the path before them intact) and
    ``reason``."""
    for secret in SECRETS:
        assert secret not in text, text
    assert f"model.safetensors?{MASKED}" in text, text
    assert reason in text, text


async def test_a_lock_wait_past_the_deadline_names_the_address_masked(
    signed_hub: FakeHub, tmp_path: Path
) -> None:
    """Another reader holds the blob's lock and the deadline passes while this one waits: the
    error names the address masked (its ``url``, after the reason), the reason intact."""
    lock = EntryLock(entry_of(tmp_path).lock(SHA))
    assert lock.try_acquire()
    try:
        with pytest.raises(ReadTimeoutError) as info:
            await stream_st.load(ADDRESS, cache=True, deadline=0.3)
    finally:
        lock.release()
    assert_masked(str(info.value), "the deadline of 0.3 s passed")
    assert_masked(info.value.url, "hf://org/model/")


def test_cache_ls_and_rm_show_the_address_masked(signed_hub: FakeHub) -> None:
    """``stream-st cache ls`` (text and ``--json``) and ``cache rm`` listed a Hub copy by its
    address at its commit with the signed values as written."""
    commit = signed_hub.repos[("model", "org/model")].refs["main"]
    assert run_command("validate", "-q", "--cache", ADDRESS).returncode == 0
    listed = run_command("cache", "ls")
    assert listed.returncode == 0, listed.stderr
    assert_masked(listed.stdout, f"hf://org/model@{commit}/model.safetensors?")
    assert "complete" in listed.stdout
    as_json = run_command("cache", "ls", "--json")
    (line,) = as_json.stdout.splitlines()
    assert_masked(json.loads(line)["address"], f"hf://org/model@{commit}/")
    removed = run_command("cache", "rm", "hf://org/model@*")
    assert removed.returncode == 0, removed.stderr
    assert_masked(removed.stdout, "removed hf://org/model@")
    assert "0 copies" in run_command("cache", "ls").stdout


def test_cache_ls_shows_a_partial_copy_masked(signed_hub: FakeHub) -> None:
    """A partial copy of the Hub file (its header read) was listed by the address its record
    names, the signed values as written."""
    assert run_command("inspect", "--cache", ADDRESS).returncode == 0
    listed = run_command("cache", "ls")
    assert listed.returncode == 0, listed.stderr
    assert_masked(listed.stdout, "partial")


async def test_a_snapshot_link_that_cannot_be_made_is_named_masked(
    signed_hub: FakeHub, tmp_path: Path
) -> None:
    """The blob is in the cache, but a folder stands where its snapshot link goes (named by
    the file's path, the signed values as written): the read goes on without the cache, with a
    warning that printed that file name unmasked."""
    assert_same_arrays(await stream_st.load(ADDRESS, cache=True), ARRAYS)
    commit = signed_hub.repos[("model", "org/model")].refs["main"]
    pointer = entry_of(tmp_path).pointer(commit)
    pointer.unlink()
    pointer.mkdir()
    (pointer / "in-the-way").write_bytes(b"")
    with pytest.warns(CacheWarning) as caught:
        assert_same_arrays(await stream_st.load(ADDRESS, cache=True), ARRAYS)
    (warning,) = caught
    assert_masked(str(warning.message), "the cache cannot be used (Is a directory: ")
    assert str(warning.message).endswith("): reading without it")
