"""Framework adapters: the torch dtype table, zero-copy numpy <-> torch views, and where a read
tensor lands (``open_stream(framework=..., into=...)``).

torch is imported only when asked for (``framework="pt"``, a torch tensor given to a writer), so
``import stream_st`` stays light. A tensor read for torch is the numpy array the reader filled,
seen as a torch tensor over the same memory: no copy beyond the one from the wire. A torch tensor
written is seen as a numpy array over its memory: detached, moved to the CPU and made contiguous
only when it is not already (one copy then). Not public API.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from typing import Any, Literal

import numpy as np

from .dtypes import DTYPES
from .errors import DtypeError, TensorNotFoundError, UsageError
from .header import TensorInfo, TensorSpec

__all__ = [
    "Delivery",
    "Framework",
    "check_device",
    "framework_of",
    "is_torch_tensor",
    "load_torch",
    "spec_of",
    "to_torch",
    "torch_code",
    "torch_dtypes",
    "torch_to_array",
]

Framework = Literal["np", "numpy", "pt", "torch"]
"""What tensors are handed out as: numpy arrays (``"np"``, ``"numpy"``) or torch tensors
(``"pt"``, ``"torch"``), as the reference's ``framework=`` names them."""

_TORCH_NAMES = {
    # Every safetensors dtype torch has; F6_E2M3 and F6_E3M2 have no torch dtype.
    "BOOL": "bool",
    "F4": "float4_e2m1fn_x2",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "C64": "complex64",
    "F64": "float64",
    "I64": "int64",
    "U64": "uint64",
}


def load_torch() -> Any:
    """The torch module; :class:`UsageError` saying how to install it if it is missing."""
    try:
        import torch
    except ImportError:
        raise UsageError("torch tensors need torch: pip install torch==2.13.0") from None
    return torch


@functools.cache
def torch_dtypes() -> dict[str, Any]:
    """Safetensors code -> torch dtype, for every code this torch has."""
    torch = load_torch()
    table = {code: getattr(torch, name, None) for code, name in _TORCH_NAMES.items()}
    return {code: dtype for code, dtype in table.items() if dtype is not None}


@functools.cache
def _codes() -> dict[Any, str]:
    return {dtype: code for code, dtype in torch_dtypes().items()}


def torch_code(dtype: Any) -> str:
    """The safetensors code of a torch dtype; :class:`DtypeError` if safetensors has none."""
    code = _codes().get(dtype)
    if code is None:
        raise DtypeError(f"torch dtype {dtype} has no safetensors equivalent")
    return code


def _torch_dtype(code: str) -> Any:
    found = torch_dtypes().get(code)
    if found is None:
        raise DtypeError(
            f"safetensors dtype {code} has no torch dtype: read it with framework='np'"
        )
    return found


def is_torch_tensor(value: object) -> bool:
    """True for a ``torch.Tensor``; never imports torch (a program without it has none)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def to_torch(array: np.ndarray[Any, Any], code: str) -> Any:
    """``array`` (as the reader delivers a tensor of dtype ``code``) as a torch tensor over the
    same memory. Packed F4 keeps the array's shape, which is torch's ``float4_e2m1fn_x2`` one."""
    torch = load_torch()
    dtype = _torch_dtype(code)
    flat = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return flat.view(dtype).reshape(array.shape)


def torch_to_array(tensor: Any, name: str) -> np.ndarray[Any, Any]:
    """A torch tensor as the numpy array of its safetensors dtype, over its memory when it can be.

    Detached from autograd; copied once only when it must be (another device, not contiguous, a
    lazy conjugate or negation). Sparse, meta and dtype-less tensors raise a
    :class:`~stream_st.SafetensorsError`. F4 comes as its packed ``uint8`` bytes.
    """
    torch = load_torch()
    if tensor.layout != torch.strided:
        raise UsageError(
            f"tensor {name!r} is {tensor.layout}, not dense: make it dense first (.to_dense())"
        )
    if tensor.is_meta:
        raise UsageError(f"tensor {name!r} is on the meta device: it holds no data to write")
    code = torch_code(tensor.dtype)
    dense = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous()
    return _raw_bytes(dense).view(DTYPES[code].numpy).reshape(dense.shape)


def spec_of(name: str, value: Any, array: np.ndarray[Any, Any]) -> TensorSpec:
    """The plan entry of tensor ``name``, given as ``value`` and written as ``array`` (what
    ``value`` became to be written): the array's dtype and shape, but for a torch
    ``float4_e2m1fn_x2`` tensor, whose array holds its packed bytes, F4 with the last dimension
    doubled, as the reference writes it. A 0-d one (two values, no shape to give them) is a
    :class:`~stream_st.UsageError`."""
    if not is_torch_tensor(value) or value.dtype != torch_dtypes().get("F4"):
        return TensorSpec(name, array.dtype, array.shape)
    if not value.dim():
        raise UsageError(
            f"tensor {name!r}: a 0-d float4_e2m1fn_x2 tensor holds two F4 values and has no "
            "safetensors shape: give it a dimension (.reshape(1))"
        )
    return TensorSpec(name, "F4", (*value.shape[:-1], 2 * value.shape[-1]))


def _raw_bytes(tensor: Any) -> np.ndarray[Any, Any]:
    """A contiguous CPU tensor's memory as a 1-D ``uint8`` array (no copy)."""
    raw: np.ndarray[Any, Any] = tensor.detach().reshape(-1).view(load_torch().uint8).numpy()
    return raw


