"""The command's defects found by the eighteenth attack: a serve token from an empty variable,
``demo --layers`` unbounded, ``file://`` destinations of ``cp``, ``--header`` values checked per
request, file names shown unescaped."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ._cli import COMMAND, write_model


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model.safetensors")


@pytest.mark.parametrize("token", ["", "two words"], ids=["empty", "not a token"])
def test_serve_refuses_a_bad_token_from_its_variable(token: str, model: Path) -> None:
    """``STREAM_ST_SERVE_TOKEN=`` (set, empty) served with no authentication at all, where
    ``--token ''`` is refused: the variable is checked as the option is, before serving (a
    server started would run until the timeout ends it)."""
    result = subprocess.run(
        [COMMAND, "serve", "--port", "0", str(model)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "STREAM_ST_SERVE_TOKEN": token},
    )
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.startswith("stream-st: error: STREAM_ST_SERVE_TOKEN is ")
    assert result.stderr.count("\n") == 1
    assert not token or token not in result.stderr  # never shown
