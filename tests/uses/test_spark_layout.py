"""What the Spark data source leaves on disk: an index Spark's parquet reader reads, and no staging
left by a driver killed in the middle of a write once the next write commits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pq = pytest.importorskip("pyarrow.parquet")

from pyspark.sql import DataFrame  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def labelled(spark: Any, rows: int) -> DataFrame:
    data = [(i, [float(i)] * 2) for i in range(rows)]
    out: DataFrame = spark.createDataFrame(data, "label int, x array<float>").coalesce(1)
    return out


def test_the_index_is_a_parquet_directory_spark_reads(spark: Any, tmp_path: Path) -> None:
    labelled(spark, 6).write.format("safetensors").option("batch_size", 4).option(
        "generate_index", "true"
    ).mode("overwrite").save(str(tmp_path))
    index = tmp_path / "_tensor_index.parquet"
    assert index.is_dir()
    table = spark.read.parquet(str(index))
    assert table.dtypes == [
        ("tensor_key", "string"),
        ("file_name", "string"),
        ("shape", "array<int>"),
        ("dtype", "string"),
    ]
    rows = sorted(tuple(r) for r in table.select("tensor_key", "shape", "dtype").collect())
    assert rows == [
        ("label", [2], "I32"),
        ("label", [4], "I32"),
        ("x", [2, 2], "F32"),
        ("x", [4, 2], "F32"),
    ]
    shards = {p.name for p in tmp_path.glob("part-*.safetensors")}
    assert {r.file_name for r in table.collect()} == shards
    assert pq.read_table(index).num_rows == 4  # pyarrow reads the directory too
    # an index written as one file (earlier versions) is replaced by the directory
    for part in index.iterdir():
        part.unlink()
    index.rmdir()
    pq.write_table(_one_row(), index)
    labelled(spark, 4).write.format("safetensors").option("batch_size", 4).option(
        "generate_index", "true"
    ).mode("overwrite").save(str(tmp_path))
    assert index.is_dir() and spark.read.parquet(str(index)).count() == 2
    # written without the option: no index is left to go stale
    labelled(spark, 4).write.format("safetensors").option("batch_size", 4).mode("append").save(
        str(tmp_path)
    )
    assert not index.exists()


def _one_row() -> Any:
    import pyarrow as pa

    return pa.table({"tensor_key": ["stale"]})


DRIVER = """
import os, sys, time
from pyspark.sql import SparkSession
from pyspark.sql.functions import udf

spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.ui.enabled", "false")
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.sql.execution.arrow.maxRecordsPerBatch", "2")
    .config("spark.sql.execution.python.udf.maxRecordsPerBatch", "2")
    .getOrCreate()
)

def stall(label):
    if label == 6:  # shards of labels 0-3 are staged by now: wait to be killed
        time.sleep(600)
    return bytearray(70_000)  # more than a Python worker buffers: each row goes on at once

frame = spark.range(8).selectExpr("cast(id as int) as label").coalesce(1)
frame = frame.withColumn("padding", udf(stall, "binary", useArrow=False)("label"))
writer = frame.write.format("safetensors").option("batch_size", 2).option("columns", "label")
writer.mode("overwrite").save(sys.argv[1])
"""


def test_staging_left_by_a_killed_driver_goes_with_the_next_write(
    spark: Any, tmp_path: Path
) -> None:
    target = tmp_path / "ds"
    labelled(spark, 4).write.format("safetensors").option("batch_size", 2).mode("overwrite").save(
        str(target)
    )
    env = {
        **os.environ,
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "SPARK_LOCAL_IP": "127.0.0.1",
    }
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(DRIVER))
    driver = subprocess.Popen(
        [sys.executable, str(script), str(target)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # the driver, its JVM and Python workers: one group to kill
    )
    try:
        deadline = time.monotonic() + 240
        staged: list[Path] = []
        while len(staged) < 2 and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.5)
            staged = list(target.glob("_temporary/*/part-*.safetensors"))
        assert len(staged) >= 2, "the killed driver staged no shard"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()
    assert staged[0].exists()  # left behind: no abort ran
    labelled(spark, 4).write.format("safetensors").option("batch_size", 2).mode("overwrite").save(
        str(target)
    )
    assert not (target / "_temporary").exists()
    assert sorted(p.name for p in target.iterdir() if not p.name.startswith("part-")) == [
        "dataset_manifest.json"
    ]
