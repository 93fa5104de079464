"""Running the stream-st command in a subprocess, for the command's tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy as reference_numpy

COMMAND = shutil.which("stream-st", path=str(Path(sys.executable).parent)) or "stream-st"
"""The installed command, next to this interpreter."""

TENSORS: dict[str, np.ndarray[Any, Any]] = {
    "model.layers.0.self_attn.q_proj.weight": np.arange(16, dtype=np.float32).reshape(4, 4),
    "model.layers.0.self_attn.k_proj.weight": np.ones((4, 4), dtype=np.float16),
    "model.embed_tokens.weight": np.arange(8, dtype=np.int32).reshape(2, 4),
}


def run(
    *args: str,
    env: dict[str, str] | None = None,
    stdin: Any = None,
    cwd: str | Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """The command with ``args``, its output as text; ``env`` added to the environment."""
    return subprocess.run(
        [COMMAND, *args],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=stdin,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def start(*args: str) -> subprocess.Popen[str]:
    """The command with ``args`` started (not waited for), its output captured as text."""
    return subprocess.Popen(
        [COMMAND, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def write_model(path: Path, tensors: dict[str, np.ndarray[Any, Any]] | None = None) -> Path:
    """A safetensors file at ``path`` written by the reference (``TENSORS`` by default)."""
    reference_numpy.save_file(TENSORS if tensors is None else tensors, str(path))
    return path
