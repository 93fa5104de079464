"""A drop-in for ``safetensors.numpy``: the same names, arguments and results, synchronous, over
every source and destination stream_st reads and writes (paths, ``http(s)://``, ``s3://``,
``hf://``, ``tcp://``, a sharded checkpoint's ``*.index.json``)::

    import stream_st.numpy as safetensors_numpy  # was: import safetensors.numpy

    arrays = safetensors_numpy.load_file("s3://bucket/model.safetensors")

Calls work from plain scripts, threads and inside running event loops alike (see
:mod:`stream_st.torch`), and take stream_st's transport options (``headers=``, ``timeout=``,
...) beyond the reference's arguments. Every safetensors dtype is read, BF16 and F8 as
``ml_dtypes`` arrays (where the reference refuses them).
"""

from __future__ import annotations

from typing import Any, Unpack

import numpy as np

from . import _facade
from ._limits import TransportOptions
from .sinks import SinkLike
from .sources import SourceLike

__all__ = ["load", "load_file", "safe_open", "save", "save_file"]


def safe_open(
    filename: SourceLike,
    framework: str = "np",
    device: str | int = "cpu",
    *,
    backend: str = "mmap",
    **options: Unpack[TransportOptions],
) -> _facade.SafeOpen:
    """Open ``filename`` to read tensors by name; see :func:`stream_st.torch.safe_open`."""
    _facade.check_backend(backend)
    return _facade.SafeOpen(filename, framework, device, **options)


def load_file(
    filename: SourceLike, *, backend: str = "mmap", **options: Unpack[TransportOptions]
) -> dict[str, np.ndarray[Any, Any]]:
    """Every tensor of ``filename`` (a file, URL or index) as ``{name: array}``."""
    _facade.check_backend(backend)
    return _facade.load_file(filename, False, **options)


def load(data: bytes) -> dict[str, np.ndarray[Any, Any]]:
    """Every tensor of a safetensors file given as ``bytes``."""
    return _facade.load_bytes(data, False)


def save_file(
    tensor_dict: dict[str, np.ndarray[Any, Any]],
    filename: SinkLike,
    metadata: dict[str, str] | None = None,
    **options: Unpack[TransportOptions],
) -> None:
    """Write ``tensor_dict`` to ``filename`` (a path or URL), laid out as the reference does,
    byte for byte. A failed write leaves nothing at the destination."""
    _facade.save_file(tensor_dict, filename, metadata, **options)


def save(
    tensor_dict: dict[str, np.ndarray[Any, Any]], metadata: dict[str, str] | None = None
) -> bytes:
    """``tensor_dict`` as the bytes of a safetensors file, as the reference makes them."""
    return _facade.save_bytes(tensor_dict, metadata)
