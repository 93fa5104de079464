"""``stream-st hash --content`` of a batch-mode dataset (its shards repeat every column's name):
refused, one name having one digest, with its structural hash given, as docs/cli.md says."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.cli import main


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """A batch-mode dataset of two shards, each with the column ``x``: its manifest."""
    directory = tmp_path / "ds"

    async def write() -> None:
        async with stream_st.open_dataset_writer(directory, target_shard_size=100) as writer:
            for batch in range(2):
                await writer.write_batch({"x": np.full((4, 3), batch, np.float32)}, samples=4)

    anyio.run(write)
    return directory / "dataset_manifest.json"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A file of one tensor."""
    path = tmp_path / "m.safetensors"
    reference_numpy.save_file({"w": np.arange(6, dtype=np.int32)}, str(path))
    return path


@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["text", "json"])
def test_hash_content_of_a_dataset_gives_its_structural_hash(
    dataset: Path, model: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """The refusal printed nothing on standard output: the structural hash the docs promise was
    not given. Now it is, as ``hash`` without ``--content`` gives it, and the refusal follows on
    standard error (exit 2, one line); the other sources are still hashed."""
    assert main(["hash", "-q", *flags, str(dataset)]) == 0
    structure = capsys.readouterr().out
    assert main(["hash", "-q", "--content", *flags, str(model)]) == 0
    other = capsys.readouterr().out
    assert main(["hash", "-q", "--content", *flags, str(dataset), str(model)]) == 2
    out, err = capsys.readouterr()
    assert out == structure + other
    if flags:
        record = json.loads(structure)
        assert "content_hash" not in record and record["tensor_count"] == 2
    [line] = err.splitlines()
    assert line.startswith(f"stream-st: error: {dataset}: tensor 'x' is in 2 shards"), line
    assert "one digest" in line, line
