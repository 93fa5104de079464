"""Sharded checkpoints: an index.json read as one stream, locally and over HTTP."""

from __future__ import annotations

import json
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import tools
from stream_st.core.shards import _inside, shard_name
from stream_st.sharded.reader import ShardedStream, shard_address
from stream_st.sharded.writer import open_dataset_writer

from .._util import assert_same_arrays, raw_file
from ..servers.http_server import RangeHTTPServer

Arrays = dict[str, np.ndarray[Any, Any]]

SHARDS: dict[str, Arrays] = {
    "model-00001-of-00002.safetensors": {
        "embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "layers.0.w": np.ones((2, 2), dtype=np.float16),
    },
    "model-00002-of-00002.safetensors": {
        "layers.1.w": np.full((2, 2), 7, dtype=np.float16),
        "lm_head.weight": np.arange(6, dtype=np.int64),
    },
}
ALL: Arrays = {name: array for shard in SHARDS.values() for name, array in shard.items()}


def index_bytes(shards: dict[str, Arrays] = SHARDS) -> bytes:
    weight_map = {name: shard for shard, arrays in shards.items() for name in arrays}
    return json.dumps({"metadata": {"total_size": 123}, "weight_map": weight_map}).encode()


def write_checkpoint(directory: Path) -> Path:
    for shard, arrays in SHARDS.items():
        reference_numpy.save_file(arrays, str(directory / shard))
    index = directory / "model.safetensors.index.json"
    index.write_bytes(index_bytes())
    return index


async def read_all(source: Any, **kwargs: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **kwargs)}


async def test_local_index_yields_every_shard_in_order(tmp_path: Path) -> None:
    index = write_checkpoint(tmp_path)
    names = []
    async with stream_st.open_stream(index) as stream:
        assert isinstance(stream, ShardedStream)
        assert stream.index.metadata == {"total_size": 123}
        async for name, _ in stream:
            names.append(name)
        assert sorted(stream.headers) == sorted(SHARDS)
    assert names == ["embed.weight", "layers.0.w", "lm_head.weight", "layers.1.w"]  # offset order
    assert_same_arrays(await read_all(str(index)), ALL)


async def test_include_across_shards_opens_only_needed_shards(tmp_path: Path) -> None:
    index = write_checkpoint(tmp_path)
    (tmp_path / "model-00001-of-00002.safetensors").unlink()  # never opened below
    got = await read_all(index, include=["lm_head.weight"])
    assert_same_arrays(got, {"lm_head.weight": ALL["lm_head.weight"]})
    with pytest.raises(stream_st.TensorNotFoundError, match="nope"):
        await read_all(index, include=["nope"])
    with pytest.raises(stream_st.ArgumentTypeError, match=r"^include= takes .* got 5$"):
        await read_all(index, include=5)


async def test_include_unknown_names_error_is_bounded(tmp_path: Path) -> None:
    """``include=`` naming 10**5 tensors an index or a manifest lacks listed every one (a 2.9 MB
    message); it now lists the first 8 and how many more. A short list is shown whole."""
    index = write_checkpoint(tmp_path)
    async with open_dataset_writer(tmp_path / "dataset") as writer:
        await writer.write_batch({"x": np.arange(3)}, samples=1)
    manifest = tmp_path / "dataset" / "dataset_manifest.json"
    wanted = [f"model.layers.{i}.weight" for i in range(10**5)]
    first = sorted(wanted)[:8]
    for source, where in ((index, "not in the index"), (manifest, "in no shard")):
        with pytest.raises(stream_st.TensorNotFoundError) as info:
            await stream_st.load(source, include=wanted)
        said = str(info.value)
        assert said == f"include= names tensors {where}: {first} and 99992 more", said[:500]
        with pytest.raises(stream_st.TensorNotFoundError) as info:
            await stream_st.load(source, include=["nope", "nix"])
        assert str(info.value) == f"include= names tensors {where}: ['nix', 'nope']"


