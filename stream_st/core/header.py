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
import re
import reprlib
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from json.scanner import make_scanner
from math import prod
from typing import Any, NamedTuple, cast, overload

import numpy as np

from ..errors import DtypeError, HeaderError, HeaderTooLargeError, TensorNotFoundError, UsageError
from .dtypes import DType, array_shape, dtype_for, dtype_from_code

__all__ = [
    "DEFAULT_MAX_HEADER_SIZE",
    "LENGTH_PREFIX_SIZE",
    "METADATA_KEY",
    "Header",
    "TensorInfo",
    "TensorSpec",
    "TensorTable",
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


class TensorInfo(NamedTuple):
    """One tensor of a header. ``start`` and ``end`` are offsets into the data section.

    A named tuple, made when read from its header's :class:`TensorTable`.
    """

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

    def rows(self, start: int, stop: int) -> TensorInfo:
        """This tensor narrowed to rows ``start:stop`` of its first dimension: the same bytes
        for those rows only (a range read of them gives that part of the tensor)."""
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        return TensorInfo(
            self.name,
            self.dtype,
            (stop - start, *self.shape[1:]),
            self.start + start * row_bytes,
            self.start + stop * row_bytes,
        )


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


_Row = tuple[str, str, tuple[int, ...], int, int]
"""A tensor's fields as a plain tuple: ``(name, dtype, shape, start, end)``."""

_to_info = cast(Callable[[_Row], TensorInfo], partial(tuple.__new__, TensorInfo))
"""The :class:`TensorInfo` of a row, made in C: iterating a table is a hot path."""


class TensorTable(Sequence[TensorInfo]):
    """A header's tensors in offset order: a read-only sequence of :class:`TensorInfo`, each
    built when read from a plain tuple of its fields.

    A header of a million tensors kept as a million :class:`TensorInfo` would be a million
    objects the cyclic garbage collector walks at every full collection for as long as the
    header lives: it never untracks a tuple subclass. It untracks a plain tuple of strings,
    ints and such tuples at the first collection that sees it, so a table costs it nothing
    after that. It equals another table, or a tuple, of the same tensors.
    """

    __slots__ = ("_rows",)

    def __init__(self, rows: tuple[_Row, ...]) -> None:
        self._rows = rows

    @classmethod
    def of(cls, tensors: Iterable[TensorInfo]) -> TensorTable:
        """The table of ``tensors``, in the order given."""
        return cls(tuple(cast(Iterator[_Row], map(tuple, tensors))))

    def names(self) -> list[str]:
        """Tensor names in offset order."""
        return [row[0] for row in self._rows]

    @overload
    def __getitem__(self, index: int) -> TensorInfo: ...

    @overload
    def __getitem__(self, index: slice) -> TensorTable: ...

    def __getitem__(self, index: int | slice) -> TensorInfo | TensorTable:
        if isinstance(index, slice):
            return TensorTable(self._rows[index])
        return _to_info(self._rows[index])

    def __iter__(self) -> Iterator[TensorInfo]:
        return map(_to_info, self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return self._rows == other._rows
        if isinstance(other, tuple):
            return self._rows == other  # a row equals the TensorInfo of the same fields
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to tuples, but not one itself

    def __repr__(self) -> str:
        return repr(tuple(self))


def _positions(names: Sequence[str]) -> dict[str, int]:
    """Each name's position in ``names`` (the last, for a name listed twice)."""
    return dict(zip(names, range(len(names)), strict=True))


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed, fully validated header.

    ``tensors`` is a :class:`TensorTable` in offset order; ``header_size`` is N, the JSON
    length (padding included); ``data_size`` is the length of the data section, i.e. the end
    offset of the last tensor.
    """

    tensors: TensorTable
    metadata: dict[str, str]
    header_size: int
    _index: dict[str, int] = field(repr=False, compare=False)
    """Each tensor's position in ``tensors`` by name: strings and ints, so never GC-tracked."""

    @classmethod
    def from_tensors(
        cls, tensors: Iterable[TensorInfo], metadata: Mapping[str, str], header_size: int
    ) -> Header:
        table = TensorTable.of(tensors)
        return cls(table, dict(metadata), header_size, _positions(table.names()))

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
        return self.tensors.names()

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[self._index[name]]
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
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise HeaderError(f"duplicate key {key!r} in the JSON header")
            seen.add(key)
    return result


def _refuse_constant(name: str) -> Any:
    raise HeaderError(f"{name} is not valid JSON")


class _Number(str):
    """A JSON number that is no plain non-negative integer (``1.0``, ``1e3``, ``-0``), kept as
    its text. Never an ``int``, so never a dimension or an offset, as for the reference's parser,
    which reads ``-0`` as the float ``-0.0``; messages show the number as written."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _json_int(digits: str) -> int | _Number:
    return _Number(digits) if digits == "-0" else int(digits)


_NO_CONSTANTS: dict[str, Any] = {"parse_constant": _refuse_constant}
_STRICT_JSON: dict[str, Any] = {
    **_NO_CONSTANTS,
    "object_pairs_hook": _refuse_duplicates,
    "parse_float": _Number,
    "parse_int": _json_int,
}


def decode_json(text: str | bytes, what: str, *, strict: bool = False) -> Any:
    """Parse the JSON document ``text``; :class:`HeaderError` naming ``what`` if it is invalid.

    Covers what escapes :func:`json.loads` on hostile input: nesting too deep for the parser
    (``RecursionError``), undecodable bytes and integers too long to convert. ``strict`` also
    refuses duplicate keys at any level and NaN / Infinity, as a safetensors header must, and
    reads every number but a plain integer (``1.0``, ``-0``) as a :class:`_Number`.
    """
    with _json_errors(what):
        return json.loads(text, **(_STRICT_JSON if strict else {}))


@contextmanager
def _json_errors(what: str) -> Iterator[None]:
    """Turn what :mod:`json` raises on hostile input into :class:`HeaderError`."""
    try:
        yield
    except HeaderError:
        raise
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
        raise HeaderError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise HeaderError(f"{what} JSON is nested too deeply") from None


_BRIEF = reprlib.Repr()
_BRIEF.maxlist = _BRIEF.maxtuple = 8
_BRIEF.maxstring = _BRIEF.maxother = 60


def _brief(value: object) -> str:
    """A short one-line ``repr`` of a parsed value for a message, however large or deep."""
    return _BRIEF.repr(value)


_JSON_TYPES: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    _Number: "a number",
}


def _json_type(value: object) -> str:
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return "a number"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _refuse_surrogates(text: str, what: str) -> None:
    """:class:`HeaderError` if ``text`` holds a lone UTF-16 surrogate (a ``\\ud800`` escape).

    Valid UTF-8 cannot carry one, but a JSON escape can; it is no Unicode text and could not be
    printed or encoded again.
    """
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise HeaderError(
                f"{what} {_brief(text)} holds a lone UTF-16 surrogate "
                f"{exc.object[exc.start]!r}, which is not valid Unicode"
            ) from None


_WHITESPACE = re.compile(r"[ \t\n\r]*")


def _skip_whitespace(text: str, at: int) -> int:
    """The index of the first character at or after ``at`` that is not JSON whitespace."""
    match = _WHITESPACE.match(text, at)
    return match.end() if match else at


_Scan = Callable[[str, int], tuple[Any, int]]
"""json's scanner: the value whose JSON text starts at an index, and the index after it."""


def _scanner(options: dict[str, Any]) -> _Scan:
    """json's (C) scanner, with these :class:`json.JSONDecoder` options."""
    decoder: Any = json.JSONDecoder(**options)
    return cast(_Scan, make_scanner(decoder))


_FAST_SCAN = _scanner({**_NO_CONSTANTS, "parse_float": _Number})
_STRICT_SCAN = _scanner(_STRICT_JSON)
_scanstring = cast(
    Callable[[str, int], tuple[str, int]],
    json.decoder.scanstring,  # type: ignore[attr-defined]  # not in the stubs
)


def _members(text: str) -> Iterator[tuple[str, Any, int, int]]:
    """The members of the JSON object ``text`` (it starts with ``{``), one at a time.

    Yields ``(name, value, start, end)`` where ``text[start:end]`` is the value's JSON text:
    a header is validated as it is parsed, so a bad one is refused at its first bad tensor and
    a big one never exists as a whole as JSON objects. Tensor entries are parsed fast (duplicate
    keys and ``-0`` pass, see :func:`_strict_entry`); ``__metadata__`` strictly.
    """
    ws = _skip_whitespace
    with _json_errors("header"):
        at = ws(text, 1)
        if text.startswith("}", at):
            at += 1
        else:
            while True:
                if not text.startswith('"', at):
                    raise HeaderError(f"header is not valid JSON: expected a name at char {at}")
                name, at = _scanstring(text, at + 1)
                if text[at : at + 1] != ":":
                    at = ws(text, at)
                    if not text.startswith(":", at):
                        raise HeaderError(f"header is not valid JSON: expected ':' at char {at}")
                start = at + 1
                if text[start : start + 1] in _SPACE:
                    start = ws(text, start)
                scan = _STRICT_SCAN if name == METADATA_KEY else _FAST_SCAN
                try:
                    value, at = scan(text, start)
                except StopIteration:
                    raise HeaderError(
                        f"header is not valid JSON: expected a value at char {start}"
                    ) from None
                yield name, value, start, at
                after = text[at : at + 1]
                if after in _SPACE:
                    at = ws(text, at)
                    after = text[at : at + 1]
                if after == "}":
                    at += 1
                    break
                if after != ",":
                    raise HeaderError(
                        f"header is not valid JSON: expected ',' or '}}' at char {at}"
                    )
                at += 1
                if text[at : at + 1] in _SPACE:
                    at = ws(text, at)
        if ws(text, at) != len(text):
            raise HeaderError(f"header is not valid JSON: extra data at char {at}")


_SPACE = " \t\n\r"
"""JSON's whitespace. ``"" in _SPACE`` holds too, which sends the end of the text to the slow
path, where it is handled."""


def _strict_entry(text: str, name: str) -> Any:
    """The tensor entry ``text`` parsed strictly, when its fast parse may differ.

    The fast parse keeps the last of duplicate keys and reads ``-0`` as 0. An entry that passes
    validation hides neither if its text holds exactly 8 ``"`` and no ``-`` (the test
    :func:`_parse_object` makes): its three keys and its dtype are four strings, and a duplicate
    key would add a fifth. Any other entry is parsed again here.
    """
    return decode_json(text, f"tensor {name!r}", strict=True)


def _parse_metadata(value: object) -> dict[str, str]:
    if type(value) is not dict:
        raise HeaderError(f"{METADATA_KEY} must be a JSON object, got {_json_type(value)}")
    for key, item in value.items():
        if type(item) is not str:
            raise HeaderError(f"{METADATA_KEY}[{key!r}] must be a string, got {_json_type(item)}")
        _refuse_surrogates(key, f"{METADATA_KEY} key")
        _refuse_surrogates(item, f"{METADATA_KEY}[{key!r}]")
    return value


_Layout = tuple[str, tuple[int, ...], int]
"""A checked dtype and shape: the dtype code (the table's own string), the shape, the bytes."""

_KNOWN_LAYOUTS = 4096
"""How many distinct (dtype, shape) pairs one parse remembers as checked."""


def _parse_tensor(name: str, entry: Any, known: dict[tuple[Any, ...], _Layout]) -> _Row:
    """Validate one tensor entry; ``known`` caches the layouts already checked by this parse
    (tensors alike share one shape tuple)."""
    try:
        if len(entry) != 3:
            raise KeyError
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError):
        raise _fields_error(name, entry) from None
    if type(shape) is not list or not {*map(type, shape)} <= _INT_ONLY:
        raise _shape_error(name, shape)
    layout = known.get((code, *shape)) if type(code) is str else None
    if layout is None:
        dtype = _header_dtype(name, code)
        dims = _checked_dims(name, shape)
        layout = dtype.code, dims, _data_size(name, dtype, dims)
        if len(known) < _KNOWN_LAYOUTS:
            known[(dtype.code, *dims)] = layout
    code, dims, nbytes = layout
    if type(offsets) is list and len(offsets) == 2:
        start, end = offsets
        if (
            type(start) is int
            and type(end) is int
            and start >= 0
            and end - start == nbytes
            and end <= _U64_MAX
        ):
            return name, code, dims, start, end
    raise _offsets_error(name, offsets, code, dims, nbytes)


def _offsets_error(
    name: str, offsets: object, code: str, dims: tuple[int, ...], nbytes: int
) -> HeaderError:
    """What is wrong with ``data_offsets`` of a tensor of ``nbytes`` bytes."""
    if not (
        type(offsets) is list
        and len(offsets) == 2
        and all(type(o) is int and 0 <= o <= _U64_MAX for o in offsets)
    ):
        return HeaderError(
            f"tensor {name!r}: data_offsets must be exactly two non-negative integers below "
            f"2**64, got {_brief(offsets)}"
        )
    start, end = offsets
    problem = "are reversed" if end < start else f"span {end - start}"
    return HeaderError(
        f"tensor {name!r}: shape {_brief(list(dims))} x {code} needs {nbytes} bytes but "
        f"data_offsets [{start}, {end}] {problem}"
    )


_INT_ONLY = frozenset({int})


def _fields_error(name: str, entry: object) -> HeaderError:
    """What is wrong with a tensor entry that is no object of the three fields."""
    if type(entry) is not dict:
        return HeaderError(f"tensor {name!r}: entry must be a JSON object, got {_json_type(entry)}")
    missing = _TENSOR_FIELDS - entry.keys()
    if missing:
        return HeaderError(f"tensor {name!r}: missing field(s) {sorted(missing)}")
    unknown = sorted(_brief(key) for key in entry.keys() - _TENSOR_FIELDS)
    return HeaderError(f"tensor {name!r}: unknown field(s) {unknown}")


def _shape_error(name: str, shape: object) -> HeaderError:
    return HeaderError(
        f"tensor {name!r}: shape must be a list of non-negative integers below 2**64, "
        f"got {_brief(shape)}"
    )


def _header_dtype(name: str, code: object) -> DType:
    try:
        return dtype_from_code(code)
    except DtypeError as exc:
        raise HeaderError(f"tensor {name!r}: {exc}") from None


def _checked_dims(name: str, shape: Iterable[int]) -> tuple[int, ...]:
    """``shape`` as a tuple; :class:`HeaderError` unless every dimension is in [0, 2**64)."""
    dims = tuple(shape)
    if dims and not (min(dims) >= 0 and max(dims) <= _U64_MAX):
        raise _shape_error(name, list(dims))
    return dims


def _data_size(name: str, dtype: DType, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape`` (dimensions in [0, 2**64)).

    :class:`HeaderError` for a shape no valid file holds: its element or bit count passes
    2**64 - 1 at any step (as the reference checks it, dimension by dimension), a sub-byte type
    that does not fill whole bytes, or an array numpy cannot make (more than 64 dimensions, 32
    before numpy 2; nonzero dimensions x item size past the largest ``intp``, even for an empty
    tensor). Linear in the number of dimensions: it stops at the first step out of range, so no
    number it forms exceeds 2**128.
    """
    count = 1
    for dim in shape:
        count *= dim
        if count > _U64_MAX:
            raise HeaderError(
                f"tensor {name!r}: shape {_brief(list(shape))} holds more than 2**64 - 1 values"
            )
    bits = count * dtype.bits
    if bits > _U64_MAX:
        raise HeaderError(
            f"tensor {name!r}: {count} values of {dtype.code} take more than 2**64 - 1 bits"
        )
    if bits % 8:
        raise HeaderError(
            f"tensor {name!r}: {count} values of {dtype.code} ({dtype.bits} bits) are not a "
            "whole number of bytes"
        )
    delivered = array_shape(dtype, shape)
    if len(delivered) > _NUMPY_MAX_NDIM:
        raise HeaderError(
            f"tensor {name!r}: {len(delivered)} dimensions, more than the {_NUMPY_MAX_NDIM} "
            "a numpy array can have"
        )
    span = dtype.numpy.itemsize
    for dim in delivered:
        span *= dim or 1
        if span > _NUMPY_MAX_BYTES:
            raise HeaderError(
                f"tensor {name!r}: shape {_brief(list(shape))} x {dtype.code} is too large for "
                f"a numpy array (its nonzero dimensions span more than {_NUMPY_MAX_BYTES} bytes)"
            )
    return bits // 8


def _data_order(rows: list[_Row], index: dict[str, int]) -> TensorTable:
    """The table of ``rows`` in offset order; :class:`HeaderError` unless they tile the data
    section. ``index`` (position by name) follows a reordering.

    Each tensor's own span is already checked. Tensors listed in offset order, as writers list
    them, are not sorted again.
    """
    if _gap(rows) is not None:
        rows.sort(key=_offsets)
        gap = _gap(rows)
        if gap is not None:
            at, expected = gap
            name, _, _, start, end = rows[at]
            problem = "leave a hole" if start > expected else "overlap the previous tensor"
            raise HeaderError(
                f"tensor {name!r}: data_offsets [{start}, {end}] {problem}; "
                f"expected it to start at {expected}"
            )
        index.update(_positions([row[0] for row in rows]))
    return TensorTable(tuple(rows))


_offsets = operator.itemgetter(3, 4)


def _gap(rows: list[_Row]) -> tuple[int, int] | None:
    """The position of the first tensor that does not start where the one before it ends (the
    first at 0), and where it should start; ``None`` if they tile the data section."""
    expected = 0
    for at, (_, _, _, start, end) in enumerate(rows):
        if start != expected:
            return at, expected
        expected = end
    return None


def parse_header(
    raw: bytes | bytearray | memoryview, *, stop: Callable[[], bool] | None = None
) -> Header:
    """Parse and fully validate the N header bytes (without the 8-byte prefix).

    Checks UTF-8, a leading ``{``, strict JSON (no duplicate keys at any level, no NaN, no lone
    UTF-16 surrogate in a name or in metadata), every tensor entry's fields and types (a
    dimension or an offset is a plain JSON integer below 2**64: not ``-0``, ``1.0`` or
    ``1e3``), dtype codes, sizes against dtype x shape (sub-byte types must fill whole bytes),
    that the offsets tile the data section from 0 with no hole or overlap, and that numpy can
    hold every shape (see :func:`_data_size`).

    Time and memory are linear in the header's size; it stops at the first tensor found bad.
    ``stop``, asked every few thousand tensors, ends a parse nobody waits for any more (one in a
    worker thread whose caller was cancelled) with :class:`UsageError`.
    """
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    except TypeError:
        raise UsageError(f"a header is bytes, got {type(raw).__name__}") from None
    if not text.startswith("{"):
        raise HeaderError(f"header must begin with '{{', begins with {text[:16]!r}")
    return _parse_object(text, len(raw), stop)


_STOP_EVERY = 4096
"""Members of a header parsed between two looks at its ``stop`` callable."""


def _parse_object(text: str, header_size: int, stop: Callable[[], bool] | None) -> Header:
    """The :class:`Header` of the JSON object ``text``, validated member by member."""
    metadata: dict[str, str] | None = None
    index: dict[str, int] = {}
    rows: list[_Row] = []
    known: dict[tuple[Any, ...], _Layout] = {}
    for count, (name, value, start, end) in enumerate(_members(text)):
        if stop is not None and count % _STOP_EVERY == 0 and stop():
            raise UsageError("the header's parse was stopped: nobody waits for it any more")
        if name in index or (name == METADATA_KEY and metadata is not None):
            raise HeaderError(f"duplicate key {name!r} in the JSON header")
        if not name.isascii():
            _refuse_surrogates(name, "tensor name")
        if name == METADATA_KEY:
            metadata = _parse_metadata(value)
            continue
        if text.count('"', start, end) != 8 or text.find("-", start, end) >= 0:
            value = _strict_entry(text[start:end], name)
        index[name] = len(rows)
        rows.append(_parse_tensor(name, value, known))
    table = _data_order(rows, index)
    return Header(table, metadata or {}, header_size, index)


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
        nbytes = _data_size(spec.name, dtype, _checked_dims(spec.name, spec.shape))
        if offset + nbytes > _U64_MAX:
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
    text += b" " * (-len(text) % 8)
    header = Header.from_tensors(infos, metadata or {}, len(text))
    return struct.pack("<Q", len(text)) + text, header
