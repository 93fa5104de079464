"""``hf://`` addresses against a fake Hub on 127.0.0.1 and its CDN on 127.0.0.2 (hub_server.py).

Every test counts the requests each host received and checks that the token went to the Hub only.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import (
    HeaderError,
    HTTPNotFoundError,
    HTTPProtocolError,
    HTTPStatusError,
    IntegrityError,
    ReadTimeoutError,
    SourceChangedError,
    TransportError,
    UnsupportedSourceError,
    tools,
)
from stream_st.cli import main
from stream_st.core.shards import shard_address
from stream_st.tools import inspect
from stream_st.transports.http.source import FIRST_RANGE, HttpSource
from stream_st.transports.hub import HubClient, HubFile, HubSource, hub_endpoint, hub_token

from .._util import assert_same_arrays
from ..servers.hub_server import CDN_HOST, FakeHub, Seen

Arrays = dict[str, np.ndarray[Any, Any]]

HUB = "127.0.0.1"
BIG: Arrays = {f"t{i}": np.random.default_rng(i).random(60_000 + i) for i in range(6)}  # ~3 MB
SHARDS: dict[str, Arrays] = {
    f"model-0000{k}-of-00003.safetensors": {
        f"layer{k}.{part}": np.full((300, 100), k * 10 + j, np.float32)
        for j, part in enumerate(("q", "k", "v"))
    }
    for k in (1, 2, 3)
}


def index_of(shards: dict[str, Arrays]) -> bytes:
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    return json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}).encode()


def sharded_files(shards: dict[str, Arrays]) -> dict[str, bytes]:
    files = {shard: reference_numpy.save(arrays) for shard, arrays in shards.items()}
    files["model.safetensors.index.json"] = index_of(shards)
    return files


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[FakeHub]:
    """A running fake Hub with a single-file model and a sharded one; the environment points
    at it and holds its token (and no token file)."""
    with FakeHub() as running:
        running.push("org/model", {"model.safetensors": reference_numpy.save(BIG)})
        running.push("org/sharded", sharded_files(SHARDS))
        monkeypatch.setenv("HF_ENDPOINT", running.endpoint)
        monkeypatch.setenv("HF_TOKEN", running.token)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        yield running


def on(hub: FakeHub, host: str) -> list[Seen]:
    """The requests ``host`` received, after checking that only the Hub ever saw the token."""
    seen = hub.seen()
    assert seen, "no request reached the fake Hub"
    assert all("authorization" not in r.headers for r in seen if r.host == CDN_HOST)
    return [r for r in seen if r.host == host]


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


# ---------------------------------------------------------------- addresses and tokens


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("hf://org/repo/model.safetensors", ("model", "org/repo", "main", "model.safetensors")),
        ("hf://org/repo@v1.0/a/b.safetensors", ("model", "org/repo", "v1.0", "a/b.safetensors")),
        ("hf://org/repo@refs%2Fpr%2F1/m.json", ("model", "org/repo", "refs/pr/1", "m.json")),
        ("hf://datasets/org/data/x.safetensors", ("dataset", "org/data", "main", "x.safetensors")),
        ("HF://datasets/org/data@abc/x", ("dataset", "org/data", "abc", "x")),
        ("hf://org/repo/a%20b.safetensors", ("model", "org/repo", "main", "a%20b.safetensors")),
    ],
)
def test_addresses(url: str, expected: tuple[str, str, str, str]) -> None:
    file = HubFile.parse(url)
    assert (file.repo_type, file.repo_id, file.revision, file.path) == expected
    assert HubFile.parse(file.address()) == file


def test_resolve_urls_encode_the_revision_and_path() -> None:
    endpoint = "https://hub.example/"
    assert (
        HubFile.parse("hf://org/repo@refs%2Fpr%2F1/a b.safetensors").resolve_url(endpoint)
        == "https://hub.example/org/repo/resolve/refs%2Fpr%2F1/a%20b.safetensors"
    )
    assert (
        HubFile.parse("hf://datasets/org/data/x%y").resolve_url(endpoint)
        == "https://hub.example/datasets/org/data/resolve/main/x%25y"
    )
    assert (
        HubFile.parse("hf://org/repo@refs%2Fpr%2F1/m").address("c0ffee") == "hf://org/repo@c0ffee/m"
    )


def test_a_revision_whose_escapes_are_not_text_is_refused() -> None:
    """Bad escapes were each made U+FFFD: two revisions written apart became one, asked of the
    Hub and kept in the cache under one name."""
    for url in ("hf://org/repo@%ED%A0%80/m", "hf://org/repo@%FF%FF/m"):
        with pytest.raises(UnsupportedSourceError, match="not UTF-8 text"):
            HubFile.parse(url)


@pytest.mark.parametrize(
    "url", ["hf://org/repo", "hf://org/model.safetensors", "hf://org//x", "hf://org/repo@/x"]
)
def test_bad_addresses(url: str) -> None:
    with pytest.raises(UnsupportedSourceError, match="hf://"):
        HubFile.parse(url)


async def test_a_space_is_no_repository_read(hub: FakeHub) -> None:
    """hf://spaces/org/name/file was read as the model repository 'spaces/org' (and answered
    'private or gated, or does not exist'): a Space is refused before any request."""
    with pytest.raises(UnsupportedSourceError, match="a Space is neither a model nor a dataset"):
        await stream_st.read_header("hf://spaces/org/model/model.safetensors")
    assert hub.seen() == []


def test_endpoint_and_token_from_the_environment(tmp_path: Path) -> None:
    assert hub_endpoint({}) == "https://huggingface.co"
    assert hub_endpoint({"HF_ENDPOINT": "http://127.0.0.1:9/"}) == "http://127.0.0.1:9"
    home = tmp_path / "home"
    home.mkdir()
    assert hub_token({"HF_HOME": str(home)}) is None
    (home / "token").write_text("hf_from_file\n")
    assert hub_token({"HF_HOME": str(home)}) == "hf_from_file"
    assert hub_token({"HF_HOME": str(home), "HF_TOKEN": "hf_env"}) == "hf_env"
    assert hub_token({"HF_HOME": str(home), "HF_TOKEN": " "}) == "hf_from_file"
    (tmp_path / "huggingface").mkdir()
    (tmp_path / "huggingface" / "token").write_text("hf_xdg")
    assert hub_token({"XDG_CACHE_HOME": str(tmp_path)}) == "hf_xdg"


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        (5, "environ takes a mapping"),
        ({"HF_ENDPOINT": 5, "HF_TOKEN": 5}, r"environ\['HF_(ENDPOINT|TOKEN)'\] must be a str"),
    ],
)
def test_an_environment_of_another_type_is_refused_naming_it(environ: Any, match: str) -> None:
    """hub_endpoint(5) and hub_token(5) raised a bare AttributeError, as did a variable of
    another type than str."""
    for function in (hub_endpoint, hub_token):
        with pytest.raises(stream_st.ArgumentTypeError, match=match):
            function(environ)


def test_a_token_given_with_whitespace_at_an_end_is_refused() -> None:
    """``token=`` pasted with a tab or a no-break space: refused as such, never shown (the
    environment's and the token file's are stripped, as huggingface_hub strips them)."""
    for token in ("hf_s3cret\t", "\u00a0hf_s3cret"):
        with pytest.raises(stream_st.UsageError, match="whitespace at its start or end") as info:
            HubSource("hf://org/m/model.safetensors", token=token)
        assert "s3cret" not in str(info.value)
    assert hub_token({"HF_TOKEN": "hf_env\t"}) == "hf_env"


def test_the_token_goes_to_the_hubs_origin_only() -> None:
    client = HubClient("https://huggingface.co", "hf_x")
    assert client.on_hub("https://HuggingFace.co:443/org/repo/resolve/main/x")
    for elsewhere in (
        "http://huggingface.co/x",  # another scheme
        "https://huggingface.co:8443/x",  # another port
        "https://cdn-lfs.huggingface.co/x",  # another host
        "https://huggingface.co.evil.example/x",
        "https://[::1/x",  # not a URL at all
        "https://huggingface.co:99999/x",
    ):
        assert not client.on_hub(elsewhere), elsewhere


def test_the_hubs_origin_is_the_one_requests_connect_to() -> None:
    # A host name the client IDNA-encodes to the Hub's is the Hub: whether the token goes and
    # where the connection goes are decided by the same parse.
    client = HubClient("https://huggingface.co", "hf_x")
    assert client.on_hub("https://\uff48uggingface.co/org/repo/resolve/main/x")
    assert not HubClient("https://[::1", "hf_x").on_hub("https://[::1/x")


def test_shard_addresses_stay_in_the_repository() -> None:
    index = "hf://org/repo@refs%2Fpr%2F1/sub/model.safetensors.index.json"
    assert (
        shard_address(index, "a b.safetensors") == "hf://org/repo@refs%2Fpr%2F1/sub/a b.safetensors"
    )
    for bad in ("../x.safetensors", "..%2Fx.safetensors", "/x.safetensors", "a?b"):
        with pytest.raises(HeaderError):
            shard_address(index, bad)


# ---------------------------------------------------------------- one file


async def test_header_only_costs_one_request_to_each_host(hub: FakeHub) -> None:
    header = await stream_st.read_header("hf://org/model/model.safetensors")
    assert set(header.names()) == set(BIG)
    hub_requests, cdn_requests = on(hub, HUB), on(hub, CDN_HOST)
    assert [(r.method, r.range) for r in hub_requests] == [("GET", f"bytes=0-{FIRST_RANGE - 1}")]
    assert hub_requests[0].headers["authorization"] == f"Bearer {hub.token}"
    assert [(r.method, r.range) for r in cdn_requests] == [("GET", f"bytes=0-{FIRST_RANGE - 1}")]
    assert "sig=" in cdn_requests[0].query


async def test_full_read_resolves_once(hub: FakeHub) -> None:
    assert_same_arrays(await read_all("hf://org/model/model.safetensors"), BIG)
    assert [r.range for r in on(hub, HUB)] == ["bytes=0-"]
    assert [r.range for r in on(hub, CDN_HOST)] == ["bytes=0-"]


async def test_later_ranges_go_straight_to_the_cdn(hub: FakeHub) -> None:
    async with stream_st.open_stream("hf://org/model/model.safetensors") as stream:
        assert_same_arrays({n: a async for n, a in stream}, BIG)
    assert len(on(hub, HUB)) == 1
    assert len(on(hub, CDN_HOST)) == 2
    hub.log.clear()
    wanted = ["t1", "t4"]
    async with stream_st.open_stream("hf://org/model/model.safetensors", include=wanted) as stream:
        assert_same_arrays({n: a async for n, a in stream}, {k: BIG[k] for k in wanted})
    assert len(on(hub, HUB)) == 1
    assert len(on(hub, CDN_HOST)) == 3  # the first 64 KiB, then each selected tensor


async def test_a_parallel_read_resolves_once(hub: FakeHub) -> None:
    """Today's HTTP source, given the resolve URL, sends every part through the Hub's redirect
    again; the hf:// source asks the Hub once and the CDN for every part."""
    source = HubSource("hf://org/model/model.safetensors", concurrency=4, part_size=256 << 10)
    assert_same_arrays(await read_all(source), BIG)
    cdn_requests = on(hub, CDN_HOST)
    assert len(on(hub, HUB)) == 1
    assert len(cdn_requests) > 8

    hub.log.clear()
    plain = HttpSource(
        hub.url("org/model", "model.safetensors"), concurrency=4, part_size=256 << 10
    )
    assert_same_arrays(await read_all(plain), BIG)
    assert len(on(hub, HUB)) == len(on(hub, CDN_HOST)) == len(cdn_requests)