async def test_include_an_iterator_is_taken_once(tmp_path: Path) -> None:
    """A manifest's stream looks at include= twice (the selection, then the check at its end
    that each name was found): an iterator's names are kept, where the selection spent it and
    a name in no shard went unnoticed."""
    async with open_dataset_writer(tmp_path) as writer:
        await writer.write_batch({"x": np.arange(3), "y": np.ones(2)}, samples=1)
    manifest = tmp_path / "dataset_manifest.json"
    assert list(await read_all(manifest, include=iter(["x"]))) == ["x"]
    with pytest.raises(stream_st.TensorNotFoundError, match=r"in no shard: \['nope'\]"):
        await read_all(manifest, include=iter(["x", "nope"]))


async def test_index_over_http() -> None:
    with RangeHTTPServer() as server:
        for shard, arrays in SHARDS.items():
            server.objects[f"/repo/{shard}"] = reference_numpy.save(arrays)
        server.objects["/repo/model.safetensors.index.json"] = index_bytes()
        got = await read_all(server.url("/repo/model.safetensors.index.json"))
    assert_same_arrays(got, ALL)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_an_index_opened_from_two_tasks_at_once_is_read_once(backend: str) -> None:
    """The second open() waits for the first one's and gets the same header: each read the
    index (two requests for it), as TensorStream.open() once did for a file; each shard is
    then requested once as the stream is read."""
    index = "/repo/model.safetensors.index.json"
    with RangeHTTPServer() as server:
        for shard, arrays in SHARDS.items():
            server.objects[f"/repo/{shard}"] = reference_numpy.save(arrays)
        server.objects[index] = index_bytes()

        async def main() -> tuple[list[stream_st.Header], Arrays]:
            stream = stream_st.open_stream(server.url(index))
            headers: list[stream_st.Header] = []

            async def opener() -> None:
                headers.append(await stream.open())

            with anyio.fail_after(10):
                async with anyio.create_task_group() as group:
                    group.start_soon(opener)
                    group.start_soon(opener)
                async with stream:
                    return headers, {name: array async for name, array in stream}

        headers, got = anyio.run(main, backend=backend)
        server.settle()
    assert len(headers) == 2 and headers[0] == headers[1]
    assert_same_arrays(got, ALL)
    gets = Counter(path for method, path, _, _ in server.requests if method == "GET")
    assert gets == {index: 1, **{f"/repo/{shard}": 1 for shard in SHARDS}}


async def test_bad_indexes(tmp_path: Path) -> None:
    index = write_checkpoint(tmp_path)
    bad = tmp_path / "bad.index.json"
    for content, message in [
        (b"{nope", "not valid JSON"),
        (b'{"weight_map": [1]}', "weight_map"),
        (b'{"weight_map": {"a": "../x.safetensors"}}', "next to the index"),
        (b'{"weight_map": {"a": "x\\u0000.safetensors"}}', "control or invisible character"),
        (b"[" * 100_000 + b"]" * 100_000, "the index JSON is nested too deeply"),
        (b'{"metadata": {"total_size": 1' + b"0" * 5000 + b"}}", "not valid JSON"),
    ]:
        bad.write_bytes(content)
        with pytest.raises(stream_st.HeaderError, match=message):
            await read_all(bad)
        with pytest.raises(stream_st.HeaderError, match=message):
            await tools.inspect(str(bad))
    # An index that assigns a shard tensors it does not hold.
    wrong = json.loads(index.read_bytes())
    wrong["weight_map"]["lm_head.weight"] = "model-00001-of-00002.safetensors"
    bad.write_text(json.dumps(wrong))
    with pytest.raises(stream_st.HeaderError, match="differ"):
        await read_all(bad)
    with pytest.raises(stream_st.SourceNotFoundError):
        await read_all(tmp_path / "missing.index.json")


def test_shard_addresses() -> None:
    assert shard_address("/m/model.safetensors.index.json", "a.safetensors") == "/m/a.safetensors"
    assert shard_address("s3://b/m/i.index.json", "a.safetensors") == "s3://b/m/a.safetensors"
    assert (
        shard_address("http://h:1/r/i.index.json?x=1", "a.safetensors")
        == "http://h:1/r/a.safetensors?x=1"
    )
    # A name is a name: percent-encoded where the transport decodes, as written where it does not.
    assert shard_address("m/i.index.json", "s/a %41.st") == "m/s/a %41.st"
    assert shard_address("s3://b/i.index.json", "s/a %41.st") == "s3://b/s/a %41.st"
    assert shard_address("file:///m/i.index.json", "s/a %41.st") == "file:///m/s/a%20%2541.st"
    assert shard_address("https://h/m/i.index.json", "s/a %41.st") == "https://h/m/s/a%20%2541.st"
    with pytest.raises(stream_st.HeaderError, match="shard name"):
        shard_address("https://h/m/i.index.json", "%2e%2e/a.st")


