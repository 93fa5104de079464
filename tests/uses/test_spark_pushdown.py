"""Filters are not pushed down: ``filter_pushdown=true`` is refused before any task runs.

It planned, of a KV dataset with ``_tensor_index.parquet``, only the shards the index listed for
the names a ``where`` kept. Spark (up to 4.3 at least) keeps the partitions a pushing plan made
on the DataFrame's relation and reuses them for its later queries that push no filter: after
``df.where(df.name == "a").collect()``, ``df.count()`` read the one shard holding "a". No hook
tells a Python source that a plan is reused, so no narrowing is safe.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")

from pyspark.sql import functions as F

import pyspark_safetensors
import stream_st
from pyspark_safetensors._write import SafetensorsWriter, WriteOptions

from .test_spark_kv import SCHEMA, batch

TASKS = [["a", "b"], ["c", "d"], ["ca", "e"]]
"""A shard per task."""

NAMES = sorted(name for task in TASKS for name in task)


def write(path: Path) -> None:
    """:data:`TASKS` written as a KV dataset with its index."""
    parsed = WriteOptions.parse(
        {"path": str(path), "name_col": "name", "generate_index": "true"}, SCHEMA
    )
    writer = SafetensorsWriter(parsed, overwrite=True)
    writer.commit([writer.write(iter([batch(names)])) for names in TASKS])


REFUSED = "option filter_pushdown is refused: Spark reuses the partitions"


def test_filter_pushdown_is_refused_before_any_task(tmp_path: Path) -> None:
    write(tmp_path)
    source = pyspark_safetensors.SafetensorsDataSource(
        {"path": str(tmp_path), "filter_pushdown": "true"}
    )
    with pytest.raises(stream_st.UsageError, match=REFUSED):
        source.schema()
    every = pyspark_safetensors.SafetensorsDataSource({"path": str(tmp_path)})
    with pytest.raises(stream_st.UsageError, match=REFUSED):
        source.reader(every.schema())


@pytest.fixture
def pushdown(spark: Any) -> Iterator[Any]:
    """The session with Python filter pushdown on."""
    conf = "spark.sql.python.filterPushdown.enabled"
    spark.conf.set(conf, "true")
    yield spark
    spark.conf.unset(conf)


def test_every_query_on_one_dataframe_reads_every_row(pushdown: Any, tmp_path: Path) -> None:
    """After a filtered query, the DataFrame's queries that push no filter read only the
    shards the first one planned (one row of six, for ``count()``)."""
    write(tmp_path)
    with pytest.raises(Exception, match=re.escape(REFUSED)):
        pushdown.read.format("safetensors").option("filter_pushdown", "true").load(str(tmp_path))
    frame = pushdown.read.format("safetensors").load(str(tmp_path))
    assert [row.name for row in frame.where(F.col("name") == "c").collect()] == ["c"]
    assert sorted(row.name for row in frame.collect()) == NAMES
    assert frame.count() == len(NAMES)
    assert sorted(row.name for row in frame.where(F.col("name").rlike("^c")).collect()) == [
        "c",
        "ca",
    ]
