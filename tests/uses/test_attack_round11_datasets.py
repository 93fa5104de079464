"""Round 11 on datasets: the epoch of a ``SafetensorsDataset`` reaches persistent ``DataLoader``
workers; the dataset writer refuses a batch whose columns do not hold ``samples`` rows; the torch
dataset says why shards are not in batch mode."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stream_st  # noqa: E402
from stream_st.integrations.torch_dataset import SafetensorsDataset  # noqa: E402

Arrays = dict[str, Any]


def write(directory: Path, *batches: tuple[Arrays, int]) -> None:
    """Each of ``batches`` (``{name: array}``, samples) written as one group, one shard each."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(directory, target_shard_size=1) as writer:
            for tensors, samples in batches:
                await writer.write_batch(tensors, samples)

    anyio.run(main)


def test_set_epoch_reaches_persistent_dataloader_workers(tmp_path: Path) -> None:
    """Each persistent worker kept its own copy of the dataset, epoch 0 for ever: every epoch
    repeated one "shuffled" order."""
    write(tmp_path, *(({"x": np.arange(i * 4, i * 4 + 4)}, 4) for i in range(8)))
    data = SafetensorsDataset(tmp_path, shuffle=True, seed=0, shuffle_buffer=4)
    loader = torch.utils.data.DataLoader(
        data, batch_size=None, num_workers=2, persistent_workers=True
    )
    orders = []
    for epoch in range(3):
        data.set_epoch(epoch)
        orders.append([int(sample["x"]) for sample in loader])
    assert all(sorted(order) == list(range(32)) for order in orders)  # every row once
    assert len({tuple(order) for order in orders}) == 3
    assert data.epoch == 2


def test_the_epoch_pickles_with_its_value(tmp_path: Path) -> None:
    write(tmp_path, ({"x": np.arange(4)}, 4))
    data = SafetensorsDataset(tmp_path, shuffle=True)
    data.epoch = 3
    copy = pickle.loads(pickle.dumps(data))
    assert copy.epoch == 3
    copy.set_epoch(5)  # a pickled copy is its own
    assert data.epoch == 3 and copy.epoch == 5
    with pytest.raises(stream_st.SafetensorsError, match="epoch"):
        data.set_epoch(-1)


@pytest.mark.parametrize(
    ("tensors", "samples", "message"),
    [
        (
            {"x": np.zeros((3, 2), np.float32), "y": np.zeros(5, np.int64)},
            3,
            r"column 'y' holds 5 rows \(shape \[5\]\), not samples=3",
        ),
        ({"x": np.zeros((3, 2), np.float32)}, 5, r"column 'x' holds 3 rows .*samples=5"),
        ({"x": np.float32(3)}, 2, r"column 'x' is 0-d .* batch of 2 samples"),
        ({"x": np.zeros(0)}, 4, r"column 'x' holds 0 rows .*samples=4"),
    ],
)
async def test_the_dataset_writer_refuses_a_batch_of_other_rows(
    tmp_path: Path, tensors: Arrays, samples: int, message: str
) -> None:
    """Such batches were written: the manifest counted ``samples`` where the shard held other
    rows, and the reader then called the dataset KV-mode."""
    with pytest.raises(stream_st.UsageError, match=message):
        async with stream_st.open_dataset_writer(tmp_path / "a") as writer:
            await writer.write_batch(tensors, samples)
    assert not (tmp_path / "a").exists()
    async with stream_st.open_dataset_writer(tmp_path / "b", target_shard_size=1) as writer:
        await writer.write_batch({"x": np.zeros((2, 2), np.float32)}, 2)
        with pytest.raises(stream_st.UsageError, match="nothing of the batch was written"):
            await writer.write_batch(tensors, samples)
        await writer.write_batch({"x": np.ones((3, 2), np.float32)}, 3)  # the writer goes on
    manifest = json.loads((tmp_path / "b" / "dataset_manifest.json").read_text())
    assert [s["samples_count"] for s in manifest["shards"]] == [2, 3]
    assert len(await anyio.to_thread.run_sync(SafetensorsDataset, tmp_path / "b")) == 5


