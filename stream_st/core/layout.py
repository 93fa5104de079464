"""Laying out a plan: the reference writer's order, and the header bytes and offsets of a plan.

A plan is a list of :class:`TensorSpec` (name, dtype, shape); :func:`build_header` turns it into
the bytes that precede the data (prefix and padded JSON) and the :class:`~stream_st.Header` that
says where every tensor goes, before any data exists. No I/O.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import HeaderError, UsageError
from .dtypes import dtype_for
from .header import (
    LENGTH_PREFIX_SIZE,
    METADATA_KEY,
    U64_MAX,
    Header,
    TensorInfo,
    checked_dims,
    data_size,
)

__all__ = ["TensorSpec", "build_header", "framed_header", "plan_order"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One planned tensor: ``dtype`` is a safetensors code or a numpy / ml_dtypes dtype.

    ``shape`` is a sequence of integers (Python or numpy); anything else raises
    :class:`~stream_st.UsageError`.
    """

    name: str
    dtype: str | np.dtype[Any] | type
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise UsageError(f"a tensor name must be a string, got {self.name!r}")
        object.__setattr__(self, "shape", _spec_shape(self.name, self.shape))


def _spec_shape(name: str, shape: Any) -> tuple[int, ...]:
    """``shape`` as a tuple of ints; :class:`UsageError` unless a sequence of integers."""
    if not isinstance(shape, str | bytes):
        try:
            return tuple(operator.index(d) for d in shape)
        except TypeError:
            pass
    raise UsageError(f"tensor {name!r}: shape must be a sequence of integers, got {shape!r}")


def _plan_list(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """``specs`` as a list; :class:`UsageError` unless an iterable of :class:`TensorSpec`."""
    try:
        plan = list(specs)
    except TypeError:
        raise UsageError(f"a plan is a list of TensorSpec, got {type(specs).__name__}") from None
    for spec in plan:
        if not isinstance(spec, TensorSpec):
            raise UsageError(f"a plan lists TensorSpec(name, dtype, shape) entries, got {spec!r}")
    return plan


def plan_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """Order a plan as the reference writer does: descending dtype alignment, then name."""
    return sorted(_plan_list(specs), key=lambda s: (-dtype_for(s.dtype).rank, s.name))


def build_header(
    specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, Header]:
    """Lay out a plan: the bytes to write before the data (prefix and padded JSON) and its Header.

    Tensors are placed back to back in the order given. The JSON is compact, with
    ``__metadata__`` first, padded with spaces to a multiple of 8 as the reference writer does.
    A plan that is not a list of :class:`TensorSpec`, or metadata that is not a mapping, raises
    :class:`UsageError`; a plan no valid header can describe raises :class:`HeaderError`.
    """
    entries: dict[str, Any] = {}
    if metadata is not None:  # even empty: the reference writes "__metadata__":{} too
        if not isinstance(metadata, Mapping):
            raise UsageError(
                f"metadata must be a mapping of strings to strings, got {type(metadata).__name__}"
            )
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise HeaderError(
                    f"metadata must map strings to strings; got {key!r}: {type(value).__name__}"
                )
        entries[METADATA_KEY] = dict(metadata)
    infos: list[TensorInfo] = []
    offset = 0
    for spec in _plan_list(specs):
        if spec.name == METADATA_KEY:
            raise HeaderError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
        if spec.name in entries:
            raise HeaderError(f"tensor {spec.name!r} appears twice in the plan")
        dtype = dtype_for(spec.dtype)
        nbytes = data_size(spec.name, dtype, checked_dims(spec.name, spec.shape))
        if offset + nbytes > U64_MAX:
            raise HeaderError(f"tensor {spec.name!r}: the data section passes 2**64 - 1 bytes")
        info = TensorInfo(spec.name, dtype.code, spec.shape, offset, offset + nbytes)
        entries[spec.name] = {
            "dtype": dtype.code,
            "shape": list(spec.shape),
            "data_offsets": [info.start, info.end],
        }
        infos.append(info)
        offset = info.end
    try:
        text = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate in a name or in metadata
        raise HeaderError(f"names and metadata must be valid Unicode text: {exc}") from None
    prefix = framed_header(text)
    header = Header.from_tensors(infos, metadata or {}, len(prefix) - LENGTH_PREFIX_SIZE)
    return prefix, header


def framed_header(text: bytes) -> bytes:
    """The bytes that precede the data for the JSON header ``text``: its length (a little-endian
    u64) and the text, padded with spaces to a multiple of 8 as the reference writer pads it."""
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text