@pytest.mark.parametrize("etag", [False, True])
@pytest.mark.parametrize("status", [403, 410])
async def test_an_expired_cdn_url_is_resolved_again(hub: FakeHub, status: int, etag: bool) -> None:
    """Also where the CDN's answers name the version with an ETag and its refusal names none,
    as CloudFront's do, where that read as the object changed (SourceChangedError)."""
    hub.cdn_etag = etag
    hub.expired_status = status
    hub.expire_after = 1  # the URL expires once the first range was served
    async with stream_st.open_stream("hf://org/model/model.safetensors") as stream:
        assert_same_arrays({n: a async for n, a in stream}, BIG)
    cdn_requests = on(hub, CDN_HOST)
    assert len(on(hub, HUB)) == 2
    assert len(cdn_requests) == 3  # served, refused (expired), served at the new URL
    assert cdn_requests[0].query != cdn_requests[2].query


async def test_parts_that_expire_together_resolve_once(hub: FakeHub) -> None:
    hub.expire_after = 2  # the first 64 KiB and one part; the other parts in flight are refused
    source = HubSource("hf://org/model/model.safetensors", concurrency=4, part_size=256 << 10)
    assert_same_arrays(await read_all(source), BIG)
    assert len(on(hub, HUB)) == 2


async def test_a_url_refused_again_after_resolving_is_an_error(hub: FakeHub) -> None:
    hub.signature_valid = lambda path, query: False  # type: ignore[method-assign]
    with pytest.raises(HTTPStatusError) as caught:
        await read_all("hf://org/model/model.safetensors")
    assert caught.value.status == 403
    assert "hf://org/model/model.safetensors" in str(caught.value)
    assert "sig=" not in str(caught.value)
    assert len(on(hub, HUB)) == len(on(hub, CDN_HOST)) == 2


