"""The eleventh attack: connections left mid-message, streams closed from another task, KV
producers that fail, memory that is not plain bytes, options of the wrong type. Each test failed
before its mend."""

from __future__ import annotations

import contextlib
import json
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import numpy as np
import pytest
from safetensors.numpy import save as reference_save
from safetensors.numpy import save_file as reference_save_file

import stream_st
from stream_st import tools
from stream_st.cli import main


async def _send_messages(
    url: str, messages: list[dict[str, np.ndarray[Any, Any]]], pause: float
) -> None:
    """Each of ``messages`` written on one connection to ``url``, kept open ``pause`` s more."""
    async with await stream_st.connect(url) as connection:
        for message in messages:
            async with connection.open_writer(_plan(message)) as writer:
                for name, array in message.items():
                    await writer.write(name, array)
        await anyio.sleep(pause)


def _plan(message: dict[str, np.ndarray[Any, Any]]) -> list[stream_st.TensorSpec]:
    return [
        stream_st.TensorSpec(name, "F32" if a.dtype == np.float32 else "U8", a.shape)
        for name, a in message.items()
    ]


@pytest.mark.parametrize("how", ["break", "refused", "messages"])
async def test_a_message_left_part_way_makes_the_connection_refuse_further_reads(
    how: str,
) -> None:
    """The next read began in the middle of the message left: a tensor whose bytes are a
    safetensors file was handed out as the next message (wrong data, no error)."""
    inner = reference_save({"weights": np.array([6.66, 6.66], np.float32)})
    first: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(4, dtype=np.float32),
        "blob": np.frombuffer(inner, np.uint8).copy(),
    }
    second: dict[str, np.ndarray[Any, Any]] = {"weights": np.array([1.0, 2.0], np.float32)}
    seen: list[str] = []
    async with stream_st.listen("127.0.0.1", 0) as listener:

        async def send() -> None:
            await _send_messages(listener.url, [first, second], pause=5)

        async with anyio.create_task_group() as group:
            group.start_soon(send)
            async with await listener.accept() as connection:
                if how == "messages":
                    with pytest.raises(stream_st.UsageError, match="left at its byte"):
                        async for stream in connection.messages():
                            async for name, _ in stream:
                                seen.append(name)
                                break
                else:
                    include = ["nope"] if how == "refused" else None
                    with (
                        pytest.raises(stream_st.TensorNotFoundError)
                        if include
                        else contextlib.nullcontext()
                    ):
                        async with connection.open_stream(include=include) as stream:
                            async for name, _ in stream:
                                seen.append(name)
                                break
                    with pytest.raises(stream_st.UsageError, match="before its end"):
                        async with connection.open_stream() as stream:
                            async for name, _ in stream:
                                seen.append(name)
            group.cancel_scope.cancel()
    assert seen == ([] if how == "refused" else ["a"])


async def test_a_connection_read_to_each_end_goes_on() -> None:
    """Messages read whole, or with include= skipping what is not wanted, leave the connection
    at the next one."""
    messages = [
        {"a": np.full(3, float(i), np.float32), "b": np.zeros(2, np.float32)} for i in range(3)
    ]
    async with stream_st.listen("127.0.0.1", 0) as listener:

        async def send() -> None:
            await _send_messages(listener.url, messages, pause=0)

        async with anyio.create_task_group() as group:
            group.start_soon(send)
            got = []
            async with await listener.accept() as connection:
                async for stream in connection.messages(include=["a"]):
                    got += [float(array[0]) async for _, array in stream]
    assert got == [0.0, 1.0, 2.0]


async def _read_while_closed(
    stream: stream_st.TensorStream, watchdog: Any, got: list[str], pause: float
) -> None:
    """Read ``stream`` into ``got`` (``pause`` s a tensor) while ``watchdog``, another task,
    closes it: the loop must fail, not end."""
    async with anyio.create_task_group() as group:
        group.start_soon(watchdog)
        with pytest.raises(stream_st.TransportError, match="closed on this side"):
            async with stream:
                async for name, _ in stream:
                    got.append(name)
                    await anyio.sleep(pause)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("kind", ["bytes", "path"])
