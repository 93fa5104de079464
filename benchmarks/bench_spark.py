"""The Spark data source against Spark's own parquet, on the same DataFrame, read and write.

A DataFrame ``label bigint, group bigint, x array<float>`` (``--dim`` floats per row; ``--mb`` MB
in all, 200 by default) is made from numpy, persisted on disk in ``--partitions`` (one per 250 MB,
at least 2), then in interleaved rounds on ``local[2]``:

* ``write``: ``df.write.parquet(...)`` and ``df.write.format("safetensors")`` (``batch_size``
  ``--batch``; with ``--kv``, KV mode: a ``name`` column added, ``name_col=name``, parquet
  writing the same frame), each a fresh overwrite;
* ``read``: ``spark.read.parquet(...)`` and ``spark.read.format("safetensors").load(...)`` of what
  they wrote, into Spark's ``noop`` sink (every row and column materialised, typed; in KV mode,
  a row per name as written). In KV mode a third variant, ``read parsed``, reads the same shards
  as a dataset written before shards recorded where their rows lie (hard links to them beside a
  manifest without ``kv_rows``): each task parses its shard's header.

The issue's figures: ``--dim 3072 --mb 2092 --partitions 8 --cold`` (170,000 rows of 3 x 32 x 32
floats and two int64 columns, 2.09 GB, page cache cleared) and ``--kv --dim 256 --rows 100000``.

``--cold``: before each read, both datasets' files are dropped from the page cache (synced,
then ``posix_fadvise(DONTNEED)``: only these files, nothing else on the machine).

``--only read`` (or ``write``) times one pair alone, so that more rounds of it fit in a few
minutes (every variant still runs once before the rounds: a read needs what a write made).

Every variant runs once before the rounds (not counted: the source cached, Python workers
started); within a pair (or the three reads of KV mode), each goes first in turn, round after
round (the one that follows another finds the JVM in another state: its garbage, its caches).
Medians over ``--rounds``, and the paired ratio of every round (safetensors time / parquet time;
below 1 is faster; the bar is 1.00x; in KV mode also parsed / parquet and safetensors /
parsed), with their median and range. The load
average is printed before and after: others may share the machine, so compare ratios, not
absolute figures. On Linux the CPU seconds the JVM and its Python workers spent on each variant
are printed too (a figure other processes on the machine disturb less than wall time).

    python benchmarks/bench_spark.py --mb 200 --rounds 3
    python benchmarks/bench_spark.py --mb 2092 --dim 3072 --partitions 8 --rounds 2 --cold
    python benchmarks/bench_spark.py --kv --rows 100000 --rounds 3
    python benchmarks/bench_spark.py --kv --rows 100000 --rounds 9 --only read
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

COMPARED = [("safetensors", "parquet"), ("parsed", "parquet"), ("safetensors", "parsed")]
"""The ratios printed, where a run has both variants."""


def session() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.driver.memory", "3g")
        .config("spark.ui.showConsoleProgress", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def source(path: Path, rows: int, dim: int) -> None:
    """The data, as parquet files Spark reads once (made with numpy and pyarrow)."""
    path.mkdir()
    rng = np.random.default_rng(0)
    step = 1 << 16
    for part, start in enumerate(range(0, rows, step)):
        count = min(step, rows - start)
        values = pa.array(rng.standard_normal(count * dim, dtype=np.float32))
        offsets = pa.array(np.arange(count + 1, dtype=np.int32) * dim)
        table = pa.table(
            {
                "label": pa.array(np.arange(start, start + count, dtype=np.int64)),
                "group": pa.array(np.arange(start, start + count, dtype=np.int64) % 10),
                "x": pa.ListArray.from_arrays(offsets, values),
            }
        )
        pq.write_table(table, path / f"part-{part:05d}.parquet")


def drop_cached(directory: Path) -> None:
    """Drop ``directory``'s files from the page cache (written back first)."""
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def without_layouts(dataset: Path, copy: Path) -> None:
    """``dataset`` as written before shards recorded where their rows lie: at ``copy``, hard
    links to its shards beside its manifest without the shards' ``kv_rows``."""
    copy.mkdir()
    document = json.loads((dataset / "dataset_manifest.json").read_text())
    for entry in document["shards"]:
        entry.pop("kv_rows", None)
        os.link(dataset / entry["shard_path"], copy / entry["shard_path"])
    (copy / "dataset_manifest.json").write_text(json.dumps(document))


