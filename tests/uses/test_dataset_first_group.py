"""A dataset's first groups taken as possible KV-mode rows, then a batch of their columns: the
batch is refused where one of those groups was no batch, whichever came first. Such groups alone,
no batch after them: a shard holding other rows than the manifest counts for it is no batch-mode
shard, so the dataset reads as no batch-mode dataset, saying which shard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st
from stream_st.integrations.dataset import DatasetInfo, describe_dataset, plan_pieces
from stream_st.sharded.writer import open_dataset_writer

Arrays = dict[str, np.ndarray[Any, Any]]


def batch(rows: int) -> Arrays:
    """A real batch of ``rows`` samples of the columns ``x`` and ``y``."""
    return {"x": np.ones((rows, 4), np.float32), "y": np.arange(rows)}


def manifest(directory: Path) -> dict[str, Any]:
    """The dataset's manifest."""
    loaded: dict[str, Any] = json.loads((directory / "dataset_manifest.json").read_text())
    return loaded


@pytest.mark.parametrize(
    ("earlier", "why"),
    [
        # 3 rows passed as 2 samples (2 columns): 8 samples read where the manifest said 7
        ([({"x": np.zeros((3, 4), np.float32), "y": np.arange(3)}, 2)], r"'x' holds 3 rows"),
        # columns of 7 rows and 2: the dataset was then no batch-mode dataset
        ([({"x": np.zeros((7, 4), np.float32), "y": np.arange(2)}, 2)], r"'x' holds 7 rows"),
        # one sample of 3 rows
        ([({"x": np.zeros((3, 4), np.float32), "y": np.arange(1)}, 1)], r"'x' holds 3 rows"),
        # a single value: refused before too, as rows of another shape than the schema's []
        ([({"x": np.zeros((), np.float32), "y": np.arange(1)}, 1)], r"'x' is 0-d"),
        # a later group of rows of another shape than the first's
        (
            [
                ({"x": np.zeros((2, 4), np.float32), "y": np.arange(2)}, 2),
                ({"x": np.zeros((2, 5), np.float32), "y": np.arange(2)}, 2),
            ],
            r"'x' is F32 rows of shape \[5\], the dataset's F32 rows of shape \[4\]",
        ),
    ],
)
async def test_a_batch_after_groups_that_were_no_batch_is_refused(
    tmp_path: Path, earlier: list[tuple[Arrays, int]], why: str
) -> None:
    """The first groups (``samples`` 1 or their number of columns) were taken unchecked, and a
    batch of their columns after them was accepted: the manifest counted samples their shards
    did not hold, or readers refused the dataset; the same groups after the batch were refused.
    The batch is refused now, nothing of it written; the groups taken stay as written (each in
    its shard, sealed before the batch came) and the writer goes on."""
    async with open_dataset_writer(tmp_path, target_shard_size=1) as d:
        for group, samples in earlier:
            await d.write_batch(group, samples)
        with pytest.raises(stream_st.UsageError, match=f"{why}.*nothing of the batch was written"):
            await d.write_batch(batch(5), samples=5)
    written = manifest(tmp_path)
    assert [s["samples_count"] for s in written["shards"]] == [samples for _, samples in earlier]
    assert written["total_samples"] == sum(samples for _, samples in earlier)
    shards = (await describe_dataset(tmp_path, kv=True)).headers
    assert [{t.name: list(t.shape) for t in header} for header in shards] == [
        {name: list(array.shape) for name, array in group.items()} for group, _ in earlier
    ]


async def test_the_other_order_is_refused_alike(tmp_path: Path) -> None:
    """The batch first, then the group that is no batch: the group is refused (as before)."""
    async with open_dataset_writer(tmp_path, target_shard_size=1) as d:
        await d.write_batch(batch(5), samples=5)
        with pytest.raises(stream_st.UsageError, match=r"'x' holds 3 rows"):
            await d.write_batch({"x": np.zeros((3, 4), np.float32), "y": np.arange(3)}, 2)
    assert manifest(tmp_path)["total_samples"] == 5


@pytest.mark.parametrize("target_shard_size", [1, 1 << 20])
async def test_first_groups_that_are_batches_still_take_batches(
    tmp_path: Path, target_shard_size: int
) -> None:
    """First groups of 1 sample, or as many as their columns, whose every column holds that
    many rows of the later batch's shape, are batches: the batch after them is taken, and the
    dataset reads in batch mode, every sample the manifest counts."""
    async with open_dataset_writer(tmp_path, target_shard_size=target_shard_size) as d:
        await d.write_batch(batch(2), samples=2)
        await d.write_batch(batch(1), samples=1)
        await d.write_batch(batch(5), samples=5)
    assert manifest(tmp_path)["total_samples"] == 8
    info = await describe_dataset(tmp_path)
    assert not info.kv
    assert sum(header[name].shape[0] for header in info.headers for name in ("x", "y")) == 16


