"""The one dtype table: safetensors code, numpy / ml_dtypes dtype, torch name and bit size.

Nothing else in stream_st spells dtypes out. Sub-byte types are carried as packed ``uint8``:

* ``F4`` (float4 e2m1, two values per byte, low nibble first as torch's ``float4_e2m1fn_x2``)
  arrives as ``uint8`` with the last dimension halved: shape ``[..., n]`` becomes ``[..., n // 2]``.
  Where that is impossible (an odd last dimension, or no dimensions at all) it arrives, like F6,
  as the packed bytes in a 1-D ``uint8`` array.
* ``F6_E2M3`` and ``F6_E3M2`` (four values per three bytes) arrive as the packed bytes in a 1-D
  ``uint8`` array of ``nelements * 6 / 8`` bytes.

A sub-byte tensor whose bit count is not a whole number of bytes is refused by the header check.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from ..errors import DtypeError

__all__ = ["DTYPES", "DType", "array_shape", "dtype_for", "dtype_from_code", "wire_bytes"]


@dataclass(frozen=True, slots=True)
class DType:
    """One safetensors dtype.

    ``rank`` is the position in the reference implementation's dtype order (increasing
    alignment); its writer sorts tensors by descending rank, then name. ``torch`` is the name of
    the ``torch`` dtype (``"bfloat16"``), ``None`` where torch has none (F6_E2M3, F6_E3M2).
    ``kind``: the numpy dtype, or the name of ``ml_dtypes``' type (``"bfloat16"``), which
    :attr:`numpy` imports ``ml_dtypes`` for on first use (a third of the drop-ins' import time
    otherwise, for files that hold no such type).
    """

    code: str
    bits: int
    kind: np.dtype[Any] | str = field(compare=False, repr=False)
    rank: int
    torch: str | None

    @property
    def numpy(self) -> np.dtype[Any]:
        """The numpy dtype of the type's values (``uint8`` for the packed sub-byte types)."""
        kind = self.kind
        if isinstance(kind, str):
            import ml_dtypes

            kind = np.dtype(getattr(ml_dtypes, kind))
            object.__setattr__(self, "kind", kind)  # the same object from any thread
        return kind

    @property
    def packed(self) -> bool:
        """True for sub-byte types, which are delivered as packed ``uint8`` bytes."""
        return self.bits < 8

    def nbytes(self, nelements: int) -> int | None:
        """Bytes taken by ``nelements`` values, or ``None`` if not a whole number of bytes."""
        bits = nelements * self.bits
        return bits // 8 if bits % 8 == 0 else None


def _table() -> dict[str, DType]:
    u8 = np.dtype(np.uint8)
    rows: list[tuple[str, int, Any, str | None]] = [
        # In the reference's order of increasing alignment.
        ("BOOL", 8, np.bool_, "bool"),
        ("F4", 4, u8, "float4_e2m1fn_x2"),
        ("F6_E2M3", 6, u8, None),
        ("F6_E3M2", 6, u8, None),
        ("U8", 8, np.uint8, "uint8"),
        ("I8", 8, np.int8, "int8"),
        ("F8_E5M2", 8, "float8_e5m2", "float8_e5m2"),
        ("F8_E4M3", 8, "float8_e4m3fn", "float8_e4m3fn"),
        ("F8_E8M0", 8, "float8_e8m0fnu", "float8_e8m0fnu"),
        ("F8_E4M3FNUZ", 8, "float8_e4m3fnuz", "float8_e4m3fnuz"),
        ("F8_E5M2FNUZ", 8, "float8_e5m2fnuz", "float8_e5m2fnuz"),
        ("I16", 16, np.int16, "int16"),
        ("U16", 16, np.uint16, "uint16"),
        ("F16", 16, np.float16, "float16"),
        ("BF16", 16, "bfloat16", "bfloat16"),
        ("I32", 32, np.int32, "int32"),
        ("U32", 32, np.uint32, "uint32"),
        ("F32", 32, np.float32, "float32"),
        ("C64", 64, np.complex64, "complex64"),
        ("F64", 64, np.float64, "float64"),
        ("I64", 64, np.int64, "int64"),
        ("U64", 64, np.uint64, "uint64"),
    ]
    return {
        code: DType(code, bits, dt if isinstance(dt, str) else np.dtype(dt), rank, torch)
        for rank, (code, bits, dt, torch) in enumerate(rows)
    }


