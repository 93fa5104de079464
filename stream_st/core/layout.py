"""Laying out a plan: the reference writer's order, and the header bytes and offsets of a plan.

A plan is a list of :class:`TensorSpec` (name, dtype, shape); :func:`build_header` turns it into
the bytes that precede the data (prefix and padded JSON) and the :class:`~stream_st.Header` that
says where every tensor goes, before any data exists. No I/O.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from json.encoder import encode_basestring
from typing import Any, SupportsIndex, cast

import numpy as np

from ..errors import ArgumentTypeError, DtypeError, HeaderError, HeaderTooLargeError, UsageError
from .dtypes import DType, dtype_for
from .header import (
    _SHORT,
    DEFAULT_MAX_HEADER_SIZE,
    LENGTH_PREFIX_SIZE,
    METADATA_KEY,
    U64_MAX,
    Header,
    TensorTable,
    checked_dims,
    data_size,
)

__all__ = ["TensorSpec", "build_header", "framed_header", "integer_shape", "plan_order"]


@dataclass(frozen=True, slots=True, init=False)
class TensorSpec:
    """One planned tensor: ``dtype`` is a safetensors code or a numpy / ml_dtypes dtype.

    ``name`` is a string (kept as a plain ``str``: a subclass's comparisons could let a name
    pass twice) and ``shape`` a sequence of integers (Python or numpy); anything else raises
    :class:`~stream_st.ArgumentTypeError` (a :class:`~stream_st.UsageError` and a
    ``TypeError``).
    """

    name: str
    dtype: str | np.dtype[Any] | type
    shape: tuple[int, ...]

    def __init__(self, name: str, dtype: str | np.dtype[Any] | type, shape: Sequence[int]) -> None:
        # Written out, not generated: a plan of many small tensors makes a spec for each, and
        # the frozen dataclass's own __init__ and __post_init__ took twice as long.
        if type(name) is not str:
            if not isinstance(name, str):
                raise _name_error(name)
            name = str.__str__(name)  # a subclass's ==, hash and repr are not the name's
        _set = object.__setattr__
        _set(self, "name", name)
        _set(self, "dtype", dtype)
        try:
            _set(self, "shape", integer_shape(shape))
        except ArgumentTypeError as exc:
            raise ArgumentTypeError(f"tensor {name!r}: {exc}") from None

    def __repr__(self) -> str:
        """The spec with its name and shape shortened (reprlib): a few hundred characters,
        whatever the name."""
        return (
            f"TensorSpec(name={_SHORT.repr(self.name)}, dtype={_SHORT.repr(self.dtype)}, "
            f"shape={_SHORT.repr(self.shape)})"
        )


def _name_error(name: object) -> ArgumentTypeError:
    """The error for a tensor name that is not a string."""
    return ArgumentTypeError(f"a tensor name must be a string, got {name!r}")


def integer_shape(shape: object) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, each taken by ``__index__`` as Python takes an index (a
    numpy integer is one, a float or a string is not); :class:`~stream_st.ArgumentTypeError`
    unless it is a sequence of integers."""
    if not isinstance(shape, str | bytes):
        try:
            return tuple(map(operator.index, cast(Iterable[SupportsIndex], shape)))
        except TypeError as exc:
            reason = f" ({exc})"
    else:
        reason = ""
    raise ArgumentTypeError(f"shape must be a sequence of integers, got {shape!r}{reason}")


