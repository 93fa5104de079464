"""The reference's low-level functions: :class:`TensorSpec`, :func:`serialize`,
:func:`serialize_file` (tensors given as raw memory: an address and a length) and
:func:`deserialize` (a file's bytes to ``(name, {"dtype", "shape", "data"})`` entries). A dict
of tensors in memory is written by :mod:`._save`.

Files are laid out as the reference lays them out, byte for byte. The memory a spec points at is
read while the call runs: the caller keeps it alive, as with the reference.
"""

from __future__ import annotations

import builtins
import ctypes
import operator
import sys
from collections.abc import Mapping, Sequence
from typing import Any, SupportsIndex, cast

import numpy as np

from ..core.digests import Digests
from ..core.header import LENGTH_PREFIX_SIZE, parse_header, parse_header_length
from ..core.layout import TensorSpec as PlanEntry
from ..core.layout import integer_shape
from ..errors import (
    DtypeError,
    SafetensorsError,
    TrailingDataError,
    TruncatedStreamError,
    UsageError,
    boolean,
)
from ..transports.inmemory import as_bytes_view
from ..transports.registry import SinkLike
from ..writer import open_writer
from ._errors import UnsignedOverflowError, WrongTypeError
from ._save import _encodable

__all__ = [
    "TensorSpec",
    "deserialize",
    "write_specs",
]

_CODES = {
    "bool": "BOOL",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "uint16": "U16",
    "int32": "I32",
    "uint32": "U32",
    "int64": "I64",
    "uint64": "U64",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2": "F8_E5M2",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
    "float4_e2m1fn_x2": "F4",
    "complex64": "C64",
}
"""The reference's dtype names (numpy's and torch's) and the safetensors code of each."""


class TensorSpec:
    """One tensor for :func:`serialize`: its ``dtype`` (a numpy or torch name such as
    ``"float32"``), ``shape``, and the address and length of its contiguous little-endian bytes.
    For ``float4_e2m1fn_x2`` (two values a byte) the shape given is the storage's and the last
    dimension is doubled, as in the reference. Refused as the reference refuses them: a dtype
    not among those names (a safetensors code such as ``"F32"`` is not) with a
    :class:`~stream_st.DtypeError` (a ``SafetensorError``); a dtype that is not a string, a
    shape that is not a sequence (a list, a tuple, ``bytes`` taken as its byte values: not a
    set, a dict or a generator) of integers, or a ``data_ptr`` or ``data_len`` that is not an
    integer, with a ``TypeError``; a negative number or one past 64 bits (an F4 last dimension
    too, once doubled) with an ``OverflowError``. Every argument's type is checked before the
    dtype's name, in the reference's order (``dtype``, ``shape``, ``data_ptr``, ``data_len``)."""

    __slots__ = ("_data_len", "_data_ptr", "_dtype", "_shape")

    def __init__(self, *, dtype: str, shape: Sequence[int], data_ptr: int, data_len: int) -> None:
        if not isinstance(dtype, str):
            raise WrongTypeError(
                f"argument 'dtype': '{type(dtype).__name__}' object is not an instance of 'str'"
            )
        if isinstance(shape, Mapping) or not hasattr(type(shape), "__getitem__"):
            raise WrongTypeError(  # as by the reference: a set (of no order), a dict, an iterator
                f"argument 'shape': '{type(shape).__name__}' object is not an instance of "
                "'Sequence'"
            )
        if isinstance(shape, bytes):  # its byte values, as the reference takes them, where
            shape = list(shape)  # integer_shape refuses bytes (a name given for a shape)
        dims = [_unsigned(dim, "shape") for dim in integer_shape(shape)]
        self._data_ptr = _unsigned(data_ptr, "data_ptr")
        self._data_len = _unsigned(data_len, "data_len")
        code = _CODES.get(dtype)  # its name once every argument's type is, as the reference
        if code is None:
            raise DtypeError(f'Unknown dtype "{dtype}". Supported dtypes: {", ".join(_CODES)}')
        if code == "F4" and dims:
            if (dims[-1] * 2) >> 64:
                raise UnsignedOverflowError(
                    f"F4 last-dim {dims[-1]} doubled to logical shape overflows usize"
                )
            dims[-1] *= 2
        self._dtype = code
        self._shape = dims

    @property
    def dtype(self) -> str:
        """The safetensors code (``"F32"``, ``"BF16"``, ...)."""
        return self._dtype

    @property
    def shape(self) -> list[int]:
        """The shape the header records (the last dimension doubled for F4)."""
        return list(self._shape)

    @property
    def data_ptr(self) -> int:
        """The address of the tensor's bytes."""
        return self._data_ptr

    @property
    def data_len(self) -> int:
        """The length of the tensor's bytes."""
        return self._data_len

    def __repr__(self) -> str:
        return (
            f"TensorSpec(dtype='{self._dtype}', shape={self._shape}, "
            f"data_ptr={self._data_ptr}, data_len={self._data_len})"
        )

    def raw(self) -> np.ndarray[Any, Any]:
        """The bytes the spec points at, as a ``uint8`` array over that memory (no copy)."""
        if not self._data_len:
            return np.empty(0, dtype=np.uint8)
        if not self._data_ptr:
            raise UsageError("a TensorSpec with bytes needs a data_ptr")
        memory = (ctypes.c_ubyte * self._data_len).from_address(self._data_ptr)
        raw: np.ndarray[Any, Any] = np.frombuffer(memoryview(memory).cast("B"), dtype=np.uint8)
        return raw