@pytest.mark.parametrize(
    ("index", "address"),
    [
        ("/m/i.index.json", "/a.st"),
        ("/m/i.index.json", "/m/../a.st"),
        ("/m/i.index.json", "/m/"),
        ("i.index.json", "../a.st"),
        ("i.index.json", "/a.st"),
        ("file:///m/i.index.json", "file:///m/%2e%2e/a.st"),
        ("http://h/m/i.index.json", "http://h/m/..%2fa.st"),
        ("http://h/m/i.index.json", "http://other/m/a.st"),
        ("http://h/m/i.index.json", "https://h/m/a.st"),
        ("http://h/m/i.index.json?k=1", "http://h/m/a.st?k=2"),
        ("http://h/m/i.index.json", "http://h/m/a.st#f"),
        ("s3://b/m/i.index.json", "s3://c/m/a.st"),
        ("s3://b/m/i.index.json", "s3://b/n/a.st"),
    ],
)
def test_addresses_outside_the_index_directory_are_caught(index: str, address: str) -> None:
    # The last check on every address shard_address builds, whatever the name check let through.
    assert not _inside(index, address)
    assert _inside(index, shard_address(index, "sub/a.st"))


# ------------------------------------------------ shard names from untrusted indexes and manifests

OUTSIDE = reference_numpy.save({"stolen": np.arange(4, dtype=np.int32)})
"""A valid safetensors file one level above the checkpoint: no shard name may reach it."""

ESCAPING_NAMES = [
    "%2e%2e/outside.safetensors",
    "..%2Foutside.safetensors",
    "..%2foutside.safetensors",
    "%252e%252e/outside.safetensors",  # decoded twice by a second parser or a proxy
    "%2525252e%2525252e/outside.safetensors",  # '..' only after four decodings
    "%2e%2e%2foutside.safetensors",
    "..",
    "../outside.safetensors",
    "sub/../../outside.safetensors",
    "..\\outside.safetensors",
    "..%5Coutside.safetensors",
    "/etc/passwd",
    "%2Fetc/passwd",
    "C:/outside.safetensors",
    "c:outside.safetensors",
    "~/outside.safetensors",
    "%7e/outside.safetensors",
    "file:///etc/passwd",
    "http://elsewhere/outside.safetensors",
    "//elsewhere/outside.safetensors",
    "sub//model.safetensors",
    "./model.safetensors",
    "sub/./model.safetensors",
    "sub/",
    "model.safetensors?x=1",
    "model.safetensors#part",
    "model\n.safetensors",
    "model%00.safetensors",
    "model%0d%0aX-Injected: 1",
    "\u202emodel.safetensors",
    "\uff0e\uff0e/outside.safetensors",  # fullwidth dots: '..' once NFKC-normalised
]


def index_naming(shard: object) -> bytes:
    return json.dumps({"weight_map": {"stolen": shard}}).encode()


def manifest_naming(shard: object, size: int = len(OUTSIDE)) -> bytes:
    return json.dumps({"shards": [{"shard_path": shard, "bytes": size}]}).encode()


@pytest.mark.parametrize("shard", ESCAPING_NAMES)
async def test_shard_names_that_could_leave_the_directory_are_refused(
    tmp_path: Path, shard: str
) -> None:
    (tmp_path / "outside.safetensors").write_bytes(OUTSIDE)
    checkpoint = tmp_path / "ck"
    (checkpoint / "sub").mkdir(parents=True)
    documents = {
        "model.safetensors.index.json": index_naming(shard),
        "dataset_manifest.json": manifest_naming(shard),
    }
    with RangeHTTPServer() as server:
        server.objects["/outside.safetensors"] = OUTSIDE
        for file_name, document in documents.items():
            (checkpoint / file_name).write_bytes(document)
            server.objects[f"/ck/{file_name}"] = document
            for address in (
                str(checkpoint / file_name),
                (checkpoint / file_name).as_uri(),
                server.url(f"/ck/{file_name}"),
            ):
                with pytest.raises(stream_st.HeaderError, match="shard name"):
                    await read_all(address)
                with pytest.raises(stream_st.HeaderError, match="shard name"):
                    await tools.inspect(address)
        # Refused before any request for a shard: the server saw only the index documents.
        assert {path for _, path, _, _ in server.requests} == {f"/ck/{d}" for d in documents}


