"""Helpers shared by the tests: raw safetensors bytes from a header object, chunked iterators."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy as reference_numpy

REFERENCE_DTYPES = [
    np.bool_,
    np.uint8,
    np.int8,
    np.int16,
    np.uint16,
    np.float16,
    np.int32,
    np.uint32,
    np.float32,
    np.float64,
    np.int64,
    np.uint64,
    np.complex64,
]
"""The numpy dtypes the reference's numpy API saves and loads."""


def raw_file(header: Any, data: bytes = b"", *, pad: int = 0) -> bytes:
    """Bytes of a safetensors file with ``header`` (an object dumped as JSON, or exact text)."""
    text = header if isinstance(header, str | bytes) else json.dumps(header)
    body = text.encode() if isinstance(text, str) else text
    body += b" " * pad
    return struct.pack("<Q", len(body)) + body + data


def sample_tensors() -> dict[str, np.ndarray[Any, Any]]:
    """A small file's worth of tensors of several dtypes, including a scalar and empties."""
    return {
        "weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "bias": np.array([1, -2, 3], dtype=np.int64),
        "scalar": np.array(2.5, dtype=np.float64),
        "empty": np.zeros((0, 7), dtype=np.float16),
        "flags": np.array([True, False, True]),
        "bytes": np.arange(5, dtype=np.uint8),
    }


def sample_file(metadata: dict[str, str] | None = None) -> bytes:
    """``sample_tensors`` written by the reference implementation."""
    data: bytes = reference_numpy.save(sample_tensors(), metadata=metadata)
    return data


async def chunked(data: bytes, size: int) -> AsyncIterator[bytes]:
    """Yield ``data`` in chunks of ``size`` bytes."""
    for start in range(0, len(data), size):
        yield data[start : start + size]


def assert_same_arrays(
    got: dict[str, np.ndarray[Any, Any]], expected: dict[str, np.ndarray[Any, Any]]
) -> None:
    assert list(got) == list(expected) or sorted(got) == sorted(expected)
    for name, array in expected.items():
        assert got[name].dtype == array.dtype, name
        assert got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name


def run_command(
    *args: str, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m stream_st.cli ARGS`` in a process of its own, from this checkout, in the
    environment with ``env`` added; its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "stream_st.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})},
    )


def nameless_works(directory: Path) -> bool:
    """Whether the writers hold ``directory``'s files with no name (``O_TMPFILE``)."""
    from stream_st.transports.file import atomic

    fd = atomic._open_nameless(os.fspath(directory), [])
    if fd is None:
        return False
    os.close(fd)
    return True


def stepped(raw: bytes) -> tuple[Any, int]:
    """What :func:`stream_st.core.header.parse_steps` of ``raw`` gives, and after how many
    steps (the turns it gave the loop)."""
    from stream_st.core.header import parse_steps

    steps = parse_steps(raw)
    yields = 0
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, yields
        yields += 1


def mapping_of(address: int) -> list[str] | None:
    """The ``VmFlags`` of this process's mapping holding ``address`` (``/proc/self/smaps``), or
    None when no mapping holds it."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):
                low, high = (int(bound, 16) for bound in first.split("-"))
                inside = low <= address < high
            elif inside and first == "VmFlags:":
                return line.split()[1:]
    return None