def _unsigned(value: object, argument: str) -> int:
    """``value`` as the reference takes an unsigned 64-bit argument: by ``__index__`` (a
    ``TypeError`` otherwise), neither negative nor past 64 bits (an ``OverflowError``)."""
    try:
        number = operator.index(cast(SupportsIndex, value))
    except TypeError:
        raise WrongTypeError(
            f"argument '{argument}': '{type(value).__name__}' object cannot be interpreted as "
            "an integer"
        ) from None
    if number < 0:
        raise UnsignedOverflowError(f"can't convert negative int to unsigned: {argument} {number}")
    if number >> 64:
        raise UnsignedOverflowError(f"int too big to convert: {argument} {number}")
    return number


def _class_name(cls: type) -> str:
    """``cls`` named with its module, so that a class of another module named as one expected
    is told apart from it: the reference's ``TensorSpec`` (an extension's, whose module reads
    ``builtins``) as ``safetensors.TensorSpec``; Python's built-in types by their name alone."""
    extension = sys.modules.get("safetensors._safetensors_rust")
    if extension is not None and getattr(extension, cls.__name__, None) is cls:
        return f"safetensors.{cls.__name__}"
    if cls is TensorSpec:
        return "stream_st.compat.TensorSpec"
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}.{cls.__qualname__}"


def specs_of(tensor_dict: object) -> dict[str, TensorSpec]:
    """``tensor_dict`` as a dict of names to :class:`TensorSpec`; :class:`WrongTypeError` (the
    reference's ``TypeError``) for anything else, :class:`UnencodableTextError` (its
    ``UnicodeEncodeError``) for a name UTF-8 cannot encode."""
    if not isinstance(tensor_dict, Mapping):
        raise WrongTypeError(
            f"argument 'tensor_dict': '{type(tensor_dict).__name__}' object cannot be converted "
            "to 'PyDict'"
        )
    for name, spec in tensor_dict.items():
        if not isinstance(name, str) or not isinstance(spec, TensorSpec):
            raise WrongTypeError(
                f"argument 'tensor_dict': expected str -> {_class_name(TensorSpec)}, got "
                f"{_class_name(type(name))} -> {_class_name(type(spec))}"
            )
        if not name.isascii():
            _encodable(name, f"tensor name {name!r:.80}")
    return dict(tensor_dict)


async def write_specs(
    dst: SinkLike, specs: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None
) -> None:
    """Write the tensors ``specs`` point at to ``dst``, laid out as the reference does."""
    plan = [PlanEntry(name, spec.dtype, tuple(spec.shape)) for name, spec in specs.items()]
    async with open_writer(dst, plan, metadata=metadata, order="reference") as writer:
        for info in writer.header.tensors:
            raw = specs[info.name].raw()
            if raw.nbytes != info.nbytes:
                raise SafetensorsError(
                    "Error while serializing: invalid shape, data type, or offset for tensor "
                    f"{info.name!r}: {info.dtype} {list(info.shape)} takes {info.nbytes} bytes, "
                    f"data_len is {raw.nbytes}"
                )
            await writer.write(info.name, raw.view(info.array_dtype).reshape(info.array_shape))


def deserialize(
    bytes: builtins.bytes | bytearray | memoryview, *, verify: bool = True
) -> list[tuple[str, dict[str, Any]]]:
    """The tensors of the safetensors file ``bytes`` (the argument named as the reference names
    it), in offset order, as the reference gives them:
    ``[(name, {"dtype": "F32", "shape": [2, 3], "data": bytearray(...)}), ...]``.

    Each tensor is checked against the digest the header records for it, if any, as
    :func:`stream_st.load` checks it: a mismatch, or a record that cannot be checked, raises
    :class:`~stream_st.IntegrityError`; ``verify=False`` skips the check. A file without
    digests is read as the reference reads it."""
    if not isinstance(bytes, builtins.bytes | bytearray | memoryview):
        raise WrongTypeError(f"deserialize takes bytes, got {type(bytes).__name__}")
    verify = boolean("verify", verify)
    view = as_bytes_view(bytes)  # a non-contiguous view copied
    length = parse_header_length(view[:LENGTH_PREFIX_SIZE], fixed_limit=True)
    if len(view) < LENGTH_PREFIX_SIZE + length:
        raise TruncatedStreamError(
            "the header", name=None, offset=len(view), expected=LENGTH_PREFIX_SIZE + length
        )
    header = parse_header(view[LENGTH_PREFIX_SIZE : LENGTH_PREFIX_SIZE + length])
    if len(view) != header.file_size:
        if len(view) < header.file_size:
            raise TruncatedStreamError(
                "the tensors' data", name=None, offset=len(view), expected=header.file_size
            )
        raise TrailingDataError(f"bytes follow the last tensor at byte {header.file_size}")
    digests = Digests.from_header(header) if verify else None
    base = header.data_start
    tensors: list[tuple[str, dict[str, Any]]] = []
    for info in header.tensors:
        data = bytearray(view[base + info.start : base + info.end])
        if digests is not None:  # the copy handed out is the one checked
            digests.check_bytes(info.name, data, "<bytes>")  # named as load(bytes) names it
        tensors.append((info.name, {"dtype": info.dtype, "shape": list(info.shape), "data": data}))
    return tensors
