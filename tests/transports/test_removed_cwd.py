"""A write to a relative path whose working directory was removed (``os.chdir(d)``, then
``os.rmdir(d)``): a :class:`~stream_st.SourceNotFoundError` (a ``FileNotFoundError`` too) naming
the destination, as a missing directory gets, from every writer of a local file (the bare
``FileNotFoundError`` of ``os.getcwd()``, naming nothing, before); a read of a relative path there
is a :class:`~stream_st.SafetensorsError` as well."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
import stream_st.numpy as st_numpy
from stream_st import SafetensorsError, SourceNotFoundError, TensorSpec
from stream_st.compat import _save

ARRAYS: dict[str, np.ndarray[Any, Any]] = {"a": np.arange(3, dtype=np.float32)}


@contextlib.contextmanager
def removed_cwd(tmp_path: Path) -> Iterator[None]:
    """The working directory a folder that was removed since, the previous one back on the way
    out, before any error goes further (pytest reports failures relative to it)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    back = os.getcwd()
    os.chdir(gone)
    try:
        gone.rmdir()
        yield
    finally:
        os.chdir(back)


async def _open_writer() -> None:
    """A whole file through :func:`stream_st.open_writer`."""
    async with stream_st.open_writer("m.safetensors", [TensorSpec("a", "F32", (3,))]) as writer:
        await writer.write("a", ARRAYS["a"])


ASYNC_WRITES: dict[str, Callable[[], Awaitable[object]]] = {
    "save": lambda: stream_st.save("m.safetensors", ARRAYS),
    "open_writer": _open_writer,
}


def _check(exc: SourceNotFoundError, name: str = "m.safetensors") -> None:
    """``exc`` says the working directory was removed and names the destination ``name``."""
    assert isinstance(exc, FileNotFoundError)
    assert "working directory was removed" in str(exc)
    assert name in str(exc)
    assert exc.url == name


@pytest.mark.parametrize("name", ["m.safetensors", "./m.safetensors"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled write", "Python write"])
def test_the_numpy_drop_in_names_the_destination(
    name: str, compiled: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:  # the compiled module (where built) takes no file with data
        monkeypatch.setattr(_save, "SMALL", 0)
    with pytest.raises(SourceNotFoundError) as caught, removed_cwd(tmp_path):
        st_numpy.save_file(ARRAYS, name)
    _check(caught.value, name)


@pytest.mark.parametrize("write", list(ASYNC_WRITES))
async def test_a_streamed_write_names_the_destination(write: str, tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError) as caught, removed_cwd(tmp_path):
        await ASYNC_WRITES[write]()
    _check(caught.value)


def test_the_torch_drop_in_names_the_destination(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")  # not with no working directory: MKL's loader exits
    import stream_st.torch as st_torch

    tensors = {"a": torch.arange(3.0)}
    with pytest.raises(SourceNotFoundError) as caught, removed_cwd(tmp_path):
        st_torch.save_file(tensors, "m.safetensors")
    _check(caught.value)


async def test_a_sharded_write_into_the_removed_directory_is_refused(tmp_path: Path) -> None:
    with (
        pytest.raises(SourceNotFoundError, match="working directory was removed"),
        removed_cwd(tmp_path),
    ):
        async with stream_st.open_sharded_writer(".") as writer:
            await writer.write("a", ARRAYS["a"])


async def test_a_read_of_a_relative_path_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(SafetensorsError) as caught, removed_cwd(tmp_path):
        st_numpy.load_file("m.safetensors")
    assert isinstance(caught.value, FileNotFoundError)
    with pytest.raises(SourceNotFoundError), removed_cwd(tmp_path):
        await stream_st.load("m.safetensors")