def filled(value: float) -> bytes:
    """A file of 8 tensors of 1 MiB each, every element ``value``."""
    return reference_numpy.save({f"t{i}": np.full(1 << 18, value, np.float32) for i in range(8)})


@pytest.mark.parametrize("concurrency", [1, 4])
async def test_an_expired_url_is_resolved_again_at_the_commit_read_from(
    hub: FakeHub, concurrency: int
) -> None:
    """The branch moves and the signed URL expires mid-read: the Hub is asked again at the
    commit the read began at, never at the branch (which would mix two versions in one read)."""
    first = hub.push("org/m", {"m.safetensors": filled(1)})
    seen: dict[str, float] = {}
    source = HubSource("hf://org/m/m.safetensors", concurrency=concurrency, part_size=1 << 20)
    async with stream_st.open_stream(source, include=["t0", "t4", "t7"]) as stream:
        async for name, array in stream:
            seen[name] = float(array[0])
            if name == "t0":
                hub.push("org/m", {"m.safetensors": filled(2)})
                hub.expire()
    assert seen == {"t0": 1.0, "t4": 1.0, "t7": 1.0}
    paths = [r.path for r in on(hub, HUB)]
    assert paths[0] == "/org/m/resolve/main/m.safetensors"
    assert set(paths[1:]) == {f"/org/m/resolve/{first}/m.safetensors"}