DTYPES: dict[str, DType] = _table()
"""Every safetensors dtype code, mapped to its :class:`DType`."""

_BY_NUMPY: dict[np.dtype[Any], DType] = {
    d.kind: d for d in DTYPES.values() if not d.packed and isinstance(d.kind, np.dtype)
}
"""The types by numpy dtype; ``ml_dtypes``' added by :func:`_know_ml_dtypes`."""


_UNPACKED = sum(not d.packed for d in DTYPES.values())


def _know_ml_dtypes() -> bool:
    """Add ``ml_dtypes``' types to :data:`_BY_NUMPY` (importing it: numpy then knows their
    names too); whether they were new to it."""
    if len(_BY_NUMPY) == _UNPACKED:
        return False
    for d in DTYPES.values():
        if not d.packed:
            _BY_NUMPY.setdefault(d.numpy, d)
    return True


def _as_numpy(value: str | np.dtype[Any] | type) -> np.dtype[Any] | None:
    """``value`` as numpy understands a dtype, None where it does not."""
    try:
        return np.dtype(value)
    except Exception:  # TypeError, ValueError, even SyntaxError for "f4,("
        return None


def dtype_from_code(code: object) -> DType:
    """The :class:`DType` for a code such as ``"F16"``; :class:`DtypeError` if unknown."""
    if isinstance(code, str):
        found = DTYPES.get(code)
        if found is not None:
            return found
    raise DtypeError(f"unknown safetensors dtype {code!r}; known: {', '.join(DTYPES)}")


def dtype_for(value: str | np.dtype[Any] | type) -> DType:
    """The :class:`DType` for a safetensors code or a numpy / ml_dtypes dtype.

    Byte order is ignored (``>f4`` is F32): arrays are converted to little-endian on the wire.
    Packed sub-byte codes (F4, F6_*) can only be named by their code.
    """
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if isinstance(value, np.dtype):  # an array's dtype, in native byte order: one lookup
        found = _BY_NUMPY.get(value)
        if found is not None:
            return found
    as_numpy = _as_numpy(value)
    unknown = as_numpy is None or as_numpy.newbyteorder("=") not in _BY_NUMPY
    if unknown and _know_ml_dtypes():  # ml_dtypes' names and types known now: ask again
        as_numpy = _as_numpy(value)
    if as_numpy is None:
        raise DtypeError(f"not a dtype: {value!r}")
    found = _BY_NUMPY.get(as_numpy.newbyteorder("="))
    if found is None:
        raise DtypeError(f"numpy dtype {as_numpy} has no safetensors equivalent")
    return found


def array_shape(dtype: DType, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the numpy array that carries a tensor of ``dtype`` and ``shape``.

    The tensor's shape itself for whole-byte types; see the module docstring for F4 and F6.
    """
    if not dtype.packed:
        return tuple(shape)
    nbytes = dtype.nbytes(prod(shape))
    if nbytes is None:
        raise DtypeError(
            f"{dtype.code} tensor of shape {list(shape)} is not a whole number of bytes"
        )
    if dtype.code == "F4" and len(shape) > 0 and shape[-1] % 2 == 0:
        return (*shape[:-1], shape[-1] // 2)
    return (nbytes,)


NATIVE_IS_LITTLE = sys.byteorder == "little"

_BUFFER_CHARS = frozenset("?" + np.typecodes["AllInteger"] + np.typecodes["Float"])
"""numpy's own bool, integer and float types: their arrays export a buffer that
:meth:`memoryview.cast` takes (not complex, whose format has two letters, nor ml_dtypes' types,
which export none)."""


def wire_bytes(array: np.ndarray[Any, Any]) -> memoryview:
    """A 1-D byte view of ``array`` as stored on the wire: C order, little-endian.

    No copy for a C-contiguous little-endian array (what the reader hands out); one otherwise.
    """
    dtype = array.dtype
    order = dtype.byteorder
    if (
        dtype.char in _BUFFER_CHARS
        and (order != ">" and NATIVE_IS_LITTLE)
        and array.size
        and array.flags.c_contiguous
    ):
        return array.data.cast("B")  # the buffer's own view: a third of the time of the below
    if order == ">" or (order == "=" and not NATIVE_IS_LITTLE):
        array = array.astype(array.dtype.newbyteorder("<"), order="C")
    elif not array.flags.c_contiguous:
        array = np.ascontiguousarray(array)
    return array.ravel().view(np.uint8).data  # C-contiguous here: a view
