"""Defects a demanding user met from the outside (the public API, the drop-ins and the command),
a fifth round: each test failed before its fix (those marked xfail still fail: their fix belongs
to a module changed elsewhere)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.tools
from stream_st.cli import main
from stream_st.cli.exits import EXIT_ERROR
from stream_st.kv import KVLayout, KVReceiver, receive_kv, send_kv

from ..servers.http_server import RangeHTTPServer
from ._cli import TENSORS, write_model

Array = np.ndarray[Any, Any]

# ------------------------------------------------------------------ KV transfer over tcp://

KV_LAYOUT = KVLayout(num_layers=3, shape=(1, 2, 4, 8), dtype="F16")


def kv_layers() -> list[tuple[int, Array, Array]]:
    """The three layers of :data:`KV_LAYOUT`: layer ``i`` all ``i``, its value all ``-i``."""
    shape = KV_LAYOUT.shape
    return [(i, np.full(shape, i, np.float16), np.full(shape, -i, np.float16)) for i in range(3)]


async def receive_over_tcp(use: Any) -> Any:
    """``await use(receiver)`` on a transfer of :func:`kv_layers` over a real socket; what it
    returns (the sender may fail once the receiver is gone: that is not what is tested)."""
    async with (
        stream_st.listen("127.0.0.1", 0, timeout=10) as listener,
        anyio.create_task_group() as group,
    ):
        group.start_soon(send_quietly, listener.url)
        async with await listener.accept() as connection, receive_kv(connection) as kv:
            result = await use(kv)
        group.cancel_scope.cancel()
    return result


async def send_quietly(url: str) -> None:
    with contextlib.suppress(stream_st.TransportError):  # the receiver went away
        await send_kv(url, KV_LAYOUT, kv_layers())


async def test_a_released_kv_layer_asked_for_again_is_a_usage_error() -> None:
    """``wait_for_layer`` of a layer ``release`` forgot failed an ``assert`` (a bare
    AssertionError; under ``python -O``, ``raise None``: a TypeError)."""

    async def use(kv: KVReceiver) -> str:
        await kv.wait_for_layer(0)
        kv.release(0)
        with pytest.raises(stream_st.UsageError, match="layer 0 was released"):
            await kv.wait_for_layer(0)
        key, value = await kv.wait_for_layer(2)  # the others still come
        assert key[0, 0, 0, 0] == 2 and value[0, 0, 0, 0] == -2
        return "checked"

    assert await receive_over_tcp(use) == "checked"


async def test_a_kv_layer_asked_for_after_the_block_is_a_usage_error() -> None:
    """A layer that had not arrived when the ``receive_kv`` block was left: the same bare
    AssertionError."""

    async def use(kv: KVReceiver) -> KVReceiver:
        return kv

    kv = await receive_over_tcp(use)
    with pytest.raises(stream_st.UsageError, match="block was left"):
        await kv.wait_for_layer(2)


@pytest.mark.parametrize("layer", ["0", 1.0, True, None])
async def test_a_kv_layer_not_given_as_an_integer_is_a_type_error(layer: Any) -> None:
    """``wait_for_layer("0")`` was a bare TypeError comparing int and str, ``1.0`` one from a
    list index, and ``True`` was taken as layer 1."""

    async def use(kv: KVReceiver) -> str:
        with pytest.raises(stream_st.ArgumentTypeError, match="a layer is an integer"):
            await kv.wait_for_layer(layer)
        assert (await kv.wait_for_layer(np.int64(1)))[0][0, 0, 0, 0] == 1  # type: ignore[arg-type]
        return "checked"

    assert await receive_over_tcp(use) == "checked"


# ------------------------------------------------------------------------- the command


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A small file the reference wrote."""
    return write_model(tmp_path / "model.safetensors")