@pytest.mark.parametrize("change", ["SHA-256", "commit"])
async def test_a_resolution_naming_another_version_is_a_changed_source(
    hub: FakeHub, change: str
) -> None:
    """A Hub whose answer at the commit names another SHA-256 or another commit than its first
    answer did: SourceChangedError, nothing of the other version delivered."""
    first = hub.push("org/m", {"m.safetensors": filled(1)})
    repo = hub.repos[("model", "org/m")]
    seen: dict[str, float] = {}
    with pytest.raises(SourceChangedError, match=f"changed on the Hub during the read: {change}"):
        async with stream_st.open_stream("hf://org/m/m.safetensors", include=["t0", "t7"]) as s:
            async for name, array in s:
                seen[name] = float(array[0])
                if change == "SHA-256":  # the commit's file replaced in place
                    data = filled(2)
                    repo.commits[first] = {"m.safetensors": data}
                    hub.cdn.objects[f"/{hashlib.sha256(data).hexdigest()}"] = data
                else:  # the commit asked for answered as another one
                    repo.refs[first] = hub.push("org/m", {"m.safetensors": filled(2)})
                hub.expire()
    assert seen == {"t0": 1.0}


@pytest.mark.parametrize(
    ("failure", "kind"),
    [("gone", TransportError), ("stalled", ReadTimeoutError), ("gzip", HTTPProtocolError)],
)
async def test_cdn_failures_never_quote_the_signed_url(
    hub: FakeHub, failure: str, kind: type[TransportError]
) -> None:
    # The signed CDN URL is a key to the file while it lasts: errors name the hf:// address.
    # Only the stall waits out the timeout: the others fail at once, so theirs has room for a
    # loaded machine.
    timeout = 0.5 if failure == "stalled" else 10.0
    source = HubSource("hf://org/model/model.safetensors", retries=0, timeout=timeout)
    with pytest.raises(kind) as caught:
        async with stream_st.open_stream(source) as stream:
            if failure == "gone":
                hub.cdn.stop()
            elif failure == "stalled":
                hub.cdn.stall_after = 0
            else:
                hub.cdn.gzip = "always"
            async for _ in stream:
                pass
    assert caught.value.url == "hf://org/model/model.safetensors"
    assert "sig=" not in str(caught.value) and "expires=" not in str(caught.value)


