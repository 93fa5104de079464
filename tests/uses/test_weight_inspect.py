"""``stream-st hash --format weight-inspect``: the weight-inspect tool's structural ID, checked
against its published test vector and its definition."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest

from stream_st.tools.weight_inspect import canonical_artifact

from ._cli import run

GGUF_GOLDEN = "d775e08a3e69f1edce0f3230ecc28841dd1c871f467529a0a8e7aa361b671202"
"""weight-inspect's own golden structural hash of its tiny.gguf fixture (GGUF version 3,
general.architecture = "llama", one F32 tensor test.weight.0 of shape [64, 128])."""


def _file(path: Path, header: dict[str, object]) -> Path:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data_size = max(
        (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),  # type: ignore[index]
        default=0,
    )
    path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(data_size))
    return path


def test_the_canonical_form_gives_the_published_vector() -> None:
    text = canonical_artifact(
        "gguf",
        {"general.architecture": "llama"},
        [("test.weight.0", "f32", [64, 128], 32768)],
        gguf_version=3,
    )
    assert hashlib.sha256(text.encode()).hexdigest() == GGUF_GOLDEN


def test_the_tools_fixture_and_escapes(tmp_path: Path) -> None:
    """weight-inspect's tiny.safetensors fixture; then metadata needing both escapes."""
    tiny = _file(
        tmp_path / "tiny.safetensors",
        {"test.weight.0": {"dtype": "F32", "shape": [64, 128], "data_offsets": [0, 32768]}},
    )
    canonical = (
        '{"format":"safetensors","metadata":{},"tensors":{"test.weight.0":{"name":'
        '"test.weight.0","dtype":"f32","shape":[64,128],"byte_length":32768}}}'
    )
    want = hashlib.sha256(canonical.encode()).hexdigest()
    result = run("hash", "--format", "weight-inspect", str(tiny))
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"wi:safetensors:0:{want[:8]} {want}  {tiny}\n"
    record = json.loads(run("hash", "--format", "weight-inspect", "--json", str(tiny)).stdout)
    assert record["structural_hash"] == want and record["id"] == f"wi:safetensors:0:{want[:8]}"
    assert (record["tensor_count"], record["metadata_count"]) == (1, 0)
    odd = _file(
        tmp_path / "odd.safetensors",
        {
            "__metadata__": {"b": 'say "hi"\\\n\x01\x7fü', "a": "1"},
            "Z": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]},
            "a": {"dtype": "U8", "shape": [], "data_offsets": [4, 5]},
        },
    )
    canonical = (
        '{"format":"safetensors","metadata":{"a":"\\"1\\"","b":"\\"say \\\\\\"hi\\\\\\"'
        '\\\\\\\\\\\\n\\\\u0001\\\\u007fü\\""},"tensors":{"Z":{"name":"Z","dtype":"bf16",'
        '"shape":[2],"byte_length":4},"a":{"name":"a","dtype":"u8","shape":[],"byte_length":1}}}'
    )
    want = hashlib.sha256(canonical.encode()).hexdigest()
    assert run("hash", "--format", "weight-inspect", str(odd)).stdout.split()[1] == want


@pytest.mark.parametrize("extra", [["--content"], ["--file"]])
def test_header_only(tmp_path: Path, extra: list[str]) -> None:
    tiny = _file(
        tmp_path / "t.safetensors", {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    )
    assert run("hash", "--format", "weight-inspect", *extra, str(tiny)).returncode == 2