@pytest.mark.parametrize(
    ("groups", "why"),
    [
        # a batch of 3 rows given as 2 samples, then as 1: 6 samples read, 3 counted
        ([(batch(3), 2), (batch(3), 1)], r"-0000-.* holds 3 rows, the manifest counts 2"),
        # a single group: 3 rows given as 1 sample
        ([(batch(3), 1)], r"-0000-.* holds 3 rows, the manifest counts 1"),
        # the first shard right, the second not
        ([(batch(2), 2), (batch(3), 1)], r"-0001-.* holds 3 rows, the manifest counts 1"),
    ],
)
async def test_shards_holding_other_rows_than_their_count_are_no_batch(
    tmp_path: Path, groups: list[tuple[Arrays, int]], why: str
) -> None:
    """Groups taken unchecked (``samples`` 1 or their number of columns) whose rows are not
    their ``samples``, and no batch after them to refuse: the dataset was described as batch
    mode and read every row of its shards, more samples than its manifest counted. It is no
    batch-mode dataset now, and says which shard holds how many rows against which count."""
    async with open_dataset_writer(tmp_path, target_shard_size=1) as d:
        for group, samples in groups:
            await d.write_batch(group, samples)
    assert [s["samples_count"] for s in manifest(tmp_path)["shards"]] == [s for _, s in groups]
    info = await describe_dataset(tmp_path)
    assert info.kv
    assert re.search(f"part-00000{why} samples for it", info.not_batch() or "")


@pytest.mark.parametrize(
    "groups",
    [
        [(batch(1), 1), (batch(2), 2), (batch(5), 5)],  # counts 1 and 2 that are batches
        [(batch(0), 0), (batch(3), 3)],  # a batch of no row first
        [(batch(4), 4), (batch(0), 0)],  # and last
        [(batch(0), 0)],  # a dataset of no sample
        [],  # nothing written: one shard of no tensor
    ],
)
async def test_shards_holding_their_count_stay_batch_mode(
    tmp_path: Path, groups: list[tuple[Arrays, int]]
) -> None:
    """Shards whose rows are the samples their manifest entry counts, a shard of no row or of
    no tensor included, are batch mode: every sample counted is read, no other."""
    async with open_dataset_writer(tmp_path, target_shard_size=1) as d:
        for group, samples in groups:
            await d.write_batch(group, samples)
    info = await describe_dataset(tmp_path)
    assert not info.kv, info.not_batch()
    assert info.not_batch() is None
    read = sum(piece.stop - piece.start for piece in plan_pieces(info))  # the rows readers read
    assert read == manifest(tmp_path)["total_samples"] == sum(s for _, s in groups)


def test_the_torch_dataset_says_which_shard_holds_other_rows(tmp_path: Path) -> None:
    """``SafetensorsDataset`` read 6 samples of a dataset whose manifest counted 3; it refuses
    it now, as it refuses every dataset that is not in batch mode, naming the shard."""
    pytest.importorskip("torch")
    from stream_st.integrations.torch_dataset import SafetensorsDataset

    async def write() -> None:
        async with open_dataset_writer(tmp_path, target_shard_size=1) as d:
            await d.write_batch(batch(3), samples=2)
            await d.write_batch(batch(3), samples=1)

    anyio.run(write)
    with pytest.raises(
        stream_st.UsageError,
        match=r"not a batch-mode dataset \(.*-0000-.* holds 3 rows, the manifest counts 2 "
        r"samples for it\).*KV-mode",
    ):
        SafetensorsDataset(tmp_path)


async def test_a_made_description_whose_manifest_lists_other_shards_counts_none(
    tmp_path: Path,
) -> None:
    """A ``DatasetInfo`` made by hand, its manifest listing another number of shards than it
    holds, raised a bare ``ValueError`` from ``not_batch()``: no entry is a shard's there."""
    path = tmp_path / "s.safetensors"
    await stream_st.save(path, {"x": np.zeros((3, 2), np.float32)})
    header = await stream_st.read_header(path)
    entries = [{"samples_count": 2}, {"samples_count": 1}]
    made = DatasetInfo(str(tmp_path), (str(path),), (header,), {"shards": entries}, False)
    assert made.not_batch() is None
    alone = DatasetInfo(str(tmp_path), (str(path),), (header,), {"shards": entries[:1]}, False)
    assert "holds 3 rows, the manifest counts 2 samples" in str(alone.not_batch())