async def test_kv_rows_and_batches_that_agree_are_still_written(tmp_path: Path) -> None:
    """A group of one sample may be one KV-mode row: its tensors are values of any shape."""
    async with stream_st.open_dataset_writer(tmp_path / "kv") as writer:
        await writer.write_batch({"a__emb": np.zeros(3), "a__n": np.int64(1)}, 1)
        await writer.write_batch({"b__emb": np.zeros((2, 2)), "b__n": np.int64(2)}, 1)
    got = await stream_st.load(tmp_path / "kv" / "dataset_manifest.json")
    assert sorted(got) == ["a__emb", "a__n", "b__emb", "b__n"]
    async with stream_st.open_dataset_writer(tmp_path / "batch") as writer:
        await writer.write_batch({"x": np.zeros((0, 3)), "y": np.zeros(0)}, 0)
        await writer.write_batch({"x": np.zeros((1, 3)), "y": np.zeros(1)}, 1)
    assert len(await anyio.to_thread.run_sync(SafetensorsDataset, tmp_path / "batch")) == 1


@pytest.mark.parametrize(
    ("batches", "message"),
    [
        ([({"x": np.zeros(3), "y": np.zeros(2)}, 1)], r"tensor 'y' holds 2 rows, 'x' 3"),
        ([({"x": np.float32(3)}, 1)], r"tensor 'x' of .*part-00000-0000-.* is 0-d"),
        (
            [({"x": np.zeros(3)}, 1), ({"y": np.zeros(3)}, 1)],  # KV rows
            r"column 'y' of the manifest's schema is not in .*part-00000-0000-",
        ),
    ],
)
def test_the_torch_dataset_says_why_shards_are_not_batch_mode(
    tmp_path: Path, batches: list[tuple[Arrays, int]], message: str
) -> None:
    """It said "a KV-mode dataset: it holds no samples", whatever the shards disagreed on."""
    write(tmp_path, *batches)
    with pytest.raises(
        stream_st.UsageError, match=rf"not a batch-mode dataset \(.*{message}.*KV-mode"
    ):
        SafetensorsDataset(tmp_path)


def test_shards_holding_other_tensors_and_no_shard_are_named(tmp_path: Path) -> None:
    write(tmp_path / "two", ({"x": np.zeros(3)}, 1), ({"y": np.zeros(3)}, 1))  # KV rows
    (tmp_path / "two" / "dataset_manifest.json").unlink()  # a directory of shards alone
    with pytest.raises(stream_st.UsageError, match=r"tensor 'y' of .*-0001-.* is not in .*-0000-"):
        SafetensorsDataset(tmp_path / "two")
    (tmp_path / "none").mkdir()
    manifest = {"format_version": "1.0", "total_samples": 0, "total_bytes": 0, "shards": []}
    (tmp_path / "none" / "dataset_manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(stream_st.UsageError, match=r"\(it has no shard\)"):
        SafetensorsDataset(tmp_path / "none")


def test_many_datasets_share_the_memory_of_their_epochs(tmp_path: Path) -> None:
    """Each dataset's shared epoch held a file descriptor of its own: about a thousand datasets
    exhausted the default limit of open files."""
    write(tmp_path, ({"x": np.arange(4)}, 4))
    before = len(os.listdir("/proc/self/fd"))
    datasets = [SafetensorsDataset(tmp_path) for _ in range(300)]
    assert len(os.listdir("/proc/self/fd")) - before < 5
    for number, data in enumerate(datasets):
        data.set_epoch(number)
    assert [data.epoch for data in datasets] == list(range(300))


def test_a_subclass_setting_epoch_in_its_set_epoch_works(tmp_path: Path) -> None:
    """The epoch setter called the overridable set_epoch: a subclass assigning self.epoch
    there recursed for ever."""

    class Logged(SafetensorsDataset):
        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    write(tmp_path, ({"x": np.arange(4)}, 4))
    data = Logged(tmp_path, shuffle=True)
    data.set_epoch(3)
    assert data.epoch == 3
    with pytest.raises(stream_st.UsageError, match="below 2\\*\\*63"):
        data.epoch = 2**63


async def test_kv_rows_counted_by_their_tensors_are_taken(tmp_path: Path) -> None:
    """A group of KV values counted one a tensor (samples = its number of tensors) is not
    a batch: its values' shapes are free."""
    async with stream_st.open_dataset_writer(tmp_path) as writer:
        await writer.write_batch({"a__emb": np.zeros(3), "b__emb": np.zeros(5)}, samples=2)
    manifest = json.loads((tmp_path / "dataset_manifest.json").read_text())
    assert manifest["total_samples"] == 2
