"""The stream-st command behaves as users of coreutils, jq and sha256sum expect: subprocesses
through the real entry point, with real files, pipes, FIFOs and a terminal."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import stat
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.core.codecs

from .test_cli import COMMAND, _run_with_stdin

TENSORS: dict[str, np.ndarray[Any, Any]] = {
    "embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
    "layers.0.q_proj.weight": np.linspace(-1, 1, 1024, dtype=np.float32).reshape(32, 32),
    "positions": np.arange(5, dtype=np.int64),
}


def run(
    *args: str, stdin: Any = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [COMMAND, *args],
        stdin=stdin,
        capture_output=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    """A file without metadata, as the reference writes it."""
    path = tmp_path / "plain.safetensors"
    reference_numpy.save_file(TENSORS, str(path))
    return path


def test_version_and_bare_command_prints_help() -> None:
    version = run("--version")
    assert version.returncode == 0
    assert version.stdout.decode().strip() == f"stream-st {stream_st.__version__}"
    assert stream_st.__version__ != "0+unknown"  # from the installed package's metadata
    bare = run()
    assert bare.returncode == 0 and b"usage: stream-st" in bare.stdout
    assert b"inspect" in bare.stdout and b"KV cache" in bare.stdout  # the commands, not the demo
    assert b"layer" not in bare.stderr


def test_dash_is_stdin_and_stdout_through_a_pipe(plain: Path, tmp_path: Path) -> None:
    """`stream-st cp model - | stream-st cp - dst`: both ends of a pipe."""
    dst = tmp_path / "dst.safetensors"
    sender = subprocess.Popen([COMMAND, "cp", "-q", str(plain), "-"], stdout=subprocess.PIPE)
    assert sender.stdout is not None
    receiver = run("cp", "-", str(dst), stdin=sender.stdout)
    sender.stdout.close()
    assert sender.wait(timeout=60) == 0 and receiver.returncode == 0, receiver.stderr
    assert dst.read_bytes() == plain.read_bytes()
    assert not (Path.cwd() / "-").exists()
    with plain.open("rb") as stdin:  # a regular file as stdin, and a regular file as stdout
        inspected = run("inspect", "--json", "-", stdin=stdin)
    assert json.loads(inspected.stdout)["tensor_count"] == 3
    redirected = tmp_path / "redirected.safetensors"
    with redirected.open("wb") as stdout:
        copied = subprocess.run([COMMAND, "cp", str(plain), "-"], stdout=stdout, timeout=60)
    assert copied.returncode == 0 and redirected.read_bytes() == plain.read_bytes()


def test_stdout_redirected_with_append_or_after_other_output_is_appended_to(
    plain: Path, tmp_path: Path
) -> None:
    """`cp x - >> file` appends, and `{ echo; cp x -; } > file` writes after what came before:
    the bytes go where the shell's descriptor stands, not to offset 0 of the file reopened."""
    data = plain.read_bytes()
    log = tmp_path / "log.bin"
    log.write_bytes(b"already here\n")
    for _ in range(2):
        with log.open("ab") as stdout:
            copied = subprocess.run(
                [COMMAND, "cp", "-q", str(plain), "-"], stdout=stdout, timeout=60
            )
        assert copied.returncode == 0
    assert log.read_bytes() == b"already here\n" + data + data
    after = tmp_path / "after.bin"
    with after.open("wb") as stdout:
        stdout.write(b"prefix")
        stdout.flush()
        copied = subprocess.run([COMMAND, "cp", "-q", str(plain), "-"], stdout=stdout, timeout=60)
        stdout.write(b"suffix")  # the shared offset moved past the copy
    assert copied.returncode == 0 and after.read_bytes() == b"prefix" + data + b"suffix"


def test_dev_stdin_and_a_fifo_are_sources(plain: Path, tmp_path: Path) -> None:
    data = plain.read_bytes()
    piped = subprocess.run(
        [COMMAND, "inspect", "/dev/stdin"], input=data, capture_output=True, timeout=60
    )
    assert piped.returncode == 0 and b"3 tensors" in piped.stdout, piped.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with fifo.open("wb") as f:
            f.write(data)

    writer = threading.Thread(target=feed)
    writer.start()
    listed = run("ls", str(fifo))
    writer.join(timeout=60)
    assert sorted(listed.stdout.decode().split()) == sorted(TENSORS)