def test_names_encoded_past_the_decoding_limit_are_refused() -> None:
    assert shard_name("%252541.safetensors", "i.index.json") == "%252541.safetensors"
    with pytest.raises(stream_st.HeaderError, match="still percent-encoded after 3 decodings"):
        shard_name("%25252541.safetensors", "i.index.json")
    # Each decoding of this name peels off one layer: checking them all would take minutes.
    with pytest.raises(stream_st.HeaderError, match="still percent-encoded"):
        shard_name("%" + "25" * 200_000 + "41.safetensors", "i.index.json")


@pytest.mark.parametrize("shard", [None, 5, ["a"], {"a": 1}, ""])
async def test_manifest_shard_paths_must_be_names(tmp_path: Path, shard: object) -> None:
    manifest = tmp_path / "dataset_manifest.json"
    manifest.write_bytes(manifest_naming(shard))
    with pytest.raises(stream_st.HeaderError, match="shard name"):
        await read_all(manifest)


@pytest.mark.parametrize("size", [True, -1, 1.5, "12"])
async def test_manifest_sizes_must_be_byte_counts(tmp_path: Path, size: object) -> None:
    manifest = tmp_path / "dataset_manifest.json"
    manifest.write_text(json.dumps({"shards": [{"shard_path": "a.safetensors", "bytes": size}]}))
    with pytest.raises(stream_st.HeaderError, match="'bytes'"):
        await read_all(manifest)


async def test_a_shard_name_means_the_same_file_next_to_every_kind_of_index(
    tmp_path: Path,
) -> None:
    # Sub-directories, spaces and a literal '%' are names, not URL syntax, wherever the index is.
    shards = {"sub/50%25 done.safetensors": SHARDS["model-00001-of-00002.safetensors"]}
    for shard, arrays in shards.items():
        (tmp_path / shard).parent.mkdir()
        reference_numpy.save_file(arrays, str(tmp_path / shard))
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(index_bytes(shards))
    expected = shards["sub/50%25 done.safetensors"]
    assert_same_arrays(await read_all(index), expected)
    assert_same_arrays(await read_all(index.as_uri()), expected)
    with RangeHTTPServer() as server:
        # The request target percent-encodes the name once; a server decodes it once.
        server.objects["/r/sub/50%2525%20done.safetensors"] = reference_numpy.save(expected)
        server.objects["/r/model.safetensors.index.json"] = index_bytes(shards)
        assert_same_arrays(await read_all(server.url("/r/model.safetensors.index.json")), expected)


async def test_symlinked_cache_layout_keeps_working(tmp_path: Path) -> None:
    # The Hugging Face cache: snapshots/<rev>/<file> are symlinks into ../../blobs/<hash>.
    blobs = tmp_path / "blobs"
    snapshot = tmp_path / "snapshots" / "0123abc"
    blobs.mkdir()
    (snapshot / "sub").mkdir(parents=True)
    shards = {
        "model-00001-of-00002.safetensors": SHARDS["model-00001-of-00002.safetensors"],
        "sub/model-00002-of-00002.safetensors": SHARDS["model-00002-of-00002.safetensors"],
    }
    files = {name: reference_numpy.save(arrays) for name, arrays in shards.items()}
    files["model.safetensors.index.json"] = index_bytes(shards)
    for number, (name, data) in enumerate(files.items()):
        (blobs / f"blob{number}").write_bytes(data)
        link = snapshot / name
        link.symlink_to(Path("../" * name.count("/")) / ".." / ".." / "blobs" / f"blob{number}")
    index = snapshot / "model.safetensors.index.json"
    assert index.is_symlink()
    assert_same_arrays(await read_all(index), ALL)
    assert_same_arrays(await read_all(index.as_uri()), ALL)
    assert (await tools.inspect(index)).tensor_count == len(ALL)


# ------------------------------------------------ errors never echo bytes of files not asked for