def test_show_refuses_a_slice_step_of_zero(model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--slice ::0`` was numpy's ValueError from deep inside: an internal error (exit 3) with
    a traceback."""
    name = "model.embed_tokens.weight"
    with pytest.raises(SystemExit) as exit_:
        main(["show", str(model), name, "--slice", "1,::0"])
    assert exit_.value.code == EXIT_ERROR
    assert "a slice's step cannot be zero, got '::0'" in capsys.readouterr().err
    assert main(["show", "--json", str(model), name, "--slice", "1,::-2"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == [7, 5]


def test_an_empty_source_path_is_shown_as_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stream-st cp "" out`` said "no such file: " with nothing after it."""
    assert main(["cp", "", str(tmp_path / "out.safetensors")]) != 0
    assert "no such file: ''" in capsys.readouterr().err


async def test_a_header_of_no_str_value_is_named_with_its_type() -> None:
    """The message read "got 'A': a int"; the value itself is never shown (it may be a token)."""
    with pytest.raises(stream_st.UsageError, match="got 'A' mapped to int") as caught:
        await stream_st.read_header("x.safetensors", headers={"A": 12345})  # type: ignore[dict-item]
    assert "12345" not in str(caught.value)


# ------------------------------------------------------------------ datasets and shards


def test_a_torch_dataset_takes_one_column_given_as_a_string(tmp_path: Path) -> None:
    """``columns="xy"`` was read as the columns ``x`` and ``y``: refused ("the dataset has no
    column 'x'"), or, where those existed, the wrong columns read. It is one name, as
    ``include=`` takes it; bytes are refused as not names."""
    pytest.importorskip("torch")
    from stream_st.integrations.torch_dataset import SafetensorsDataset

    async def write() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            await writer.write_batch(
                {"x": np.zeros(2, np.int8), "xy": np.arange(2), "y": np.ones(2, np.int8)}, 2
            )

    anyio.run(write)
    samples = list(SafetensorsDataset(tmp_path, columns="xy"))
    assert [{name: int(value) for name, value in s.items()} for s in samples] == [
        {"xy": 0},
        {"xy": 1},
    ]
    with pytest.raises(stream_st.ArgumentTypeError, match="names are str"):
        SafetensorsDataset(tmp_path, columns=b"xy")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("task_id", "samples", "error"),
    [
        (-1, 1, stream_st.UsageError),  # shards named part--0001-...: not found without manifest
        ("0", 1, stream_st.ArgumentTypeError),
        (0, "3", stream_st.ArgumentTypeError),  # was a bare TypeError comparing str and int
        (0, True, stream_st.ArgumentTypeError),  # was counted as 1 sample
        (0, 1.5, stream_st.ArgumentTypeError),
    ],
)
async def test_a_dataset_writer_refuses_a_task_or_a_count_that_is_not_one(
    tmp_path: Path, task_id: Any, samples: Any, error: type[Exception]
) -> None:
    with pytest.raises(error, match="must be an integer >= 0"):
        async with stream_st.open_dataset_writer(tmp_path / "data", task_id=task_id) as writer:
            await writer.write_batch({"x": np.zeros(2, np.int8)}, samples)
    assert not (tmp_path / "data").exists()
    three, two = np.int64(3), np.int64(2)
    async with stream_st.open_dataset_writer(tmp_path, task_id=three) as writer:  # type: ignore[arg-type]
        await writer.write_batch({"x": np.zeros(2, np.int8)}, two)  # type: ignore[arg-type]
    assert [p.name[:15] for p in tmp_path.glob("part-*")] == ["part-00003-0000"]


@pytest.mark.parametrize(
    ("size", "error"),
    [
        ("1GB", stream_st.ArgumentTypeError),
        (True, stream_st.ArgumentTypeError),
        (0, stream_st.UsageError),
    ],
)
async def test_a_sharded_writer_refuses_a_shard_size_that_is_not_a_count(
    tmp_path: Path, size: Any, error: type[Exception]
) -> None:
    """``max_shard_size="1GB"`` was a bare ``TypeError`` from comparing it with a number."""
    with pytest.raises(error, match="max_shard_size must be an integer >= 1"):
        async with stream_st.open_sharded_writer(tmp_path / "out", max_shard_size=size):
            pass
    with pytest.raises(stream_st.ArgumentTypeError, match="target_shard_size must be an integer"):
        stream_st.open_dataset_writer(tmp_path / "data", target_shard_size="1GB")  # type: ignore[arg-type]