def test_a_stream_closed_from_another_task_fails_its_loop(
    tmp_path: Path, backend: str, kind: str
) -> None:
    """The loop of a stream closed by another task (a watchdog) while the loop's body ran ended
    as if the file held only the tensors handed out so far."""
    data = reference_save({f"t{i}": np.full(1000, i, np.float32) for i in range(6)})
    path = tmp_path / "six.safetensors"
    path.write_bytes(data)
    got: list[str] = []

    async def main() -> None:
        stream = stream_st.open_stream(data if kind == "bytes" else path)

        async def watchdog() -> None:
            await anyio.sleep(0.05)
            await stream.aclose()

        await _read_while_closed(stream, watchdog, got, pause=0.03)

    anyio.run(main, backend=backend)
    assert 0 < len(got) < 6


async def test_a_stream_read_to_its_end_then_closed_ends_quietly() -> None:
    """Closing after the last tensor, or after a break, raises nothing."""
    data = reference_save({f"t{i}": np.zeros(2, np.float32) for i in range(3)})
    stream = stream_st.open_stream(data)
    async with stream:
        names = [name async for name, _ in stream]
    await stream.aclose()
    assert names == ["t0", "t1", "t2"]
    async with stream_st.open_stream(data) as stream:
        async for _ in stream:
            break


@pytest.mark.parametrize("pause", [0.0, 0.1])
async def test_a_failing_kv_producer_delivers_the_layers_it_made(pause: float) -> None:
    """With no pause before its failure, the producer's error cancelled layer 0 mid-send: the
    receiver got none of the two layers made, or both, by timing alone."""
    from stream_st.kv import KVLayout, receive_kv, send_kv

    shape = (1, 4, 64, 64)

    async def producer() -> Any:
        for i in range(2):
            yield i, np.full(shape, i, np.float16), np.full(shape, i, np.float16)
        await anyio.sleep(pause)
        raise RuntimeError("model failed at layer 2")

    got: list[int] = []
    async with stream_st.listen("127.0.0.1", 0) as listener:

        async def receive() -> None:
            with pytest.raises(stream_st.TruncatedStreamError, match="layer_2_key"):
                connection = await listener.accept()
                async with connection, receive_kv(connection, timeout=5) as kv:
                    async for layer, key, _ in kv:
                        assert float(key.reshape(-1)[0]) == layer
                        got.append(layer)

        with anyio.fail_after(10):
            async with anyio.create_task_group() as group:
                group.start_soon(receive)
                with pytest.raises(RuntimeError, match="model failed at layer 2"):
                    await send_kv(listener.url, KVLayout(4, shape), producer())
    assert got == [0, 1]


async def test_memory_of_python_objects_is_neither_a_chunk_nor_a_destination() -> None:
    """An object array as into= memory had its pointers overwritten (the process then crashed);
    as a chunk, its pointers were read as tensor bytes. A bfloat16 chunk, which memoryview
    cannot export, was refused where float16 was taken."""
    import ml_dtypes

    data = reference_save({"t": np.array([1, 2], np.int64)})
    objects = np.array([object(), object()], dtype=object)
    with pytest.raises(stream_st.UsageError, match="a buffer of Python objects"):
        async for _ in stream_st.open_stream(data, into={"t": objects.data}):
            pass

    async def chunks(last: Any) -> Any:
        yield data[:-16]
        yield last

    with pytest.raises(stream_st.UnsupportedSourceError, match="Python objects"):
        async for _ in stream_st.open_stream(chunks(np.array(["secret", 42], dtype=object))):
            pass
    tail = np.frombuffer(data[-16:], np.uint16).view(ml_dtypes.bfloat16)
    arrays = [a async for _, a in stream_st.open_stream(chunks(tail))]
    assert arrays[0].tolist() == [1, 2]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ("send_kv queue=None", stream_st.ArgumentTypeError),
        ("send_kv queue=-5", stream_st.UsageError),
        ("receive_kv max_ahead=nan", stream_st.ArgumentTypeError),
        ("receive_kv max_ahead=None", stream_st.ArgumentTypeError),
        ("KVLayout codec=None", stream_st.ArgumentTypeError),
        ("listen port='9000'", stream_st.ArgumentTypeError),
        ("listen port=1.5", stream_st.ArgumentTypeError),
    ],
)
async def test_options_of_the_wrong_kind_are_refused_by_name(
    tmp_path: Path, call: str, error: type[Exception]
) -> None:
    """Each was a bare TypeError, ValueError or AttributeError, or (queue=-5, max_ahead=nan:
    no backpressure at all) taken."""
    from stream_st.kv import KVLayout, receive_kv, send_kv

    shape = (1, 1, 2, 64)
    layout = KVLayout(2, shape)
    layers = [(i, np.ones(shape, np.float16), np.ones(shape, np.float16)) for i in range(2)]
    path = tmp_path / "kv.safetensors"
    await send_kv(path, layout, layers)
    with pytest.raises(error):
        if call.startswith("send_kv"):
            await send_kv(path, layout, layers, queue=None if "None" in call else -5)  # type: ignore[arg-type]
        elif call.startswith("receive_kv"):
            ahead = None if "None" in call else float("nan")
            async with receive_kv(path, max_ahead=ahead):  # type: ignore[arg-type]
                pass
        elif call.startswith("KVLayout"):
            KVLayout(2, shape, codec=None)  # type: ignore[arg-type]
        else:
            port = "9000" if "'" in call else 1.5
            async with stream_st.listen("127.0.0.1", port):  # type: ignore[arg-type]
                pass


