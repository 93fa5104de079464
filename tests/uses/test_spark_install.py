"""Finding ``format("safetensors")`` as users install the package: a wheel, or an editable
install, each in a fresh virtual environment, the driver run from another directory.

Spark registers the top-level ``pyspark_*`` modules its scan (``pkgutil.iter_modules``) lists.
A wheel puts ``pyspark_safetensors`` in site-packages, where the scan sees it; an editable
install (the default mode, and ``editable_mode=compat``) puts the checkout on the path (the
project's ``package-dir``), where it sees it too: not behind setuptools' import hook, which the
scan cannot see.

The wheel is checked end to end by a Spark session; the editable installs by the very function
Spark's lookup worker runs (``pyspark.sql.worker.lookup_data_sources``), in their environment,
without starting a JVM for each: ``register()`` itself is checked by ``test_spark.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import venv
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("pyspark")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SKIP = shutil.ignore_patterns(
    ".git", ".*venv*", "build", "dist", "site", "*.egg-info", "__pycache__", ".*_cache"
)

DRIVER = """
import json, sys
from pyspark.sql import SparkSession

spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.ui.enabled", "false")
    .config("spark.driver.host", "127.0.0.1")
    .config("spark.driver.bindAddress", "127.0.0.1")
    .getOrCreate()
)
frame = spark.createDataFrame([(1, [1.5]), (2, [2.5])], "label int, x array<float>")

def write():
    frame.write.format("safetensors").option("batch_size", 2).mode("overwrite").save("ds")

out = {}
try:
    write()
    out["found_by_spark"] = True
except Exception as exc:
    out["found_by_spark"] = False
    out["error"] = str(exc)[:400]
import pyspark_safetensors

pyspark_safetensors.register(spark)
write()
back = spark.read.format("safetensors").load("ds")
out["rows"] = [list(row) for row in back.collect()]
out["types"] = back.dtypes
out["module"] = pyspark_safetensors.__file__
print(json.dumps(out))
"""


def _clean_env() -> dict[str, str]:
    """This environment without the path that makes Python import this tree's code."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def _check(args: list[Any], cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=400,
        env=env or _clean_env(),
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr[-3000:]}"
    return result.stdout


def _fresh_venv(where: Path) -> Path:
    """A new virtual environment; its dependencies (pyspark, pyarrow, numpy...) lent from this
    one through a path entry, which Python reads no ``.pth`` file of (this environment's own
    editable install of stream_st stays out)."""
    venv.create(where)
    python = where / "bin" / "python"
    site = _check([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"])
    lent = Path(np.__file__).resolve().parent.parent
    (Path(site.strip()) / "lent-dependencies.pth").write_text(f"{lent}\n")
    return python


def _install(python: Path, *what: Any) -> None:
    pip = ["-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-build-isolation"]
    _check([python, *pip, *what])


def _run_driver(python: Path, where: Path) -> dict[str, Any]:
    """The driver, run from ``where`` (not the checkout) with ``python`` for every process."""
    where.mkdir()
    (where / "driver.py").write_text(textwrap.dedent(DRIVER))
    env = {**_clean_env(), "PYSPARK_PYTHON": str(python), "SPARK_LOCAL_IP": "127.0.0.1"}
    lines = _check([python, "driver.py"], cwd=where, env=env).strip().splitlines()
    out: dict[str, Any] = json.loads(lines[-1])
    assert out["rows"] == [[1, [1.5]], [2, [2.5]]]
    assert out["types"] == [["label", "int"], ["x", "array<float>"]]
    return out


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of this checkout, to install from."""
    out = tmp_path_factory.mktemp("src") / "tree"
    shutil.copytree(ROOT, out, ignore=SKIP)
    return out


def test_a_wheel_is_found_by_spark_itself(tree: Path, tmp_path: Path) -> None:
    script = "import sys; from setuptools import build_meta; build_meta.build_wheel(sys.argv[1])"
    _check([sys.executable, "-c", script, tmp_path / "dist"], cwd=tree)
    python = _fresh_venv(tmp_path / "venv")
    _install(python, next((tmp_path / "dist").glob("*.whl")))
    out = _run_driver(python, tmp_path / "run")
    assert out["found_by_spark"], out.get("error")
    assert Path(out["module"]).is_relative_to(tmp_path / "venv")


LOOKUP = """
import io, json, struct
from pyspark.sql.worker import lookup_data_sources

out = io.BytesIO()
lookup_data_sources._main(io.BytesIO(), out)
data = out.getvalue()
names, at = [], 4
for _ in range(struct.unpack(">i", data[:4])[0]):
    size = struct.unpack(">i", data[at : at + 4])[0]
    names.append(data[at + 4 : at + 4 + size].decode())
    at += 4 + size
    at += 4 + struct.unpack(">i", data[at : at + 4])[0]  # the pickled class
import pyspark_safetensors

print(json.dumps({"found_by_spark": names, "module": pyspark_safetensors.__file__}))
"""


def _spark_lookup(python: Path, where: Path) -> dict[str, Any]:
    """What Spark's data source lookup finds with ``python``, run from ``where``."""
    where.mkdir()
    lines = _check([python, "-c", LOOKUP], cwd=where).strip().splitlines()
    out: dict[str, Any] = json.loads(lines[-1])
    return out


@pytest.mark.parametrize("mode", [[], ["--config-settings", "editable_mode=compat"]])
def test_an_editable_install_is_found_by_spark_itself(
    tree: Path, tmp_path: Path, mode: list[str]
) -> None:
    python = _fresh_venv(tmp_path / "venv")
    _install(python, *mode, "-e", tree)
    out = _spark_lookup(python, tmp_path / "run")
    assert out["found_by_spark"] == ["safetensors"]
    assert Path(out["module"]).is_relative_to(tree)
