"""The sans-IO core: parse and validate safetensors headers, and build them from a plan.

Nothing here performs I/O or awaits, so every transport reuses it and it can be fuzzed directly.

Layout of a safetensors file::

    [ N: u64 little-endian ][ N bytes of UTF-8 JSON, space padded ][ data: tensors back to back ]

The JSON object maps tensor names to ``{"dtype", "shape", "data_offsets": [start, end]}`` with
offsets relative to the start of the data section, plus an optional ``"__metadata__"`` map of
strings to strings.
"""

from __future__ import annotations

import json
import operator
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from .dtypes import DType, array_shape, dtype_for, dtype_from_code
from .errors import HeaderError, HeaderTooLargeError, TensorNotFoundError, UsageError

__all__ = [
    "DEFAULT_MAX_HEADER_SIZE",
    "LENGTH_PREFIX_SIZE",
    "METADATA_KEY",
    "Header",
    "TensorInfo",
    "TensorSpec",
    "build_header",
    "decode_json",
    "parse_header",
    "parse_header_length",
]

LENGTH_PREFIX_SIZE = 8
"""Bytes of the little-endian u64 that precedes the JSON header."""

DEFAULT_MAX_HEADER_SIZE = 100_000_000
"""The reference implementation's limit on the JSON header length."""

METADATA_KEY = "__metadata__"

