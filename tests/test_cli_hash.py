"""``stream-st hash``: the sha256 of every byte of any input, sha256sum's lines and ``--check``."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

from ._cli import COMMAND, run, write_model

EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_model(tmp_path / "model.safetensors")


def _file_sha256_of(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    found: str = json.loads(result.stdout)["file_sha256"]
    return found


@pytest.mark.parametrize("content", [False, True], ids=["structure", "content"])
def test_file_sha256_of_a_pipe_a_fifo_and_a_redirect(
    model: Path, tmp_path: Path, content: bool
) -> None:
    """The header read first used to be missing from the file's hash of a pipe (the data section
    only), and with --content the whole input (the hash of nothing)."""
    data = model.read_bytes()
    want = hashlib.sha256(data).hexdigest()
    flags = ["hash", "--json", "--file", *(["--content"] if content else [])]
    assert _file_sha256_of(run(*flags, str(model))) == want
    with model.open("rb") as redirected:  # < model.safetensors
        assert _file_sha256_of(run(*flags, "-", stdin=redirected)) == want
    piped = subprocess.Popen(["cat", str(model)], stdout=subprocess.PIPE)  # cat model | ...
    assert piped.stdout is not None
    try:
        result = run(*flags, "-", stdin=piped.stdout)
    finally:
        piped.stdout.close()
        piped.wait()
    assert _file_sha256_of(result) == want
    assert want != EMPTY_SHA256
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with fifo.open("wb") as f:
            f.write(data)

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        assert _file_sha256_of(run(*flags, str(fifo))) == want
    finally:
        feeder.join(timeout=30)


def test_file_sha256_counts_trailing_bytes_or_fails(model: Path, tmp_path: Path) -> None:
    """Every byte of the input or an error: a file with bytes past its data is not hashed
    without them."""
    longer = tmp_path / "longer.safetensors"
    longer.write_bytes(model.read_bytes() + b"extra")
    result = subprocess.run(
        [COMMAND, "hash", "--json", "--file", "-"],
        stdin=longer.open("rb"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode == 0:
        assert _file_sha256_of(result) == hashlib.sha256(longer.read_bytes()).hexdigest()
    else:
        assert result.returncode == 2 and "error" in result.stderr
