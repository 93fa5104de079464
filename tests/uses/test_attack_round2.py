"""Defects found by using stream_st as a demanding user does, each pinned by a test: the
command's messages and exit statuses, sharded copies, the KV layout, saving torch tensors."""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import signal
import warnings
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st import KVLayout, SafetensorsError, TensorNotFoundError, UsageError
from stream_st.cli import main
from stream_st.cli.app import _run, _Stopped

from ..servers.http_server import RangeHTTPServer
from ._cli import write_model


@pytest.fixture
def not_safetensors(tmp_path: Path) -> Path:
    path = tmp_path / "notes.txt"
    path.write_bytes(b"hello, this is no safetensors file at all")
    return path


# ------------------------------------------------- a failing source is named in the error


@pytest.mark.parametrize("first", [True, False], ids=["as A", "as B"])
def test_diff_names_the_source_that_is_not_safetensors(
    tmp_path: Path, not_safetensors: Path, first: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Of two sources, the error says which one is broken (it said only "not a safetensors
    file", the same for either)."""
    good = write_model(tmp_path / "good.safetensors")
    pair = [str(not_safetensors), str(good)] if first else [str(good), str(not_safetensors)]
    assert main(["diff", "-q", *pair]) == 2
    err = capsys.readouterr().err
    assert "not a safetensors file" in err
    assert str(not_safetensors) in err and str(good) not in err


def test_diff_content_names_the_source_whose_data_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An error while streaming one side's tensors (an unknown packed dtype) names that side."""
    good = write_model(tmp_path / "good.safetensors", {"w": np.zeros(4, np.int8)})
    packed = tmp_path / "packed.safetensors"
    header = json.dumps({"w": {"dtype": "I4", "shape": [8], "data_offsets": [0, 4]}}).encode()
    packed.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    assert main(["diff", "-q", "--content", str(good), str(packed)]) == 2
    err = capsys.readouterr().err
    assert "I4" in err and str(packed) in err


def test_cp_and_show_name_the_source_that_is_not_safetensors(
    tmp_path: Path, not_safetensors: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.safetensors"
    empty.touch()
    for argv, source in (
        (["cp", "-q", str(not_safetensors), str(tmp_path / "out.safetensors")], not_safetensors),
        (["show", str(empty), "w"], empty),
    ):
        assert main(argv) == 2
        assert f"error: {source}: " in capsys.readouterr().err
    assert not (tmp_path / "out.safetensors").exists()
    model = write_model(tmp_path / "model.safetensors")
    with pytest.raises(SystemExit) as stopped:  # the option's error, not the file's
        main(["show", "--timeout", "-1", str(model), "w"])
    assert stopped.value.code == 2 and str(model) not in capsys.readouterr().err


def test_cp_does_not_blame_the_source_for_its_destination(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_model(tmp_path / "model.safetensors")
    assert main(["cp", "-q", str(model), str(tmp_path / "no" / "such" / "out.st")]) == 2
    err = capsys.readouterr().err
    assert "no such directory" in err and f"error: {model}:" not in err


# ------------------------------------------------------------- signals and exit statuses


def test_a_stopping_signal_is_reported_even_when_the_command_then_fails() -> None:
    """SIGTERM (or SIGHUP) arriving as the source ends (``cat | stream-st cp - x``, both sent
    the hangup) stopped the command with exit status 2 and "stream ended": the signal's own
    status, 143 (129), is what a stopped command reports."""

    async def fails_as_the_signal_comes(args: argparse.Namespace) -> int:
        os.kill(os.getpid(), signal.SIGTERM)  # delivered, not yet handled by the event loop
        raise stream_st.TruncatedStreamError(
            "the header", name=None, offset=100, expected=288, source="/dev/stdin"
        )

    async def fails_after_the_signal(args: argparse.Namespace) -> int:
        os.kill(os.getpid(), signal.SIGHUP)
        with anyio.CancelScope(shield=True):  # work in flight when the signal came
            await anyio.sleep(0.1)
        raise stream_st.TruncatedStreamError(
            "the header", name=None, offset=100, expected=288, source="/dev/stdin"
        )

    for handler, signum in (
        (fails_as_the_signal_comes, signal.SIGTERM),
        (fails_after_the_signal, signal.SIGHUP),
    ):
        with pytest.raises(_Stopped) as stopped:
            anyio.run(_run, argparse.Namespace(handler=handler))
        assert stopped.value.signum == signum


# ------------------------------------------------------------------------------ validate


def test_validate_table_header_lines_up_with_short_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_model(tmp_path / "m.safetensors", {"a": np.arange(4, dtype=np.float32)})
    assert main(["validate", "-q", str(model)]) == 0
    head, row = capsys.readouterr().out.splitlines()[1:3]
    assert head.index("dtype") == row.index("F32")


# ---------------------------------------------------------------------------- cache rm


def test_cache_rm_takes_its_patterns_after_the_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stream-st cache rm --dir DIR PATTERN`` was refused ("unrecognized arguments")."""
    cache = str(tmp_path / "cache")
    os.mkdir(cache)  # an empty cache
    assert main(["cache", "rm", "--dir", cache, "http://nowhere/*"]) == 1  # nothing matched
    assert main(["cache", "rm", "http://nowhere/*", "--dir", cache]) == 1
    with pytest.raises(SystemExit) as refused:
        main(["cache", "ls", "--dir", cache, "http://*"])  # ls takes no pattern: not ignored
    assert refused.value.code == 2
    capsys.readouterr()


# ------------------------------------------------------------------- sharded cp --include


@pytest.fixture
def sharded(tmp_path: Path) -> Path:
    home = tmp_path / "sharded"
    home.mkdir()
    shards: dict[str, dict[str, np.ndarray[Any, Any]]] = {
        "model-00001-of-00002.safetensors": {"a": np.arange(4, dtype=np.float32)},
        "model-00002-of-00002.safetensors": {"c": np.ones((2, 3), np.float16)},
    }
    weight_map: dict[str, str] = {}
    for shard, tensors in shards.items():
        reference_numpy.save_file(tensors, str(home / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    index = home / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_mirroring_includes_tensors_of_several_shards(tmp_path: Path, sharded: Path) -> None:
    """``--include`` naming tensors of two shards failed: each shard was asked for every name
    ("include= names tensors not in the header: ['c']")."""
    out = tmp_path / "out"
    assert main(["cp", "-q", str(sharded), f"{out}/", "--include", "a", "--include", "c"]) == 0
    loaded = anyio.run(stream_st.load, str(out / sharded.name))
    assert sorted(loaded) == ["a", "c"]


def test_mirroring_refuses_a_name_not_in_the_index(tmp_path: Path, sharded: Path) -> None:
    """An unknown ``--include`` name wrote an index of no tensor and succeeded, where a single
    file's copy refuses it."""
    out = tmp_path / "out"
    for include in (["nope"], ["a", "nope"]):
        with pytest.raises(TensorNotFoundError, match="nope"):
            anyio.run(
                functools.partial(stream_st.tools.mirror, include=include), str(sharded), f"{out}/"
            )
        assert not out.exists()


# ------------------------------------------------------------------------------ KVLayout


@pytest.mark.parametrize(
    ("num_layers", "shape"),
    [
        (1.5, (1, 1, 2, 64)),
        ("2", (1, 1, 2, 64)),
        (True, (1, 1, 2, 64)),
        (2, (1, 1, -1, 64)),
        (2, (1, 1, 2.0, 64)),
    ],
    ids=["float layers", "str layers", "bool layers", "negative dim", "float dim"],
)
def test_kv_layout_refuses_what_is_not_a_count_or_a_shape(
    num_layers: object, shape: tuple[object, ...]
) -> None:
    """A layer count or dimension of the wrong type was taken, to fail later with a bare
    ``TypeError`` (``range(1.5)`` in ``send_kv``), or a ``TypeError`` at once for a string."""
    with pytest.raises(UsageError):
        KVLayout(num_layers, shape)  # type: ignore[arg-type]


# ------------------------------------------------------------------ saving torch tensors


def test_saving_a_nested_tensor_is_refused(tmp_path: Path) -> None:
    """A nested tensor (strided layout, no single shape) crashed the writers with torch's
    ``RuntimeError`` from ``reshape``; refused as a ``SafetensorsError`` now."""
    torch = pytest.importorskip("torch")
    import stream_st.torch as st

    with warnings.catch_warnings():  # torch's "nested tensors are in prototype stage", once
        warnings.simplefilter("ignore", UserWarning)  # a process (another test may have had it)
        nested = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(SafetensorsError, match="nested"):
        st.save_file({"n": nested}, tmp_path / "n.safetensors")
    with pytest.raises(SafetensorsError, match="nested"):
        anyio.run(stream_st.save, str(tmp_path / "n2.safetensors"), {"n": nested})
    assert list(tmp_path.iterdir()) == []


def test_kv_layout_of_a_list_shape_sends(tmp_path: Path) -> None:
    """A shape given as a list (as JSON gives it) was kept as a list, and every layer was then
    refused: "layer 0 key has shape [1, 1, 2, 64], the layout says [1, 1, 2, 64]"."""
    layout = KVLayout(1, [1, 1, 2, 64])  # type: ignore[arg-type]
    assert layout == KVLayout(1, (1, 1, 2, 64))
    layer = np.zeros((1, 1, 2, 64), np.float16)
    anyio.run(stream_st.send_kv, str(tmp_path / "kv.safetensors"), layout, [(0, layer, layer)])
    assert len(anyio.run(stream_st.load, str(tmp_path / "kv.safetensors"))) == 3


# --------------------------------------------------------- a destination folder with a query


def test_cp_into_a_url_folder_with_a_query(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cp m.safetensors 'http://host/up/?token=T'`` uploaded the file as the folder itself
    (PUT /up/): a destination whose path ends in ``/`` is a folder, a query or not."""
    model = write_model(tmp_path / "m.safetensors")
    with RangeHTTPServer() as server:
        assert main(["cp", "-q", str(model), server.url("/up/?token=T")]) == 0
        assert server.objects.get("/up/m.safetensors") == model.read_bytes()
        assert "/up/" not in server.objects
    capsys.readouterr()


def test_cp_checksums_to_an_upload_says_what_the_command_can_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``cp --checksums`` to an HTTP upload was refused with advice for the library
    ("checksums=stream_st.Digests.compute(arrays), or save()"), which cp cannot take."""
    model = write_model(tmp_path / "m.safetensors")
    with RangeHTTPServer() as server:
        assert main(["cp", "-q", "--checksums", str(model), server.url("/m.safetensors")]) == 2
        assert server.objects == {}
    err = capsys.readouterr().err
    assert "Digests.compute" not in err and "save()" not in err
    assert "--checksums" in err


# ------------------------------------------------------------- cp --dtype beyond the range


@pytest.mark.parametrize("dtype", ["f16", "bf16", "f32"])
def test_cp_says_when_a_conversion_makes_values_infinite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dtype: str
) -> None:
    """``cp --dtype f16`` of values beyond F16's range turned them into infinities silently,
    but for numpy's own "RuntimeWarning: overflow encountered in cast" line, which named a
    source file of the package; it says how many, of which tensor, as the command's warning."""
    model = write_model(
        tmp_path / "m.safetensors", {"x": np.array([1e300, -1e300, 1.0, np.inf], np.float64)}
    )
    out = tmp_path / "out.safetensors"
    assert main(["cp", "-q", "--dtype", dtype, str(model), str(out)]) == 0
    err = capsys.readouterr().err
    assert "RuntimeWarning" not in err
    assert "stream-st: warning: tensor 'x': 2 finite values" in err
    assert np.isinf(anyio.run(stream_st.load, str(out))["x"].astype(np.float64)).sum() == 3


# --------------------------------------------------------------- safe_open, a name of no str


@pytest.mark.parametrize("name", [1, None, b"w", ["w"]], ids=["int", "None", "bytes", "list"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_safe_open_takes_a_name_of_no_str_as_the_reference_does(
    tmp_path: Path, name: object, backend: str
) -> None:
    """``get_tensor(1)`` / ``get_slice(1)`` raised ``TensorNotFoundError`` (a ``KeyError``:
    "File does not contain tensor 1") where the reference raises a ``TypeError``."""
    import stream_st.numpy as sn

    model = write_model(tmp_path / "m.safetensors", {"w": np.ones(2, np.float32)})
    with sn.safe_open(model, "np", backend=backend) as f:
        for call in (f.get_tensor, f.get_slice):
            with pytest.raises(TypeError, match="not an instance of 'str'") as refused:
                call(name)  # type: ignore[arg-type]
            assert isinstance(refused.value, SafetensorsError)


# ---------------------------------------------------------- hash --check, secrets in the list


def test_hash_check_masks_the_secrets_of_the_addresses_it_lists(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hash --check`` printed each listed address as it stood, password and token too
    ("http://u:PASSWORD@host/m?token=SECRET: OK"); every other line of the command masks them."""
    model = write_model(tmp_path / "m.safetensors")
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    with RangeHTTPServer(objects={"/m": model.read_bytes()}) as server:
        address = server.url("/m").replace("http://", "http://u:PASSWORD@") + "?token=SECRET"
        gone = server.url("/gone").replace("http://", "http://u:PASSWORD@") + "?token=SECRET"
        listed = tmp_path / "sums"
        listed.write_text(f"{digest}  {address}\n{'0' * 64}  {address}\n{digest}  {gone}\n")
        assert main(["hash", "--check", str(listed)]) == 2
    out, err = capsys.readouterr()
    assert out.count(": OK") == 1 and out.count(": FAILED") == 2
    assert "PASSWORD" not in out + err and "SECRET" not in out + err
