"""Framework adapters: torch dtypes (named in the one table, :mod:`.dtypes`), zero-copy
numpy <-> torch views, and where a read tensor lands (``open_stream(framework=..., into=...)``).

torch is imported only when asked for (``framework="pt"``, a torch tensor given to a writer), so
``import stream_st`` stays light. A tensor read for torch is the numpy array the reader filled,
seen as a torch tensor over the same memory: no copy beyond the one from the wire. A torch tensor
written is seen as a numpy array over its memory: detached, moved to the CPU and made contiguous
only when it is not already (one copy then). Not public API.
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Sequence
from typing import Any, Literal, SupportsIndex

import numpy as np

from ..errors import (
    ArgumentTypeError,
    DeviceError,
    DtypeError,
    UnsupportedDeviceError,
    UnsupportedFrameworkError,
    UsageError,
)
from .dtypes import DTYPES
from .layout import TensorSpec

__all__ = [
    "Framework",
    "TorchlessDtypeError",
    "as_array",
    "framework_of",
    "is_torch_tensor",
    "load_torch",
    "one_cpu",
    "spec_of",
    "to_torch",
    "torch_code",
    "torch_device",
    "torch_dtypes",
    "torch_shape",
    "torch_to_array",
]

Framework = Literal["np", "numpy", "pt", "torch", "pytorch"]
"""What tensors are handed out as: numpy arrays (``"np"``, ``"numpy"``) or torch tensors
(``"pt"``, ``"torch"``, ``"pytorch"``), as the reference's ``framework=`` names them."""

_OTHER_FRAMEWORKS = ("tf", "tensorflow", "flax", "jax", "mlx", "paddle")
"""The reference's other ``framework=`` names, whose tensors stream_st does not hand out."""


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
    table = {code: getattr(torch, row.torch, None) for code, row in DTYPES.items() if row.torch}
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


class TorchlessDtypeError(DtypeError):
    """A safetensors dtype code this torch has no dtype for (``F6_E2M3``): told apart so that
    the torch drop-in's ``load`` raises it as the reference does (a ``KeyError``)."""


def torch_dtype(code: str) -> Any:
    found = torch_dtypes().get(code)
    if found is None:
        raise TorchlessDtypeError(
            f"safetensors dtype {code} has no torch dtype: read it with framework='np'"
        )
    return found


