"""Defects a demanding user met from the outside (the command and the reading API), a fourth
round: each test failed before its fix."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st import tools
from stream_st.cli import main
from stream_st.cli.exits import EXIT_DIFFERENT, EXIT_ERROR

from .._util import raw_file
from ._cli import write_model

Array = np.ndarray[Any, Any]


# -------------------------------------------------------------- show: packed sub-byte dtypes


@pytest.fixture
def packed(tmp_path: Path) -> Path:
    """An F4 tensor of shape [2, 4] (values 0.5, 1, 1.5, 2, 3, 4, 6, -0: codes 1 to 8, two a
    byte, low nibble first) and an F6_E2M3 tensor of 4 values in 3 bytes."""
    header = {
        "w4": {"dtype": "F4", "shape": [2, 4], "data_offsets": [0, 4]},
        "w6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [4, 7]},
    }
    path = tmp_path / "packed.safetensors"
    path.write_bytes(raw_file(header, bytes([0x21, 0x43, 0x65, 0x87, 0x01, 0x02, 0xFF])))
    return path


F4_VALUES = [[0.5, 1.0, 1.5, 2.0], [3.0, 4.0, 6.0, -0.0]]


def test_show_prints_an_f4_tensors_values_not_its_packed_bytes(
    packed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed ``w4: uint8 [2, 2]`` and the bytes 33, 67, 101, 135, as if they were values."""
    assert main(["show", str(packed), "w4"]) == 0
    out = capsys.readouterr().out
    assert out == "w4: F4 [2, 4] (float4_e2m1fn values, two a byte)\n[[0.5 1 1.5 2]\n [3 4 6 -0]]\n"
    assert main(["show", "--json", str(packed), "w4", "--slice", "1,1:3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (
        record
        == {
            "name": "w4",
            "safetensors_dtype": "F4",
            "tensor_shape": [2, 4],
            "packed": False,
            "dtype": "float4_e2m1fn",
            "shape": [2],  # of what "values" holds: the slice's (docs/cli.md)
            "values": F4_VALUES[1][1:3],
        }
    )
    assert main(["show", "--json", str(packed), "w4"]) == 0
    assert json.loads(capsys.readouterr().out)["values"] == F4_VALUES


def test_show_says_an_f6_tensors_bytes_are_packed(
    packed: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """F6 (no bit order set by safetensors) is shown as its bytes, said to be packed, in hex."""
    assert main(["show", str(packed), "w6"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("w6: F6_E2M3 [4], packed: 3 raw bytes, not values")
    assert out[1] == "[0x01 0x02 0xff]"
    assert main(["show", "--json", str(packed), "w6"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["packed"] is True and record["safetensors_dtype"] == "F6_E2M3"
    assert (record["tensor_shape"], record["shape"], record["values"]) == ([4], [3], [1, 2, 255])
    assert main(["show", str(packed), "w6", "--slice", "0"]) == EXIT_ERROR
    assert "--slice indexes values, and 'w6' is F6_E2M3" in capsys.readouterr().err


def test_show_json_names_the_safetensors_dtype_of_any_tensor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_model(tmp_path / "m.safetensors", {"x": np.arange(3, dtype=np.float16)})
    assert main(["show", "--json", str(model), "x"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert (record["safetensors_dtype"], record["dtype"], record["packed"]) == (
        "F16",
        "float16",
        False,
    )


# ------------------------------------------------- options' errors are the options', not a file's


@pytest.fixture
def two(tmp_path: Path) -> tuple[str, str]:
    a = write_model(tmp_path / "a.safetensors", {"x": np.zeros(2, np.float32)})
    b = write_model(tmp_path / "b.safetensors", {"x": np.ones(2, np.float32)})
    return str(a), str(b)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["diff", "--timeout", "-1"], "argument --timeout: must be a number >= 0, got -1.0"),
        (["hash", "--deadline", "nan"], "argument --deadline: must be a number >= 0, got nan"),
        (["hash", "--speed-time", "0"], "argument --speed-time: must be a number > 0, got 0.0"),
        (["validate", "--speed-limit", "x"], "argument --speed-limit: not a number: 'x'"),
        (["validate", "--warn-abs", "-1"], "argument --warn-abs: must be a number >= 0, got -1.0"),
        (["hash", "-H", "Bad Name: v"], "argument -H/--header: header 'Bad Name' has no valid"),
        (
            ["inspect", "-H", "X: a\nb"],
            "argument -H/--header: the value of header 'X' holds a line break",
        ),
    ],
)
def test_a_bad_option_is_named_once_not_blamed_on_each_source(
    two: tuple[str, str], argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each source was said to fail: ``error: a.safetensors: timeout must be a number >= 0``,
    then the same for b.safetensors."""
    with pytest.raises(SystemExit) as stopped:
        main([*argv, *two])
    assert stopped.value.code == EXIT_ERROR
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
    assert not any(source in err for source in two)


def test_a_header_without_a_colon_is_not_echoed(capsys: pytest.CaptureFixture[str]) -> None:
    """``-H 'Authorization Bearer <token>'`` (the colon forgotten) printed the token back."""
    with pytest.raises(SystemExit):
        main(["inspect", "-H", "Authorization Bearer s3cret", "x.safetensors"])
    err = capsys.readouterr().err
    assert "expected 'Name: value', without the colon" in err and "s3cret" not in err


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "--config: cannot read the model config"),
        ("{", "--config: cannot read the model config"),
        ('{"hidden_size": 8}', "num_attention_heads must be a positive integer"),
    ],
)
def test_an_unusable_config_is_the_options_error(
    two: tuple[str, str],
    tmp_path: Path,
    content: str | None,
    said: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "config.json"
    if content is not None:
        config.write_text(content)
    assert main(["validate", "-q", "--config", str(config), *two]) == EXIT_ERROR
    captured = capsys.readouterr()
    assert said in captured.err and captured.err.count("\n") == 1 and not captured.out
    assert captured.err.startswith("stream-st: error: --config: ")


def test_cp_names_include_for_a_tensor_the_source_lacks(
    two: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It said ``include= names tensors ...``: the library's keyword, not the option given."""
    out = tmp_path / "out.safetensors"
    assert main(["cp", "-q", "--include", "x", "--include", "nope", two[0], str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stream-st: error: --include names tensors not in the header: ['nope']")
    assert not out.exists()


# ------------------------------------------------------------- validate: a config of another model


CONFIG = {
    "hidden_size": 16,
    "intermediate_size": 40,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 50,
}


def another_model(tmp_path: Path) -> Path:
    return write_model(
        tmp_path / "bert.safetensors",
        {f"encoder.layer.{i}.attention.weight": np.eye(2, dtype=np.float32) for i in range(5)},
    )


async def test_a_config_no_tensor_matches_is_an_error(tmp_path: Path) -> None:
    """A config for another model only warned (expected layers and tensors missing, tensors the
    config does not describe, the parameter count): the file was called valid."""
    result = await tools.validate(another_model(tmp_path), config=CONFIG)
    assert not result.ok and result.warnings == []
    [error] = result.errors
    assert error.startswith("no tensor of the file is one the config names")
    assert "expects 21 tensors, the first ['model.embed_tokens.weight', " in error, error
    assert error.endswith(
        "5 tensors: ['encoder.layer.0.attention.weight', 'encoder.layer.1.attention.weight', "
        "'encoder.layer.2.attention.weight', 'encoder.layer.3.attention.weight', "
        "'encoder.layer.4.attention.weight']"
    ), error


def test_the_command_fails_a_file_no_tensor_of_which_the_config_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(CONFIG))
    argv = ["validate", "-q", "--config", str(config), str(another_model(tmp_path))]
    assert main(argv) == EXIT_DIFFERENT
    assert "error: no tensor of the file is one the config names" in capsys.readouterr().out


async def test_a_config_a_file_partly_matches_keeps_its_warnings(tmp_path: Path) -> None:
    """One tensor of the config's is enough: a shard holding the embeddings alone is valid."""
    path = write_model(
        tmp_path / "shard.safetensors",
        {"model.embed_tokens.weight": np.eye(50, 16, dtype=np.float32)},
    )
    result = await tools.validate(path, config=CONFIG)
    assert result.ok and result.warnings


# ------------------------------------------------------------------- the reading API's arguments


@pytest.fixture
def small() -> bytes:
    data: bytes = reference_numpy.save(
        {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64)}
    )
    return data


@pytest.mark.parametrize(
    ("include", "said"),
    [
        (b"a", "got bytes b'a': names are str"),
        (bytearray(b"a"), "got bytes bytearray(b'a'): names are str"),
        ([1], "names are str, got int 1"),
        (["a", None], "names are str, got NoneType None"),
    ],
)
async def test_include_of_other_than_names_is_a_type_error(
    small: bytes, include: object, said: str
) -> None:
    """``include=b"a"`` was iterated into 97 and refused as a name the header lacks
    (``TensorNotFoundError: include= names tensors not in the header: [97]``); ``[1]`` too."""
    with pytest.raises(stream_st.ArgumentTypeError, match=re.escape(said)):
        await stream_st.load(small, include=include)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["100", None, 1.5, True, 0, -1])
async def test_a_bad_max_header_size_is_a_usage_error(small: bytes, value: object) -> None:
    """A string or None escaped as a TypeError from comparing it with the header's length; a
    bool, a float or a number below 1 was taken as the cap ("exceeds the limit of True bytes")."""
    with pytest.raises(stream_st.UsageError, match="max_header_size must be an integer >= 1"):
        await stream_st.load(small, max_header_size=value)  # type: ignore[arg-type]
    with pytest.raises(stream_st.UsageError, match="max_header_size must be an integer >= 1"):
        await stream_st.read_header(small, max_header_size=value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["100", None, True, 0])
async def test_a_bad_max_header_size_is_a_usage_error_for_a_path_too(
    tmp_path: Path, small: bytes, value: object
) -> None:
    """``read_header`` of a local file reads its header without a stream: a string or None
    escaped there as a TypeError, ``True`` and 0 as "exceeds the limit of True bytes"."""
    path = tmp_path / "small.safetensors"
    path.write_bytes(small)
    with pytest.raises(stream_st.UsageError, match="max_header_size must be an integer >= 1"):
        await stream_st.read_header(path, max_header_size=value)  # type: ignore[arg-type]


async def test_max_header_size_takes_numpy_integers(small: bytes) -> None:
    cap: Any = np.int64(1000)
    assert sorted(await stream_st.load(small, max_header_size=cap)) == ["a", "b"]


def test_a_path_given_as_bytes_to_the_drop_ins_is_a_type_error(
    tmp_path: Path, small: bytes
) -> None:
    """``load_file(os.fsencode(path))`` read the path's characters as a file and said "not a
    safetensors file (its first 8 bytes are not a header length)"; the reference refuses bytes
    with a TypeError, as this does now, saying why."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(small)
    said = "bytes are read as a safetensors file's content"
    for call in (stream_st.numpy.load_file, lambda name: stream_st.numpy.safe_open(name, "np")):
        with pytest.raises(stream_st.ArgumentTypeError, match=said) as raised:
            call(os.fsencode(path))
        assert isinstance(raised.value, TypeError) and str(path) in str(raised.value)
    with stream_st.numpy.safe_open(small, "np") as f:  # a file's bytes are still read
        assert sorted(f.keys()) == ["a", "b"]
