"""What a :class:`~stream_st.TensorWriter` checks and counts, apart from driving its sink: the
views of the arrays it is given, checked against the plan, and how far each tensor is written
(bytes claimed and written per tensor, and on a stream the order they must come in)."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from .core.arrays import as_array
from .core.dtypes import dtype_for, wire_bytes
from .core.header import Header, TensorInfo
from .errors import WriterError

__all__ = ["Progress", "describe", "piece_view", "whole_view"]

Mode = Literal["whole", "part", "begin"]
"""How bytes are claimed: a whole tensor, its next part, or the start of a write in parts."""


def describe(info: TensorInfo) -> str:
    """``info``'s dtype and shape, as messages show them."""
    return f"{info.dtype} {list(info.shape)}"


def _check_dtype(info: TensorInfo, array: np.ndarray[Any, Any]) -> None:
    planned = info.dtype_info
    if planned.packed:
        ok = array.dtype == np.uint8
    else:
        try:
            ok = dtype_for(array.dtype).code == planned.code
        except Exception:
            ok = False
    if not ok:
        raise WriterError(
            f"tensor {info.name!r}: planned {describe(info)} takes an array of dtype "
            f"{info.array_dtype}, got {array.dtype}",
            name=info.name,
        )


def whole_view(info: TensorInfo, value: Any) -> memoryview:
    """The bytes of ``value``, the whole tensor ``info``; :class:`~stream_st.WriterError` for
    another dtype or shape."""
    array = as_array(value, info.name)
    _check_dtype(info, array)
    if array.shape != info.array_shape:
        raise WriterError(
            f"tensor {info.name!r}: planned {describe(info)} takes an array of shape "
            f"{info.array_shape}, got {array.shape}",
            name=info.name,
        )
    return wire_bytes(array)


def piece_view(info: TensorInfo, value: Any) -> memoryview:
    """The bytes of ``value``, rows of tensor ``info`` (``(rows, *rest)`` or one row ``rest``);
    :class:`~stream_st.WriterError` for another dtype or shape."""
    piece = as_array(value, info.name)
    _check_dtype(info, piece)
    shape = info.array_shape
    rest = shape[1:]
    rows = piece.ndim == len(shape) and piece.shape[1:] == rest
    if not (rows or piece.shape == rest):
        raise WriterError(
            f"tensor {info.name!r}: a part of {describe(info)} must have shape "
            f"(rows, *{rest}) or {rest}, got {piece.shape}",
            name=info.name,
        )
    return wire_bytes(piece)


class Progress:
    """How far each tensor of ``header`` is claimed and written. On a stream (not
    ``random_access``) tensors are claimed in header order."""

    def __init__(self, header: Header) -> None:
        self.header = header
        self._position = {info.name: index for index, info in enumerate(header.tensors)}
        self._claimed: dict[str, int] = {}  # bytes handed out per started tensor
        self._done: dict[str, int] = {}  # bytes written per started tensor
        self._next = 0  # on a stream: index of the first tensor not fully claimed

    def written(self, name: str) -> int:
        """Bytes of tensor ``name`` written so far."""
        return self._done.get(name, 0)

    def complete(self, info: TensorInfo) -> bool:
        return self._done.get(info.name) == info.nbytes

    def wrote(self, name: str, count: int) -> None:
        """``count`` more bytes of tensor ``name`` (claimed before) are written."""
        self._done[name] += count

    def claim(self, info: TensorInfo, count: int, mode: Mode, random_access: bool) -> int:
        """Reserve the next ``count`` bytes of ``info``; returns their offset in the tensor."""
        name = info.name
        claimed = self._claimed.get(name)
        if claimed is not None and mode != "part":
            state = "written" if claimed == info.nbytes else "being written in parts"
            raise WriterError(f"tensor {name!r} is already {state}", name=name)
        start = claimed or 0
        if start + count > info.nbytes:
            raise WriterError(
                f"tensor {name!r}: parts add up to {start + count} bytes, more than the "
                f"{info.nbytes} bytes planned for {describe(info)}",
                name=name,
            )
        if not random_access:
            index = self._position[name]
            if index != self._next and not (claimed is not None and count == 0):
                expected = self.header.tensors[self._next].name
                raise WriterError(
                    f"tensor {name!r} is out of order: a stream takes tensors in header order "
                    f"and the next one is {expected!r}",
                    name=name,
                )
        self._claimed[name] = start + count
        self._done.setdefault(name, 0)
        if not random_access:
            tensors = self.header.tensors
            while self._next < len(tensors) and self._claimed.get(tensors[self._next].name) == (
                tensors[self._next].nbytes
            ):
                self._next += 1
        return start

    def incomplete(self) -> WriterError | None:
        """The error for the tensors not completely written, if any."""
        missing = [t for t in self.header.tensors if not self.complete(t)]
        if not missing:
            return None
        details = ", ".join(
            f"{t.name!r} ({self.written(t.name)} of {t.nbytes} bytes)" for t in missing[:8]
        )
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        return WriterError(
            f"{len(missing)} tensor(s) not completely written when the writer closed: "
            f"{details}{more}",
            name=missing[0].name,
        )
