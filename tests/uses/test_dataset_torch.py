"""The torch IterableDataset over a safetensors dataset: every sample once per epoch across
DataLoader workers and distributed ranks, only the selected columns' bytes read, any source."""

from __future__ import annotations

import itertools
from pathlib import Path

import anyio
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stream_st  # noqa: E402
from stream_st.integrations.torch_dataset import SafetensorsDataset  # noqa: E402

from ..servers.http_server import RangeHTTPServer  # noqa: E402

SHARD_ROWS = (10, 10, 7)


def write_dataset(directory: Path) -> None:
    """Three shards of 10, 10 and 7 samples: ``image`` (U8 [256, 256]) and ``label`` (its index)."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(directory, target_shard_size=1) as writer:
            start = 0
            for rows in SHARD_ROWS:
                labels = np.arange(start, start + rows, dtype=np.int64)
                images = np.repeat(labels.astype(np.uint8), 256 * 256).reshape(rows, 256, 256)
                await writer.write_batch({"image": images, "label": labels}, rows)
                start += rows

    anyio.run(main)


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    write_dataset(tmp_path)
    return tmp_path


def labels(samples: object) -> list[int]:
    return [int(sample["label"]) for sample in samples]  # type: ignore[attr-defined]


def test_single_process_reads_every_sample_once(dataset_dir: Path) -> None:
    data = SafetensorsDataset(dataset_dir / "dataset_manifest.json")
    samples = list(data)
    assert labels(samples) == list(range(27)) and data.num_samples == 27
    assert samples[13]["image"].shape == (256, 256) and samples[13]["image"].dtype == torch.uint8
    assert samples[13]["image"].eq(13).all()


def test_dataloader_workers_and_ranks_split_the_samples(dataset_dir: Path) -> None:
    seen: list[int] = []
    for rank in range(2):
        data = SafetensorsDataset(dataset_dir, rank=rank, world_size=2, shuffle=True, seed=3)
        data.set_epoch(1)
        loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=2)
        seen += [int(label) for batch in loader for label in batch["label"]]
    assert sorted(seen) == list(range(27))  # each sample exactly once across the job


def test_more_consumers_than_shards_cuts_shards_into_row_ranges(dataset_dir: Path) -> None:
    data = SafetensorsDataset(dataset_dir, world_size=4, rank=0, columns=["label"])
    parts = [data.pieces(worker, 2) for worker in range(2)]
    others = [
        SafetensorsDataset(dataset_dir, world_size=4, rank=r).pieces(w, 2)
        for r, w in itertools.product(range(1, 4), range(2))
    ]
    assert all(parts) and all(others)  # 8 consumers, 3 shards: everyone gets work
    rows = sorted(
        (p.address, r) for p in itertools.chain(*parts, *others) for r in range(p.start, p.stop)
    )
    assert len(rows) == len(set(rows)) == 27
    assert all(p.names == ("label",) for p in parts[0])


def test_streams_from_http_reading_only_the_selected_columns(dataset_dir: Path) -> None:
    with RangeHTTPServer() as server:
        for path in dataset_dir.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        data = SafetensorsDataset(server.url("/data/dataset_manifest.json"), columns=["label"])
        server.requests.clear()
        samples = list(data)
        assert labels(samples) == list(range(27)) and samples[0].keys() == {"label"}
        sent = sum(request[3] for request in server.requests)
        assert (
            sent < 27 * 256 * 256 // 4
        )  # labels and headers (a 64 KiB first read each), no images


def test_kv_dataset_and_bad_rank_are_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            await writer.write_batch({"a__x": np.zeros(3), "b__x": np.zeros((2, 2))}, 1)

    anyio.run(main)
    with pytest.raises(stream_st.UsageError, match="KV-mode"):
        SafetensorsDataset(tmp_path)
    write_dataset(tmp_path / "batch")
    with pytest.raises(stream_st.UsageError, match="rank 2 is not in a world of 2"):
        SafetensorsDataset(tmp_path / "batch", rank=2, world_size=2)


def test_a_damaged_checksummed_shard_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path, checksums=True) as writer:
            await writer.write_batch({"label": np.arange(4, dtype=np.int64)}, 4)

    anyio.run(main)
    assert labels(list(SafetensorsDataset(tmp_path))) == [0, 1, 2, 3]
    (shard,) = tmp_path.glob("part-*.safetensors")
    header = anyio.run(stream_st.read_header, str(shard))
    damaged = bytearray(shard.read_bytes())
    damaged[header.data_start + header["label"].start] ^= 1
    shard.write_bytes(bytes(damaged))
    with pytest.raises(stream_st.IntegrityError, match="'label'"):
        list(SafetensorsDataset(tmp_path))
