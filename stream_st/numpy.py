"""A drop-in for ``safetensors.numpy``: the same names, arguments and results, synchronous, over
every source and destination stream_st reads and writes (paths, ``http(s)://``, ``s3://``,
``hf://``, ``tcp://``, a sharded checkpoint's ``*.index.json``)::

    import stream_st.numpy as safetensors_numpy  # was: import safetensors.numpy

    arrays = safetensors_numpy.load_file("s3://bucket/model.safetensors")

Calls work from plain scripts, threads and inside running event loops alike (see
:mod:`stream_st.torch`), and take stream_st's transport options (``headers=``, ``timeout=``,
...) beyond the reference's arguments. Every safetensors dtype is read, BF16 and F8 as
``ml_dtypes`` arrays (where the reference refuses them). Local files are mapped, digests
recorded and checked (``checksums=``, ``verify=``) as in :mod:`stream_st.torch`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Unpack

import numpy as np

from . import compat
from .compat import _local, _save, safe_open
from .core.dtypes import DTYPES

if TYPE_CHECKING:
    from .compat import TensorSpec as TensorSpec
    from .compat import _reference as _facade
    from .compat import deserialize as deserialize
    from .compat import serialize as serialize
    from .compat import serialize_file as serialize_file
    from .transports.cache import CacheLike
    from .transports.options import TransportOptions
    from .transports.registry import SinkLike, SourceLike
else:  # the streaming core, imported when a call needs it (see stream_st.compat._lazy)
    from .compat._lazy import reference as _facade

__all__ = [
    "TensorSpec",
    "deserialize",
    "load",
    "load_file",
    "safe_open",
    "save",
    "save_file",
    "serialize",
    "serialize_file",
]


def load_file(
    filename: SourceLike,
    *,
    backend: str = "mmap",
    verify: bool = True,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> dict[str, np.ndarray[Any, Any]]:
    """Every tensor of ``filename`` (a file, URL or index) as ``{name: array}``: a local file's
    as writable copy-on-write views of a private mapping of it (``backend="pread"`` reads them
    into fresh memory instead: use it on network file systems and for files that may change
    while the arrays live); see :func:`stream_st.torch.load_file`. ``max_tensor_bytes`` and
    ``max_total_bytes`` cap what the file may make the read allocate, as for
    :func:`stream_st.open_stream`; ``cache=`` keeps a verified local copy of a remote file (see
    :func:`stream_st.open_stream`)."""
    caps = {"max_tensor_bytes": max_tensor_bytes, "max_total_bytes": max_total_bytes}
    given = {**options, **caps, "cache": cache}
    arrays = _local.load_mapped(filename, False, verify, backend, given)
    if arrays is not None:
        return arrays
    return _facade.load_file(
        filename,
        False,
        backend,
        verify,
        max_tensor_bytes=max_tensor_bytes,
        max_total_bytes=max_total_bytes,
        cache=cache,
        **options,
    )


def load(
    data: bytes | bytearray | memoryview, *, verify: bool = True
) -> dict[str, np.ndarray[Any, Any]]:
    """Every tensor of a safetensors file given as ``bytes`` (or a ``bytearray`` or
    ``memoryview``; digests checked unless ``verify=False``). A dtype a program put into
    ``_TYPES`` (as programs patch the reference's: ``_TYPES["BF16"] = np.uint16``) is the one
    the tensors of its code are viewed as, as the reference's ``load`` views them."""
    arrays = _facade.load_bytes(data, False, verify)
    arrays.update(_view2np(_facade.retyped_views(data, arrays, _TYPES, _BUILT_IN_TYPES)))
    return arrays


def save_file(
    tensor_dict: dict[str, np.ndarray[Any, Any]],
    filename: SinkLike,
    metadata: dict[str, str] | None = None,
    *,
    checksums: bool | str = False,
    **options: Unpack[TransportOptions],
) -> None:
    """Write ``tensor_dict`` to ``filename`` (a path or URL), laid out as the reference does,
    byte for byte (unless ``checksums=True`` records digests, see
    :func:`stream_st.torch.save_file`). A failed write leaves nothing at the destination."""
    if not _save.save_local(tensor_dict, filename, metadata, checksums, options):
        _facade.save_file(tensor_dict, filename, metadata, checksums, **options)


def save(
    tensor_dict: dict[str, np.ndarray[Any, Any]],
    metadata: dict[str, str] | None = None,
    *,
    checksums: bool | str = False,
) -> bytes:
    """``tensor_dict`` as the bytes of a safetensors file, as the reference makes them."""
    return _save.save_bytes(tensor_dict, metadata, checksums)


def _getdtype(dtype_str: str) -> type[Any]:
    """The numpy scalar type of a safetensors dtype code in ``_TYPES`` (``KeyError`` for one
    numpy has no type of its own for, unless patched in), as the reference's private helper
    that other libraries import is."""
    return _TYPES[dtype_str]


def _view2np(safeview: Any) -> dict[str, np.ndarray[Any, Any]]:
    """The arrays of ``(name, {"dtype", "shape", "data"})`` pairs (what
    :func:`stream_st.compat.deserialize` gives), over their data, as the reference's private
    helper makes them."""
    return {
        name: np.frombuffer(view["data"], dtype=_getdtype(view["dtype"])).reshape(view["shape"])
        for name, view in safeview
    }


_NUMPY_OWN = ("F64", "F32", "F16", "I64", "U64", "I32", "U32", "I16", "U16", "I8", "U8", "BOOL")
_TYPES: dict[str, type[Any]] = {
    code: bool if code == "BOOL" else DTYPES[code].numpy.type for code in (*_NUMPY_OWN, "C64")
}
"""Dtype code to numpy scalar type (the builtin ``bool`` for ``BOOL``), for the codes numpy
has a type of its own for: the reference's private table, which programs import and patch
(:func:`load` reads it when called); ``ml_dtypes``' types are left out, as there."""

_BUILT_IN_TYPES = dict(_TYPES)
""":data:`_TYPES` as made, unpatched: what :func:`load` tells a patch by."""


if not TYPE_CHECKING:  # checkers see the names imported above, not Any for every name

    def __getattr__(name: str) -> Any:
        """``TensorSpec``, ``serialize``, ``serialize_file`` and ``deserialize``, which the
        reference's module has too (:mod:`stream_st.compat`'s), imported when first asked for:
        they import the streaming core."""
        if name not in compat._LAZY:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(compat, name)
        globals()[name] = value
        return value
