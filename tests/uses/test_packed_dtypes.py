"""Packed dtypes stream_st cannot read (``I4``, ``I2``): the header-only commands accept them,
every read of their data refuses them with an UnknownDtypeError (a DtypeError) naming the
tensor."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy as st_numpy
from stream_st import DtypeError, HeaderError, UnknownDtypeError, tools
from stream_st.cli import main
from stream_st.cli.exits import EXIT_ERROR
from stream_st.core.header import parse_header
from stream_st.tools.hash import structural_hash

from .._util import raw_file

WEIGHTS = np.arange(6, dtype=np.float32).reshape(2, 3)

HEADER: dict[str, Any] = {
    "__metadata__": {"quant": "int4"},
    "scales": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
    "q4": {"dtype": "I4", "shape": [4, 8], "data_offsets": [24, 40]},
    "q2": {"dtype": "I2", "shape": [16], "data_offsets": [40, 44]},
}


@pytest.fixture
def packed(tmp_path: Path) -> Path:
    """An F32 tensor beside an I4 and an I2 one, written by hand (header JSON, then bytes)."""
    path = tmp_path / "packed.safetensors"
    path.write_bytes(raw_file(HEADER, WEIGHTS.tobytes() + bytes(range(20))))
    return path


def header_bytes(header: dict[str, Any]) -> bytes:
    return json.dumps(header).encode()


def test_parse_refuses_by_default_and_keeps_on_request() -> None:
    raw = header_bytes(HEADER)
    with pytest.raises(UnknownDtypeError, match="tensor 'q4': unknown safetensors dtype 'I4'"):
        parse_header(raw)
    with pytest.raises(HeaderError):  # still a HeaderError where one was caught before
        parse_header(raw)
    header = parse_header(raw, unknown_dtypes="keep")
    assert header.names() == ["scales", "q4", "q2"]
    assert header.unreadable == ("q4", "q2")
    assert (header["q4"].dtype, header["q4"].shape, header["q4"].nbytes) == ("I4", (4, 8), 16)
    assert header["q2"].nbytes == 4 and not header["q2"].readable and header["scales"].readable
    assert header.data_size == 44 and header.metadata == {"quant": "int4"}
    with pytest.raises(UnknownDtypeError, match="tensor 'q4' has dtype 'I4'"):
        _ = header["q4"].dtype_info
    with pytest.raises(DtypeError, match=r"'q2'.*'I2'"):
        _ = header["q2"].array_shape


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dtype": "I 4", "shape": [2], "data_offsets": [0, 1]}, "unknown safetensors dtype"),
        ({"dtype": "", "shape": [2], "data_offsets": [0, 1]}, "unknown safetensors dtype"),
        ({"dtype": 4, "shape": [2], "data_offsets": [0, 1]}, "unknown safetensors dtype"),
        ({"dtype": "I4", "shape": [-2], "data_offsets": [0, 1]}, "shape must be"),
        ({"dtype": "I4", "shape": [2], "data_offsets": [1, 0]}, "reversed"),
        ({"dtype": "I4", "shape": [2], "data_offsets": [0, -1]}, "two non-negative integers"),
        ({"dtype": "I4", "shape": [2], "data_offsets": [0]}, "two non-negative integers"),
        ({"dtype": "I4", "shape": [2], "data_offsets": [1, 2]}, "leave a hole"),
        ({"dtype": "I4", "shape": [2], "data_offsets": [0, 1], "x": 1}, "unknown field"),
    ],
)
def test_keep_checks_everything_else(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(HeaderError, match=message):
        parse_header(header_bytes({"t": entry}), unknown_dtypes="keep")


def test_keep_is_refuse_or_keep() -> None:
    with pytest.raises(stream_st.UsageError):
        parse_header(header_bytes(HEADER), unknown_dtypes="ignore")  # type: ignore[arg-type]


async def test_read_header_keeps_only_when_asked(packed: Path) -> None:
    with pytest.raises(UnknownDtypeError, match="'q4'"):
        await stream_st.read_header(packed)
    header = await stream_st.read_header(packed, unknown_dtypes="keep")
    assert header.unreadable == ("q4", "q2") and header.file_size == packed.stat().st_size


async def test_header_only_tools(packed: Path) -> None:
    inspection = await tools.inspect(str(packed))
    assert [(t["name"], t["dtype"], t["bytes"]) for t in inspection.tensors] == [
        ("scales", "F32", 24),
        ("q4", "I4", 16),
        ("q2", "I2", 4),
    ]
    assert inspection.parameter_count == 6 + 32 + 16 and inspection.data_bytes == 44
    structure = await tools.hash(str(packed))
    header = parse_header(header_bytes(HEADER), unknown_dtypes="keep")
    assert structure["structural_hash"] == structural_hash(header.tensors)
    assert structure["tensor_count"] == 3
    with_file = await tools.hash(str(packed), file=True)
    assert with_file["structural_hash"] == structure["structural_hash"]
    identity = await tools.weight_inspect(str(packed))
    assert identity["id"].startswith("wi:safetensors:0:") and identity["tensor_count"] == 3


def test_header_only_commands(packed: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(packed)]) == 0
    shown = capsys.readouterr().out
    assert "I4" in shown and "I2" in shown and "q4" in shown and "F32" in shown
    assert main(["ls", str(packed)]) == 0
    assert capsys.readouterr().out.split() == ["scales", "q4", "q2"]
    assert main(["hash", str(packed)]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["inspect", "--json", str(packed)]) == 0
    tensors = json.loads(capsys.readouterr().out)["tensors"]
    assert [t["dtype"] for t in tensors] == ["F32", "I4", "I2"]


def test_diff_of_the_headers_keeps_them(
    packed: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plain ``diff`` reads the headers alone, and refused a packed dtype inspect, ls and hash
    accept ("only header-only reads accept it"); ``--content`` reads the data, and refuses it."""
    wider = tmp_path / "wider.safetensors"
    header = {
        **HEADER,
        "q4": {"dtype": "I4", "shape": [4, 16], "data_offsets": [24, 56]},
        "q2": {"dtype": "I2", "shape": [16], "data_offsets": [56, 60]},
    }
    wider.write_bytes(raw_file(header, WEIGHTS.tobytes() + bytes(36)))
    assert main(["diff", str(packed), str(packed)]) == 0
    capsys.readouterr()
    assert main(["diff", "--json", str(packed), str(wider)]) == 1
    record = json.loads(capsys.readouterr().out)
    assert list(record["changed"]) == ["q4"] and not record["added"] and not record["removed"]
    assert main(["diff", "--content", str(packed), str(wider)]) == EXIT_ERROR
    assert "'q4'" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["cp", "validate", "hash --content"])