def cpu_seconds(root: int) -> dict[tuple[int, int], float]:
    """CPU seconds (user and system) of process ``root`` and every process below it, by
    process (its id and start time), from ``/proc`` (empty where there is none)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    used: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        used[int(entry)] = (int(fields[19]), (int(fields[11]) + int(fields[12])) / tick)
    out, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in used:
            out[pid, used[pid][0]] = used[pid][1]
        stack += [child for child, parent in parents.items() if parent == pid]
    return out


def cpu_between(before: dict[tuple[int, int], float], after: dict[tuple[int, int], float]) -> float:
    """CPU seconds spent between two :func:`cpu_seconds` (a process that ended meanwhile is
    not counted: its last seconds are lost)."""
    return sum(seconds - before.get(process, 0.0) for process, seconds in after.items())


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="data size in MB (2000: 2 GB)")
    parser.add_argument("--dim", type=int, default=256, help="floats per row")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", type=int, default=0, help="rows (instead of --mb)")
    parser.add_argument("--batch", type=int, default=4096, help="rows per safetensors shard")
    parser.add_argument("--kv", action="store_true", help="KV mode: a row per name")
    parser.add_argument("--cold", action="store_true", help="reads start from a cold page cache")
    parser.add_argument(
        "--partitions", type=int, default=0, help="the frame's partitions (default: 250 MB each)"
    )
    parser.add_argument(
        "--only", choices=("read", "write"), help="time only reads or writes (both run once)"
    )
    args = parser.parse_args()
    row_bytes = 4 * args.dim + 16
    rows = args.rows or int(args.mb * 1e6 / row_bytes)
    work = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    try:
        source(work / "source", rows, args.dim)
        spark = session()
        from pyspark import StorageLevel

        partitions = args.partitions or max(2, round(rows * row_bytes / 250e6))
        frame = spark.read.parquet(str(work / "source")).repartition(partitions)
        if args.kv:
            frame = frame.selectExpr("concat('k', label) as name", "*")
        frame.persist(StorageLevel.DISK_ONLY)  # a heap of 3 GB holds no 2 GB frame
        frame.count()

        def write_parquet() -> None:
            frame.write.mode("overwrite").parquet(str(work / "parquet"))

        def write_safetensors() -> None:
            writer = frame.write.format("safetensors")
            if args.kv:
                writer = writer.option("name_col", "name")
            else:
                writer = writer.option("batch_size", args.batch)
            writer.mode("overwrite").save(str(work / "safetensors"))

        def read_parquet() -> None:
            if args.cold:
                drop_cached(work / "parquet")
            spark.read.parquet(str(work / "parquet")).write.format("noop").mode("overwrite").save()

        def read_from(name: str) -> Callable[[], None]:
            def read_safetensors() -> None:
                if args.cold:
                    drop_cached(work / name)
                spark.read.format("safetensors").load(str(work / name)).write.format("noop").mode(
                    "overwrite"
                ).save()

            return read_safetensors

        variants: dict[str, dict[str, Callable[[], None]]] = {
            "write": {"safetensors": write_safetensors, "parquet": write_parquet},
            "read": {"safetensors": read_from("safetensors"), "parquet": read_parquet},
        }
        if args.only:
            variants = {args.only: variants[args.only]}
        for warm_up in (write_safetensors, write_parquet, read_from("safetensors"), read_parquet):
            warm_up()  # the source cached, Python workers started, both readers run once
        if args.kv and "read" in variants:
            without_layouts(work / "safetensors", work / "parsed")
            variants["read"]["parsed"] = read_from("parsed")
            read_from("parsed")()
        jvm = spark.sparkContext._gateway.proc.pid
        times: dict[str, list[float]] = {}
        cpu: dict[str, list[float]] = {}
        before = load()
        for round_ in range(args.rounds):
            for name, runs in variants.items():
                order = [(f"{name} {variant}", run) for variant, run in runs.items()]
                turn = round_ % len(order)
                for label, run in order[turn:] + order[:turn]:  # each first in turn
                    spent = cpu_seconds(jvm)
                    began = time.perf_counter()
                    run()
                    times.setdefault(label, []).append(time.perf_counter() - began)
                    cpu.setdefault(label, []).append(cpu_between(spent, cpu_seconds(jvm)))
        total = rows * row_bytes
        print(
            f"{'KV mode, ' if args.kv else ''}"
            f"{rows} rows x {args.dim} floats, {total / 1e6:.0f} MB, {args.rounds} rounds, "
            f"{partitions} partitions, local[2], {'cold' if args.cold else 'warm'} page cache; "
            "load average before "
            f"{before}, after {load()}"
        )
        print(f"{'variant':<20} {'seconds':>8} {'MB/s':>8} {'CPU s':>8}")
        for label, seconds in times.items():
            median = statistics.median(seconds)
            used = statistics.median(cpu[label])
            print(f"{label:<20} {median:8.2f} {total / median / 1e6:8.0f} {used:8.2f}")
        for name, runs in variants.items():
            for ours_, theirs_ in [pair for pair in COMPARED if set(pair) <= set(runs)]:
                for what, figures in (("time", times), ("CPU time", cpu)):
                    mine, other = figures[f"{name} {ours_}"], figures[f"{name} {theirs_}"]
                    ratio = [a / b for a, b in zip(mine, other, strict=True) if b]
                    if ratio:
                        rounds = " ".join(f"{r:.2f}" for r in ratio)
                        print(
                            f"{name}: {ours_} / {theirs_} {statistics.median(ratio):.2f}x the "
                            f"{what} (paired median, range {min(ratio):.2f}-{max(ratio):.2f}; "
                            f"rounds {rounds})"
                        )
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