def _plan_list(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """``specs`` as a list; :class:`UsageError` unless an iterable of :class:`TensorSpec`."""
    try:
        plan = list(specs)
    except ArgumentTypeError:
        raise  # a spec made while listing them was refused: that says more
    except TypeError:
        raise UsageError(f"a plan is a list of TensorSpec, got {type(specs).__name__}") from None
    for spec in plan:
        if not isinstance(spec, TensorSpec):
            raise UsageError(f"a plan lists TensorSpec(name, dtype, shape) entries, got {spec!r}")
    return plan


def _dtype_of(spec: TensorSpec) -> DType:
    """The dtype of a planned tensor; a :class:`~stream_st.DtypeError` naming the tensor (one
    of a dict of many arrays) if safetensors cannot carry it."""
    return _dtype_named(spec.name, spec.dtype)


def _dtype_named(name: str, dtype: Any) -> DType:
    """The dtype ``dtype`` names (a safetensors code, a numpy / ml_dtypes dtype) for tensor
    ``name``; a :class:`~stream_st.DtypeError` naming the tensor if safetensors has none."""
    try:
        return dtype_for(dtype)
    except DtypeError as exc:
        raise DtypeError(f"tensor {name!r}: {exc}") from None


def plan_order(specs: Iterable[TensorSpec]) -> list[TensorSpec]:
    """Order a plan as the reference writer does: descending dtype alignment, then name."""
    return sorted(_plan_list(specs), key=lambda s: (-_dtype_of(s).rank, s.name))


_compact = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
"""A value as compact JSON, non-ASCII text kept (as the reference writes it): what ``json.dumps``
with these arguments gives, through one encoder made once (``dumps`` makes one each call)."""


_Row = tuple[str, Any, tuple[int, ...]]
"""A planned tensor as :func:`_header_of` takes it: its name, its dtype (as ``dtype_of`` there
takes it) and its shape (a tuple of ints)."""


_SPEC_FIELDS = ("name", "dtype", "shape")
"""The attributes of a spec that make its row."""

_FIELDS = cast(Callable[[TensorSpec], _Row], operator.attrgetter(*_SPEC_FIELDS))
"""A spec's row (in C)."""


def build_header(
    specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, Header]:
    """Lay out a plan: the bytes to write before the data (prefix and padded JSON) and its Header.

    Tensors are placed back to back in the order given. The JSON is compact, with
    ``__metadata__`` first, padded with spaces to a multiple of 8 as the reference writer does:
    the text ``json.dumps`` writes, made member by member (each distinct dtype and shape
    checked and written once).
    A plan that is not a list of :class:`TensorSpec`, or metadata that is not a mapping, raises
    :class:`UsageError`; a plan no valid header can describe raises :class:`HeaderError` (a
    :class:`~stream_st.HeaderTooLargeError` for a header no reader takes, see
    :func:`framed_header`).
    """
    members = _metadata_members(metadata)
    return _header_of(members, _plan_list(specs), metadata, _dtype_named, specs=True)


def _metadata_members(metadata: Mapping[str, str] | None) -> list[str]:
    """The JSON object's first members, as ``json.dumps`` writes them: ``__metadata__``'s, if
    ``metadata`` is not None (even empty: the reference writes ``"__metadata__":{}`` too);
    :class:`UsageError` for metadata that is not a mapping, :class:`HeaderError` for one that
    does not map strings to strings."""
    if metadata is None:
        return []
    if not isinstance(metadata, Mapping):
        raise UsageError(
            f"metadata must be a mapping of strings to strings, got {type(metadata).__name__}"
        )
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            got = (
                f"{key!r:.80}: {type(value).__name__}"
                if isinstance(key, str)
                else f"a key of type {type(key).__name__}, {key!r:.80}"
            )
            raise HeaderError(f"metadata must map strings to strings; got {got}")
    return [f'"{METADATA_KEY}":{_compact(dict(metadata))}']


def _header_of(
    members: list[str],
    rows: list[Any],
    metadata: Mapping[str, str] | None,
    dtype_of: Callable[[str, Any], DType],
    *,
    specs: bool = False,
) -> tuple[bytes, Header]:
    """:func:`build_header`'s result for ``rows`` placed back to back in the order given (each
    a :data:`_Row`, or a :class:`TensorSpec` where ``specs``), after ``members``
    (:func:`_metadata_members` of ``metadata``, checked): each row's name checked (not
    ``__metadata__``, not twice), then its dtype found by ``dtype_of(name, dtype)``, then its
    size (each distinct dtype and shape checked and written once).

    A plain plan is laid out by the compiled module where it was built
    (:func:`stream_st.core._compact.laid`: a third of the loop's instructions, with the same
    calls of ``dtype_of`` and :func:`_layout`); any other, by the loop here
    (:func:`_laid_here`), which raises what is wrong. A plan the module declines part way (a
    later name JSON escapes, say) is laid out again from its first row by the loop: the rows
    before it are looked up a second time."""
    attrs = _SPEC_FIELDS if specs else None
    laid = _LAID(rows, attrs, ",".join(members), dtype_of, _layout) if _LAID else None
    if laid is not None:
        text, names, codes, shapes, starts, ends, positions = laid
    else:
        text, (names, codes, shapes, starts, ends), positions = _laid_here(
            members, map(_FIELDS, rows) if specs else rows, dtype_of
        )
    prefix = framed_header(text)
    table = TensorTable(names, codes, shapes, starts, ends)  # every dtype a known one
    size = len(prefix) - LENGTH_PREFIX_SIZE
    header = Header(table, dict(metadata or {}), size, positions, has_metadata=metadata is not None)
    return prefix, header


def _laid_here(
    members: list[str], rows: Iterable[_Row], dtype_of: Callable[[str, Any], DType]
) -> tuple[bytes, tuple[list[Any], ...], dict[str, int]]:
    """:func:`_header_of`'s layout in Python: the header's text, its five columns and each
    name's position."""
    names: list[str] = []  # the header's columns, as a TensorTable holds them
    codes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    starts: list[int] = []
    ends: list[int] = []
    positions: dict[str, int] = {}  # each name's position (the header's index of names)
    offset = 0
    found: tuple[object, DType] | None = None  # the row before's dtype, as given and as found
    layouts: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}  # each checked once
    for name, given, shape in rows:
        if name == METADATA_KEY:
            raise HeaderError(f"{METADATA_KEY!r} is reserved and cannot name a tensor")
        if name in positions:
            raise HeaderError(f"tensor {name!r} appears twice in the plan")
        positions[name] = len(names)
        if found is None or given is not found[0]:  # most plans: one dtype object throughout
            found = given, dtype_of(name, given)
        dtype = found[1]
        layout = layouts.get((dtype.code, shape))
        if layout is None:
            layout = layouts[dtype.code, shape] = _layout(name, dtype, shape)
        nbytes, fields = layout
        end = offset + nbytes
        if end > U64_MAX:
            raise HeaderError(f"tensor {name!r}: the data section passes 2**64 - 1 bytes")
        members.append(f"{encode_basestring(name)}:{fields}{offset},{end}]}}")
        names.append(name)
        codes.append(dtype.code)
        shapes.append(shape)
        starts.append(offset)
        ends.append(end)
        offset = end
    try:
        text = ("{" + ",".join(members) + "}").encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate in a name or in metadata
        raise HeaderError(f"names and metadata must be valid Unicode text: {exc}") from None
    return text, (names, codes, shapes, starts, ends), positions