def framework_of(framework: str | None) -> bool:
    """Whether ``framework`` asks for torch tensors; :class:`UsageError` if it is unknown."""
    if framework in (None, "np", "numpy"):
        return False
    if framework in ("pt", "torch"):
        return True
    raise UsageError(f"framework must be 'pt' or 'np', got {framework!r}")


def check_device(device: object) -> None:
    """:class:`UsageError` unless ``device`` is the CPU.

    Loading onto an accelerator goes through the same ``into=`` mechanism (pinned staging
    buffers, each copied to the device while the next tensor arrives); until it can be tested it
    is refused rather than done slowly.
    """
    if device in ("cpu", None) or str(device) == "cpu":
        return
    raise UsageError(
        f"device={device!r} is not supported yet: tensors are loaded on the CPU "
        "(move them with .to(device) afterwards)"
    )


class Delivery:
    """Where each tensor of a read lands and what it is handed out as.

    ``into`` maps names to memory the caller owns: a torch tensor or numpy array of the tensor's
    dtype and shape, or any writable contiguous buffer of exactly its bytes. Those tensors are
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
            raise TensorNotFoundError(f"into= names tensors not in the header: {missing[:8]}")

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

    def deliver(self, info: TensorInfo, array: np.ndarray[Any, Any], placed: bool) -> Any:
        """What the reader hands out for ``info``, filled into ``array``; ``placed`` when that
        is the caller's memory (:meth:`target`)."""
        given = self.into.get(info.name) if placed else None
        if self.torch:
            return given if is_torch_tensor(given) else to_torch(array, info.dtype)
        return given if isinstance(given, np.ndarray) else array

    @staticmethod
    def _mismatch(info: TensorInfo, what: str) -> UsageError:
        return UsageError(
            f"into={info.name!r}: the file holds {info.dtype} {list(info.shape)}, "
            f"the memory given is {what}"
        )

    def _tensor_array(self, info: TensorInfo, tensor: Any) -> np.ndarray[Any, Any]:
        expected = (_torch_dtype(info.dtype), info.array_shape)
        if (tensor.dtype, tuple(tensor.shape)) != expected:
            raise self._mismatch(info, f"a {tensor.dtype} tensor of shape {list(tensor.shape)}")
        if tensor.device.type != "cpu" or not tensor.is_contiguous() or tensor.is_meta:
            raise self._mismatch(info, f"not contiguous CPU memory ({tensor.device})")
        return _raw_bytes(tensor).view(info.array_dtype).reshape(info.array_shape)

    def _checked_array(self, info: TensorInfo, array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if (array.dtype, array.shape) != (info.array_dtype, info.array_shape):
            raise self._mismatch(info, f"a {array.dtype} array of shape {array.shape}")
        if not (array.flags.c_contiguous and array.flags.writeable):
            raise self._mismatch(info, "not writable C-contiguous memory")
        return array

    def _buffer_array(self, info: TensorInfo, buffer: Any) -> np.ndarray[Any, Any]:
        try:
            view = memoryview(buffer)
        except TypeError:
            raise self._mismatch(info, f"a {type(buffer).__name__}, not a buffer") from None
        if view.readonly or not view.c_contiguous or view.nbytes != info.nbytes:
            raise self._mismatch(
                info, f"{view.nbytes} bytes{' read-only' if view.readonly else ''}"
            )
        raw = np.frombuffer(view.cast("B"), dtype=np.uint8)
        return raw.view(info.array_dtype).reshape(info.array_shape)