def _two_shards(folder: Path) -> Path:
    """A checkpoint of two shards written by the reference, and its index."""
    folder.mkdir()
    shards = {"model-00001-of-00002.safetensors": "a", "model-00002-of-00002.safetensors": "b"}
    for number, (shard, name) in enumerate(shards.items()):
        reference_save_file({name: np.full(4, number, np.float32)}, str(folder / shard))
    index = folder / "model.safetensors.index.json"
    weight_map = {name: shard for shard, name in shards.items()}
    index.write_text(json.dumps({"metadata": {"total_size": 32}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("where", ["index", "folder"])
def test_show_reads_a_tensor_of_a_sharded_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """Failed for every index and model folder: "a sharded stream has one header per shard"."""
    index = _two_shards(tmp_path / "model")
    source = str(index if where == "index" else index.parent)
    assert main(["show", "--json", source, "b"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["values"] == [1.0] * 4 and record["shape"] == [4]


def test_hash_check_shows_listed_names_escaped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checksum list (untrusted, downloaded with the files) forged an "OK" line with a name
    holding newlines (coreutils' escaped form), and sent escape sequences to the terminal."""
    monkeypatch.chdir(tmp_path)
    forged = "x\\nmodel.safetensors: OK\\ny.safetensors"
    listing = tmp_path / "SHA256SUMS"
    listing.write_text(f"\\{'0' * 64}  {forged}\n{'0' * 64}  evil\x1b[2J.safetensors\n")
    assert main(["hash", "--check", str(listing)]) != 0
    captured = capsys.readouterr()
    assert "\nmodel.safetensors: OK" not in captured.out
    assert "x\\nmodel.safetensors: OK\\ny.safetensors: FAILED" in captured.out
    assert "\x1b" not in captured.out + captured.err


def test_cp_to_an_s3_address_without_a_bucket_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cp m.safetensors s3://`` wrote ./s3:/m.safetensors (the URL became a local path) where
    an ``s3:`` folder existed, else said "no such directory"."""
    monkeypatch.chdir(tmp_path)
    reference_save_file({"a": np.zeros(2, np.float32)}, "m.safetensors")
    (tmp_path / "s3:").mkdir()
    for destination in ("s3://", "s3:///"):
        assert main(["cp", "m.safetensors", destination]) == 2
        assert "names no bucket or host" in capsys.readouterr().err
    assert list((tmp_path / "s3:").iterdir()) == []


async def test_saving_a_sparse_tensor_is_refused_by_name_everywhere(tmp_path: Path) -> None:
    """To a local file, the size check choosing the inline write raised torch's bare
    RuntimeError before the tensors were checked."""
    torch = pytest.importorskip("torch")
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(stream_st.UsageError, match="sparse_coo, not dense"):
        await stream_st.save(tmp_path / "s.safetensors", {"w": sparse})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("options", [[], ["--dtype", "bf16"], ["--include", "a"]])
def test_a_mirror_checks_each_shard_against_the_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], options: list[str]
) -> None:
    """An index assigning each tensor to the other shard was mirrored (exit 0) as it was, or
    with --dtype given a "corrected" index, or with --include refused as a bad option."""
    folder = tmp_path / "model"
    index = _two_shards(folder)
    swapped = {"a": "model-00002-of-00002.safetensors", "b": "model-00001-of-00002.safetensors"}
    index.write_text(json.dumps({"metadata": {"total_size": 32}, "weight_map": swapped}))
    out = tmp_path / "out"
    assert main(["cp", "-q", *options, str(index), f"{out}/"]) == 2
    assert "differ from those the index assigns it" in capsys.readouterr().err
    assert not out.exists()


def test_a_merge_of_shards_with_digests_of_two_kinds_keeps_digests(tmp_path: Path) -> None:
    """Every digest was dropped (no digests in the merged file) when the shards' algorithms
    differed, or only some shards had digests."""
    folder = tmp_path / "model"
    folder.mkdir()
    for shard, name, algorithm in (("s1", "a", "xxh3-128"), ("s2", "b", "sha256")):
        path, tensors = folder / f"{shard}.safetensors", {name: np.ones(4, np.float32)}
        anyio.run(partial(stream_st.save, path, tensors, checksums=algorithm))
    weight_map = {"a": "s1.safetensors", "b": "s2.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    merged = tmp_path / "merged.safetensors"
    assert main(["cp", "-q", "--merge", f"{folder}/", str(merged)]) == 0
    header = anyio.run(stream_st.read_header, merged)
    assert header.metadata["stream_st.digest"] == "xxh3-128"


@pytest.mark.parametrize("option", [{"quantize": 8}, {"dtype": 5}, {"include": 5}])
async def test_cp_refuses_options_of_the_wrong_kind(tmp_path: Path, option: dict[str, Any]) -> None:
    """cp(quantize=8) and cp(include=5) raised bare AttributeError and TypeError."""
    source = tmp_path / "a.safetensors"
    reference_save_file({"a": np.zeros(2, np.float32)}, str(source))
    with pytest.raises(stream_st.UsageError):
        await stream_st.tools.cp(source, tmp_path / "b.safetensors", **option)
    assert not (tmp_path / "b.safetensors").exists()


@pytest.mark.parametrize(("before", "after"), [(1, 2), (3, 2), (2, 1)])
async def test_a_checkpoint_saved_again_leaves_no_shard_of_the_earlier_one(
    tmp_path: Path, before: int, after: int
) -> None:
    """A checkpoint of two shards saved where one of one shard was left model.safetensors,
    which loaders (transformers) take before the index: the old weights were loaded."""
    (tmp_path / "notes.safetensors").write_bytes(b"kept")
    (tmp_path / "other-00001-of-00002.safetensors").write_bytes(b"kept")

    async def save(shards: int, value: float) -> None:
        async with stream_st.open_sharded_writer(tmp_path, max_shard_size=16) as writer:
            for i in range(shards):
                await writer.write(f"w{i}", np.full(4, value, np.float32))

    await save(before, 0.0)
    await save(after, 1.0)
    names = sorted(p.name for p in tmp_path.iterdir())
    shards = (
        ["model.safetensors"]
        if after == 1
        else [f"model-{i:05d}-of-{after:05d}.safetensors" for i in range(1, after + 1)]
    )
    assert names == sorted(
        [
            *shards,
            "model.safetensors.index.json",
            "notes.safetensors",
            "other-00001-of-00002.safetensors",
        ]
    )
    loaded = await stream_st.load(tmp_path / "model.safetensors.index.json")
    assert all(float(a[0]) == 1.0 for a in loaded.values()) and len(loaded) == after


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"stream_st.digest": "md5"}, "the header's digests use 'md5'"),
        ({"stream_st.digest:b": None}, "tensor 'b' has no digest in the header"),
    ],
)
def test_cp_of_a_damaged_digest_record_names_the_source(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: dict[str, str | None],
    message: str,
) -> None:
    """cp said "unknown digest algorithm 'md5'; choose one of [...]", as if an option were
    wrong, or "tensor 'b' has no digest", naming no source; the other commands said which."""
    arrays = {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)}
    good = tmp_path / "good.safetensors"
    anyio.run(partial(stream_st.save, good, arrays, checksums=True))
    metadata = dict(anyio.run(stream_st.read_header, good).metadata)
    for key, value in damage.items():
        if value is None:
            del metadata[key]
        else:
            metadata[key] = value
    damaged = tmp_path / "damaged.safetensors"
    reference_save_file(arrays, str(damaged), metadata=metadata)
    assert main(["cp", "-q", str(damaged), str(tmp_path / "copy.safetensors")]) == 2
    error = capsys.readouterr().err
    assert message in error and str(damaged) in error and "choose one of" not in error


def test_cp_of_an_unknown_algorithm_names_the_argument_not_the_source(tmp_path: Path) -> None:
    """cp(src, dst, checksums="md5") said "src: unknown digest algorithm 'md5'", the name
    checked once the source was open, as if the source were damaged; a mirror as well."""
    missing = tmp_path / "missing.safetensors"  # never opened: the argument is refused first
    said = "checksums= names an unknown digest algorithm 'md5'"
    with pytest.raises(stream_st.UsageError, match=said) as refused:
        anyio.run(partial(tools.cp, missing, tmp_path / "c.safetensors", checksums="md5"))
    assert str(missing) not in str(refused.value)
    index = tmp_path / "missing.safetensors.index.json"
    with pytest.raises(stream_st.UsageError, match=said):
        anyio.run(partial(tools.mirror, str(index), f"{tmp_path}/out/", checksums="md5"))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ({"stream_st.digest": "md5"}, "md5 digests of 2 tensors, which no read can check"),
        ({"stream_st.digest:ghost": "0" * 32}, "digests of 3 tensors of 2: a damaged record"),
    ],
)
def test_inspect_says_when_a_digest_record_cannot_be_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: dict[str, str], said: str
) -> None:
    """An md5 record was said to be "checked as read", and a record with a digest for no
    tensor "a digest of each of 3 tensors" for a file of 2."""
    arrays = {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)}
    good = tmp_path / "good.safetensors"
    anyio.run(partial(stream_st.save, good, arrays, checksums=True))
    metadata = {**anyio.run(stream_st.read_header, good).metadata, **damage}
    damaged = tmp_path / "damaged.safetensors"
    reference_save_file(arrays, str(damaged), metadata=metadata)
    assert main(["inspect", str(damaged)]) == 0
    out = capsys.readouterr().out
    assert said in out and "checked as read" not in out


async def test_a_file_given_as_an_index_is_called_a_file(tmp_path: Path) -> None:
    """tools.mirror() of a .safetensors file said "the index is not valid JSON: 'utf-32-le'
    codec can't decode..."."""
    path = tmp_path / "m.safetensors"
    reference_save_file({"a": np.zeros(2, np.float32)}, str(path))
    with pytest.raises(stream_st.UsageError, match="is a safetensors file, not an index"):
        await stream_st.tools.mirror(str(path), f"{tmp_path}/out/")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("how", ["header only", "one anext", "break on the last"])
async def test_a_message_read_to_its_last_byte_leaves_the_connection_usable(how: str) -> None:
    """A message whose every byte was taken without its iteration reaching its end (a message
    of no tensor whose header was looked at, anext() of a one-tensor message, a break on the
    last tensor) made the next read refuse the connection."""
    first: dict[str, np.ndarray[Any, Any]] = (
        {} if how == "header only" else {"x": np.arange(3, dtype=np.float32)}
    )
    messages = [first, {"y": np.ones(2, np.float32)}]
    async with stream_st.listen("127.0.0.1", 0) as listener:

        async def send() -> None:
            await _send_messages(listener.url, messages, pause=5)

        async with anyio.create_task_group() as group:
            group.start_soon(send)
            async with await listener.accept() as connection:
                async with connection.open_stream() as stream:
                    if how == "one anext":
                        await anext(aiter(stream))
                    elif how == "break on the last":
                        async for _ in stream:
                            break
                async with connection.open_stream() as stream:
                    names = [name async for name, _ in stream]
            group.cancel_scope.cancel()
    assert names == ["y"]


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_step_that_failed_and_is_tried_again_does_not_end_the_loop_quietly(
    backend: str,
) -> None:
    """A step cut off by a timeout caught around it, then tried again, ended the iteration as if
    every tensor had been read."""
    data = reference_save({f"t{i}": np.full(1000, i, np.float32) for i in range(6)})

    async def chunks() -> Any:
        yield data[:200]
        await anyio.sleep(0.2)
        yield data[200:]

    async def main() -> None:
        items = aiter(stream_st.open_stream(chunks()))
        with anyio.move_on_after(0.05):
            await anext(items)
        with pytest.raises(stream_st.UsageError, match=r"iteration failed .* cannot go on"):
            await anext(items)

    anyio.run(main, backend=backend)


async def test_a_sharded_stream_closed_while_reading_opens_no_further_shard(
    tmp_path: Path,
) -> None:
    """Closed by another task while its loop was inside a shard's read, the stream went on to
    read every later shard and handed out all of their tensors."""
    async with stream_st.open_sharded_writer(tmp_path, max_shard_size=4 << 20) as writer:
        for i in range(8):
            await writer.write(f"t{i}", np.full(1 << 20, i, np.float32))  # a shard each
    stream = stream_st.open_stream(tmp_path / "model.safetensors.index.json")
    got: list[str] = []

    async def watchdog() -> None:
        while len(got) < 2:
            await anyio.lowlevel.checkpoint()
        generator = stream._generator() if stream._generator is not None else None
        while generator is None or not getattr(generator, "ag_running", False):  # inside a read
            await anyio.lowlevel.checkpoint()
        await stream.aclose()

    await _read_while_closed(stream, watchdog, got, pause=0.0)
    assert len(got) < 8


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """The fake Hub with one private file, and an environment with no token of its own."""
    from ..servers.hub_server import FakeHub

    with FakeHub(token="hf_SECRET123") as served:
        data = reference_save({"a": np.arange(4, dtype=np.float32)})
        served.push("org/private", {"model.safetensors": data}, private=True)
        monkeypatch.setenv("HF_ENDPOINT", served.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        monkeypatch.delenv("HF_TOKEN", raising=False)
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield served


async def test_a_callers_credentials_never_reach_the_hubs_cdn(hub: Any) -> None:
    """An Authorization header given with headers= to an hf:// read went to the CDN (another
    origin), where an http:// read of the same URL dropped it at the redirect."""
    secret = {"Authorization": "Bearer hf_SECRET123", "Cookie": "session=hf_SECRET123"}
    loaded = await stream_st.load("hf://org/private/model.safetensors", headers=secret)
    assert loaded["a"].tolist() == [0, 1, 2, 3]
    seen = hub.seen()
    assert any("resolve" in r.path for r in seen) and any("resolve" not in r.path for r in seen)
    for request in seen:
        on_hub = "resolve" in request.path
        sent = request.headers.get("authorization"), request.headers.get("cookie")
        assert (sent[0] is not None) == on_hub and (sent[1] is None or on_hub), request.path


async def test_hf_hub_offline_holds_for_reads_without_a_cache(
    hub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HF_HUB_OFFLINE=1 was ignored unless cache= was given: the Hub was asked, the token
    sent."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET123")
    with pytest.raises(stream_st.CacheMissError):
        await stream_st.read_header("hf://org/private/model.safetensors")
    assert hub.seen() == []


@pytest.mark.parametrize("token", ["hf_abc\r\nX-Injected: yes", 123, b"hf_abc"])
async def test_a_hub_token_that_no_header_can_carry_is_refused(
    hub: Any, monkeypatch: pytest.MonkeyPatch, token: Any
) -> None:
    """A token with a line break injected a header; an int or bytes token was sent as its
    text."""
    if isinstance(token, str):
        monkeypatch.setenv("HF_TOKEN", token)
        with pytest.raises(stream_st.UsageError, match="from HF_TOKEN holds a line break") as info:
            await stream_st.read_header("hf://org/private/model.safetensors")
    else:
        with pytest.raises(stream_st.ArgumentTypeError, match="a Hub token is a str") as info:
            stream_st.hub.HubSource("hf://org/private/model.safetensors", token=token)
    assert "hf_abc" not in str(info.value)
    assert hub.seen() == []


async def test_hf_hub_offline_stops_every_request_to_the_hub(
    hub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads no cache answers (a HubSource given itself, a process group's, a dataset's
    manifest) still asked the Hub, the token sent, with HF_HUB_OFFLINE=1."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_SECRET123")
    source = stream_st.hub.HubSource("hf://org/private/model.safetensors")
    with pytest.raises(stream_st.CacheMissError, match="HF_HUB_OFFLINE is set"):
        await stream_st.read_header(source)
    assert hub.seen() == []


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_stream_of_chunks_closed_while_a_chunk_is_awaited(backend: str) -> None:
    """Closing raised a bare RuntimeError in the closing task ("aclose(): asynchronous
    generator is already running"), the chunks' generator being awaited by the loop."""
    data = reference_save({f"t{i}": np.full(1000, i, np.float32) for i in range(6)})

    async def chunks() -> Any:
        for start in range(0, len(data), 1000):
            await anyio.sleep(0.01)
            yield data[start : start + 1000]

    async def main() -> None:
        stream = stream_st.open_stream(chunks())
        got: list[str] = []

        async def watchdog() -> None:
            await anyio.sleep(0.075)
            await stream.aclose()

        await _read_while_closed(stream, watchdog, got, pause=0.0)
        assert len(got) < 6

    anyio.run(main, backend=backend)


async def test_a_save_timed_out_by_asyncio_settles_before_it_raises() -> None:
    """asyncio.timeout cancelled save() at once while its thread wrote on: the file could be
    committed after the call had raised TimeoutError (a retry or a clean-up raced it)."""
    import asyncio
    import threading
    import time

    from stream_st.writer import run_stoppable

    running = threading.Event()
    ended: list[bool] = []

    def work(stop: Any) -> str:
        running.set()
        time.sleep(0.3)  # a block being written: the thread cannot be interrupted
        ended.append(True)
        return "committed" if not stop() else "stopped"

    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.05):
            await run_stoppable(work)
    assert running.is_set() and ended == [True]  # the thread had ended when the call raised


@pytest.mark.parametrize("how", ["save", "open_writer", "numpy drop-in"])
async def test_metadata_copied_from_a_checksummed_file_makes_a_readable_file(
    tmp_path: Path, how: str
) -> None:
    """The digest record in metadata copied from a checksummed file was written as it was:
    stream_st then called its own fresh file corrupt (the tensor had changed)."""
    source = tmp_path / "a.safetensors"
    await stream_st.save(source, {"w": np.ones(4, np.float32)}, checksums=True)
    metadata = dict((await stream_st.read_header(source)).metadata)
    changed = {"w": np.full(4, 2.0, np.float32)}
    destination = tmp_path / "b.safetensors"
    if how == "save":
        await stream_st.save(destination, changed, metadata=metadata)
    elif how == "open_writer":
        plan = [stream_st.TensorSpec("w", "F32", (4,))]
        async with stream_st.open_writer(destination, plan, metadata=metadata) as writer:
            await writer.write("w", changed["w"])
    else:
        from stream_st.numpy import save_file

        await anyio.to_thread.run_sync(
            lambda: save_file(changed, str(destination), metadata=metadata)
        )
    loaded = await stream_st.load(destination)
    assert loaded["w"].tolist() == [2.0] * 4
    header = await stream_st.read_header(destination)
    assert not any(key.startswith("stream_st.digest") for key in header.metadata)


@pytest.mark.parametrize("how", ["save", "open_writer"])
async def test_a_destination_ending_in_a_slash_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """save("ckpt/") wrote a regular file named ckpt, where the reference and open() refuse."""
    monkeypatch.chdir(tmp_path)
    arrays = {"a": np.zeros(2, np.float32)}
    with pytest.raises(stream_st.UsageError, match="names a directory"):
        if how == "save":
            await stream_st.save("ckpt/", arrays)
        else:
            plan = [stream_st.TensorSpec("a", "F32", (2,))]
            async with stream_st.open_writer("ckpt/", plan) as writer:
                await writer.write("a", arrays["a"])
    assert list(tmp_path.iterdir()) == []


async def test_switches_take_true_or_false_only(tmp_path: Path) -> None:
    """verify="no" turned verification on, fsync="yes" was taken: any truthy value passed."""
    path = tmp_path / "a.safetensors"
    arrays = {"a": np.zeros(2, np.float32)}
    with pytest.raises(stream_st.ArgumentTypeError, match="fsync must be True or False"):
        await stream_st.save(path, arrays, fsync="yes")  # type: ignore[arg-type]
    await stream_st.save(path, arrays)
    with pytest.raises(stream_st.ArgumentTypeError, match="verify must be True or False"):
        await stream_st.load(path, verify="no")  # type: ignore[arg-type]
    with pytest.raises(stream_st.ArgumentTypeError, match="copy must be True or False"):
        await stream_st.load(path, copy="no")  # type: ignore[arg-type]


async def test_metadata_keys_that_only_begin_like_a_digest_record_are_kept(
    tmp_path: Path,
) -> None:
    """Only the keys a reader takes for a digest record are left out, not a user's own
    "stream_st.digestion"."""
    path = tmp_path / "a.safetensors"
    metadata = {"stream_st.digestion": "mine", "stream_st.digest:w": "0" * 32}
    await stream_st.save(path, {"w": np.ones(2, np.float32)}, metadata=metadata)
    assert (await stream_st.read_header(path)).metadata == {"stream_st.digestion": "mine"}
