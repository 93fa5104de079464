"""Where each tensor of a read lands and what it is handed out as (``open_stream(framework=...,
into=...)``): fresh arrays, memory the caller gives, numpy arrays or torch tensors over them.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..core.arrays import (
    framework_of,
    is_torch_tensor,
    raw_bytes,
    to_torch,
    torch_dtype,
    torch_shape,
)
from ..core.header import TensorInfo
from ..core.strict_json import brief
from ..errors import ArgumentTypeError, DtypeError, TensorNotFoundError, UsageError, some_names

__all__ = ["Delivery"]


class Delivery:
    """Where each tensor of a read lands and what it is handed out as.

    ``into`` maps names to memory the caller owns: a torch tensor (contiguous on the CPU, no
    negative or conjugate view) or numpy array of the tensor's dtype and shape, or any writable
    contiguous buffer of exactly its bytes. Those tensors are
    received straight into it; the others into fresh arrays. ``torch`` hands tensors out as torch
    tensors (a given tensor itself), else as numpy arrays (a given array itself). Not ``exact``:
    memory that does not fit its tensor, and names the file lacks, are passed over (the tensor
    lands in a fresh array) rather than refused.

    ``writable``: tensors viewed in a mapped file (``copy=False``) must be writable, so the
    mapping is private (copy on write: writes never reach the file). Always so for torch, which
    has no read-only tensors (a write to a read-only mapping would kill the process).
    """

    def __init__(
        self,
        framework: str | None = None,
        into: Mapping[str, Any] | None = None,
        *,
        exact: bool = True,
        writable: bool = False,
    ) -> None:
        self.torch = framework_of(framework)
        if into is not None and not isinstance(into, Mapping):
            raise UsageError(
                f"into= takes a mapping of names to buffers, got {type(into).__name__}"
            )
        self.into: Mapping[str, Any] = into or {}
        for name in self.into:
            if not isinstance(name, str):  # a bare TypeError sorting mixed names, else "not found"
                raise ArgumentTypeError(
                    f"into= names are str, got {type(name).__name__} {brief(name)}"
                )
        self.exact = exact
        self.writable = writable or self.torch

    def only(self, names: list[str]) -> Delivery:
        """This delivery for a part of the read (a shard) that holds ``names``."""
        kept = set(names)
        into = {k: v for k, v in self.into.items() if k in kept}
        framework = "pt" if self.torch else "np"
        return Delivery(framework, into, exact=self.exact, writable=self.writable)

    def check(self, names: list[str]) -> None:
        """:class:`~stream_st.TensorNotFoundError` for ``into=`` names not among ``names``."""
        missing = sorted(set(self.into).difference(names))
        if missing and self.exact:
            raise TensorNotFoundError(
                f"into= names tensors not in the header: {some_names(missing)}"
            )

    def check_apart(self, infos: Sequence[TensorInfo]) -> None:
        """:class:`UsageError` if the caller's memory for two of ``infos`` overlaps (one
        staging buffer given for several names): for a read that receives them together
        (a process group's), where a read of one tensor at a time lets each have it in turn."""
        spans = []
        for info in infos:
            target = self.target(info)
            if target is not None and info.nbytes:
                start = target[0].__array_interface__["data"][0]
                spans.append((start, start + info.nbytes, info.name))
        spans.sort()
        for (_, end, name), (start, _, other) in itertools.pairwise(spans):
            if start < end:
                raise UsageError(
                    f"into= gives {name!r} and {other!r} overlapping memory: with a process "
                    "group tensors are received together, each needs memory of its own"
                )

    def target(self, info: TensorInfo) -> tuple[np.ndarray[Any, Any], memoryview] | None:
        """The caller's memory for ``info`` as an array and a writable byte view, if given (and,
        when not ``exact``, if it fits)."""
        given = self.into.get(info.name)
        if given is None:
            return None
        try:
            if is_torch_tensor(given):
                array = self._tensor_array(info, given)
            elif isinstance(given, np.ndarray):
                array = self._checked_array(info, given)
            else:
                array = self._buffer_array(info, given)
        except (UsageError, DtypeError):
            if self.exact:
                raise
            return None
        return array, array.reshape(-1).view(np.uint8).data

    def deliver(
        self,
        info: TensorInfo,
        array: np.ndarray[Any, Any],
        placed: bool,
        shape: Sequence[int] | None = None,
    ) -> Any:
        """What the reader hands out for ``info``, filled into ``array``; ``placed`` when that
        is the caller's memory (:meth:`target`). ``shape``: what ``array`` holds of ``info``
        when not the whole of it (a part a rank receives), as the header would give it."""
        given = self.into.get(info.name) if placed else None
        if self.torch:
            if is_torch_tensor(given):
                return given
            return to_torch(array, info.dtype, info.shape if shape is None else shape)
        return given if isinstance(given, np.ndarray) else array

    @staticmethod
    def _mismatch(info: TensorInfo, what: str) -> UsageError:
        return UsageError(
            f"into={info.name!r}: the file holds {info.dtype} {list(info.shape)}, "
            f"the memory given is {what}"
        )

    def _tensor_array(self, info: TensorInfo, tensor: Any) -> np.ndarray[Any, Any]:
        expected = (torch_dtype(info.dtype), torch_shape(info.dtype, info.shape))
        if (tensor.dtype, tuple(tensor.shape)) != expected:
            raise self._mismatch(info, f"a {tensor.dtype} tensor of shape {list(tensor.shape)}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_meta:
            raise self._mismatch(info, f"not contiguous CPU memory ({tensor.device})")
        if tensor.is_neg() or tensor.is_conj():  # its memory holds other values than it shows
            raise self._mismatch(info, "a negative or conjugate view")
        return raw_bytes(tensor).view(info.array_dtype).reshape(info.array_shape)

    def _checked_array(self, info: TensorInfo, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if (array.dtype, array.shape) != (info.array_dtype, info.array_shape):
            raise self._mismatch(info, f"a {array.dtype} array of shape {array.shape}")
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise self._mismatch(info, "not writable C-contiguous memory")
        return array

    def _buffer_array(self, info: TensorInfo, buffer: Any) -> np.ndarray[Any, Any]:
        try:
            view = memoryview(buffer)
        except (TypeError, ValueError):  # ValueError: a released memoryview, say
            if isinstance(buffer, memoryview):  # which memoryview() refuses once released alone
                raise self._mismatch(info, "a released memoryview") from None
            raise self._mismatch(info, f"a {type(buffer).__name__}, not a buffer") from None
        if "O" in view.format:  # Python objects: writing would overwrite their pointers
            raise self._mismatch(info, "a buffer of Python objects")
        if view.readonly or not view.c_contiguous or view.nbytes != info.nbytes:
            raise self._mismatch(
                info, f"{view.nbytes} bytes{' read-only' if view.readonly else ''}"
            )
        raw = np.frombuffer(view.cast("B"), dtype=np.uint8)
        return raw.view(info.array_dtype).reshape(info.array_shape)