async def test_files_the_hub_serves_itself(hub: FakeHub) -> None:
    hub.is_lfs = lambda path: False  # type: ignore[method-assign]
    async with stream_st.open_stream("hf://org/model/model.safetensors") as stream:
        assert_same_arrays({n: a async for n, a in stream}, BIG)
    assert len(on(hub, HUB)) == 2  # the first 64 KiB, then the rest
    assert on(hub, CDN_HOST) == []


async def test_datasets_and_revisions(hub: FakeHub) -> None:
    small = {"x": np.arange(10, dtype=np.int32)}
    other = {"x": np.arange(5, dtype=np.int32)}
    hub.push("org/data", {"x.safetensors": reference_numpy.save(small)}, repo_type="dataset")
    first = hub.push("org/model", {"m.safetensors": reference_numpy.save(small)}, revision="v2")
    hub.push("org/model", {"m.safetensors": reference_numpy.save(other)}, revision="v2")
    hub.push("org/model", {"m.safetensors": reference_numpy.save(other)}, revision="refs/pr/1")
    assert_same_arrays(await read_all("hf://datasets/org/data/x.safetensors"), small)
    assert_same_arrays(await read_all(f"hf://org/model@{first}/m.safetensors"), small)
    assert_same_arrays(await read_all("hf://org/model@v2/m.safetensors"), other)
    assert_same_arrays(await read_all("hf://org/model@refs%2Fpr%2F1/m.safetensors"), other)
    paths = [r.path for r in on(hub, HUB)]
    assert paths == [
        "/datasets/org/data/resolve/main/x.safetensors",
        f"/org/model/resolve/{first}/m.safetensors",
        "/org/model/resolve/v2/m.safetensors",
        "/org/model/resolve/refs%2Fpr%2F1/m.safetensors",
    ]
    with pytest.raises(HTTPNotFoundError, match=r"hf://org/model@v3/m\.safetensors"):
        await stream_st.read_header("hf://org/model@v3/m.safetensors")
    with pytest.raises(HTTPNotFoundError, match=r"hf://org/model/nothing\.safetensors"):
        await stream_st.read_header("hf://org/model/nothing.safetensors")