def test_a_torch_datasets_rank_is_taken_even_without_a_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``rank`` given without ``world_size`` was dropped (both taken from the environment:
    rank 1 read rank 0's samples); a rank, world size or buffer given as a string was a bare
    ``TypeError`` or taken (``rank="0"``), a world size of 0 taken."""
    pytest.importorskip("torch")
    from stream_st.integrations.torch_dataset import SafetensorsDataset

    async def write() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            await writer.write_batch({"x": np.arange(4)}, 4)

    anyio.run(write)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert [int(s["x"]) for s in SafetensorsDataset(tmp_path, rank=1)] == [2, 3]
    assert [int(s["x"]) for s in SafetensorsDataset(tmp_path, world_size=4)] == [0]
    for bad in ({"rank": "0"}, {"world_size": "2"}, {"shuffle_buffer": "8"}, {"rank": True}):
        with pytest.raises(stream_st.ArgumentTypeError, match="must be an integer"):
            SafetensorsDataset(tmp_path, **bad)
    with pytest.raises(stream_st.UsageError, match="world_size must be an integer >= 1"):
        SafetensorsDataset(tmp_path, rank=0, world_size=0)


def test_a_kv_layouts_digest_is_true_or_false() -> None:
    """``digest="no"`` was taken, as true: the layer digests were sent."""
    with pytest.raises(stream_st.ArgumentTypeError, match="digest must be True or False"):
        KVLayout(1, (1, 1, 2, 4), digest="no")  # type: ignore[arg-type]
    assert KVLayout(1, (1, 1, 2, 4), digest=np.bool_(False)).digest is False  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ serving


async def test_a_name_given_with_its_suffix_is_served_under_it(model: Path) -> None:
    """``name="model.safetensors"`` (``--name model.safetensors``) was served at
    ``/model.safetensors.safetensors``: a request for ``/model.safetensors`` was a 404."""
    pytest.importorskip("aiohttp")
    async with stream_st.serving(model, name="weights.safetensors") as server:
        assert server.url.endswith("/weights.safetensors") and server.path == "/weights.safetensors"
        assert sorted(await stream_st.load(server.url)) == sorted(TENSORS)
    with pytest.raises(stream_st.UsageError, match="a plain file name"):
        async with stream_st.serving(model, name=".safetensors"):
            pass
    with pytest.raises(stream_st.UsageError, match="control characters"):  # was served at a
        async with stream_st.serving(model, name="a\nb"):  # URL no route answered (a 404)
            pass


# --------------------------------------------------------------------------- the writer


async def test_a_writer_aborted_by_its_user_says_so_not_none(tmp_path: Path) -> None:
    """After ``abort()``, closing (leaving the block) and writing said "the write was aborted
    (None); nothing was committed"."""
    plan = [stream_st.TensorSpec("a", "F32", (2,))]
    writer = stream_st.open_writer(tmp_path / "out.safetensors", plan)
    with pytest.raises(stream_st.SafetensorsError) as raised:
        async with writer:
            await writer.abort()
            await writer.write("a", np.zeros(2, np.float32))
    assert "None" not in str(raised.value) and "abort()" in str(raised.value)
    with pytest.raises(stream_st.WriterError) as closing:
        await writer.aclose()
    assert "None" not in str(closing.value) and "abort()" in str(closing.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", [1, b"a", ["a"]])
async def test_a_tensor_name_that_is_not_a_str_is_a_type_error(tmp_path: Path, name: Any) -> None:
    """``write(1, array)`` said "no tensor named 1 in the plan", as if the plan lacked it."""
    plan = [stream_st.TensorSpec("a", "F32", (2,))]
    with pytest.raises(stream_st.ArgumentTypeError, match="tensor names are str"):
        async with stream_st.open_writer(tmp_path / "out.safetensors", plan) as writer:
            await writer.write(name, np.zeros(2, np.float32))
    assert list(tmp_path.iterdir()) == []


def test_the_cache_commands_take_the_cache_dir_option_the_readers_take(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stream-st validate --cache-dir D URL`` kept a copy in D, then ``stream-st cache ls
    --cache-dir D`` was refused ("unrecognized arguments"): the cache commands took ``--dir``
    only, said to be "the cache given to --cache DIR", an option no command has."""
    data = reference_numpy.save({"t": np.arange(4, dtype=np.float32)})
    cache = str(tmp_path / "cache")
    with RangeHTTPServer(objects={"/m.safetensors": data}, etag="strong") as server:
        url = server.url("/m.safetensors")
        assert main(["validate", "-q", "--cache-dir", cache, url]) == 0
    capsys.readouterr()
    assert main(["cache", "ls", "--cache-dir", cache]) == 0
    assert url in capsys.readouterr().out
    assert main(["cache", "--cache-dir", cache, "rm", url]) == 0
    assert f"removed {url}" in capsys.readouterr().out
    assert main(["cache", "ls", "--json", "--dir", cache]) == 0
    assert url not in capsys.readouterr().out


# ------------------------------------------------------------------------- read_header


async def test_read_header_of_an_index_says_what_to_read_instead(tmp_path: Path) -> None:
    """``read_header("model.safetensors.index.json")`` said "a sharded stream has one header
    per shard: see .headers, .index", attributes of a stream the caller never had."""
    reference_numpy.save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "s1.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors"}}))
    with pytest.raises(stream_st.UsageError, match=r"index of sharded files.*tools\.inspect"):
        await stream_st.read_header(index)
    assert (await stream_st.tools.inspect(index)).tensor_count == 1
