"""SafetensorsDataset against a hand-written reader on the reference ``safetensors`` package.

A dataset of ``--mb`` MB (``image`` U8 [3, 64, 64], ``label`` I64; shards of ``--batch``
samples) is written once; then, in interleaved rounds, one epoch of samples through a
``DataLoader`` (``--workers``, batches of 64) from:

* ``stream_st``: ``SafetensorsDataset(directory)`` (``--shuffle``: with its buffer of 1024);
* ``reference``: an ``IterableDataset`` that opens each shard with ``safetensors.safe_open``
  (``framework="pt"``), takes its tensors whole and yields their rows, shards split between
  workers as the dataset splits them.

Medians over ``--rounds`` and the paired ratio (stream_st time / reference time per round; below
1 is faster), its median and range. The load average is printed: compare ratios, not absolute
figures.

    python benchmarks/bench_torch_dataset.py --mb 200 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import torch
from safetensors import safe_open
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

import stream_st
from stream_st.integrations.torch_dataset import SafetensorsDataset

SAMPLE = (3, 64, 64)


def write(directory: Path, samples: int, batch: int) -> None:
    async def main() -> None:
        rng = np.random.default_rng(0)
        async with stream_st.open_dataset_writer(directory, target_shard_size=1) as writer:
            for start in range(0, samples, batch):
                rows = min(batch, samples - start)
                image = rng.integers(0, 255, (rows, *SAMPLE), dtype=np.uint8)
                label = np.arange(start, start + rows, dtype=np.int64)
                await writer.write_batch({"image": image, "label": label}, rows)

    anyio.run(main)


class Reference(IterableDataset[dict[str, torch.Tensor]]):
    """What one writes by hand with the reference package: whole shards, rows yielded."""

    def __init__(self, directory: Path) -> None:
        self.shards = sorted(str(p) for p in directory.glob("part-*.safetensors"))

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for shard in self.shards[worker::workers]:
            with safe_open(shard, framework="pt") as handle:
                tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
            rows = len(next(iter(tensors.values())))
            for row in range(rows):
                yield {name: tensor[row] for name, tensor in tensors.items()}


def epoch(dataset: Any, workers: int) -> int:
    loader = DataLoader(dataset, batch_size=64, num_workers=workers)
    return sum(len(batch["label"]) for batch in loader)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="dataset size in MB")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1024, help="samples per shard")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    parser.add_argument("--shuffle", action="store_true", help="stream_st shuffles samples")
    args = parser.parse_args()
    sample_bytes = int(np.prod(SAMPLE)) + 8
    samples = max(args.batch, int(args.mb * 1e6 / sample_bytes))
    work = Path(tempfile.mkdtemp(prefix="bench-torch-dataset-"))
    try:
        write(work, samples, args.batch)
        ours = SafetensorsDataset(work, shuffle=args.shuffle)
        theirs = Reference(work)
        assert epoch(ours, 0) == epoch(theirs, 0) == samples  # and warm the page cache
        times: dict[str, list[float]] = {"stream_st": [], "reference": []}
        for _ in range(args.rounds):
            for name, dataset in (("stream_st", ours), ("reference", theirs)):
                began = time.perf_counter()
                epoch(dataset, args.workers)
                times[name].append(time.perf_counter() - began)
        total = samples * sample_bytes
        print(
            f"{samples} samples, {total / 1e6:.0f} MB, {args.rounds} rounds, "
            f"{args.workers} workers, shuffle={args.shuffle}, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
        )
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{name:<10} {median:7.2f} s {samples / median:9.0f} samples/s")
        ratios = [a / b for a, b in zip(times["stream_st"], times["reference"], strict=True)]
        print(
            f"stream_st / reference: {statistics.median(ratios):.2f}x the time (paired median; "
            f"range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