@pytest.mark.parametrize("cache", [False, True])
async def test_a_hub_out_of_reach_is_named_by_the_address_given(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cache: bool
) -> None:
    """With the cache, the Hub's question failing to connect named the resolve URL asked
    (HF_ENDPOINT/org/model/resolve/main/...), where a read without it names the hf:// address."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        address = "hf://org/model/model.safetensors"
        with pytest.raises(TransportError) as caught:
            await stream_st.read_header(address, cache=cache, timeout=5)
    assert caught.value.url == address, caught.value


async def test_private_and_gated_repositories(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    hub.push("org/private", {"model.safetensors": reference_numpy.save(BIG)}, private=True)
    hub.push("org/gated", {"model.safetensors": reference_numpy.save(BIG)}, gated=True)
    header = await stream_st.read_header("hf://org/private/model.safetensors")
    assert set(header.names()) == set(BIG)

    monkeypatch.delenv("HF_TOKEN")
    with pytest.raises(HTTPStatusError) as caught:
        await stream_st.read_header("hf://org/private/model.safetensors")
    message = str(caught.value)
    assert caught.value.status == 401
    assert "private or gated" in message and "HF_TOKEN" in message and "\n" not in message

    (tmp_path / "hf-home").mkdir()
    (tmp_path / "hf-home" / "token").write_text(hub.token)  # the token file `hf auth login` writes
    assert (await stream_st.read_header("hf://org/private/model.safetensors")).names()

    monkeypatch.setenv("HF_TOKEN", "hf_not_granted")
    with pytest.raises(HTTPStatusError) as caught:
        await stream_st.read_header("hf://org/gated/model.safetensors")
    assert caught.value.status == 403
    assert "token was refused or has no access" in str(caught.value)
    assert all(r.host == HUB for r in hub.seen() if "gated" in r.path)

    # The Hub answers 401 for a repository that does not exist, token or not: the message says
    # so, where with a token it blamed the token alone.
    with pytest.raises(HTTPStatusError) as caught:
        await stream_st.read_header("hf://org/no-such-repo/model.safetensors")
    assert caught.value.status == 401 and "does not exist (check its name)" in str(caught.value)


async def test_a_renamed_repository_is_followed_with_the_token(hub: FakeHub) -> None:
    hub.push("org/private", {"model.safetensors": reference_numpy.save(BIG)}, private=True)
    hub.renamed[("model", "old/name")] = "org/private"
    assert set((await stream_st.read_header("hf://old/name/model.safetensors")).names()) == set(BIG)
    hub_requests = on(hub, HUB)
    assert [r.path for r in hub_requests] == [
        "/old/name/resolve/main/model.safetensors",
        "/org/private/resolve/main/model.safetensors",
    ]
    assert all(r.headers.get("authorization") == f"Bearer {hub.token}" for r in hub_requests)
    assert len(on(hub, CDN_HOST)) == 1


async def test_a_renamed_repository_s_file_the_hub_serves_is_asked_where_it_moved(
    hub: FakeHub,
) -> None:
    """A file the Hub serves itself (no CDN) of a renamed repository: the ranges after the
    first go to the address the Hub redirected to, not through the old name's redirect again."""
    hub.push("org/private", {"model.safetensors": reference_numpy.save(BIG)})
    hub.renamed[("model", "old/name")] = "org/private"
    hub.is_lfs = lambda path: False  # type: ignore[method-assign]
    async with stream_st.open_stream("hf://old/name/model.safetensors") as stream:
        assert {name async for name, _ in stream} == set(BIG)
    assert [r.path for r in on(hub, HUB)] == [
        "/old/name/resolve/main/model.safetensors",
        *["/org/private/resolve/main/model.safetensors"] * 2,
    ]


async def test_a_hub_redirect_to_an_unusable_address_is_a_protocol_error(hub: FakeHub) -> None:
    hub.renamed[("model", "org/model")] = "/127.0.0.1:99999/x"  # Location: //127.0.0.1:99999/...
    with pytest.raises(HTTPProtocolError, match="redirect to an unusable address"):
        await read_all("hf://org/model/model.safetensors")


async def test_no_token_no_authorization(hub: FakeHub) -> None:
    source = HubSource("hf://org/model/model.safetensors", token="")
    assert (await stream_st.read_header(source)).names()
    assert all("authorization" not in r.headers for r in hub.seen())


