"""The Spark data source on a real local Spark session (``local[2]``), one for the whole run.

Writes and reads in both modes, every tail and duplicate strategy, the shards checked with the
reference ``safetensors`` and ``open_stream``, a task failing mid-write, an S3 destination (moto).
"""

from __future__ import annotations

import glob
import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from pyspark.sql import DataFrame  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

import stream_st  # noqa: E402
from stream_st.integrations.dataset import describe_dataset, plan_pieces, read_piece  # noqa: E402

from ..servers.http_server import RangeHTTPServer  # noqa: E402
from ..servers.s3_server import MotoS3Server  # noqa: E402
from .conftest import BUCKET  # noqa: E402

TENSOR = "struct<data: binary, shape: array<int>, dtype: string>"
SEED_FIELDS = {"format_version", "safetensors_version", "total_samples", "total_bytes", "shards"}
SHARD_FIELDS = {"shard_path", "samples_count", "bytes"}
KV_SHARD_FIELDS = SHARD_FIELDS | {"kv_rows"}  # where a KV shard's rows lie, an extra field


def frame(spark: Any, data: list[Any], schema: str, partitions: int) -> DataFrame:
    """``data`` in ``partitions`` partitions, in order (consecutive rows share one)."""
    rows = spark.sparkContext.parallelize(data, partitions)
    out: DataFrame = spark.createDataFrame(rows, schema)
    return out


def images(spark: Any, rows: int, partitions: int = 2) -> DataFrame:
    """``rows`` rows: an image-like tensor struct (U8 [2, 3]), a label and an array column."""
    data = [
        (
            (bytearray(np.full((2, 3), i, np.uint8).tobytes()), [2, 3], "U8"),
            i,
            [float(i), float(-i)],
        )
        for i in range(rows)
    ]
    return frame(spark, data, f"image {TENSOR}, label long, pair array<double>", partitions)