def _layout(name: str, dtype: DType, shape: tuple[int, ...]) -> tuple[int, str]:
    """The size of tensor ``name`` of ``dtype`` and ``shape`` (checked), and its header
    member's text up to its offsets."""
    dims = checked_dims(name, shape)  # ints (a plan's and an array's shapes are)
    nbytes = data_size(name, dtype, dims)
    shape_text = ",".join(map(str, dims))  # as JSON writes them: a tenth of its time
    return nbytes, f'{{"dtype":"{dtype.code}","shape":[{shape_text}],"data_offsets":['


def _compiled_laid() -> Callable[..., Any] | None:
    """:func:`stream_st.core._compact.laid`; None where the package was installed without it
    (no C compiler at hand): the Python loop then lays out every plan."""
    try:
        from ._compact import laid
    except ImportError:
        return None
    return laid


_LAID = _compiled_laid()


def framed_header(text: bytes) -> bytes:
    """The bytes that precede the data for the JSON header ``text``: its length (a little-endian
    u64) and the text, padded with spaces to a multiple of 8 as the reference writer pads it.

    A header over :data:`~stream_st.core.header.DEFAULT_MAX_HEADER_SIZE` bytes, padded, is a
    :class:`~stream_st.HeaderTooLargeError`: the reference refuses to write it, and no reader
    with its default limit (the reference's, stream_st's) would read it back."""
    size = len(text) + -len(text) % 8
    if size > DEFAULT_MAX_HEADER_SIZE:
        raise HeaderTooLargeError(size, DEFAULT_MAX_HEADER_SIZE, writing=True)
    text += b" " * (size - len(text))
    return struct.pack("<Q", len(text)) + text