def is_torch_tensor(value: object) -> bool:
    """True for a ``torch.Tensor``; never imports torch (a program without it has none)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def torch_shape(code: str, shape: Sequence[int]) -> tuple[int, ...]:
    """The shape of the torch tensor holding a tensor of dtype ``code`` and ``shape`` (as the
    header gives it): ``shape`` itself, but F4's last dimension halved, as torch's
    ``float4_e2m1fn_x2`` holds two values an element. An F4 tensor whose last dimension is odd
    has no torch shape: :class:`DtypeError`, with the reference's message."""
    if code != "F4":
        return tuple(shape)
    if not shape or shape[-1] % 2:
        raise DtypeError(
            f"f4_x2 dtype requires that the last dim be divisible by 2 in torch: got {list(shape)}"
        )
    return (*shape[:-1], shape[-1] // 2)


def to_torch(array: np.ndarray[Any, Any], code: str, shape: Sequence[int]) -> Any:
    """``array`` (as the reader delivers a tensor of dtype ``code`` and ``shape``) as a torch
    tensor over the same memory, of :func:`torch_shape`."""
    torch = load_torch()
    dtype = torch_dtype(code)
    wanted = torch_shape(code, shape)
    flat = torch.from_numpy(array.reshape(-1).view(np.uint8))
    return flat.view(dtype).reshape(wanted)


def torch_to_array(tensor: Any, name: str) -> np.ndarray[Any, Any]:
    """A torch tensor as the numpy array of its safetensors dtype, over its memory when it can be.

    Detached from autograd; copied once only when it must be (another device, not contiguous, a
    lazy conjugate or negation). Sparse, nested, meta and dtype-less tensors raise a
    :class:`~stream_st.SafetensorsError`. F4 comes as its packed ``uint8`` bytes.
    """
    torch = load_torch()
    if tensor.layout != torch.strided:
        raise UsageError(
            f"tensor {name!r} is {tensor.layout}, not dense: make it dense first (.to_dense())"
        )
    if tensor.is_meta:
        raise UsageError(f"tensor {name!r} is on the meta device: it holds no data to write")
    if tensor.is_nested:  # strided, yet of no one shape
        raise UsageError(
            f"tensor {name!r} is a nested tensor, of no one shape: save each of its tensors "
            "(.unbind()) or a padded one (.to_padded_tensor(0))"
        )
    code = torch_code(tensor.dtype)
    dense = tensor.detach().resolve_conj().resolve_neg().cpu().contiguous()
    try:
        return raw_bytes(dense).view(DTYPES[code].numpy).reshape(dense.shape)
    except ValueError as exc:  # more dimensions, or more elements, than numpy holds
        raise UsageError(
            f"tensor {name!r} ({dense.dim()} dimensions of {dense.numel()} elements) cannot be "
            f"written: stream_st writes through numpy arrays, which cannot have its shape ({exc})"
        ) from None


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


def raw_bytes(tensor: Any) -> np.ndarray[Any, Any]:
    """A contiguous CPU tensor's memory as a 1-D ``uint8`` array (no copy). Taken as one run of
    elements, whatever the strides of its dimensions of size 1 (torch calls a tensor of shape
    ``(1,)`` and stride ``(2,)`` contiguous, and will not view it as bytes)."""
    flat = tensor.detach().as_strided((tensor.numel(),), (1,))
    raw: np.ndarray[Any, Any] = flat.view(load_torch().uint8).numpy()
    return raw


def framework_of(framework: str | None, *, required: bool = False) -> bool:
    """Whether ``framework`` asks for torch tensors (``"pt"``, ``"torch"``, ``"pytorch"``) or
    numpy arrays (``"np"``, ``"numpy"``, None unless ``required``, as the reference's
    ``safe_open`` has it); :class:`~stream_st.errors.UnsupportedFrameworkError` (an
    ``ImportError`` too) for another of the reference's (``"flax"``, ``"tf"``...),
    :class:`UsageError` for another name, :class:`ArgumentTypeError` for what is not a name."""
    if (framework is None and not required) or framework in ("np", "numpy"):
        return False
    if framework in ("pt", "torch", "pytorch"):
        return True
    if not isinstance(framework, str):
        raise ArgumentTypeError(
            f"framework must be a name ('pt' or 'np'), got {type(framework).__name__}"
        )
    if framework in _OTHER_FRAMEWORKS:
        raise UnsupportedFrameworkError(
            f"framework={framework!r} is not supported: stream_st hands out torch tensors ('pt') "
            "and numpy arrays ('np'); read with 'np' and convert the arrays"
        )
    raise UsageError(f"framework must be 'pt' or 'np', got {framework!r}")


def one_cpu(device: object, index: int | None) -> None:
    """Refuse ``device``, the CPU of ``index``, unless it is the one (``index`` None or 0):
    a :class:`~stream_st.errors.DeviceError` (a ``ValueError`` too), as the reference refuses
    ``"cpu:1"``."""
    if index not in (None, 0):
        raise DeviceError(f"device={device!r}: there is one CPU device, 'cpu' (or 'cpu:0')")


def _cuda_index(device: object) -> int:
    """``device`` given as a CUDA index: an ``int`` or what stands for one (a numpy integer),
    as the reference takes it, but not a ``bool``; anything else (``b"cpu"``, ``1.0``) is
    refused with a :class:`~stream_st.errors.DeviceError` worded as the reference's
    ``SafetensorError`` (``device b'cpu' is invalid``)."""
    if isinstance(device, SupportsIndex) and not isinstance(device, bool):
        return operator.index(device)
    raise DeviceError(
        f"device {device!r} is invalid: a device is a name ('cpu', 'cuda:1'), a CUDA index "
        f"or a torch.device, not {type(device).__name__}"
    )


def torch_device(device: object) -> Any | None:
    """The ``torch.device`` tensors are handed out on, or None for the CPU (where they are
    received). ``device`` is what the reference takes: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` (a
    ``str``, or a subclass of it), a CUDA index (``0``, not ``True``); and beyond it
    ``"cpu:0"`` or a ``torch.device``. Another type (``b"cpu"``), a name torch does not know,
    or a CPU but the one (``"cpu:1"``), which the reference refuses too, is a
    :class:`~stream_st.errors.DeviceError` (a ``ValueError`` too, as the reference's),
    a device neither the CPU nor CUDA (``"xla"``) an
    :class:`~stream_st.errors.UnsupportedDeviceError` (a ``NotImplementedError`` too, as torch
    raises for the reference), a device this torch cannot use (no CUDA build, no such GPU) a
    :class:`UsageError`, before anything is read."""
    if device is None or (isinstance(device, str) and device == "cpu"):
        return None
    torch = load_torch()
    named = isinstance(device, (str, torch.device))
    index = None if named else _cuda_index(device)
    try:
        chosen = torch.device(device) if named else torch.device("cuda", index)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise DeviceError(f"device={device!r} is not a device torch knows: {exc}") from None
    if chosen.type == "cpu":
        one_cpu(device, chosen.index)
        return None
    if chosen.type != "cuda":
        raise UnsupportedDeviceError(
            f"device={device!r}: only the CPU and CUDA devices are supported"
        )
    if not torch.cuda.is_available():
        raise UsageError(f"device={device!r}: this torch has no usable CUDA device")
    if chosen.index is not None and chosen.index >= torch.cuda.device_count():
        raise UsageError(f"device={device!r}: there are {torch.cuda.device_count()} CUDA devices")
    return chosen


def as_array(value: Any, name: str) -> np.ndarray[Any, Any]:
    """``np.asarray(value)`` for tensor ``name``; :class:`~stream_st.UsageError` if numpy cannot
    make an array of it (a ragged nested list, an object whose ``__array__`` fails).

    A torch tensor (any dtype safetensors has, BF16 and F8 included) is seen as an array over
    its memory: detached, and made contiguous on the CPU once if it is not already."""
    if is_torch_tensor(value):
        return torch_to_array(value, name)
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"tensor {name!r}: cannot make an array of the {type(value).__name__} given: {exc}"
        ) from None
