"""A local file's mapping and a ``backend="pread"`` handle's descriptor are let go in C.

Freed by a ``weakref.finalize`` (Python code), a mapping, or a descriptor, stayed for the life of
the process where a Ctrl-C landed as the finalizer began, and the Ctrl-C was swallowed
("Exception ignored in: <finalize object ...>"). Here a profile hook raises ``KeyboardInterrupt``
at the first Python function called while the arrays or the handle are let go, as a signal
handler would: nothing of the file may be left, and no exception swallowed. Skipped where the
compiled module was not built (the fallback is that finalizer).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np
import pytest

import stream_st.numpy as st_numpy
from stream_st.transports.file import mmap as file_mmap

held = pytest.importorskip("stream_st.transports.file._held", reason="not built")


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "m.safetensors"
    st_numpy.save_file({f"t{i}": np.full(50_000, i, np.float32) for i in range(4)}, path)
    return path


@pytest.fixture
def swallowed(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The exceptions Python reports as ignored (in a finalizer, a __del__) meanwhile."""
    seen: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    yield seen


def interrupted(release: Callable[[], None], skipped: str = "") -> None:
    """``release()`` with a ``KeyboardInterrupt`` raised at the first Python call it makes (of
    a file whose path does not hold ``skipped``)."""

    def hook(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and not (skipped and skipped in frame.f_code.co_filename):
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(hook)
    try:
        release()
    except KeyboardInterrupt:
        pass
    finally:
        sys.setprofile(None)
    gc.collect()


def mappings_of(path: Path) -> int:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        return sum(str(path) in line for line in maps)


def descriptors_of(path: Path) -> int:
    found = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own)
            found += os.readlink(f"/proc/self/fd/{name}") == str(path)
    return found


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc")
def test_a_load_file_mapping_is_unmapped_whatever_interrupts(
    path: Path, swallowed: list[str]
) -> None:
    arrays: dict[str, Any] = st_numpy.load_file(path)
    assert mappings_of(path) == 1
    interrupted(arrays.clear)
    assert mappings_of(path) == 0
    assert not swallowed


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="needs /proc")
def test_a_pread_handle_s_descriptor_is_closed_whatever_interrupts(
    path: Path, swallowed: list[str]
) -> None:
    handle = st_numpy.safe_open(path, "np", backend="pread")
    handle.get_tensor("t1")
    assert descriptors_of(path) == 1  # held until the handle closes, as the reference holds it
    close = functools.partial(handle.__exit__, None, None, None)  # no Python frame of its own
    interrupted(close, skipped=f"{os.sep}stream_st{os.sep}")
    assert descriptors_of(path) == 0
    assert not swallowed


def test_the_mapping_is_the_compiled_one_and_read_only_where_shared(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        shared = file_mmap.map_file(fd, path.stat().st_size)
        private = file_mmap.map_file(fd, path.stat().st_size, private=True)
    finally:
        os.close(fd)
    assert isinstance(shared, held.Mapping) and isinstance(private, held.Mapping)
    assert memoryview(shared).readonly and not memoryview(private).readonly
    assert bytes(memoryview(shared)[:8]) == path.read_bytes()[:8]


def test_a_held_descriptor_closes_once(path: Path) -> None:
    descriptor = file_mmap.open_descriptor(str(path), os.O_RDONLY)
    fd = descriptor.fileno()
    os.fstat(fd)
    descriptor.close()
    descriptor.close()
    assert descriptor.fileno() == -1
    with pytest.raises(OSError):
        os.fstat(fd)
