"""Filters on the KV key pushed down through ``_tensor_index.parquet`` (``filter_pushdown=true``).

A pushed filter only narrows the shards planned: the rows read are the ones a read of every
shard gives, filtered afterwards, and a shard the index says holds no matching key is never
opened (a shard deleted after the write shows it). Without an index, or with one that does not
list the dataset's shards as they are, every shard is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark")
pc = pytest.importorskip("pyarrow.compute")
pq = pytest.importorskip("pyarrow.parquet")

from pyspark.sql import functions as F  # noqa: E402
from pyspark.sql.datasource import (  # noqa: E402
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    In,
    StringStartsWith,
)

import pyspark_safetensors  # noqa: E402
from pyspark_safetensors._write import SafetensorsWriter, WriteOptions  # noqa: E402

from .test_spark_kv import SCHEMA, batch, shards  # noqa: E402

TASKS = [["a", "b"], ["c", "d"], ["ca", "e"]]
"""A shard per task."""


def write(path: Path, **options: str) -> list[Path]:
    """:data:`TASKS` written as a KV dataset with its index; its shards, in the tasks' order."""
    parsed = WriteOptions.parse(
        {"path": str(path), "name_col": "name", "generate_index": "true", **options}, SCHEMA
    )
    writer = SafetensorsWriter(parsed, overwrite=True)
    writer.commit([writer.write(iter([batch(names)])) for names in TASKS])
    return shards(path)


def planned(path: Path, filters: list[Filter], **options: str) -> tuple[list[Any], set[str]]:
    """The rows a pushing read of ``path`` gives after ``filters`` were pushed (all of which
    it must hand back), and the shards it plans."""
    options = {"path": str(path), "filter_pushdown": "true", **options}
    source = pyspark_safetensors.SafetensorsDataSource(options)
    reader: Any = source.reader(source.schema())
    assert list(reader.pushFilters(filters)) == filters
    rows = []
    for partition in reader.partitions():
        for part in reader.read(partition):
            rows += part.to_pylist()
    shards = {Path(p.address).name for group in reader.groups for p in group}
    return rows, shards


@pytest.mark.parametrize(
    ("filters", "names", "shards"),
    [
        ([EqualTo(("name",), "c")], {"c"}, {1}),
        ([EqualNullSafe(("name",), "c")], {"c"}, {1}),
        ([In(("name",), ("a", "e", None))], {"a", "e"}, {0, 2}),
        ([StringStartsWith(("name",), "c")], {"c", "ca"}, {1, 2}),
        ([StringStartsWith(("name",), "c"), EqualTo(("name",), "ca")], {"ca"}, {2}),
        ([EqualTo(("name",), "z")], set(), set()),
        ([EqualTo(("n",), 1), GreaterThan(("name",), "c")], None, {0, 1, 2}),
    ],
)
def test_filters_on_the_name_plan_only_the_shards_holding_it(
    tmp_path: Path, filters: list[Filter], names: set[str] | None, shards: set[int]
) -> None:
    files = write(tmp_path)
    rows, kept = planned(tmp_path, filters)
    assert kept == {files[i].name for i in shards}
    everything = {name for task in TASKS for name in task}
    assert {row["name"] for row in rows} >= (everything if names is None else names)
    assert all(row["name"] in everything for row in rows)


def test_a_row_per_tensor_is_planned_by_its_key(tmp_path: Path) -> None:
    files = write(tmp_path)
    _, kept = planned(tmp_path, [EqualTo(("tensor_key",), "d__x")], raw="true")
    assert kept == {files[1].name}


def test_nothing_is_pushed_without_an_index_that_lists_the_shards_as_they_are(
    tmp_path: Path,
) -> None:
    files = write(tmp_path, generate_index="false")
    everything = {f.name for f in files}
    assert planned(tmp_path, [EqualTo(("name",), "c")])[1] == everything
    write(tmp_path)
    index = next((tmp_path / "_tensor_index.parquet").iterdir())
    table = pq.read_table(index)
    pq.write_table(table.filter(pc.field("tensor_key") != "c__x"), index)  # "c" seems gone
    assert planned(tmp_path, [EqualTo(("name",), "c")])[1] == {f.name for f in shards(tmp_path)}


@pytest.fixture
def pushdown(spark: Any) -> Iterator[Any]:
    """The session with Python filter pushdown on."""
    conf = "spark.sql.python.filterPushdown.enabled"
    spark.conf.set(conf, "true")
    yield spark
    spark.conf.unset(conf)


def test_spark_reads_the_rows_a_filtered_read_gives_from_fewer_shards(
    pushdown: Any, tmp_path: Path
) -> None:
    files = write(tmp_path)
    reader = pushdown.read.format("safetensors").option("name_col", "name")
    every = reader.load(str(tmp_path))
    wheres = [F.col("name") == "c", F.col("name").isin("a", "e"), F.col("name").startswith("c")]
    expected = [sorted(map(tuple, every.where(where).collect())) for where in wheres]
    files[0].unlink()  # holds "a": only the isin read opens it
    pushing = reader.option("filter_pushdown", "true").load(str(tmp_path))
    assert sorted(map(tuple, pushing.where(wheres[0]).collect())) == expected[0]
    assert sorted(map(tuple, pushing.where(wheres[2]).collect())) == expected[2]
    with pytest.raises(Exception, match=re.escape(files[0].name)):
        pushing.where(wheres[1]).collect()


def test_spark_without_pushdown_on_says_which_conf_it_needs(spark: Any, tmp_path: Path) -> None:
    write(tmp_path)
    reader = spark.read.format("safetensors").option("name_col", "name")
    assert len(reader.load(str(tmp_path)).where(F.col("name") == "c").collect()) == 1
    pushing = reader.option("filter_pushdown", "true").load(str(tmp_path))
    with pytest.raises(Exception, match=re.escape("spark.sql.python.filterPushdown.enabled")):
        pushing.where(F.col("name") == "c").collect()