def test_several_sources_one_line_or_record_each(plain: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.safetensors"
    reference_numpy.save_file({"x": np.zeros(2, np.float16)}, str(other))
    hashed = run("hash", str(plain), str(other))
    lines = hashed.stdout.decode().splitlines()
    assert hashed.returncode == 0 and len(lines) == 2
    assert lines[0].endswith(f"  {plain}") and lines[1].endswith(f"  {other}")
    records = run("inspect", "--json", str(plain), str(other)).stdout.decode().splitlines()
    assert [json.loads(r)["tensor_count"] for r in records] == [3, 1]
    validated = run("validate", "--json", "-q", str(plain), str(other))
    assert [json.loads(r)["ok"] for r in validated.stdout.decode().splitlines()] == [True, True]
    # One that fails is reported on one line; the others are still done; the status says so.
    missing = tmp_path / "missing.safetensors"
    mixed = run("hash", str(plain), str(missing), str(other))
    assert mixed.returncode == 2 and len(mixed.stdout.decode().splitlines()) == 2
    assert mixed.stderr.decode().count("\n") == 1 and "missing.safetensors" in str(mixed.stderr)


def test_a_model_directory_is_accepted_where_a_file_is(plain: Path, tmp_path: Path) -> None:
    single = tmp_path / "single"
    single.mkdir()
    shutil.copy(plain, single / "model.safetensors")
    assert sorted(run("ls", str(single)).stdout.decode().split()) == sorted(TENSORS)
    out = tmp_path / "from-dir.safetensors"
    assert run("cp", "-q", str(single), str(out)).returncode == 0
    assert out.read_bytes() == plain.read_bytes()
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    names = sorted(TENSORS)
    weight_map = {}
    for i, name in enumerate(names):
        shard = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        reference_numpy.save_file({name: TENSORS[name]}, str(sharded / shard))
        weight_map[name] = shard
    index = {"metadata": {}, "weight_map": weight_map}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    found = json.loads(run("inspect", "--json", str(sharded)).stdout)
    assert found["shards"] == 3 and found["tensor_count"] == 3
    assert run("validate", "-q", str(sharded)).returncode == 0
    (sharded / "model.safetensors.index.json").unlink()  # no index: each file on its own
    assert len(run("hash", str(sharded)).stdout.decode().splitlines()) == 3
    several = run("cp", str(sharded), str(tmp_path / "x.safetensors"))
    assert several.returncode == 2 and b"name one of them" in several.stderr


def test_a_directory_of_several_indexes_and_no_file_asks_to_name_one(tmp_path: Path) -> None:
    """A folder holding two indexes whose shards lie in subfolders (and no ``*.safetensors`` of
    its own) was said to hold "no safetensors files ... no index"; it holds several indexes,
    as a folder with files beside them is said to, and the command asks to name one."""
    for prefix in ("a", "b"):
        (tmp_path / prefix).mkdir()
        reference_numpy.save_file(
            {"x": np.ones(2, np.float32)}, str(tmp_path / prefix / "s.safetensors")
        )
        weight_map = {"x": f"{prefix}/s.safetensors"}
        index = tmp_path / f"{prefix}.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    listed = run("ls", str(tmp_path))
    assert listed.returncode == 2
    assert b"holds several indexes (a.safetensors.index.json, b.safetensors.index.json)" in (
        listed.stderr
    )


def test_a_model_directory_is_accepted_as_a_file_url(plain: Path, tmp_path: Path) -> None:
    """``stream-st inspect file:///d/`` (cp, hash) of a model directory said "cannot read a
    directory" where the path ``/d`` was read: the URL was never taken for the directory."""
    folder = tmp_path / "my model"
    folder.mkdir()
    shutil.copy(plain, folder / "model.safetensors")
    url = folder.as_uri()
    assert json.loads(run("inspect", "--json", url).stdout)["tensor_count"] == len(TENSORS)
    out = tmp_path / "out.safetensors"
    assert run("cp", "-q", url, str(out)).returncode == 0
    assert out.read_bytes() == plain.read_bytes()
    hashed = run("hash", url)
    assert hashed.returncode == 0 and hashed.stdout == run("hash", str(folder)).stdout


def test_errors_say_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("these are notes, not tensors\n" * 10)
    archive = tmp_path / "pytorch_model.bin"
    archive.write_bytes(b"PK\x03\x04\x14\x00\x00\x00" + bytes(200))
    for path in (text, archive):
        result = run("inspect", str(path))
        err = result.stderr.decode()
        assert result.returncode == 2 and err.count("\n") == 1
        assert "not a safetensors file" in err and str(path) in err
        assert "header length" not in err.replace("not a header length", "")
    empty = tmp_path / "empty"
    empty.mkdir()
    result = run("validate", str(empty))
    assert result.returncode == 2 and b"no safetensors files" in result.stderr
    assert result.stderr.count(b"\n") == 1


def test_a_mistyped_command_or_choice_names_the_nearest_one(plain: Path) -> None:
    for args, near in (
        (["inpsect", str(plain)], b"did you mean 'inspect'?"),
        (["valdate", str(plain)], b"did you mean 'validate'?"),
        (["cp", "--dtype", "bf61", str(plain), "x"], b"did you mean 'bf16'?"),
        (["completion", "fsh"], b"did you mean 'fish'?"),
    ):
        result = run(*args)
        assert result.returncode == 2 and result.stderr.count(b"\n") == 1, args
        assert near in result.stderr, result.stderr
    far = run("frobnicate")
    assert b"did you mean" not in far.stderr and b"choose from demo, inspect" in far.stderr


def test_new_commands_errors_are_one_line_a_user_can_act_on(plain: Path, tmp_path: Path) -> None:
    shown = run("show", str(plain), "nope")
    assert shown.returncode == 2 and shown.stderr.count(b"\n") == 1
    assert f"{plain} has no tensor 'nope' (stream-st ls {plain}".encode() in shown.stderr
    missing = tmp_path / "missing.safetensors"
    listed = run("ls", str(missing))
    assert listed.returncode == 2  # the path said once, not again as "url=..."
    assert listed.stderr.decode() == f"stream-st: error: no such file: {missing}\n"
    demo = run("demo", "--text", str(missing))
    assert demo.returncode == 2
    assert demo.stderr.decode().endswith(f"--text {missing}: No such file or directory\n")
    pipe = run("cp", "--checksums", str(plain), "-", stdin=subprocess.DEVNULL)
    assert pipe.returncode == 2 and pipe.stderr.count(b"\n") == 1


def test_cp_into_a_directory_takes_the_source_name(plain: Path, tmp_path: Path) -> None:
    """As coreutils' cp: `cp model.safetensors dir/` writes dir/model.safetensors."""
    into = tmp_path / "into"
    into.mkdir()
    copied = run("cp", str(plain), str(into))
    assert copied.returncode == 0, copied.stderr
    assert (into / plain.name).read_bytes() == plain.read_bytes()
    with plain.open("rb") as stdin:  # standard input has no name to take
        unnamed = run("cp", "-", str(into), stdin=stdin)
    assert unnamed.returncode == 2 and b"is a directory: name the file" in unnamed.stderr


def test_demo_json_is_one_record_and_quiet_is_silent() -> None:
    demo = run("demo", "-q", "--synthetic", "--layers", "2", "--seq", "8", "--json")
    assert demo.returncode == 0 and demo.stderr == b"", demo.stderr
    (line,) = demo.stdout.decode().splitlines()
    record = json.loads(line)
    assert record["layers"] == 2 and [t["codec"] for t in record["transfers"]] == [
        "none",
        "int8",
        "int4",
    ]
    assert all(len(t["verified"]) == 2 for t in record["transfers"])


def test_cp_without_metadata_is_byte_identical(plain: Path, tmp_path: Path) -> None:
    out = tmp_path / "copy.safetensors"
    assert run("cp", str(plain), str(out)).returncode == 0
    assert out.read_bytes() == plain.read_bytes()  # no "__metadata__":{} added


def test_overwriting_keeps_the_destinations_permission_bits(plain: Path, tmp_path: Path) -> None:
    out = tmp_path / "shared.safetensors"
    out.write_bytes(b"old")
    out.chmod(0o640)
    assert run("cp", str(plain), str(out)).returncode == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o640 and out.read_bytes() == plain.read_bytes()


def test_quantize_refuses_quantized_and_dequantize_restores(plain: Path, tmp_path: Path) -> None:
    q8 = tmp_path / "q8.safetensors"
    quantized = run("cp", "--quantize", "int8", str(plain), str(q8))
    assert quantized.returncode == 0 and b"2 quantized" in quantized.stderr
    again = tmp_path / "again.safetensors"
    refused = run("cp", "--quantize", "int8", str(q8), str(again))
    assert refused.returncode == 2 and b"quantized already" in refused.stderr
    assert not again.exists()
    restored = tmp_path / "restored.safetensors"
    back = run("cp", "--dequantize", str(q8), str(restored))
    assert back.returncode == 0 and b"2 dequantized" in back.stderr
    found = reference_numpy.load_file(str(restored))
    assert sorted(found) == sorted(TENSORS)
    for name, array in TENSORS.items():
        assert found[name].dtype == array.dtype and found[name].shape == array.shape
        np.testing.assert_allclose(found[name], array, atol=np.abs(array).max() / 127)
    metadata = json.loads(run("inspect", "--json", str(restored)).stdout)["metadata"]
    assert "compression" not in metadata and "original_dtype" not in metadata
    said = metadata["dequantized_from"]  # what the codec's keys said, kept in one key
    assert said.startswith("2 tensors (") and "compression=INT8" in said
    not_quantized = run("cp", "--dequantize", str(plain), str(tmp_path / "n.safetensors"))
    assert not_quantized.returncode == 2 and b"no compression key" in not_quantized.stderr
    labelled = tmp_path / "none.safetensors"
    reference_numpy.save_file(TENSORS, str(labelled), metadata={"compression": "NONE"})
    none = run("cp", "--dequantize", str(labelled), str(tmp_path / "m.safetensors"))
    assert none.returncode == 2 and b"says compression=NONE" in none.stderr


@pytest.mark.parametrize(
    ("tensors", "named"),
    [
        ({"x": np.array([5, -3], np.int8), "x.scale": np.array([0.5], np.float32)}, "'x'"),
        ({"x": np.array([5, -3], np.int8), "x.scale": np.array([2], np.int32)}, "'x'"),
        ({"y": np.ones(2, np.float32), "y.scale.scale": np.ones(1, np.int8)}, "'y.scale'"),
    ],
    ids=["kept_beside_quantized", "kept_beside_kept", "scale_beside_kept"],
)
def test_quantize_refuses_tensors_dequantize_would_pair_wrongly(
    tmp_path: Path, tensors: dict[str, np.ndarray[Any, Any]], named: str
) -> None:
    """A tensor written beside ``<its name>.scale`` that is not its int8 scale (an I8 ``x`` kept
    beside an F32 ``x.scale`` quantized into ``x.scale`` and ``x.scale.scale``) is refused
    before anything is written: the copy was written, and ``--dequantize`` of it failed ('INT8
    scale must be one float, got int8'). Without it, the copy round-trips."""
    source = tmp_path / "src.safetensors"
    reference_numpy.save_file({**tensors, "z": np.arange(4, dtype=np.float32)}, str(source))
    out = tmp_path / "q8.safetensors"
    refused = run("cp", "--quantize", "int8", str(source), str(out))
    assert refused.returncode == 2, refused.stderr
    said = refused.stderr.decode()
    assert f"quantize= (--quantize) would write tensor {named}" in said and "--dequantize" in said
    assert said.count("\n") == 1 and not out.exists()
    first = next(iter(tensors))
    only = ["--include", first, "--include", "z"]
    assert run("cp", "-q", "--quantize", "int8", *only, str(source), str(out)).returncode == 0
    back = tmp_path / "back.safetensors"
    assert run("cp", "-q", "--dequantize", str(out), str(back)).returncode == 0
    found = reference_numpy.load_file(str(back))
    assert sorted(found) == [first, "z"]
    np.testing.assert_allclose(found[first], tensors[first], atol=1 / 127)
    np.testing.assert_allclose(found["z"], np.arange(4), atol=3 / 127)
    clash = tmp_path / "clash.safetensors"  # w.scale written twice: refused as it was
    reference_numpy.save_file(
        {"w": np.ones(2, np.float32), "w.scale": np.ones(1, np.float32)}, str(clash)
    )
    twice = run("cp", "--quantize", "int8", str(clash), str(out))
    assert twice.returncode == 2 and b"'w.scale' appears twice in the plan" in twice.stderr


def test_dequantize_restores_each_tensors_dtype(tmp_path: Path) -> None:
    """A file of F64, F32 and F16 tensors, quantized and dequantized, comes back with each
    tensor's own dtype (``original_dtypes``; ``original_dtype``, which readers apply to every
    tensor, is recorded only where all share one): every tensor came back F32 (an F64 value
    beyond F32's range infinite). A file that records only
    ``original_dtype`` (as before) is read as it was; a damaged record is refused."""
    rng = np.random.default_rng(0)
    tensors: dict[str, np.ndarray[Any, Any]] = {
        "a": rng.standard_normal(64),  # F64
        "b": rng.standard_normal(64).astype(np.float32),
        "c": rng.standard_normal(64).astype(np.float32),
        "d": rng.standard_normal(64).astype(np.float16),
        "n": np.arange(3, dtype=np.int64),
    }
    source, q8 = tmp_path / "mixed.safetensors", tmp_path / "q8.safetensors"
    reference_numpy.save_file(tensors, str(source))
    assert run("cp", "-q", "--quantize", "int8", str(source), str(q8)).returncode == 0
    quantized = json.loads(run("inspect", "--json", str(q8)).stdout)["metadata"]
    # no original_dtype: readers that know only it would decode every tensor to it
    assert "original_dtype" not in quantized
    assert json.loads(quantized["original_dtypes"]) == {
        "a": "float64",
        "b": "float32",
        "c": "float32",
        "d": "float16",
    }
    back = tmp_path / "back.safetensors"
    restored = run("cp", "-q", "--dequantize", str(q8), str(back))
    assert restored.returncode == 0 and restored.stderr == b""
    found = reference_numpy.load_file(str(back))
    for name, array in tensors.items():
        assert found[name].dtype == array.dtype, name
        np.testing.assert_allclose(found[name], array, atol=np.abs(array).max() / 127)
    metadata = json.loads(run("inspect", "--json", str(back)).stdout)["metadata"]
    assert "original_dtypes" not in metadata and "original_dtypes=" in metadata["dequantized_from"]

    codes = reference_numpy.load_file(str(q8))
    for record, dtypes in [({}, ["float32"] * 4), ({"original_dtype": "float16"}, ["float16"] * 4)]:
        older = tmp_path / "older.safetensors"  # as quantized before the per-tensor key
        meta = {k: v for k, v in quantized.items() if not k.startswith("original_dtype")}
        reference_numpy.save_file(codes, str(older), metadata={**meta, **record})
        assert run("cp", "-q", "--dequantize", str(older), str(back)).returncode == 0
        found = reference_numpy.load_file(str(back))
        assert [found[name].dtype.name for name in "abcd"] == dtypes
    damaged = tmp_path / "damaged.safetensors"
    meta = {**quantized, "original_dtypes": '{"a": "int8"}'}
    reference_numpy.save_file(codes, str(damaged), metadata=meta)
    refused = run("cp", "-q", "--dequantize", str(damaged), str(tmp_path / "no.safetensors"))
    assert refused.returncode == 2 and b"metadata original_dtypes must be" in refused.stderr
    assert not (tmp_path / "no.safetensors").exists()


def test_dequantize_reads_original_dtypes_as_original_dtype(tmp_path: Path) -> None:
    """Each name in ``original_dtypes`` is read as ``original_dtype``'s (a ``torch.`` name or a
    code too), where only numpy names were taken; JSON nested too deeply is a CodecError, where
    a bare RecursionError escaped as an internal error."""
    codec = stream_st.core.codecs.get_codec("int8")
    codes: dict[str, np.ndarray[Any, Any]] = {}
    for name in "abc":
        codes.update(codec.encode(name, np.linspace(-1, 1, 8, dtype=np.float32)))
    source, out = tmp_path / "q8.safetensors", tmp_path / "out.safetensors"
    spelt = '{"a": "torch.float16", "b": "F64", "c": "bfloat16"}'
    for recorded, dtypes in [(spelt, ["float16", "float64", "bfloat16"]), ("[" * 100_000, None)]:
        metadata = {**codec.metadata(), "original_dtypes": recorded}
        reference_numpy.save_file(codes, str(source), metadata=metadata)
        out.unlink(missing_ok=True)
        result = run("cp", "-q", "--dequantize", str(source), str(out))
        if dtypes is None:
            assert result.returncode == 2, result.stderr
            assert b"metadata original_dtypes JSON is nested too deeply" in result.stderr
            assert not out.exists()
        else:
            assert result.returncode == 0 and result.stderr == b"", result.stderr
            found = reference_numpy.load_file(str(out))
            assert [found[name].dtype.name for name in "abc"] == dtypes


def test_dequantize_to_a_dtype_warns_as_cp_dtype_does(tmp_path: Path) -> None:
    """A guard: ``--dequantize --dtype f16`` of values beyond F16's range, decoded into F16,
    become infinite with the warning ``--dtype`` gives (naming the tensor and counting the
    values), never with numpy's own "overflow encountered in cast", which says neither."""
    source, q8 = tmp_path / "big.safetensors", tmp_path / "q8.safetensors"
    reference_numpy.save_file({"w": np.array([1e6, -2e5, 3e4], np.float32)}, str(source))
    assert run("cp", "-q", "--quantize", "int8", str(source), str(q8)).returncode == 0
    out = tmp_path / "f16.safetensors"
    done = run("cp", "-q", "--dequantize", "--dtype", "f16", str(q8), str(out))
    assert done.returncode == 0, done.stderr
    assert b"tensor 'w': 2 finite values beyond F16's range became infinite" in done.stderr
    assert b"overflow encountered" not in done.stderr
    found = reference_numpy.load_file(str(out))["w"]
    assert found.dtype == np.float16 and np.isinf(found[:2]).all() and np.isfinite(found[2])


def test_dequantize_to_a_dtype_decodes_into_it(tmp_path: Path) -> None:
    """``--dequantize --dtype f16`` of INT4 codes of an F32, F64 or BF16 tensor at F16's edge
    gives what the codec's decode into F16 gives: a product within half a step beyond F16's
    largest value saturates (``7 * 9360 = 65520`` from 65504), where the tensor was decoded as
    its original dtype, then converted to F16 and turned infinite, with a warning."""
    codec = stream_st.core.codecs.get_codec("int4")
    edge = np.zeros((2, 64), np.float32)
    edge[0, :2] = [65504.0, -65504.0]
    edge[1, :2] = [65536.0, -1.0]  # BF16 holds no 65504: its next value up, beyond F16
    for original in (edge, edge.astype(np.float64), stream_st.core.codecs.to_bfloat16(edge)):
        parts = dict(codec.encode("w", original))
        q4, out = tmp_path / "q4.safetensors", tmp_path / "f16.safetensors"
        metadata = codec.metadata(original.dtype)
        reference_numpy.save_file(parts, str(q4), metadata=metadata)
        done = run("cp", "-q", "--dequantize", "--dtype", "f16", str(q4), str(out))
        assert done.returncode == 0 and done.stderr == b"", (original.dtype, done.stderr)
        found = reference_numpy.load_file(str(out))["w"]
        expected = codec.decode("w", parts, np.float16)
        assert np.isfinite(expected).all() and abs(float(expected[0, 0])) == 65504.0
        np.testing.assert_array_equal(found, expected)


def test_dequantize_warns_of_values_beyond_the_original_dtype(tmp_path: Path) -> None:
    """An INT8 scale far smaller than the codec writes, decoded as the recorded F16: the values
    beyond F16's range become infinite with cp's warning naming the tensor and counting them
    (numpy's bare "overflow encountered" said neither); an original_dtype that names no float
    dtype is refused, leaving nothing behind (the tensors came back F32 without a word), and
    the KV reader's spellings are taken."""
    codes: dict[str, np.ndarray[Any, Any]] = {
        "t": np.array([1, -2, 127], np.int8),
        "t.scale": np.array([1e-45], np.float32),
    }
    tiny = tmp_path / "tiny.safetensors"
    reference_numpy.save_file(
        codes, str(tiny), metadata={"compression": "INT8", "original_dtype": "float16"}
    )
    out = tmp_path / "out.safetensors"
    done = run("cp", "-q", "--dequantize", str(tiny), str(out))
    assert done.returncode == 0, done.stderr
    assert b"tensor 't': 3 finite values beyond F16's range became infinite" in done.stderr
    assert b"overflow encountered" not in done.stderr
    found = reference_numpy.load_file(str(out))["t"]
    assert found.dtype == np.float16 and found.tolist() == [np.inf, -np.inf, np.inf]
    codes["t.scale"] = np.array([2.0], np.float32)
    for original, dtype in [
        ("torch.bfloat16", "bfloat16"),
        ("F64", "float64"),
        ("int32", None),
        ("zzz", None),
    ]:
        source = tmp_path / "q8.safetensors"
        reference_numpy.save_file(
            codes, str(source), metadata={"compression": "INT8", "original_dtype": original}
        )
        out.unlink(missing_ok=True)
        result = run("cp", "-q", "--dequantize", str(source), str(out))
        if dtype is None:
            assert (
                result.returncode == 2
                and b"metadata original_dtype must name one of float16, bfloat16, float32, "
                b"float64, got"
                in result.stderr
            )
            assert not out.exists()
        else:
            assert result.returncode == 0 and result.stderr == b"", result.stderr
            assert reference_numpy.load_file(str(out))["t"].dtype.name == dtype


def test_dequantize_int4_kv_transfer(tmp_path: Path) -> None:
    """A KV file written with the int4 codec (its steps in `<name>.scales`) comes back as F16."""
    codec = stream_st.core.codecs.get_codec("int4")
    key = np.linspace(-2, 2, 2 * 128, dtype=np.float16).reshape(2, 128)
    parts = dict(codec.encode("layer_0_key", key))
    q4 = tmp_path / "q4.safetensors"
    reference_numpy.save_file(parts, str(q4), metadata=codec.metadata(np.float16))
    out = tmp_path / "f16.safetensors"
    assert run("cp", "-q", "--dequantize", str(q4), str(out)).returncode == 0
    restored = reference_numpy.load_file(str(out))["layer_0_key"]
    assert restored.dtype == np.float16 and restored.shape == key.shape
    np.testing.assert_allclose(restored, key, atol=2 / 7)


def _write_raw(
    path: Path, parts: dict[str, tuple[str, np.ndarray[Any, Any]]], metadata: dict[str, str]
) -> None:
    """A safetensors file of ``parts`` (name: dtype code and array) in the order given, which
    the reference writer would not keep, or of dtypes it does not write."""
    header: dict[str, Any] = {"__metadata__": metadata}
    data = b""
    for name, (dtype, array) in parts.items():
        offsets = [len(data), len(data) + array.nbytes]
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": offsets}
        data += array.tobytes()
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_dequantize_to_stdout_writes_each_tensor_where_its_last_part_lies(
    tmp_path: Path,
) -> None:
    """``cp --dequantize`` to stdout of a valid INT8 file whose codes ``w`` come before an F32
    ``p`` and then their scale failed ("tensor 'p' is out of order") after writing part of the
    copy: ``w`` was planned where its codes lay, and can only be written once its scale has
    come. It is planned where its last wire tensor lies, to a pipe as to a file."""
    source, out = tmp_path / "src.safetensors", tmp_path / "out.safetensors"
    parts: dict[str, tuple[str, np.ndarray[Any, Any]]] = {
        "w": ("I8", np.array([1, -2, 127], np.int8)),
        "p": ("F32", np.array([9.0], np.float32)),
        "w.scale": ("F32", np.array([2.0], np.float32)),
    }
    _write_raw(source, parts, {"compression": "INT8"})
    piped = run("cp", "-q", "--dequantize", str(source), "-")
    assert piped.returncode == 0, piped.stderr
    assert run("cp", "-q", "--dequantize", str(source), str(out)).returncode == 0
    assert piped.stdout == out.read_bytes()
    found = reference_numpy.load_file(str(out))
    assert found["w"].tolist() == [0.5, -1.0, 63.5] and found["p"].tolist() == [9.0]
    written = out.read_bytes()
    tensors = json.loads(written[8 : 8 + int.from_bytes(written[:8], "little")])
    del tensors["__metadata__"]
    assert sorted(tensors, key=lambda name: tensors[name]["data_offsets"]) == ["p", "w"]


def test_dtype_and_quantize_say_which_float_tensors_they_leave(tmp_path: Path) -> None:
    """``cp --dtype`` and ``--quantize int8`` copied F8 tensors as they were without a word
    (exit 0, ``converted: 0``), though their help said floating-point tensors are converted.
    The help names the dtypes converted, and a warning counts the floating-point tensors of
    others copied as they are; ``--dequantize``, which copies every tensor but its codes as it
    is, says nothing of them."""
    f8 = np.array([0x38, 0xC0, 0x08], np.uint8)  # F8_E4M3 1.0, -2.0 and a subnormal
    source, out = tmp_path / "src.safetensors", tmp_path / "out.safetensors"
    parts: dict[str, tuple[str, np.ndarray[Any, Any]]] = {
        "w8": ("F8_E4M3", f8),
        "w": ("F32", np.linspace(-1, 1, 8, dtype=np.float32)),
        "e": ("F8_E5M2", f8),
        "n": ("I64", np.arange(2, dtype=np.int64)),
    }
    _write_raw(source, parts, {})
    said = "converts F16, BF16, F32 and F64 tensors: 2 tensors of other floating-point dtypes"
    for option, value, dtype in (("dtype", "f16", "F16"), ("quantize", "int8", "I8")):
        done = run("cp", "-q", f"--{option}", value, str(source), str(out))
        assert done.returncode == 0, done.stderr
        warned = f"{option}= (--{option}) {said} (F8_E4M3, F8_E5M2) copied as they are"
        assert warned.encode() in done.stderr and done.stderr.count(b"\n") == 1, done.stderr
        header = json.loads(run("inspect", "--json", str(out)).stdout)["tensors"]
        dtypes = {t["name"]: t["dtype"] for t in header}
        assert (dtypes["w"], dtypes["w8"], dtypes["e"]) == (dtype, "F8_E4M3", "F8_E5M2")
    back = run("cp", "-q", "--dequantize", str(out), str(tmp_path / "back.safetensors"))
    assert back.returncode == 0 and back.stderr == b"", back.stderr
    helped = run("cp", "--help").stdout.decode()
    assert helped.count("F16/BF16/F32/F64") == 2, helped


def test_dtype_of_signaling_nans_prints_no_bare_cast_warning(tmp_path: Path) -> None:
    """``cp --dtype f32`` of signaling NaNs (F64 and BF16) printed numpy's bare "invalid value
    encountered in cast", which names neither tensor nor value (the values are right: NaNs
    stay NaNs). The cast says nothing; the values are as before."""
    source, out = tmp_path / "snan.safetensors", tmp_path / "out.safetensors"
    parts: dict[str, tuple[str, np.ndarray[Any, Any]]] = {
        "f64": ("F64", np.array([0x7FF0000000000001, 0x3FF0000000000000], np.uint64)),
        "bf16": ("BF16", np.array([0x7F81, 0x3F80], np.uint16)),
    }
    _write_raw(source, parts, {})
    done = run("cp", "-q", "--dtype", "f32", str(source), str(out))
    assert done.returncode == 0, done.stderr
    assert b"in cast" not in done.stderr, done.stderr
    found = reference_numpy.load_file(str(out))
    for name in parts:
        assert found[name].dtype == np.float32 and np.isnan(found[name][0]), name
        assert found[name][1] == 1.0, name


KV_SHAPE = (1, 2, 3, 64)


def _kv_layers() -> list[tuple[int, np.ndarray[Any, Any], np.ndarray[Any, Any]]]:
    """Two layers of F32 keys and values of :data:`KV_SHAPE`."""
    rng = np.random.default_rng(0)
    values = [rng.standard_normal((2, *KV_SHAPE)).astype(np.float32) for _ in range(2)]
    return [(layer, key, value) for layer, (key, value) in enumerate(values)]


@pytest.mark.parametrize(
    ("codec", "options", "dtype", "atol"),
    [
        ("int8", {"dequantize": True}, "F32", 0.05),
        ("int4", {"dequantize": True}, "F32", 0.5),
        ("int8", {"dequantize": True, "dtype": "f16"}, "F16", 0.05),
        ("none", {"quantize": "int8"}, "F32", 0.05),
        ("none", {"dtype": "bf16"}, "BF16", 0.05),
    ],
    ids=["dequantize_int8", "dequantize_int4", "dequantize_to_f16", "quantize", "dtype"],
)
async def test_a_converted_kv_transfer_is_received(
    tmp_path: Path, codec: str, options: dict[str, Any], dtype: str, atol: float
) -> None:
    """A KV transfer written by ``send_kv`` and converted by ``cp`` (``--dequantize``,
    ``--quantize int8``, ``--dtype``) kept its ``layer_{i}_digest`` tensors and ``kv_dtype``:
    ``receive_kv`` of the copy raised IntegrityError (or HeaderError), and an INT4 transfer was
    refused (its U8 digests taken for codes without scales). The copy's digests are computed
    anew over its bytes, once the source's are checked, and its metadata names its dtype."""
    source, out = tmp_path / "kv.safetensors", tmp_path / "out.safetensors"
    sent = _kv_layers()
    layout = stream_st.KVLayout(num_layers=2, shape=KV_SHAPE, dtype="F32", codec=codec)
    await stream_st.send_kv(str(source), layout, iter(sent))
    copied = await stream_st.tools.cp(str(source), str(out), **options)
    assert copied.converted == 4
    async with stream_st.receive_kv(str(out)) as kv:
        assert (kv.integrity, kv.layout.dtype, kv.layout.num_layers) == ("layer-sha256", dtype, 2)
        received = [(layer, key, value) async for layer, key, value in kv]
    assert [layer for layer, _, _ in received] == [0, 1]
    for (_, key, value), (_, sent_key, sent_value) in zip(received, sent, strict=True):
        assert key.dtype == stream_st.dtypes.dtype_for(dtype).numpy
        np.testing.assert_allclose(key.astype(np.float32), sent_key, atol=atol)
        np.testing.assert_allclose(value.astype(np.float32), sent_value, atol=atol)


async def test_a_kv_transfer_is_converted_whole_its_digests_checked(tmp_path: Path) -> None:
    """Converting a KV transfer checks each layer's bytes against its ``layer_{i}_digest``
    before its digest is computed anew (a damaged layer would be given a digest it passes):
    an IntegrityError naming the layer, nothing written. ``include=`` leaving some of its
    tensors out (its layout and digests cover every layer) is refused before anything is
    written."""
    source, out = tmp_path / "kv.safetensors", tmp_path / "out.safetensors"
    layout = stream_st.KVLayout(num_layers=2, shape=KV_SHAPE, dtype="F32", codec="int8")
    await stream_st.send_kv(str(source), layout, iter(_kv_layers()))
    damaged = bytearray(source.read_bytes())
    header = await stream_st.read_header(str(source))
    at = header.data_start + header["layer_1_value"].start
    damaged[at] ^= 1
    source.write_bytes(bytes(damaged))
    with pytest.raises(stream_st.IntegrityError) as failed:
        await stream_st.tools.cp(str(source), str(out), dequantize=True)
    assert failed.value.layer == 1 and "layer_1_digest" in str(failed.value)
    assert not out.exists()
    with pytest.raises(stream_st.UsageError, match="KV transfer") as refused:
        await stream_st.tools.cp(
            str(source), str(out), dequantize=True, include=["layer_0_key", "layer_0_key.scale"]
        )
    assert "include=" in str(refused.value)
    assert not out.exists()


@pytest.mark.parametrize(
    "metadata",
    [{"kv_dtype": "fp8_e4m3"}, {"kv_layers": "2", "kv_shape": "[1, 2, 3, 64]", "kv_dtype": "F32"}],
    ids=["one_kv_key", "no_kv_layout"],
)
async def test_a_checkpoint_recording_kv_keys_is_converted_as_any_file(
    tmp_path: Path, metadata: dict[str, str]
) -> None:
    """A model's checkpoint whose ``__metadata__`` merely records a ``kv_*`` key (or all three a
    transfer has, over tensors of no KV layout) was taken for a KV transfer: ``--dtype`` (and the
    other conversions) refused it ("not a KV-cache transfer"), ``--include`` too. It is copied
    and converted as any file, as before there were KV transfers to convert."""
    source, out = tmp_path / "model.safetensors", tmp_path / "out.safetensors"
    tensors = {"w": np.ones(4, np.float32), "b": np.zeros(2, np.float32)}
    reference_numpy.save_file(tensors, str(source), metadata=metadata)
    copied = await stream_st.tools.cp(str(source), str(out), dtype="f16")
    assert copied.converted == 2
    found = reference_numpy.load_file(str(out))
    assert {name: array.dtype for name, array in found.items()} == {
        "w": np.float16,
        "b": np.float16,
    }
    partial = await stream_st.tools.cp(str(source), str(out), dtype="f16", include=["w"])
    assert list(partial.header.names()) == ["w"]


def test_dtype_on_a_file_already_of_that_dtype_converts_nothing(tmp_path: Path) -> None:
    f16 = tmp_path / "f16.safetensors"
    reference_numpy.save_file({"w": np.ones((2, 2), np.float16)}, str(f16))
    out = tmp_path / "out.safetensors"
    result = run("cp", "--dtype", "f16", str(f16), str(out))
    assert result.returncode == 0 and b"nothing converted to F16" in result.stderr
    assert out.read_bytes() == f16.read_bytes()
    to_f32 = run("cp", "--dtype", "f32", str(f16), str(tmp_path / "f32.safetensors"))
    assert b"1 converted to F32" in to_f32.stderr


def test_show_prints_values_and_json(plain: Path) -> None:
    shown = run("show", str(plain), "embed.weight", "--slice", "0:2")
    text = shown.stdout.decode()
    assert shown.returncode == 0 and "[[0. 1. 2. 3.]\n [4. 5. 6. 7.]]" in text
    record = json.loads(run("show", "--json", str(plain), "embed.weight", "--slice", "1").stdout)
    assert record["values"] == [4.0, 5.0, 6.0, 7.0] and record["shape"] == [4]
    assert record["tensor_shape"] == [3, 4]
    big = run("show", str(plain), "layers.0.q_proj.weight").stdout.decode()
    assert "..." in big  # summarized, numpy-style
    missing = run("show", str(plain), "nope")
    assert missing.returncode == 2 and b"nope" in missing.stderr


def test_ls_lists_names_one_per_line(plain: Path) -> None:
    listed = run("ls", str(plain))
    assert listed.returncode == 0 and sorted(listed.stdout.decode().split("\n")[:-1]) == sorted(
        TENSORS
    )


def _serve_once(data: bytes) -> tuple[str, threading.Thread]:
    """A tcp:// peer that sends ``data`` to its first connection."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def send() -> None:
        with server, server.accept()[0] as peer:
            peer.sendall(data)

    thread = threading.Thread(target=send)
    thread.start()
    return f"tcp://127.0.0.1:{port}", thread


def test_plain_progress_lines_without_rich_with_totals_from_tcp(
    plain: Path, tmp_path: Path
) -> None:
    """Without rich the command still works and prints plain progress lines; their totals come
    from the header the command reads, so a tcp:// peer (read once) shows them too."""
    hide = tmp_path / "no-rich"
    hide.mkdir()
    (hide / "rich.py").write_text("raise ImportError('rich is not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    url, sender = _serve_once(plain.read_bytes())
    result = _run_with_stdin(["validate", url], b"", terminal=True, env=env)
    sender.join(timeout=60)
    size = sum(a.nbytes for a in TENSORS.values()) / 1000  # decimal units, as inspect's
    assert result.returncode == 0, result
    assert f"validating: {size:.1f} kB of {size:.1f} kB, 3/3 tensors".encode() in result.stderr


needs_argcomplete = pytest.mark.skipif(
    importlib.util.find_spec("argcomplete") is None,
    reason="shell completion needs argcomplete (the cli extra)",
)

COMPLETE_IN_BASH = r"""
source "$1"
complete -p stream-st
shift
for line in "$@"; do
    read -ra COMP_WORDS <<< "$line"
    if [[ $line == *" " ]]; then COMP_WORDS+=(""); fi
    COMP_LINE=$line COMP_POINT=${#line} COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
    _python_argcomplete stream-st
    echo "$line|${COMPREPLY[*]}"
done
"""
"""Load a completion script into bash and complete each line given, as bash does on TAB."""


def _on_path() -> dict[str, str]:
    """The environment with the command's directory on PATH, as a shell finds it."""
    return {"PATH": os.pathsep.join([str(Path(COMMAND).parent), os.environ.get("PATH", "")])}


@needs_argcomplete
def test_bash_completion_completes_commands_options_choices_and_paths(
    plain: Path, tmp_path: Path
) -> None:
    script = run("completion", "bash")
    assert script.returncode == 0 and script.stdout.startswith(b"#compdef stream-st")
    path = tmp_path / "stream-st.bash"
    path.write_bytes(script.stdout)
    lines = ["stream-st va", "stream-st cp --deq", "stream-st cp --dtype "]
    lines += ["stream-st completion f", f"stream-st inspect {plain.parent}/pla"]
    result = subprocess.run(
        ["bash", "-c", COMPLETE_IN_BASH, "bash", str(path), *lines],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **_on_path()},
    )
    assert result.returncode == 0, result.stderr
    registered, *completed = result.stdout.splitlines()
    assert registered.startswith("complete ") and registered.endswith(" stream-st")
    assert [line.partition("|")[2].split() for line in completed] == [
        ["validate"],
        ["--dequantize"],
        ["bf16", "f16", "f32"],
        ["fish"],
        [str(plain)],
    ]


@needs_argcomplete
def test_fish_zsh_and_tcsh_scripts_register_the_command() -> None:
    """Each script registers stream-st; fish's asks the command as its script does (the words in
    COMP_LINE, the candidates on descriptor 8, each with its help after a tab)."""
    scripts = {shell: run("completion", shell) for shell in ("fish", "zsh", "tcsh")}
    assert all(s.returncode == 0 for s in scripts.values())
    assert b"complete --command stream-st" in scripts["fish"].stdout
    assert b"#compdef stream-st" in scripts["zsh"].stdout and b"compdef" in scripts["zsh"].stdout
    assert scripts["tcsh"].stdout.startswith(b'complete "stream-st"')
    line = "stream-st sh"
    asked = subprocess.run(
        ["bash", "-c", "stream-st 8>&1 9>&2 1>/dev/null 2>&1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            **_on_path(),
            "_ARGCOMPLETE": "1",
            "_ARGCOMPLETE_SHELL": "fish",
            "_ARGCOMPLETE_DFS": "\t",
            "_ARGCOMPLETE_IFS": "\n",
            "_ARGCOMPLETE_SUPPRESS_SPACE": "1",
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
        },
    )
    assert asked.stdout.split("\n") == ["show\tprint a tensor's values (summarized when big)"]


def test_completion_without_argcomplete_says_what_to_install(tmp_path: Path) -> None:
    hide = tmp_path / "no-argcomplete"
    hide.mkdir()
    (hide / "argcomplete.py").write_text("raise ImportError('argcomplete is not installed')\n")
    env = {"PYTHONPATH": os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")])}
    result = run("completion", "fish", env=env)
    assert result.returncode == 2 and result.stderr.count(b"\n") == 1
    assert b"needs argcomplete" in result.stderr and b".[cli]" in result.stderr