# ---------------------------------------------------------------- sharded checkpoints

INDEX = "hf://org/sharded/model.safetensors.index.json"
ALL_SHARDED = {name: array for arrays in SHARDS.values() for name, array in arrays.items()}


async def test_sharded_checkpoint(hub: FakeHub) -> None:
    assert_same_arrays(await read_all(INDEX), ALL_SHARDED)
    assert len(on(hub, HUB)) == 1 + len(SHARDS)  # the index (served by the Hub), each shard
    assert len(on(hub, CDN_HOST)) == len(SHARDS)

    hub.log.clear()
    report = await inspect(INDEX)
    assert report.shards == len(SHARDS) and report.tensor_count == len(ALL_SHARDED)
    assert len(on(hub, HUB)) == 1 + len(SHARDS)
    assert len(on(hub, CDN_HOST)) == len(SHARDS)

    hub.log.clear()
    async with stream_st.open_stream(INDEX, include=["layer2.k"]) as stream:
        assert_same_arrays({n: a async for n, a in stream}, {"layer2.k": ALL_SHARDED["layer2.k"]})
    assert len(on(hub, HUB)) == 2  # the index, the one shard holding the tensor
    assert len(on(hub, CDN_HOST)) == 2  # its first 64 KiB, the tensor


async def test_shards_come_from_the_commit_of_the_index(hub: FakeHub) -> None:
    commit = hub.repos[("model", "org/sharded")].refs["main"]
    changed = {
        shard: {name: array + 1 for name, array in arrays.items()}
        for shard, arrays in SHARDS.items()
    }
    got: Arrays = {}
    async for name, array in stream_st.open_stream(INDEX):
        if not got:  # the branch moves while the first shard is being read
            hub.push("org/sharded", sharded_files(changed))
        got[name] = array
    assert_same_arrays(got, ALL_SHARDED)
    shard_paths = [r.path for r in on(hub, HUB)][1:]
    assert shard_paths == [f"/org/sharded/resolve/{commit}/{shard}" for shard in sorted(SHARDS)]


async def test_shard_names_are_held_to_the_policy(hub: FakeHub) -> None:
    weight_map = {"x": "../other/model.safetensors"}
    hub.push(
        "org/bad", {"model.safetensors.index.json": json.dumps({"weight_map": weight_map}).encode()}
    )
    with pytest.raises(HeaderError, match="stays next to the index"):
        await read_all("hf://org/bad/model.safetensors.index.json")
    assert len(on(hub, HUB)) == 1  # the index; no shard was asked for


# ---------------------------------------------------------------- paths holding '?' and '#'

# An hf:// path is taken as written, as an S3 key is: '?' and '#' are part of a name there, never
# a query or a fragment.


@pytest.mark.parametrize("folder", ["a#b", "a?b", "a?b#c"])
async def test_an_index_in_a_folder_holding_a_query_or_fragment_character(
    hub: FakeHub, folder: str
) -> None:
    shard = "model-00001-of-00001.safetensors"
    beside: Arrays = {"w": np.full(4, 7.0, np.float32)}
    hub.push(
        "org/folders",
        {
            shard: reference_numpy.save({"w": np.zeros(4, np.float32)}),  # not the index's
            f"{folder}/{shard}": reference_numpy.save(beside),
            f"{folder}/model.safetensors.index.json": index_of({shard: beside}),
        },
    )
    index = f"hf://org/folders/{folder}/model.safetensors.index.json"
    assert shard_address(index, shard) == f"hf://org/folders/{folder}/{shard}"
    assert_same_arrays(await read_all(index), beside)
    assert_same_arrays(await stream_st.load(index), beside)


