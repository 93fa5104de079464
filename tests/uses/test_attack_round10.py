"""The tenth attack: what a file's names do to a terminal, the command's JSON, the writers'
arguments and leftovers. Each test failed before its mend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from safetensors.numpy import save_file as reference_save

import stream_st
from stream_st.cli import main

FORGED = "w\nvalid: 9 tensors, 0 errors, 0 warnings"
ESCAPE = "esc\x1b[31mRED\x1b]0;pwned\x07"


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """A file whose names and metadata carry a forged line and terminal escapes."""
    path = tmp_path / "hostile.safetensors"
    arrays = {FORGED: np.array([np.nan], np.float32), ESCAPE: np.zeros(2, np.float32)}
    reference_save(arrays, str(path), metadata={"k\x1b[2J": "v\nfake line"})
    return path


@pytest.mark.parametrize("command", ["inspect", "ls", "validate", "diff"])
def test_names_from_a_file_reach_the_terminal_escaped(
    hostile: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tables printed names and metadata raw: escape sequences reached the terminal, and a name
    holding a newline forged a line of validate's verdict."""
    other = tmp_path / "other.safetensors"
    reference_save({"x": np.zeros(1, np.float32)}, str(other))
    args = [command, str(hostile)] + ([str(other)] if command == "diff" else [])
    main(args)
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "\nvalid: 9 tensors" not in out and "\nfake line" not in out
    assert "w\\nvalid: 9 tensors" in out or command == "diff"
    assert "esc\\x1b[31mRED" in out


def test_show_prints_the_name_escaped(
    hostile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``show``'s first line gave the name as the command line had it, raw: a newline forged a
    line, an escape sequence reached the terminal (a packed tensor's line too)."""
    name = ESCAPE + "\nvalid: ok"
    header = json.dumps({name: {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}})
    packed = tmp_path / "packed.safetensors"
    packed.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"abc")
    for path, shown in ((hostile, FORGED), (hostile, ESCAPE), (packed, name)):
        assert main(["show", str(path), shown]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "\x07" not in out and "\nvalid: " not in out, out
        assert out.startswith(shown.encode("unicode_escape").decode() + ": "), out


def test_show_json_gives_the_shape_of_the_slice(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """ "shape" was the whole tensor's, where the docs say it is that of what "values" holds."""
    path = tmp_path / "a.safetensors"
    reference_save({"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(path))
    for given, shape in (("0", [4]), ("0,0", []), ("1:3,2", [2]), ("", [3, 4])):
        slicing = ["--slice", given] if given else []
        assert main(["show", "--json", str(path), "a", *slicing]) == 0
        record = json.loads(capsys.readouterr().out)
        assert record["shape"] == shape == list(np.shape(record["values"])), given


@pytest.mark.parametrize(
    "given", ["99999999999999999999", "-4", "1,4", "0:2,-99999999999999999999"]
)
def test_show_names_the_axis_an_index_falls_outside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str
) -> None:
    """An integer too large for numpy's own was refused as "only integers, slices ... are valid
    indices", a wrong kind of index, where it is one out of range."""
    path = tmp_path / "a.safetensors"
    reference_save({"a": np.arange(12, dtype=np.float32).reshape(3, 4)}, str(path))
    assert main(["show", str(path), "a", "--slice", given]) != 0
    error = capsys.readouterr().err
    assert "is out of range for axis" in error and "valid indices" not in error, error


def test_json_records_are_json_for_a_file_name_that_is_not_utf8(
    tmp_path: Path, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """The raw byte of the name went into the record: not UTF-8, so not JSON."""
    name = (tmp_path / "bad\udcffname.safetensors").as_posix()
    reference_save({"a": np.zeros(2, np.float32)}, name)
    for command in ("inspect", "hash", "validate"):
        main([command, "--json", name])
        record = json.loads(capsysbinary.readouterr().out.decode("utf-8"))
        assert record["source"].endswith("bad\\xffname.safetensors"), command


async def test_writers_refuse_what_is_not_tensors_and_leave_no_folder(tmp_path: Path) -> None:
    """write_many(5) and write_batch([...]) raised bare TypeError and AttributeError; a failed
    sharded or dataset write left the folder it had made."""
    plan = [stream_st.TensorSpec("a", "F32", (2,))]
    with pytest.raises(stream_st.ArgumentTypeError, match="write_many takes"):
        async with stream_st.open_writer(tmp_path / "w.safetensors", plan) as writer:
            await writer.write_many(5)  # type: ignore[arg-type]
    assert not (tmp_path / "w.safetensors").exists()
    arrays: Any = [("x", np.zeros((2, 2)))]
    with pytest.raises(stream_st.ArgumentTypeError, match="write_batch takes"):
        async with stream_st.open_dataset_writer(tmp_path / "deep" / "ds") as dataset:
            await dataset.write_batch(arrays, 2)
    with pytest.raises(stream_st.DtypeError):
        async with stream_st.open_sharded_writer(tmp_path / "ckpt", max_shard_size=1 << 20) as w:
            await w.write("c", np.zeros(2, np.complex128))
    with anyio.move_on_after(0.01):
        async with stream_st.open_sharded_writer(tmp_path / "cut", max_shard_size=1 << 20) as w:
            await w.write("a", np.zeros(4, np.float32))
            await anyio.sleep(1)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


async def test_index_metadata_cannot_replace_the_total_size(tmp_path: Path) -> None:
    with pytest.raises(stream_st.UsageError, match="may not hold 'total_size'"):
        stream_st.open_sharded_writer(
            tmp_path / "c", max_shard_size=1 << 20, metadata={"total_size": "9"}
        )
    assert not (tmp_path / "c").exists()


@pytest.mark.skipif(not Path("/proc/version").exists(), reason="needs /proc")
async def test_a_folder_that_makes_no_file_is_not_called_missing() -> None:
    """Writing /proc/version said "no such directory: /proc"."""
    with pytest.raises(stream_st.SourceNotFoundError, match="cannot create a file in /proc"):
        await stream_st.save("/proc/version", {"a": np.zeros(1)})


async def test_write_many_takes_pairs_as_lists_too(tmp_path: Path) -> None:
    """Pairs given as lists unpack as tuples do (the check of pairs must not refuse them)."""
    plan = [stream_st.TensorSpec("a", "F32", (2,)), stream_st.TensorSpec("b", "F32", (1,))]
    async with stream_st.open_writer(tmp_path / "x.safetensors", plan) as writer:
        pairs: Any = [["a", np.zeros(2, np.float32)], ("b", np.ones(1, np.float32))]
        await writer.write_many(pairs)
    loaded = await stream_st.load(tmp_path / "x.safetensors")
    assert loaded["b"].tolist() == [1.0] and loaded["a"].tolist() == [0.0, 0.0]
    with pytest.raises(stream_st.ArgumentTypeError, match="takes \\(name, array\\) pairs"):
        async with stream_st.open_writer(tmp_path / "y.safetensors", plan) as writer:
            await writer.write_many([("a",)])  # type: ignore[list-item]
    assert not (tmp_path / "y.safetensors").exists()
