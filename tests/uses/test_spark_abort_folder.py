"""The Spark data source's writer, aborted after its folder was moved away and an empty one put
at its path, leaves that folder: it removes a folder only where it is still one it made (as the
sharded writer does, b0eaf93), where it removed every empty folder at the paths it had made."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")

from pyspark.sql.types import DoubleType, StructField, StructType

from pyspark_safetensors._write import SafetensorsWriter, WriteOptions


def test_an_abort_leaves_a_folder_put_in_place_of_the_one_it_made(tmp_path: Path) -> None:
    schema = StructType([StructField("x", DoubleType())])
    options = {"path": str(tmp_path / "sub" / "d"), "batch_size": "1"}
    writer = SafetensorsWriter(WriteOptions.parse(options, schema), overwrite=True)
    (tmp_path / "sub").rename(tmp_path / "moved")  # the folders it made, moved away
    (tmp_path / "sub" / "d").mkdir(parents=True)  # others, empty, at their paths
    writer.abort([])
    assert (tmp_path / "sub" / "d").is_dir()


def test_an_abort_removes_the_folders_it_made(tmp_path: Path) -> None:
    schema = StructType([StructField("x", DoubleType())])
    options = {"path": str(tmp_path / "sub" / "d"), "batch_size": "1"}
    writer = SafetensorsWriter(WriteOptions.parse(options, schema), overwrite=True)
    writer.abort([])
    assert list(tmp_path.iterdir()) == []
