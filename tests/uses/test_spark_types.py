"""The Spark data source's column types and options, on a real local Spark session.

A DataFrame comes back from ``format("safetensors")`` with the types and rows it was written
with; options are spelled and checked as the Scala connector's; every manifest written is valid
under the layout's manifest schema (``dataset_manifest.schema.json`` here, from seed 003).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("pyspark")
pa = pytest.importorskip("pyarrow")
jsonschema = pytest.importorskip("jsonschema")

from pyspark.sql import DataFrame  # noqa: E402
from pyspark.sql.pandas.types import to_arrow_schema  # noqa: E402
from pyspark.sql.types import (  # noqa: E402
    ArrayType,
    DataType,
    DoubleType,
    IntegerType,
    LongType,
    StructField,
    StructType,
)
from pyspark.testing.utils import assertSchemaEqual  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from pyspark_safetensors._write import SafetensorsWriter, WriteOptions  # noqa: E402
from stream_st import UsageError  # noqa: E402

SCHEMA = json.loads((Path(__file__).parent / "dataset_manifest.schema.json").read_text())
TENSOR = "struct<data: binary, shape: array<int>, dtype: string>"
EVERY_TYPE = (
    "b tinyint, s smallint, i int, l bigint, f float, d double, z boolean, "
    "af array<float>, ad array<array<double>>, ai array<int>, al array<bigint>, "
    f"ab array<boolean>, ab2 array<array<tinyint>>, t {TENSOR}"
)


def manifest(path: Path) -> dict[str, Any]:
    """The dataset's manifest, checked against the layout's manifest schema."""
    document: dict[str, Any] = json.loads((path / "dataset_manifest.json").read_text())
    jsonschema.validate(document, SCHEMA)
    return document


def every_type_rows(count: int) -> list[tuple[Any, ...]]:
    out = []
    for i in range(count):
        sign = -1 if i % 2 else 1
        out.append(
            (
                sign * (i % 128),
                sign * 1000 * i,
                sign * 70_000 * i,
                sign * (2**40 + i),
                sign * (i + 0.5),
                sign * (i / 3),
                i % 3 == 0,
                [float(i), -1.5, math.inf if i == 2 else 0.25],
                [[i * 0.1, 1e300], [-(10.0**-300), 0.0]],
                [i, -i, 2**31 - 1],
                [-(2**63), 2**63 - 1],
                [True, i % 2 == 1],
                [[1, -1], [i, 127], [-128, 0]],
                (bytearray(np.full(4, i, np.uint16).tobytes()), [2, 2], "U16"),
            )
        )
    return out


def frame(spark: Any, data: list[Any], schema: str, partitions: int = 2) -> DataFrame:
    out: DataFrame = spark.createDataFrame(spark.sparkContext.parallelize(data, partitions), schema)
    return out


def test_every_accepted_type_comes_back_as_written(spark: Any, tmp_path: Path) -> None:
    written = frame(spark, every_type_rows(11), EVERY_TYPE)
    written.write.format("safetensors").option("batch_size", 3).mode("overwrite").save(
        str(tmp_path)
    )
    document = manifest(tmp_path)
    assert document["schema"]["z"]["dtype"] == "U8"  # BOOL is not a dtype of the layout
    assert document["schema"]["ab"]["dtype"] == "U8"
    back = spark.read.format("safetensors").load(str(tmp_path))
    assertSchemaEqual(back.schema, written.schema)  # Spark's equality: nullability aside
    text = back.schema.json()
    assert '"nullable":true' not in text and '"containsNull":true' not in text  # no null at all
    # the partitions' shards in order, each shard's rows in order: the rows as written
    assert back.collect() == written.collect()
    raw = spark.read.format("safetensors").option("raw", "true").load(str(tmp_path))
    assert {kind for _, kind in raw.dtypes} == {TENSOR.replace(" ", "")}
    first = raw.first()
    assert first is not None
    assert (first.l.dtype, first.l.shape) == ("I64", [])
    assert (first.ad.dtype, first.ad.shape) == ("F64", [2, 2])
    picked = spark.read.format("safetensors").option("columns", "ai,z").load(str(tmp_path))
    assert picked.collect() == written.select("ai", "z").collect()
    given = spark.read.format("safetensors").schema("ad array<array<double>>, t " + TENSOR)
    assert given.load(str(tmp_path)).collect() == written.select("ad", "t").collect()


def test_kv_mode_gives_every_type_back_a_row_per_name(spark: Any, tmp_path: Path) -> None:
    rows = [(f"k{i}", *row) for i, row in enumerate(every_type_rows(7))]
    written = frame(spark, rows, "name string, " + EVERY_TYPE)
    written.write.format("safetensors").option("name_col", "name").option(
        "target_shard_size_mb", 50
    ).mode("overwrite").save(str(tmp_path))
    assert manifest(tmp_path)["kv"] == {
        "name_col": "name",
        "spark_type": "string",
        "separator": "__",
        "whole_rows": True,
    }
    back = spark.read.format("safetensors").load(str(tmp_path))
    assertSchemaEqual(back.schema, written.schema)
    assert back.collect() == written.collect()  # each shard's names in the order written
    picked = spark.read.format("safetensors").option("columns", "t,l").load(str(tmp_path))
    assert picked.collect() == written.select("name", "t", "l").collect()
    raw = spark.read.format("safetensors").option("raw", "true").load(str(tmp_path))
    assert raw.columns == ["tensor_key", "tensor"] and raw.count() == 7 * 14
    # integer names, rows of different shapes; an append of other names, without some
    # columns: those read as null
    numbered = frame(
        spark, [(i, [-i] * (i + 1), i / 2) for i in range(4)], "id bigint, v array<int>, w double"
    )
    numbered.write.format("safetensors").option("name_col", "id").mode("overwrite").save(
        str(tmp_path / "ids")
    )
    extra = frame(spark, [(9, [9, 9])], "id bigint, v array<int>", 1)
    extra.write.format("safetensors").option("name_col", "id").mode("append").save(
        str(tmp_path / "ids")
    )
    both = spark.read.format("safetensors").load(str(tmp_path / "ids"))
    assert [(f.name, f.nullable) for f in both.schema] == [("id", False), ("v", False), ("w", True)]
    assert [tuple(r) for r in both.collect()] == [
        *((i, [-i] * (i + 1), i / 2) for i in range(4)),
        (9, [9, 9], None),
    ]
    with pytest.raises(Exception, match="kv_separator"):
        extra.write.format("safetensors").option("name_col", "id").option("kv_separator", "/").mode(
            "append"
        ).save(str(tmp_path / "ids"))


def test_casts_and_shapes_come_back_in_the_written_types(spark: Any, tmp_path: Path) -> None:
    data = [([i / 3 + j for j in range(6)], i) for i in range(5)]
    written = frame(spark, data, "x array<double>, n bigint", 1)
    written.write.format("safetensors").option("batch_size", 5).option(
        "dtype", "x:F32,n:I16"
    ).option("shapes", json.dumps({"x": [2, 3]})).mode("overwrite").save(str(tmp_path))
    schema = manifest(tmp_path)["schema"]
    assert (schema["x"]["dtype"], schema["x"]["shape"]) == ("F32", [5, 2, 3])
    assert (schema["n"]["dtype"], schema["n"]["shape"]) == ("I16", [5])
    back = spark.read.format("safetensors").load(str(tmp_path))
    assertSchemaEqual(back.schema, written.schema)
    rows = back.collect()
    assert [r.n for r in rows] == list(range(5))
    expected = [np.float32(v).item() for v in np.asarray([d[0] for d in data]).reshape(-1)]
    assert [v for r in rows for v in r.x] == expected


@pytest.mark.parametrize(
    ("kind", "values", "code", "bad"),
    [
        (IntegerType(), [127, 300], "I8", "300"),
        (IntegerType(), [-128, -200], "I8", "-200"),
        (IntegerType(), [0, -1], "U8", "-1"),
        (LongType(), [0, 2**32], "U32", "4294967296"),
        (DoubleType(), [-2147483648.9, 1e10], "I32", "10000000000.0"),
        (DoubleType(), [1.0, math.nan], "I32", "nan"),
        (DoubleType(), [1.0, -math.inf], "U64", "-inf"),
        (ArrayType(DoubleType()), [[2.5, 255.9], [0.0, 256.0]], "U8", "256.0"),
    ],
)
def test_a_cast_to_an_integer_dtype_refuses_a_value_it_cannot_hold(
    tmp_path: Path, kind: DataType, values: list[Any], code: str, bad: str
) -> None:
    schema = StructType([StructField("x", kind)])
    options = {"path": str(tmp_path / "d"), "batch_size": "1", "dtype": f"x:{code}"}
    writer = SafetensorsWriter(WriteOptions.parse(options, schema), overwrite=True)
    fits = pa.record_batch({"x": pa.array(values[:1], to_arrow_schema(schema).field("x").type)})
    message = writer.write(iter([fits]))  # the first value fits (toward zero)
    rows = pa.record_batch({"x": pa.array(values, to_arrow_schema(schema).field("x").type)})
    with pytest.raises(UsageError, match=rf"column 'x': the value {re.escape(bad)} does not fit"):
        writer.write(iter([rows]))
    writer.abort([message])
    assert not (tmp_path / "d").exists()


@pytest.mark.filterwarnings("error")  # refused, not warned of
@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
def test_an_integer_f16_cannot_hold_is_refused_whichever_the_rounding(
    tmp_path: Path, rounding: str
) -> None:
    """It became an infinity, read back as the smallest bigint (a float keeps IEEE's
    infinity: a float column reads it back as one)."""
    schema = StructType([StructField("c", LongType())])
    options = {"path": str(tmp_path / "d"), "batch_size": "3", "dtype": "F16"}
    writer = SafetensorsWriter(
        WriteOptions.parse({**options, "f16_rounding": rounding}, schema), overwrite=True
    )
    rows = pa.record_batch({"c": pa.array([5, 65504, 70000], pa.int64())})
    with pytest.raises(
        UsageError, match=r"column 'c': the value 70000 does not fit F16 \(it would become an inf"
    ):
        writer.write(iter([rows]))
    writer.abort([])
    assert not (tmp_path / "d").exists()


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("rounding", ["nearest", "truncate"])
@pytest.mark.parametrize("code", ["F32", "F16", "BF16"])
def test_a_float_beyond_the_dtype_becomes_its_infinity_without_a_warning(
    tmp_path: Path, code: str, rounding: str
) -> None:
    """The infinity is the documented result, where numpy's 'overflow encountered in cast'
    RuntimeWarning reached the user."""
    schema = StructType([StructField("x", DoubleType())])
    options = {"path": str(tmp_path), "batch_size": "3", "dtype": code, "f16_rounding": rounding}
    writer = SafetensorsWriter(WriteOptions.parse(options, schema), overwrite=True)
    writer.commit([writer.write(iter([pa.record_batch({"x": pa.array([1.0, 1e300, -1e300])})]))])
    shard = manifest(tmp_path)["shards"][0]["shard_path"]
    assert load_file(str(tmp_path / shard))["x"].astype(np.float64).tolist() == [
        1.0,
        math.inf,
        -math.inf,
    ]


def test_an_empty_frame_writes_one_empty_shard(spark: Any, tmp_path: Path) -> None:
    empty = frame(spark, [], "x array<float>, n int, z boolean", 1)
    empty.write.format("safetensors").option("batch_size", 4).option("shapes", '{"x": [2]}').mode(
        "overwrite"
    ).save(str(tmp_path / "batch"))
    document = manifest(tmp_path / "batch")
    assert document["total_samples"] == 0 and len(document["shards"]) == 1
    assert document["schema"]["x"]["shape"] == [0, 2] and document["schema"]["n"]["shape"] == [0]
    back = spark.read.format("safetensors").load(str(tmp_path / "batch"))
    assertSchemaEqual(back.schema, empty.schema)
    assert back.count() == 0
    # drop leaves no batch of 3 rows: an empty dataset too
    three = frame(spark, [([1.0, 2.0], 1, True)] * 3, "x array<float>, n int, z boolean", 1)
    three.write.format("safetensors").option("batch_size", 4).option("tail_strategy", "DROP").mode(
        "overwrite"
    ).save(str(tmp_path / "batch"))
    assert manifest(tmp_path / "batch")["total_samples"] == 0
    names = frame(spark, [], "name string, v array<int>", 1)
    names.write.format("safetensors").option("name_col", "name").mode("overwrite").save(
        str(tmp_path / "kv")
    )
    document = manifest(tmp_path / "kv")
    assert document["total_samples"] == 0 and len(document["shards"]) == 1
    shard = tmp_path / "kv" / document["shards"][0]["shard_path"]
    assert load_file(str(shard)) == {}
    assert spark.read.format("safetensors").load(str(tmp_path / "kv")).count() == 0


def connector_f16(value: float) -> int:
    """The F16 bits the Scala connector writes for ``value`` (seed 003, section 5.2): the
    value rounded to a float32, whose bits are cut down to F16's without rounding."""
    bits = int(np.array([value], np.float64).astype(np.float32).view(np.uint32)[0])
    sign, exponent, mantissa = bits >> 31, (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exponent == 0xFF:
        return sign << 15 | 0x7C00 | (0x200 if mantissa else 0)
    if exponent == 0:
        return sign << 15
    exponent += 15 - 127
    if exponent >= 0x1F:
        return sign << 15 | 0x7C00
    if exponent <= 0:
        return sign << 15
    return sign << 15 | exponent << 10 | mantissa >> 13


def connector_bf16(value: float) -> int:
    """The BF16 bits the connector writes: the float32's upper half."""
    return int(np.array([value], np.float64).astype(np.float32).view(np.uint32)[0]) >> 16


F16_VALUES = [
    1.0,
    1 / 3,
    2 / 3,
    -0.1,
    3.14159,
    65504.0,
    65519.0,
    65520.0,
    1e6,
    6.0e-5,  # below F16's smallest normal
    6.2e-5,
    1e-40,  # a float32 subnormal
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    1.0 + 2.0**-11,  # halfway: nearest-even and truncation agree
    1.0 + 2.0**-11 + 2.0**-20,  # just past halfway: they differ
]


@pytest.mark.parametrize("code", ["F16", "BF16"])
def test_f16_rounding_truncate_is_the_connectors(spark: Any, tmp_path: Path, code: str) -> None:
    big = 2**53 + 1 if code == "BF16" else 65519  # F16 holds no integer from 65520 up
    data = [(F16_VALUES, big, 7)]
    written = frame(spark, data, "x array<double>, big bigint, small int", 1)
    arrays = {}
    for rounding in ("nearest", "TRUNCATE"):
        out = tmp_path / rounding
        written.write.format("safetensors").option("batch_size", 1).option("dtype", code).option(
            "f16_rounding", rounding
        ).mode("overwrite").save(str(out))
        shard = manifest(out)["shards"][0]["shard_path"]
        arrays[rounding] = {k: v.view(np.uint16) for k, v in load_file(str(out / shard)).items()}
    reference = connector_f16 if code == "F16" else connector_bf16
    truncated = arrays["TRUNCATE"]
    assert truncated["x"][0].tolist() == [reference(v) for v in F16_VALUES]
    assert truncated["big"].tolist() == [reference(float(big))]  # a long goes through a double
    assert truncated["small"].tolist() == [reference(7.0)]
    nearest_type = np.float16 if code == "F16" else ml_dtypes.bfloat16
    with np.errstate(over="ignore"):  # 65520 and 1e6 become F16's infinity
        nearest = np.asarray(F16_VALUES).astype(nearest_type).view(np.uint16)
    assert arrays["nearest"]["x"][0].tolist() == nearest.tolist()  # numpy's rounding
    assert arrays["nearest"]["x"][0].tolist() != truncated["x"][0].tolist()


def _touch(marker: str) -> Any:
    """A UDF body that notes in ``marker`` that a task ran."""

    def touch(value: int) -> int:
        Path(marker).write_text("a task ran")
        return value

    return touch


def test_misuse_is_refused_before_any_task_runs(spark: Any, tmp_path: Path) -> None:
    from pyspark.sql.functions import udf

    marker = tmp_path / "ran"
    touched = udf(_touch(str(marker)), "long", useArrow=False)
    data = spark.range(4).select(touched("id").alias("id"))
    data = data.selectExpr("id", "id as n", "cast(id as string) as name")
    target = str(tmp_path / "out")

    def refused(match: str, **options: Any) -> None:
        writer = data.write.format("safetensors").mode("overwrite")
        for name, value in options.items():
            writer = writer.option(name, value)
        with pytest.raises(Exception, match=match):
            writer.save(target)
        assert not marker.exists(), f"a task ran before {match!r} was refused"
        assert not (tmp_path / "out").exists()

    refused("'name' is string", batch_size=2)
    refused("name_col 'nom' is not a column", name_col="nom")
    refused(
        "target_shard_size_mb must be between 50 and 1000",
        name_col="name",
        **{"target_shard_size_mb": 49},
    )
    refused(
        "target_shard_size_mb must be between 50 and 1000",
        name_col="name",
        **{"target_shard_size_mb": 1001},
    )
    refused("tail_strategy must be one of", batch_size=2, columns="n", tail_strategy="keep")
    refused("duplicatesStrategy must be one of", name_col="name", duplicatesStrategy="first")
    refused("f16_rounding must be one of", batch_size=2, columns="n", f16_rounding="up")
    refused("'BOOL' is not a dtype of the dataset layout", batch_size=2, columns="n", dtype="BOOL")
    refused("option columns: 'm' is not a column", batch_size=2, columns="n,m")
    refused("option shapes", batch_size=2, columns="n", shapes="[1, 2]")
    # the same frame, written: its task runs (the marker can tell)
    data.write.format("safetensors").option("batch_size", 2).option("columns", "id,n").mode(
        "overwrite"
    ).save(target)
    assert marker.exists()
    assert manifest(tmp_path / "out")["schema"].keys() == {"id", "n"}


def test_option_values_are_case_insensitive(spark: Any, tmp_path: Path) -> None:
    data = frame(spark, [("a", 1), ("b", 2), ("a", 3)], "name string, v int", 1)
    data.write.format("safetensors").option("name_col", "name").option(
        "duplicatesStrategy", "LASTWIN"
    ).option("target_shard_size_mb", "50").mode("overwrite").save(str(tmp_path))
    document = manifest(tmp_path)
    shard = load_file(str(tmp_path / document["shards"][0]["shard_path"]))
    assert {k: v.tolist() for k, v in shard.items()} == {"a__v": 3, "b__v": 2}
    rows = frame(spark, [(i,) for i in range(5)], "v int", 1)
    rows.write.format("safetensors").option("batch_size", 2).option("tail_strategy", "Pad").mode(
        "overwrite"
    ).save(str(tmp_path / "pad"))
    back = spark.read.format("safetensors").load(str(tmp_path / "pad"))
    assert [r.v for r in back.collect()] == [0, 1, 2, 3, 4, 0]


def test_dtype_and_checksums_values_are_case_insensitive(tmp_path: Path) -> None:
    """As docs/spark.md says every option value is: ``f16`` and ``SHA256`` were refused."""
    options = {"path": str(tmp_path), "batch_size": "1"}
    assert WriteOptions.parse({**options, "dtype": "f16"}).dtypes == {"": "F16"}
    parsed = WriteOptions.parse({**options, "dtype": "x:bf16, n: i32"})
    assert parsed.dtypes == {"x": "BF16", "n": "I32"}
    assert WriteOptions.parse({**options, "checksums": "SHA256"}).checksums == "sha256"
    assert WriteOptions.parse({**options, "checksums": "TRUE"}).checksums is True


def test_a_tensor_struct_of_a_dtype_outside_the_layout_is_refused(
    spark: Any, tmp_path: Path
) -> None:
    data = frame(spark, [((bytearray(b"\x01"), [1], "BOOL"),)], f"t {TENSOR}", 1)
    with pytest.raises(Exception, match="dtype 'BOOL' is not one the dataset layout allows"):
        data.write.format("safetensors").option("batch_size", 1).mode("overwrite").save(
            str(tmp_path)
        )
    assert not list(tmp_path.iterdir())


def test_a_read_spark_cannot_carry_is_refused(spark: Any, tmp_path: Path) -> None:
    """``F32 [10**15, 0]``: no byte, but more rows than Spark's Arrow batches count."""
    header = json.dumps({"x": {"dtype": "F32", "shape": [10**15, 0], "data_offsets": [0, 0]}})
    shard = tmp_path / "part-00000-0000-00000000-0000-0000-0000-000000000000.safetensors"
    shard.write_bytes(len(header).to_bytes(8, "little") + header.encode())
    with pytest.raises(Exception, match=r"10{15} rows in one piece"):
        spark.read.format("safetensors").load(str(tmp_path)).collect()
