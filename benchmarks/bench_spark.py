"""Spark's overhead on a safetensors dataset: rows/s and MB/s, Spark ``local[2]`` vs one process.

An image-like dataset (``image`` U8 [3, 224, 224], ``label`` I64; 1 GB at ``--scale 1``) is written
by stream_st's single-process dataset writer, then, in interleaved rounds:

* ``stream_st write``: the same arrays written again by ``open_dataset_writer`` (one batch of
  ``--batch`` samples per shard);
* ``stream_st read``: every shard read back with ``stream_st.integrations.dataset.read_piece``;
* ``spark read``: ``spark.read.format("safetensors").load(...)`` into Spark's ``noop`` sink;
* ``spark read+write``: the same, written by the data source (``batch_size`` = ``--batch``).

Medians over ``--rounds``; ratios against the single-process peer of the same round. The machine
may be loaded by others: compare ratios, not absolute figures.

    python benchmarks/bench_spark.py --scale 0.25 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import stream_st
from stream_st.integrations.dataset import describe_dataset, plan_pieces, read_piece

SAMPLE = (3, 224, 224)


def arrays(samples: int, batch: int) -> list[dict[str, np.ndarray[Any, Any]]]:
    rng = np.random.default_rng(0)
    out: list[dict[str, np.ndarray[Any, Any]]] = []
    for start in range(0, samples, batch):
        rows = min(batch, samples - start)
        image = rng.integers(0, 255, (rows, *SAMPLE), dtype=np.uint8)
        label = np.arange(start, start + rows, dtype=np.int64)
        out.append({"image": image, "label": label})
    return out


def write_single(directory: Path, batches: list[dict[str, np.ndarray[Any, Any]]]) -> None:
    async def main() -> None:
        async with stream_st.open_dataset_writer(directory) as writer:
            for group in batches:
                await writer.write_batch(group, len(group["label"]))

    anyio.run(main)


def read_single(directory: Path) -> None:
    async def main() -> None:
        dataset = await describe_dataset(directory)
        for piece in plan_pieces(dataset):
            await read_piece(piece)

    anyio.run(main)


def session() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", "2g")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="1.0 = 1 GB of images")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256, help="samples per shard")
    args = parser.parse_args()
    sample_bytes = int(np.prod(SAMPLE)) + 8
    samples = max(args.batch, int(args.scale * 1e9 / sample_bytes))
    total = samples * sample_bytes
    work = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    try:
        batches = arrays(samples, args.batch)
        source = work / "source"
        write_single(source, batches)
        spark = session()
        spark.read.format("safetensors").load(str(source)).limit(1).collect()  # warm up

        def spark_read() -> None:
            spark.read.format("safetensors").load(str(source)).write.format("noop").mode(
                "overwrite"
            ).save()

        def spark_copy() -> None:
            frame = spark.read.format("safetensors").load(str(source))
            frame.write.format("safetensors").option("batch_size", args.batch).mode(
                "overwrite"
            ).save(str(work / "spark-out"))

        def single_write() -> None:
            shutil.rmtree(work / "single-out", ignore_errors=True)
            write_single(work / "single-out", batches)

        variants: dict[str, Callable[[], None]] = {
            "stream_st write": single_write,
            "stream_st read": lambda: read_single(source),
            "spark read": spark_read,
            "spark read+write": spark_copy,
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, run in variants.items():
                began = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - began)
        print(f"{samples} samples, {total / 1e6:.0f} MB, {args.rounds} rounds, medians")
        print(f"{'variant':<18} {'seconds':>8} {'rows/s':>9} {'MB/s':>8}")
        for name, seconds in times.items():
            median = statistics.median(seconds)
            print(f"{name:<18} {median:8.2f} {samples / median:9.0f} {total / median / 1e6:8.0f}")
        ratio_read = [
            s / r for s, r in zip(times["spark read"], times["stream_st read"], strict=True)
        ]
        ratio_rw = [
            s / (r + w)
            for s, r, w in zip(
                times["spark read+write"],
                times["stream_st read"],
                times["stream_st write"],
                strict=True,
            )
        ]
        print(f"spark read / stream_st read: {statistics.median(ratio_read):.2f}x the time")
        print(
            "spark read+write / (stream_st read + write): "
            f"{statistics.median(ratio_rw):.2f}x the time"
        )
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