def manifest(path: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((path / "dataset_manifest.json").read_text())
    return document


def labels_of(path: Path) -> list[int]:
    """Every label in the dataset, through the reference safetensors, shard by shard."""
    out: list[int] = []
    for shard in manifest(path)["shards"]:
        out += load_file(str(path / shard["shard_path"]))["label"].tolist()
    return out


def check_layout(path: Path) -> None:
    """The manifest has seed 003's fields (a KV shard's entry may add where its rows lie), and
    every shard is there and as large as it says."""
    document = manifest(path)
    assert document.keys() >= SEED_FIELDS and "schema" in document
    assert document["format_version"] == "1.0" and document["safetensors_version"] == "1.0"
    names = sorted(p.name for p in path.iterdir())
    shards = [s["shard_path"] for s in document["shards"]]
    assert all(SHARD_FIELDS <= set(s) <= KV_SHARD_FIELDS for s in document["shards"])
    assert all((path / s["shard_path"]).stat().st_size == s["bytes"] for s in document["shards"])
    assert document["total_bytes"] == sum(s["bytes"] for s in document["shards"])
    assert document["total_samples"] == sum(s["samples_count"] for s in document["shards"])
    extra = {"dataset_manifest.json", "_tensor_index.parquet"}
    assert sorted(set(names) - extra) == sorted(shards)  # no staging, nothing else
    for name in shards:
        part, task, shard, *tag = name.removesuffix(".safetensors").split("-")
        assert (part, len(task), len(shard), len("-".join(tag))) == ("part", 5, 4, 36)


@pytest.mark.parametrize(("tail", "expected"), [("drop", 8), ("pad", 12), ("write", 10)])
def test_batch_mode_tail_strategies(spark: Any, tmp_path: Path, tail: str, expected: int) -> None:
    images(spark, 10, partitions=1).write.format("safetensors").option("batch_size", 4).option(
        "tail_strategy", tail
    ).mode("overwrite").save(str(tmp_path))
    check_layout(tmp_path)
    document = manifest(tmp_path)
    assert document["total_samples"] == expected
    assert document["schema"] == {
        "image": {"dtype": "U8", "shape": [4, 2, 3], "spark_type": TENSOR.replace(" ", "")},
        "label": {"dtype": "I64", "shape": [4], "spark_type": "bigint"},
        "pair": {"dtype": "F64", "shape": [4, 2], "spark_type": "array<double>"},
    }
    labels = labels_of(tmp_path)
    assert sorted(labels[:8]) == list(range(8))
    assert labels[8:] == {"drop": [], "pad": [8, 9, 0, 0], "write": [8, 9]}[tail]


def test_batch_round_trip_through_spark_and_stream_st(spark: Any, tmp_path: Path) -> None:
    images(spark, 25).write.format("safetensors").option("batch_size", 5).mode("overwrite").save(
        str(tmp_path)
    )
    check_layout(tmp_path)
    back = spark.read.format("safetensors").load(str(tmp_path))
    assert back.schema.simpleString() == images(spark, 0).schema.simpleString()
    rows = back.collect()
    assert len(rows) == 25
    by_label = {r.label: r for r in rows}
    assert sorted(by_label) == list(range(25))
    row = by_label[7]
    assert (row.image.shape, row.image.dtype) == ([2, 3], "U8")
    assert np.frombuffer(row.image.data, np.uint8).tolist() == [7] * 6
    assert row.pair == [7.0, -7.0]
    # open_stream reads the manifest as one stream of every shard's tensors
    arrays = anyio.run(
        lambda: _collect(stream_st.open_stream(str(tmp_path / "dataset_manifest.json")))
    )
    assert sorted(np.concatenate(arrays["label"]).tolist()) == list(range(25))


async def _collect(stream: Any) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    async for name, array in stream:
        out.setdefault(name, []).append(array)
    return out


def test_read_prunes_columns_and_splits_large_shards(spark: Any, tmp_path: Path) -> None:
    images(spark, 40, partitions=1).write.format("safetensors").option("batch_size", 40).mode(
        "overwrite"
    ).save(str(tmp_path))
    reader = spark.read.format("safetensors").option("columns", "label")
    back = reader.option("max_partition_mb", 1).load(str(tmp_path))
    assert back.columns == ["label"]
    labels = sorted(r.label for r in back.collect())
    assert labels == list(range(40))
    # one shard: a piece per row range, each reading only its rows of the selected tensor
    dataset = anyio.run(describe_dataset, str(tmp_path))
    pieces = plan_pieces(dataset, ["label"], max_bytes=80)
    assert [(p.start, p.stop) for p in pieces] == [(i, i + 10) for i in range(0, 40, 10)]
    assert anyio.run(read_piece, pieces[1])["label"].tolist() == list(range(10, 20))


def kv_frame(spark: Any, names: list[str], partitions: int = 1) -> DataFrame:
    """A row per name: ``emb`` (3 x its position) and ``n`` (its position)."""
    data = [(name, [float(i)] * 3, i) for i, name in enumerate(names)]
    return frame(spark, data, "name string, emb array<float>, n int", partitions)


def test_kv_mode_round_trip_rolls_shards_and_writes_the_index(spark: Any, tmp_path: Path) -> None:
    names = [f"doc{i}" for i in range(6)]
    kv_frame(spark, names).write.format("safetensors").option("name_col", "name").option(
        "generate_index", "true"
    ).option("dtype", "emb:F16").mode("overwrite").save(str(tmp_path))
    check_layout(tmp_path)
    shard = manifest(tmp_path)["shards"][0]["shard_path"]
    arrays = load_file(str(tmp_path / shard))
    assert arrays["doc2__emb"].tolist() == [2.0] * 3 and arrays["doc2__emb"].dtype == np.float16
    assert arrays["doc2__n"].tolist() == 2 and arrays["doc2__n"].shape == ()
    index = pq.read_table(tmp_path / "_tensor_index.parquet").to_pylist()
    assert {r["tensor_key"] for r in index} == {f"{n}__{c}" for n in names for c in ("emb", "n")}
    assert index[0].keys() == {"tensor_key", "file_name", "shape", "dtype"}
    raw = spark.read.format("safetensors").option("raw", "true").load(str(tmp_path)).collect()
    assert {r.tensor_key for r in raw} == {f"{n}__{c}" for n in names for c in ("emb", "n")}
    emb = next(r.tensor for r in raw if r.tensor_key == "doc4__emb")
    assert (emb.dtype, emb.shape, np.frombuffer(emb.data, np.float16).tolist()) == (
        "F16",
        [3],
        [4.0] * 3,
    )


def test_kv_shards_roll_over_at_the_target_size(spark: Any, tmp_path: Path) -> None:
    # 20 MB tensors made by Spark itself; 50 MB (the smallest target) holds two of them
    size = 20_000_000
    rows = spark.range(5).selectExpr(
        "concat('k', id) as name",
        f"struct(cast(repeat('a', {size}) as binary) as data, array({size}) as shape, "
        "'U8' as dtype) as t",
    )
    rows.coalesce(1).write.format("safetensors").option("name_col", "name").option(
        "target_shard_size_mb", 50
    ).option("kv_separator", "/").mode("overwrite").save(str(tmp_path))
    check_layout(tmp_path)
    shards = manifest(tmp_path)["shards"]
    assert [s["samples_count"] for s in shards] == [2, 2, 1]
    header = anyio.run(stream_st.read_header, str(tmp_path / shards[0]["shard_path"]))
    assert header.names() == ["k0/t", "k1/t"]


def kv_contents(path: Path) -> dict[str, tuple[str, Any]]:
    """Every key of a KV dataset -> (its shard, its value), through the reference safetensors;
    a key in two shards fails."""
    out: dict[str, tuple[str, Any]] = {}
    for shard in manifest(path)["shards"]:
        for key, array in load_file(str(path / shard["shard_path"])).items():
            assert key not in out, f"{key} is in two shards"
            out[key] = (shard["shard_path"], array.tolist())
    return out


def index_rows(path: Path) -> list[tuple[str, str]]:
    rows = pq.read_table(path / "_tensor_index.parquet").to_pylist()
    return sorted((row["tensor_key"], row["file_name"]) for row in rows)


def kv_writer(data: DataFrame, strategy: str) -> Any:
    writer = data.write.format("safetensors").option("name_col", "name")
    return writer.option("duplicatesStrategy", strategy).option("generate_index", "true")


def test_duplicate_keys_fail_in_a_task_across_tasks_and_on_append(
    spark: Any, tmp_path: Path
) -> None:
    with pytest.raises(Exception, match="'a__emb' is written twice"):
        kv_writer(kv_frame(spark, ["a", "b", "a"]), "fail").mode("overwrite").save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == []
    # partitions [a, b] and [a, c]: two tasks, one key; refused at the commit
    across = kv_frame(spark, ["a", "b", "a", "c"], partitions=2)
    with pytest.raises(Exception, match="'a__emb' is written twice"):
        kv_writer(across, "fail").mode("overwrite").save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == []
    kv_writer(kv_frame(spark, ["x", "y"]), "fail").mode("overwrite").save(str(tmp_path))
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(Exception, match="'y__emb' is written twice"):
        kv_writer(kv_frame(spark, ["y"]), "fail").mode("append").save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == before
    check_layout(tmp_path)


def test_last_win_leaves_one_copy_of_every_key(spark: Any, tmp_path: Path) -> None:
    # partitions [a, b] and [a, c]: the second task's a wins; the first shard is rewritten
    across = kv_frame(spark, ["a", "b", "a", "c"], partitions=2)
    kv_writer(across, "lastWin").mode("overwrite").save(str(tmp_path))
    check_layout(tmp_path)  # the superseded shard is gone, nothing staged is left
    contents = kv_contents(tmp_path)
    assert {key: value for key, (_, value) in contents.items()} == {
        "a__emb": [2.0] * 3,
        "a__n": 2,
        "b__emb": [1.0] * 3,
        "b__n": 1,
        "c__emb": [3.0] * 3,
        "c__n": 3,
    }
    assert index_rows(tmp_path) == sorted((key, shard) for key, (shard, _) in contents.items())
    assert [s["samples_count"] for s in manifest(tmp_path)["shards"]] == [1, 2]  # b; a and c
    (first, _), (second, _) = contents["b__n"], contents["c__n"]
    assert first.startswith("part-00000-0000-") and second.startswith("part-00001-0000-")
    # appending b again: the shard that held only b is dropped, not left behind
    kv_writer(kv_frame(spark, ["b", "d"]), "lastWin").mode("append").save(str(tmp_path))
    check_layout(tmp_path)
    contents = kv_contents(tmp_path)
    assert first not in os.listdir(tmp_path) and contents["b__n"][1] == 0
    assert sorted(contents) == [f"{k}__{c}" for k in "abcd" for c in ("emb", "n")]
    assert index_rows(tmp_path) == sorted((key, shard) for key, (shard, _) in contents.items())
    assert manifest(tmp_path)["total_samples"] == 4
    back = spark.read.format("safetensors").load(str(tmp_path)).collect()
    assert [(r.name, r.n) for r in back] == [("a", 2), ("c", 3), ("b", 0), ("d", 1)]


def _fail_on_label(label: int) -> int:
    if label == 13:
        raise RuntimeError("injected failure")
    return label


def test_failed_task_leaves_nothing(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql.functions import udf

    fail = udf(_fail_on_label, "long", useArrow=False)
    frame = images(spark, 30).withColumn("label", fail("label"))
    writer = frame.write.format("safetensors").option("batch_size", 2).mode("overwrite")
    with pytest.raises(Exception, match="injected failure"):
        writer.save(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == []  # no shard, no manifest, no staging


PADDING = 70_000
"""Bytes of a UDF's value: more than the 64 KiB a Python worker buffers its results in, so that
each row reaches the writer as soon as it is made."""


def _crash_first_attempt(directory: str, seen: str) -> Any:
    """A UDF body (label -> a padding tensor) that kills the first attempt of the task holding
    label 13 (its Python worker exits) once that attempt has staged a shard, after noting in
    ``seen`` what it staged; the retry goes through."""

    def padding(label: int) -> tuple[bytearray, list[int], str]:
        from pyspark import TaskContext

        context = TaskContext.get()
        if label == 13 and context is not None and context.attemptNumber() == 0:
            deadline = time.monotonic() + 10
            staged: list[str] = []
            while not staged and time.monotonic() < deadline:
                staged = glob.glob(f"{directory}/_temporary/*/part-00000-*")
                time.sleep(0.05)
            Path(seen).write_text(json.dumps([os.path.basename(p) for p in staged]))
            os._exit(1)
        return bytearray(PADDING), [PADDING], "U8"

    return padding


def test_a_retried_task_commits_only_its_successful_attempt(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql.functions import udf

    target, seen = tmp_path / "ds", tmp_path / "seen.json"
    crash = udf(_crash_first_attempt(str(target), str(seen)), TENSOR, useArrow=False)
    data = images(spark, 30).withColumn("padding", crash("label"))  # labels 0-14 in task 0
    data.write.format("safetensors").option("batch_size", 2).mode("overwrite").save(str(target))
    check_layout(target)  # nothing staged is left
    assert sorted(labels_of(target)) == list(range(30))  # every row once
    first_attempt = json.loads(seen.read_text())
    assert first_attempt, "the first attempt staged no shard before it was killed"
    shards = [s["shard_path"] for s in manifest(target)["shards"]]
    tags = {name.split("-", 3)[3] for name in shards if name.startswith("part-00000-")}
    assert len(tags) == 1 and not set(first_attempt) & set(shards)  # the retry's shards only


def test_checksums_and_reading_over_http(spark: Any, tmp_path: Path) -> None:
    images(spark, 12).write.format("safetensors").option("batch_size", 4).option(
        "checksums", "true"
    ).mode("overwrite").save(str(tmp_path))
    shard = tmp_path / manifest(tmp_path)["shards"][0]["shard_path"]
    header = anyio.run(stream_st.read_header, str(shard))
    assert header.metadata["stream_st.digest"] == "xxh3-128" and len(header.metadata) == 4
    assert len(load_file(str(shard))["label"]) == 4  # an ordinary safetensors file
    with RangeHTTPServer() as server:
        for path in tmp_path.iterdir():
            server.objects[f"/ds/{path.name}"] = path.read_bytes()
        # a directory URL cannot be listed: its manifest is read
        back = spark.read.format("safetensors").load(server.url("/ds")).collect()
        assert sorted(r.label for r in back) == list(range(12))
        damaged = bytearray(shard.read_bytes())
        damaged[header.data_start + header["label"].start] ^= 1
        server.objects[f"/ds/{shard.name}"] = bytes(damaged)
        reader = spark.read.format("safetensors").option("columns", "label")
        with pytest.raises(Exception, match=r"'label' .* does not match its xxh3-128 digest"):
            reader.load(server.url("/ds/dataset_manifest.json")).collect()
        with pytest.raises(Exception, match=r"dataset_manifest\.json"):
            spark.read.format("safetensors").load(server.url("/elsewhere")).collect()
    with pytest.raises(Exception, match="unknown digest algorithm 'md5'"):
        images(spark, 4, 1).write.format("safetensors").option("batch_size", 4).option(
            "checksums", "md5"
        ).mode("overwrite").save(str(tmp_path / "md5"))


def test_overwrite_replaces_and_append_extends(spark: Any, tmp_path: Path) -> None:
    def write(rows: int, mode: str) -> None:
        images(spark, rows, partitions=1).write.format("safetensors").option("batch_size", 5).mode(
            mode
        ).save(str(tmp_path))

    write(10, "overwrite")
    write(5, "append")
    check_layout(tmp_path)
    assert manifest(tmp_path)["total_samples"] == 15 and len(manifest(tmp_path)["shards"]) == 3
    write(5, "overwrite")
    check_layout(tmp_path)
    assert manifest(tmp_path)["total_samples"] == 5 and len(list(tmp_path.iterdir())) == 2


def test_an_append_under_another_type_is_refused(spark: Any, tmp_path: Path) -> None:
    """The earlier shards were read cast to the append's types (0.5 as 0, 2**40 as 0); the job
    is aborted and leaves nothing (``test_spark_shards_alike.py`` has more)."""
    written = [(0.5, 2**40), (1.7, 3)]
    frame(spark, written, "x double, n bigint", 1).write.format("safetensors").option(
        "batch_size", 10
    ).mode("overwrite").save(str(tmp_path))
    with pytest.raises(Exception, match="column 'x' of the dataset is double"):
        frame(spark, [(7, 8)], "x int, n int", 1).write.format("safetensors").option(
            "batch_size", 10
        ).mode("append").save(str(tmp_path))
    check_layout(tmp_path)  # no staging left
    assert [tuple(r) for r in spark.read.format("safetensors").load(str(tmp_path)).collect()] == (
        written
    )


def test_explicit_registration_reads_what_stream_st_wrote(spark: Any, tmp_path: Path) -> None:
    import pyspark_safetensors

    async def write() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            await writer.write_batch({"x": np.arange(4.0), "y": np.ones((4, 2), np.int8)}, 4)

    anyio.run(write)
    pyspark_safetensors.register(spark)
    assert pyspark_safetensors.DefaultSource.name() == "safetensors"
    back = spark.read.format("safetensors").load(str(tmp_path)).collect()
    # no Spark types recorded: told from the dtypes (F64 [4] a double, I8 [4, 2] byte arrays)
    assert back[0].asDict().keys() == {"x", "y"}
    assert sorted(r.x for r in back) == [0.0, 1.0, 2.0, 3.0]
    assert [r.y for r in back] == [[1, 1]] * 4
    # under another name (beside a JVM source named "safetensors", such as the Scala connector)
    pyspark_safetensors.register(name="stream_st")  # the active session
    named = spark.read.format("stream_st").option("raw", "true").load(str(tmp_path)).collect()
    assert {(r.y.dtype, tuple(r.y.shape)) for r in named} == {("I8", (2,))}


def test_bad_options_are_refused(spark: Any, tmp_path: Path) -> None:
    frame = images(spark, 4, partitions=1)
    with pytest.raises(Exception, match="exactly one of batch_size"):
        frame.write.format("safetensors").mode("overwrite").save(str(tmp_path))
    with pytest.raises(Exception, match="tail_strategy must be one of"):
        frame.write.format("safetensors").option("batch_size", 2).option(
            "tail_strategy", "keep"
        ).mode("overwrite").save(str(tmp_path))


def test_s3_destination_and_source(spark: Any, moto_s3: MotoS3Server) -> None:
    url = f"s3://{BUCKET}/runs/images"
    images(spark, 12).write.format("safetensors").option("batch_size", 3).option(
        "generate_index", "true"
    ).mode("overwrite").save(url)
    client = moto_s3.client()
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket=BUCKET)["Contents"])
    document = json.loads(
        client.get_object(Bucket=BUCKET, Key="runs/images/dataset_manifest.json")["Body"].read()
    )
    shards = [f"runs/images/{s['shard_path']}" for s in document["shards"]]
    index = [key for key in keys if key.startswith("runs/images/_tensor_index.parquet/part-")]
    assert len(index) == 1  # a Spark parquet directory of one file
    assert keys == sorted([*shards, *index, "runs/images/dataset_manifest.json"])
    assert document["total_samples"] == 12
    back = spark.read.format("safetensors").option("columns", "label").load(url).collect()
    assert sorted(r.label for r in back) == list(range(12))