def test_cp_into_a_directory_names_the_copy_by_the_whole_hub_path(
    hub: FakeHub, tmp_path: Path
) -> None:
    files: dict[str, Arrays] = {
        "w?a.safetensors": {"x": np.zeros(2, np.float32)},
        "w#b.safetensors": {"x": np.ones(2, np.float32)},
    }
    hub.push("org/names", {name: reference_numpy.save(arrays) for name, arrays in files.items()})
    into = tmp_path / "copies"
    into.mkdir()
    for name in files:  # the second once overwrote the first, both named 'w'
        assert main(["cp", f"hf://org/names/{name}", f"{into}/"]) == 0
    assert sorted(path.name for path in into.iterdir()) == sorted(files)
    for name, arrays in files.items():
        assert_same_arrays(reference_numpy.load_file(into / name), arrays)


# ---------------------------------------------------------------- against huggingface_hub


def count_requests(hub: FakeHub) -> tuple[int, int]:
    return len(on(hub, HUB)), len(on(hub, CDN_HOST))


async def test_header_only_costs_fewer_requests_than_huggingface_hub(
    hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Header-only inspection of a single-file and a sharded checkpoint: at most as many requests
    as ``huggingface_hub.get_safetensors_metadata`` (its cache in a fresh directory)."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    api = huggingface_hub.HfApi(endpoint=hub.endpoint, token=hub.token)
    for repo, address in (
        ("org/model", "hf://org/model/model.safetensors"),
        ("org/sharded", INDEX),
    ):
        hub.log.clear()
        theirs = await anyio_to_thread(api.get_safetensors_metadata, repo)
        their_counts = count_requests(hub)
        hub.log.clear()
        ours = await inspect(address)
        our_counts = count_requests(hub)
        assert ours.tensor_count == sum(len(m.tensors) for m in theirs.files_metadata.values())
        assert sum(our_counts) <= sum(their_counts)
        assert our_counts[1] <= their_counts[1]


async def anyio_to_thread(function: Any, *args: Any) -> Any:
    import anyio.to_thread

    return await anyio.to_thread.run_sync(function, *args)


# ---------------------------------------------------------------- the Hub's SHA-256


async def test_a_full_read_is_checked_against_the_hubs_sha256(hub: FakeHub) -> None:
    url = "hf://org/model/model.safetensors"
    async with stream_st.open_stream(url) as stream:
        got = {name: array async for name, array in stream}
    assert_same_arrays(got, BIG)
    assert stream.object_check == "the Hub's SHA-256 (X-Linked-Etag): verified"
    # Part of the file: nothing to check it against.
    async with stream_st.open_stream(url, include="t1") as stream:
        assert [name async for name, _ in stream] == ["t1"]
    assert stream.object_check is None
    # A file the Hub serves itself (not LFS) comes with no X-Linked-Etag.
    hub.push("org/small", {"model.bin": reference_numpy.save(BIG)})
    async with stream_st.open_stream(HubSource("hf://org/small/model.bin")) as stream:
        assert_same_arrays({name: array async for name, array in stream}, BIG)
    assert stream.object_check is None


async def test_bytes_damaged_after_the_hub_never_pass_unnoticed(
    hub: FakeHub, tmp_path: Path
) -> None:
    url = "hf://org/model/model.safetensors"
    data = reference_numpy.save(BIG)
    key = f"/{hashlib.sha256(data).hexdigest()}"
    damaged = bytearray(data)
    damaged[-1000] ^= 0x10  # inside the last tensor: a plain file has nothing else to check
    hub.cdn.objects[key] = bytes(damaged)
    delivered = []
    with pytest.raises(IntegrityError, match=r"does not match the Hub's SHA-256") as info:
        async for name, _ in stream_st.open_stream(url):
            delivered.append(name)
    assert delivered == list(BIG)  # every tensor, then the error: the end is where it is known
    assert info.value.name is None and info.value.source == url
    with pytest.raises(IntegrityError):
        await stream_st.load(url)
    with pytest.raises(IntegrityError):
        await tools.cp(url, tmp_path / "copy.safetensors")
    assert not list(tmp_path.iterdir())  # nothing committed
    unchecked = await stream_st.load(url, verify=False)
    assert_same_arrays(unchecked, reference_numpy.load(bytes(damaged)))