_U64_MAX = 2**64 - 1
_NUMPY_MAX_NDIM = 64 if np.lib.NumpyVersion(np.__version__) >= "2.0.0" else 32
_NUMPY_MAX_BYTES = int(np.iinfo(np.intp).max)
_TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor of a header. ``start`` and ``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes in the data section."""
        return self.end - self.start

    @property
    def nelements(self) -> int:
        """Number of values (1 for a scalar, 0 for an empty tensor)."""
        return prod(self.shape)

    @property
    def dtype_info(self) -> DType:
        """The :class:`~stream_st.dtypes.DType` row for this tensor's dtype code."""
        return dtype_from_code(self.dtype)

    @property
    def array_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the array this tensor is delivered as."""
        return self.dtype_info.numpy

    @property
    def array_shape(self) -> tuple[int, ...]:
        """The shape of the array this tensor is delivered as (differs for packed F4/F6)."""
        return array_shape(self.dtype_info, self.shape)


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


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed, fully validated header.

    ``tensors`` is in offset order; ``header_size`` is N, the JSON length (padding included);
    ``data_size`` is the length of the data section, i.e. the end offset of the last tensor.
    """

    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]
    header_size: int
    _index: dict[str, TensorInfo] = field(repr=False, compare=False)

    @classmethod
    def from_tensors(
        cls, tensors: Iterable[TensorInfo], metadata: Mapping[str, str], header_size: int
    ) -> Header:
        ordered = tuple(tensors)
        return cls(ordered, dict(metadata), header_size, {t.name: t for t in ordered})

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data section: 8 + N."""
        return LENGTH_PREFIX_SIZE + self.header_size

    @property
    def data_size(self) -> int:
        return self.tensors[-1].end if self.tensors else 0

    @property
    def file_size(self) -> int:
        """Total bytes of the file: prefix, header and data."""
        return self.data_start + self.data_size

    def names(self) -> list[str]:
        """Tensor names in offset order."""
        return [t.name for t in self.tensors]

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self._index[name]
        except KeyError:
            raise TensorNotFoundError(f"no tensor named {name!r} in the header") from None

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


def parse_header_length(
    prefix: bytes | bytearray | memoryview, *, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
) -> int:
    """Decode the 8-byte length prefix and check it against ``max_header_size``.

    Raises :class:`HeaderError` for fewer than 8 bytes or an empty header and
    :class:`HeaderTooLargeError` before anything is allocated for an oversized one.
    """
    if len(prefix) < LENGTH_PREFIX_SIZE:
        raise HeaderError(
            f"a safetensors file starts with an 8-byte header length; got only {len(prefix)} bytes"
        )
    (n,) = struct.unpack("<Q", bytes(prefix[:LENGTH_PREFIX_SIZE]))
    if n > max_header_size:
        raise HeaderTooLargeError(n, max_header_size)
    if n < 2:
        raise HeaderError(f"header length {n} is too small to hold a JSON object")
    return int(n)


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise HeaderError(f"duplicate key {key!r} in the JSON header")
        result[key] = value
    return result


def _refuse_constant(name: str) -> Any:
    raise HeaderError(f"{name} is not valid JSON")


_STRICT_JSON: dict[str, Any] = {
    "object_pairs_hook": _refuse_duplicates,
    "parse_constant": _refuse_constant,
}


def decode_json(text: str | bytes, what: str, *, strict: bool = False) -> Any:
    """Parse the JSON document ``text``; :class:`HeaderError` naming ``what`` if it is invalid.

    Covers what escapes :func:`json.loads` on hostile input: nesting too deep for the parser
    (``RecursionError``), undecodable bytes and integers too long to convert. ``strict`` also
    refuses duplicate keys at any level and NaN / Infinity, as a safetensors header must.
    """
    try:
        return json.loads(text, **(_STRICT_JSON if strict else {}))
    except HeaderError:
        raise
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
        raise HeaderError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise HeaderError(f"{what} JSON is nested too deeply") from None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_metadata(value: object) -> dict[str, str]:
    if not isinstance(value, dict):
        raise HeaderError(f"{METADATA_KEY} must be a JSON object, got {type(value).__name__}")
    for key, item in value.items():
        if not isinstance(item, str):
            raise HeaderError(
                f"{METADATA_KEY}[{key!r}] must be a string, got {type(item).__name__}"
            )
    return value


def _parse_tensor(name: str, entry: object) -> tuple[TensorInfo, DType]:
    if not isinstance(entry, dict):
        raise HeaderError(
            f"tensor {name!r}: entry must be a JSON object, got {type(entry).__name__}"
        )
    missing = _TENSOR_FIELDS - entry.keys()
    if missing:
        raise HeaderError(f"tensor {name!r}: missing field(s) {sorted(missing)}")
    unknown = entry.keys() - _TENSOR_FIELDS
    if unknown:
        raise HeaderError(f"tensor {name!r}: unknown field(s) {sorted(unknown)}")
    try:
        dtype = dtype_from_code(entry["dtype"])
    except Exception as exc:
        raise HeaderError(f"tensor {name!r}: {exc}") from None
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _U64_MAX for d in shape):
        raise HeaderError(
            f"tensor {name!r}: shape must be a list of non-negative integers, got {shape!r}"
        )
    offsets = entry["data_offsets"]
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) and 0 <= o <= _U64_MAX for o in offsets)
    ):
        raise HeaderError(
            f"tensor {name!r}: data_offsets must be exactly two non-negative integers, "
            f"got {offsets!r}"
        )
    start, end = offsets
    return TensorInfo(name, dtype.code, tuple(shape), start, end), dtype


def _check_numpy_limits(name: str, dtype: DType, shape: tuple[int, ...]) -> None:
    """Refuse a shape whose array (:func:`~stream_st.dtypes.array_shape`) numpy cannot make.

    numpy caps the number of dimensions (64; 32 before numpy 2) and, even for an empty array,
    the product of the nonzero dimensions times the item size (the largest ``intp``).
    """
    delivered = array_shape(dtype, shape)
    if len(delivered) > _NUMPY_MAX_NDIM:
        raise HeaderError(
            f"tensor {name!r}: {len(delivered)} dimensions, more than the {_NUMPY_MAX_NDIM} "
            "a numpy array can have"
        )
    if prod(d for d in delivered if d) * dtype.numpy.itemsize > _NUMPY_MAX_BYTES:
        raise HeaderError(
            f"tensor {name!r}: shape {list(shape)} x {dtype.code} is too large for a numpy "
            f"array (its nonzero dimensions span more than {_NUMPY_MAX_BYTES} bytes)"
        )


def parse_header(raw: bytes | bytearray | memoryview) -> Header:
    """Parse and fully validate the N header bytes (without the 8-byte prefix).

    Checks UTF-8, a leading ``{``, strict JSON (no duplicate keys at any level, no NaN), every
    tensor entry's fields and types, dtype codes, sizes against dtype x shape (sub-byte types must
    fill whole bytes), that the offsets tile the data section from 0 with no hole or overlap, and
    that numpy can hold every shape (at most 64 dimensions, 32 before numpy 2; nonzero dimensions
    x item size within the largest ``intp``, even for an empty tensor).
    """
    header_size = len(raw)
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.startswith("{"):
        raise HeaderError(f"header must begin with '{{', begins with {text[:16]!r}")
    obj = decode_json(text, "header", strict=True)
    if not isinstance(obj, dict):  # pragma: no cover - a leading '{' guarantees an object
        raise HeaderError("header must be a JSON object")

    metadata: dict[str, str] = {}
    parsed: list[tuple[TensorInfo, DType]] = []
    for key, value in obj.items():
        if key == METADATA_KEY:
            metadata = _parse_metadata(value)
        else:
            parsed.append(_parse_tensor(key, value))

    parsed.sort(key=lambda item: (item[0].start, item[0].end))
    expected_start = 0
    for info, dtype in parsed:
        if info.start != expected_start or info.end < info.start:
            problem = (
                "reversed"
                if info.end < info.start
                else "leave a hole"
                if info.start > expected_start
                else "overlap the previous tensor"
            )
            raise HeaderError(
                f"tensor {info.name!r}: data_offsets [{info.start}, {info.end}] {problem}; "
                f"expected it to start at {expected_start}"
            )
        nbytes = dtype.nbytes(info.nelements)
        if nbytes is None:
            raise HeaderError(
                f"tensor {info.name!r}: {info.nelements} values of {dtype.code} "
                f"({dtype.bits} bits) are not a whole number of bytes"
            )
        if nbytes != info.nbytes:
            raise HeaderError(
                f"tensor {info.name!r}: shape {list(info.shape)} x {dtype.code} needs {nbytes} "
                f"bytes but data_offsets [{info.start}, {info.end}] span {info.nbytes}"
            )
        _check_numpy_limits(info.name, dtype, info.shape)
        expected_start = info.end
    return Header.from_tensors((info for info, _ in parsed), metadata, header_size)


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
        if any(d < 0 for d in spec.shape):
            raise HeaderError(f"tensor {spec.name!r}: negative dimension in {list(spec.shape)}")
        nbytes = dtype.nbytes(prod(spec.shape))
        if nbytes is None:
            raise HeaderError(
                f"tensor {spec.name!r}: {prod(spec.shape)} values of {dtype.code} are not a "
                "whole number of bytes"
            )
        _check_numpy_limits(spec.name, dtype, spec.shape)
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
    text += b" " * (-len(text) % 8)
    header = Header.from_tensors(infos, metadata or {}, len(text))
    return struct.pack("<Q", len(text)) + text, header
