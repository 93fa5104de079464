"""A whole message laid out from arrays in memory: the plan of ``{name: array}``, its header, and
each tensor's bytes, for a write at once (:func:`stream_st.save` to a local file, the drop-ins'
``save_file`` and ``save``, a server's reply). No I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Literal

import numpy as np

from ..errors import UsageError
from .arrays import as_array, spec_of
from .dtypes import DType, wire_bytes
from .header import Header
from .layout import (
    TensorSpec,
    _dtype_named,
    _header_of,
    _metadata_members,
    _name_error,
    _plan_list,
    _Row,
    plan_order,
)

__all__ = ["Order", "lay_out", "ordered"]

Order = Literal["plan", "reference"]
"""``"plan"``: tensors laid out in the order given. ``"reference"``: ordered as the reference
writer does (descending dtype alignment, then name), giving byte-identical files."""


def ordered(plan: Iterable[TensorSpec], order: Order) -> list[TensorSpec]:
    """``plan`` as a list, in ``order``; :class:`~stream_st.UsageError` for another order."""
    if order == "reference":
        return plan_order(plan)
    if order == "plan":
        return _plan_list(plan)
    raise UsageError(f"order must be 'plan' or 'reference', got {order!r}")


def lay_out(
    tensors: Mapping[str, Any],
    metadata: Mapping[str, str] | None = None,
    checksums: bool | str = False,
    order: Order = "reference",
) -> tuple[bytes, Header, Iterator[memoryview]]:
    """A message of ``{name: array}`` laid out as :func:`~stream_st.save` lays it out, for a
    write at once with every array in memory: the bytes before the data, the header, and each
    tensor's bytes in header order, made as they are taken (views of the arrays' memory where
    they are contiguous and little-endian, else a copy, one tensor at a time).

    ``order`` and ``checksums`` as for :func:`~stream_st.open_writer`: the digests are computed
    from the arrays, one pass over each, and recorded in the header. The same plan, header and
    errors as :func:`~stream_st.save` of the same dict."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    rows: list[_Row] = []
    found: dict[np.dtype[Any], DType] = {}  # each array dtype's safetensors dtype, found once
    for name, value in tensors.items():
        if type(name) is not str and isinstance(name, str):
            name = str.__str__(name)  # a subclass's ==, hash and repr are not the name's
        if type(value) is np.ndarray:  # most tensors: no torch tensor, nothing to convert
            if not isinstance(name, str):
                raise _name_error(name)
            arrays[name] = value
            dtype = found.get(value.dtype)
            if dtype is None:
                dtype = found[value.dtype] = _dtype_named(name, value.dtype)
            rows.append((name, dtype, value.shape))  # an array's shape: a tuple of ints
        else:  # its dtype found as the streamed writer's plan finds it: after every conversion
            array = arrays[name] = as_array(value, name)
            spec = spec_of(name, value, array)
            rows.append((spec.name, spec.dtype, spec.shape))
    if order == "reference":
        rows.sort(key=_reference_key)
    elif order != "plan":
        raise UsageError(f"order must be 'plan' or 'reference', got {order!r}")
    if checksums is not False:  # imported here: hashing is not needed to write a plain file
        from .digests import Digests, digests_for

        digests = digests_for(checksums)
        if digests is not None:
            digests = Digests.compute(arrays, digests.algorithm)
            metadata = digests.add_to(metadata, [name for name, _, _ in rows])
    else:
        metadata = unrecorded(metadata)
    members = _metadata_members(metadata)
    prefix, header = _header_of(members, rows, metadata, _found)
    return prefix, header, (wire_bytes(arrays[name]) for name in header.names())


def unrecorded(metadata: Mapping[str, str] | None) -> Mapping[str, str] | None:
    """``metadata`` as a file with no digests recorded holds it: a digest record copied from a
    checksummed file's metadata is left out (see
    :func:`~stream_st.core.digests.without_record`)."""
    if not metadata:
        return metadata
    from .digests import without_record  # imported here: hashing is not needed to write

    return without_record(metadata)


def _found(name: str, dtype: Any) -> DType:
    """The dtype of a row of :func:`lay_out`: the one found already for an array, else the one
    its plan entry names (:class:`~stream_st.DtypeError` naming tensor ``name`` if none)."""
    return dtype if isinstance(dtype, DType) else _dtype_named(name, dtype)


def _reference_key(row: _Row) -> tuple[int, str]:
    """The reference writer's order of rows (as :func:`~stream_st.core.layout.plan_order`
    orders a plan): descending dtype alignment, then name."""
    name, dtype, _ = row
    return -_found(name, dtype).rank, name
