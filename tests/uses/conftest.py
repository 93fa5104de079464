"""A local Spark session (``local[2,2]``) for every Spark test of the run, started on first use."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from ..servers.s3_server import CREDENTIALS, MotoS3Server

BUCKET = "spark-data"
"""The moto bucket the Spark tests write to."""


SESSION_CONFIG = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.default.parallelism": "2",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.adaptive.enabled": "false",
    # tiny frames: interpreting beats compiling, and a JVM that only starts needs no C2 compiler
    "spark.sql.codegen.wholeStage": "false",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    # batches of a few rows: a task writes shards while a UDF still works on later rows
    "spark.sql.execution.arrow.maxRecordsPerBatch": "4",
    "spark.sql.execution.python.udf.maxRecordsPerBatch": "4",
}


@pytest.fixture(scope="session")
def spark(moto_s3: MotoS3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One local Spark session on 127.0.0.1 (two threads, a task tried twice before its job
    fails); its Python workers reach the moto S3 server."""
    session_class: Any = pytest.importorskip("pyspark.sql").SparkSession
    client = moto_s3.client()
    client.create_bucket(Bucket=BUCKET)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    worker_env = {
        **CREDENTIALS,
        "AWS_ENDPOINT_URL": moto_s3.endpoint_url,
        "AWS_EC2_METADATA_DISABLED": "true",
        "HOME": str(tmp_path_factory.mktemp("home")),
    }
    builder = session_class.builder.master("local[2,2]").appName("stream_st tests")
    for name, value in SESSION_CONFIG.items():
        builder = builder.config(name, value)
    for name, value in worker_env.items():
        builder = builder.config(f"spark.executorEnv.{name}", value)
    # Local mode's Python workers inherit the JVM's environment, not executorEnv: the JVM is
    # started with the worker environment, which this process then drops again.
    saved = {name: os.environ.get(name) for name in worker_env}
    os.environ.update(worker_env)
    try:
        session = builder.getOrCreate()
    finally:
        for name, before in saved.items():
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
    session.sparkContext.setLogLevel("OFF")
    yield session
    session.stop()
