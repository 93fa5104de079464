"""A sharded checkpoint whose shards' ``__metadata__`` differ at a key: ``inspect`` shows each
shard's value, and what merges the shards into one file (``cp`` to a file, ``serve``) refuses it,
where the last shard's value won before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.server.served import served_object
from stream_st.tools import cp, diff, inspect


def checkpoint(tmp_path: Path, second: dict[str, str]) -> Path:
    """Two shards, the first with ``{"format": "np", "note": "a"}``, the second with ``second``."""
    shards: dict[str, tuple[dict[str, np.ndarray[Any, Any]], dict[str, str]]] = {
        "model-00001-of-00002.safetensors": (
            {"a": np.ones(3, np.float32)},
            {"format": "np", "note": "a"},
        ),
        "model-00002-of-00002.safetensors": ({"b": np.zeros(2, np.int8)}, second),
    }
    weight_map: dict[str, str] = {}
    for file, (tensors, metadata) in shards.items():
        reference_numpy.save_file(tensors, tmp_path / file, metadata=metadata)
        weight_map.update(dict.fromkeys(tensors, file))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


async def test_inspect_shows_each_shards_value_of_a_key_they_differ_at(tmp_path: Path) -> None:
    index = checkpoint(tmp_path, {"format": "np", "note": "b"})
    found = await inspect(str(index))
    assert found.metadata == {"format": "np", "note (shard 0)": "a", "note (shard 1)": "b"}


async def test_a_key_spelled_as_a_shards_label_does_not_hide_that_shards_value(
    tmp_path: Path,
) -> None:
    """A key of the file spelled ``note (shard 0)`` took the place of the label of shard 0's
    value of ``note`` (inspect lost that value, diff one of the two changes): the label is made
    ``note (shard 0) (shard 0)``."""
    fake = "note (shard 0)"
    sides = []
    for side, first in (("a", "a"), ("b", "c")):
        (tmp_path / side).mkdir()
        index = checkpoint(tmp_path / side, {"format": "np", "note": "b", fake: side})
        reference_numpy.save_file(
            {"a": np.ones(3, np.float32)},
            tmp_path / side / "model-00001-of-00002.safetensors",
            metadata={"format": "np", "note": first, fake: side},
        )
        sides.append(str(index))
    found = await inspect(sides[0])
    assert found.metadata == {
        "format": "np",
        "note (shard 0) (shard 0)": "a",
        fake: "a",
        "note (shard 1)": "b",
    }
    changed = (await diff(*sides)).metadata_changed
    assert changed == {"note (shard 0) (shard 0)": ["a", "c"], fake: ["a", "b"]}


async def test_merging_shards_whose_metadata_differ_is_refused(tmp_path: Path) -> None:
    index = checkpoint(tmp_path, {"format": "np", "note": "b"})
    target = tmp_path / "merged.safetensors"
    with pytest.raises(
        stream_st.UsageError, match=r"differ at 'note' \(shard 0: 'a', shard 1: 'b'\)"
    ):
        await cp(str(index), str(target))
    assert not target.exists()
    with pytest.raises(stream_st.UsageError, match="differ at 'note'"):
        await served_object(index)


async def test_shards_agreeing_where_both_hold_a_key_merge(tmp_path: Path) -> None:
    """A key one shard lacks is no disagreement: the merged file carries it."""
    index = checkpoint(tmp_path, {"format": "np"})
    target = tmp_path / "merged.safetensors"
    await cp(str(index), str(target))
    header = await stream_st.read_header(target)
    assert header.metadata == {"format": "np", "note": "a"}
    assert (await inspect(str(index))).metadata == {"format": "np", "note": "a"}


async def test_a_conversion_s_counts_that_differ_between_shards_are_left_out(
    tmp_path: Path,
) -> None:
    """A mirror converted by an older cp recorded each shard's own counts (``converted_to``,
    ``quantized_tensors``): such shards merge, the counts no merged file can say left out, the
    keys that agree kept."""
    index = checkpoint(tmp_path, {"format": "np", "note": "a", "converted_to": "BF16 (1 tensor)"})
    first = tmp_path / "model-00001-of-00002.safetensors"
    reference_numpy.save_file(
        {"a": np.ones(3, np.float32)},
        first,
        metadata={"format": "np", "note": "a", "converted_to": "BF16 (2 tensors)"},
    )
    target = tmp_path / "merged.safetensors"
    await cp(str(index), str(target))
    assert (await stream_st.read_header(target)).metadata == {"format": "np", "note": "a"}
