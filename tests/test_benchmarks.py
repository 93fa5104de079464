"""The scripts in benchmarks/: what they time, and what they leave behind."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st.numpy

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def benchmarks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A function importing a benchmark's module, as the benchmarks import one another."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module


def test_bench_ab_times_the_checkout_it_is_given(
    benchmarks: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run from the repository root, as documented, each side imported the root's stream_st
    ('-c' puts the working directory first on the path, before PYTHONPATH): A/B compared the code
    with itself. A checkout whose stream_st prints 42 is timed as 42 seconds."""
    fake = tmp_path / "checkout" / "stream_st"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import sys\nprint(42.0)\nsys.exit(0)\n")
    kv = tmp_path / "kv.safetensors"
    stream_st.numpy.save_file({"x": np.zeros(4, np.float32)}, str(kv))
    monkeypatch.chdir(ROOT)
    files = {"kv": kv, "big": kv}
    assert benchmarks("bench_ab")._run(fake.parent, "import", files, tmp_path) == 42.0