SECRET = b"s3cr3t"
PAD = 4321
"""Spaces after each JSON header below: a header length no path or message holds by chance."""


def leaky_files() -> dict[str, tuple[bytes, type[Exception] | tuple[type[Exception], ...]]]:
    """Files that are not the shards an index names, each with the error its bytes cause."""
    password_line = b"root:x:0:0:root:/root:/bin/bash\n" + SECRET + b"\n"
    return {
        # The first 8 bytes read as a header length, far above the limit.
        "passwd": (password_line, stream_st.HeaderTooLargeError),
        # A small length, then text that is not a JSON object.
        "excerpt": (raw_file(b'"' + SECRET + b'-token"', pad=PAD), stream_st.HeaderError),
        # A JSON object whose values the parser would quote back.
        "dtype": (
            raw_file(
                {"t": {"dtype": SECRET.decode(), "shape": [1], "data_offsets": [0, 1]}}, pad=PAD
            ),
            # a HeaderError and a DtypeError; a header-only read (inspect) keeps an unknown code
            # and then finds the shard shorter than its header says
            (stream_st.UnknownDtypeError, stream_st.TruncatedStreamError),
        ),
        # A valid header promising more bytes than the file holds.
        "short": (
            raw_file(
                {SECRET.decode(): {"dtype": "U8", "shape": [9999], "data_offsets": [0, 9999]}},
                pad=PAD,
            ),
            stream_st.TruncatedStreamError,
        ),
        "tail": (raw_file({}, SECRET, pad=PAD), stream_st.TrailingDataError),
        "tiny": (SECRET[:5], stream_st.HeaderError),
    }


def assert_no_echo(exc: BaseException, *forbidden: str) -> None:
    text = "".join(traceback.format_exception(exc))
    for value in (SECRET.decode(), *forbidden):
        assert value not in text, text


@pytest.mark.parametrize("kind", list(leaky_files()))
async def test_errors_from_a_shard_do_not_echo_its_bytes(tmp_path: Path, kind: str) -> None:
    data, error = leaky_files()[kind]
    secret = tmp_path / "secret"  # a file the user never named, reached through a symlink
    secret.write_bytes(data)
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / "leak.safetensors").symlink_to(secret)
    (checkpoint / "dataset_manifest.json").write_bytes(manifest_naming("leak.safetensors"))
    (checkpoint / "model.safetensors.index.json").write_bytes(index_naming("leak.safetensors"))
    length = str(int.from_bytes(data[:8].ljust(8, b"\0"), "little"))
    with RangeHTTPServer() as server:
        server.objects["/ck/leak.safetensors"] = data
        addresses = []
        for name in ("dataset_manifest.json", "model.safetensors.index.json"):
            server.objects[f"/ck/{name}"] = (checkpoint / name).read_bytes()
            addresses += [
                checkpoint / name,
                (checkpoint / name).as_uri(),
                server.url(f"/ck/{name}"),
            ]
        for address in addresses:
            for read in (read_all, tools.inspect):
                with pytest.raises(error) as caught:
                    await read(str(address))
                allowed = error if isinstance(error, tuple) else (error,)
                assert type(caught.value) in allowed
                assert "leak.safetensors" in str(caught.value)  # names the shard
                assert_no_echo(caught.value, length)


async def test_mismatched_shards_are_reported_without_their_contents(tmp_path: Path) -> None:
    shard = {SECRET.decode(): np.arange(12_345, dtype=np.uint8)}
    data = reference_numpy.save(shard)
    (tmp_path / "a.safetensors").write_bytes(data)
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(json.dumps({"weight_map": {"wanted": "a.safetensors"}}).encode())
    with pytest.raises(stream_st.HeaderError, match=r"differ.*'wanted'") as caught:
        await read_all(index)
    assert_no_echo(caught.value)
    manifest = tmp_path / "dataset_manifest.json"
    manifest.write_bytes(manifest_naming("a.safetensors", size=77))
    with pytest.raises(stream_st.HeaderError, match="77 bytes") as caught:
        await read_all(manifest)
    assert_no_echo(caught.value, str(len(data)))


# ------------------------------------------------ include= on a large index