def test_data_commands_refuse(
    packed: Path, tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    args = [*command.split(), str(packed)]
    if command == "cp":
        args.append(str(tmp_path / "copy.safetensors"))
    assert main(args) == EXIT_ERROR
    error = capsys.readouterr().err
    assert "'q4'" in error and "'I4'" in error
    assert not (tmp_path / "copy.safetensors").exists()


async def test_data_reads_refuse(packed: Path, tmp_path: Path) -> None:
    with pytest.raises(DtypeError, match=r"tensor 'q4'.*'I4'"):
        await stream_st.load(packed)
    with pytest.raises(DtypeError, match="'q4'"):
        await stream_st.load(packed, include=["scales"])  # the file itself is refused
    with pytest.raises(DtypeError, match="'q4'"):
        async with stream_st.open_stream(packed) as stream:
            async for _ in stream:
                pass
    with pytest.raises(DtypeError, match="'q4'"):
        await tools.cp(str(packed), str(tmp_path / "copy.safetensors"))
    with pytest.raises(DtypeError, match="'q4'"):
        await tools.validate(str(packed))
    with pytest.raises(DtypeError, match="'q4'"):
        st_numpy.load_file(str(packed))


async def test_a_kept_header_never_reads_the_data(packed: Path) -> None:
    """A stream opened to keep them reads the readable tensors, and refuses the packed ones
    before reading any of their bytes."""
    stream = stream_st.TensorStream(str(packed), unknown_dtypes="keep", include=["scales"])
    async with stream:
        got = {name: array async for name, array in stream}
    assert np.array_equal(got["scales"], WEIGHTS)
    stream = stream_st.TensorStream(str(packed), unknown_dtypes="keep")
    with pytest.raises(UnknownDtypeError, match="tensor 'q4' has dtype 'I4'"):
        async with stream:
            async for _ in stream:
                pass


async def test_normal_files_unchanged(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    reference_numpy.save_file({"a": WEIGHTS, "b": np.ones(4, np.int8)}, str(path))
    strict = await stream_st.read_header(path)
    kept = await stream_st.read_header(path, unknown_dtypes="keep")
    assert strict == kept and strict.unreadable == kept.unreadable == ()
    assert structural_hash(strict.tensors) == (await tools.hash(str(path)))["structural_hash"]
    loaded = await stream_st.load(path)
    assert np.array_equal(loaded["a"], WEIGHTS)
