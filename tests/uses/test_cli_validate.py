"""``stream-st validate``: what it says of NaN and Inf, digests, and its counts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ._cli import run, write_model


def test_nan_and_inf_are_reported_never_as_constant(tmp_path: Path) -> None:
    """[1, NaN, Inf, -Inf] was warned about as "constant 1": its only finite value."""
    path = write_model(
        tmp_path / "odd.safetensors",
        {"odd": np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32)},
    )
    result = run("validate", "--json", str(path))
    assert result.returncode == 1, result.stderr
    found = json.loads(result.stdout)
    assert not any("constant" in w for w in found["warnings"]), found["warnings"]
    assert any("NaN" in e for e in found["errors"]) and any("Inf" in e for e in found["errors"])
    text = run("validate", str(path)).stdout
    assert "constant" not in text
    assert "finite values" in text  # the statistics say what they cover
    constant = write_model(tmp_path / "c.safetensors", {"c": np.full(3, 2.0, np.float32)})
    assert "c: constant 2" in run("validate", str(constant)).stdout