class ScanCounter(dict[str, str]):
    """A weight map that counts the passes made over it."""

    scans = 0

    def items(self) -> Any:
        self.scans += 1
        return super().items()

    def values(self) -> Any:
        self.scans += 1
        return super().values()

    def __iter__(self) -> Any:
        self.scans += 1
        return super().__iter__()


async def test_include_on_an_index_scans_the_weight_map_once(tmp_path: Path) -> None:
    shards = {f"s{n:04}.safetensors": {f"t{n}": np.full(2, n, np.int16)} for n in range(300)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_bytes(index_bytes(shards))
    reference_numpy.save_file(shards["s0123.safetensors"], str(tmp_path / "s0123.safetensors"))
    async with stream_st.open_stream(index, include=["t123"]) as stream:
        assert isinstance(stream, ShardedStream)
        counted = ScanCounter(stream.index.weight_map or {})
        stream.index.weight_map = counted
        got = {name: array async for name, array in stream}
    assert_same_arrays(got, shards["s0123.safetensors"])
    assert counted.scans <= 1


async def test_a_closed_index_stream_does_not_open_again(tmp_path: Path) -> None:
    """As any stream: open() and 'async with' after aclose() are a UsageError (the index's
    stream gave an empty header)."""
    stream = stream_st.open_stream(write_checkpoint(tmp_path))
    async with stream:
        pass
    with pytest.raises(stream_st.UsageError, match="the stream is closed"):
        await stream.open()
    with pytest.raises(stream_st.UsageError, match="the stream is closed"):
        async with stream:
            pass


@pytest.mark.parametrize("name", ["m.index.json", "dataset_manifest.json"])
async def test_a_file_named_like_an_index_is_read_as_the_file_it_is(
    tmp_path: Path, name: str
) -> None:
    """A safetensors file named ``*.index.json`` (stream_st's own save_file writes one) was
    refused by every call and command, "a safetensors file, not an index of shards: copy or read
    it as one", where the reference loads it: a local one is now read as the file it is."""
    import safetensors
    import safetensors.numpy as reference_numpy

    import stream_st.compat as drop_in
    import stream_st.numpy as drop_in_numpy
    from stream_st.cli import main

    arrays: Arrays = {"a": np.arange(3, dtype=np.float32), "b": np.ones((2, 2), np.int16)}
    path = tmp_path / name
    drop_in_numpy.save_file(arrays, str(path), metadata={"k": "v"})
    assert_same_arrays(drop_in_numpy.load_file(str(path)), reference_numpy.load_file(str(path)))
    with (
        drop_in.safe_open(str(path), "np") as mine,
        safetensors.safe_open(str(path), "np") as theirs,
    ):
        assert mine.metadata() == theirs.metadata() == {"k": "v"}
        names = mine.keys()
        assert sorted(names) == sorted(theirs.keys())
        assert_same_arrays({k: mine.get_tensor(k) for k in names}, arrays)
    for source in (str(path), path, path.as_uri()):
        assert_same_arrays(await stream_st.load(source), arrays)
        assert (await stream_st.read_header(source)).metadata == {"k": "v"}
        async with stream_st.open_stream(source) as stream:
            assert_same_arrays({k: v async for k, v in stream}, arrays)
    copy = tmp_path / "copy.safetensors"
    for command in (["ls", str(path)], ["cp", "-q", str(path), str(copy)]):
        assert await anyio.to_thread.run_sync(main, command) == 0  # main() runs its own loop
    assert_same_arrays(reference_numpy.load_file(str(copy)), arrays)


async def test_a_remote_file_named_like_an_index_says_how_to_read_it(tmp_path: Path) -> None:
    """A remote address is taken for an index by its name: a file there is refused, with a way
    that works (a local copy), and what is neither a file nor an index stays refused."""
    with RangeHTTPServer() as server:
        server.objects["/r/m.index.json"] = reference_numpy.save({"a": np.ones(2, np.float32)})
        with pytest.raises(stream_st.UsageError, match=r"is a safetensors file.*local copy"):
            await stream_st.load(server.url("/r/m.index.json"))
    neither = tmp_path / "n.index.json"
    neither.write_bytes(b"\x09" + bytes(7) + b"{abcd")  # a length prefix past its end
    with pytest.raises(stream_st.HeaderError, match="not valid JSON"):
        await stream_st.load(neither)
