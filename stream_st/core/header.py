"""The sans-IO core: parse and validate safetensors headers into a :class:`Header`.

Nothing here performs I/O or awaits, so every transport reuses it and it can be fuzzed directly.

Layout of a safetensors file::

    [ N: u64 little-endian ][ N bytes of UTF-8 JSON, space padded ][ data: tensors back to back ]

The JSON object maps tensor names to ``{"dtype", "shape", "data_offsets": [start, end]}`` with
offsets relative to the start of the data section, plus an optional ``"__metadata__"`` map of
strings to strings. Building a header from a plan is :mod:`.layout`'s; the strict JSON
reading is :mod:`.strict_json`'s.
"""

from __future__ import annotations

import contextlib
import operator
import reprlib
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from math import prod
from typing import Any, Literal, NamedTuple, TypeVar, cast, overload

import numpy as np

from .._regex import LazyPattern
from ..errors import (
    ArgumentTypeError,
    DtypeError,
    HeaderError,
    HeaderTooLargeError,
    TensorNotFoundError,
    UnknownDtypeError,
    UsageError,
    some_names,
)
from .dtypes import DTYPES, DType, array_shape, dtype_from_code
from .strict_json import (
    PIECE_BYTES,
    brief,
    decode_json,
    first_item,
    json_type,
    kind_at,
    member_name,
    next_item,
    object_pieces,
    refuse_surrogates,
    scan_bounded,
    scan_piece,
    scan_short,
    scan_string,
    scan_value,
    skip_space,
    string_count,
)

__all__ = [
    "AT_ONCE_BYTES",
    "DEFAULT_MAX_HEADER_SIZE",
    "LENGTH_PREFIX_SIZE",
    "METADATA_KEY",
    "Header",
    "TensorInfo",
    "TensorTable",
    "UnknownDtypes",
    "parse_header",
    "parse_header_length",
    "parse_steps",
    "run_steps",
]

LENGTH_PREFIX_SIZE = 8
"""Bytes of the little-endian u64 that precedes the JSON header."""

DEFAULT_MAX_HEADER_SIZE = 100_000_000
"""The reference implementation's limit on the JSON header length."""

METADATA_KEY = "__metadata__"

U64_MAX = 2**64 - 1
_NUMPY_MAX_NDIM = 64 if int(np.__version__.split(".", 1)[0]) >= 2 else 32
_NUMPY_MAX_BYTES = int(np.iinfo(np.intp).max)
_PLAIN_BITS = min(U64_MAX, 8 * _NUMPY_MAX_BYTES)
"""The most bits a tensor of a whole-byte type may take (the format's limit, and numpy's)."""
_TENSOR_FIELDS = frozenset({"dtype", "shape", "data_offsets"})

UnknownDtypes = Literal["refuse", "keep"]
"""What a header parse does with a dtype code stream_st does not know: ``"refuse"`` it (the
default, :class:`~stream_st.UnknownDtypeError`), or ``"keep"`` the tensor for header-only use
(see :func:`parse_header`)."""

_KEPT_CODE = LazyPattern(r"[A-Za-z][A-Za-z0-9_]{0,31}")
"""The dtype codes ``unknown_dtypes="keep"`` keeps: a letter, then up to 31 letters, digits or
underscores (``I4``, ``I2``, ``U1``...), unless it is a known code in other letter case (``f32``:
refused, as the reference refuses it). Anything else in a dtype is refused in any mode."""


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
    def readable(self) -> bool:
        """Whether stream_st knows this tensor's dtype, so can read its data (False only for a
        tensor kept by a header-only parse, ``unknown_dtypes="keep"``)."""
        return self.dtype in DTYPES

    @property
    def dtype_info(self) -> DType:
        """The :class:`~stream_st.core.dtypes.DType` row for this tensor's dtype code;
        :class:`~stream_st.UnknownDtypeError` naming the tensor for a code stream_st does not
        know (a tensor kept by a header-only parse)."""
        found = DTYPES.get(self.dtype)
        if found is None:
            raise unreadable_error(self)
        return found

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


_Row = tuple[str, str, tuple[int, ...], int, int]
"""A tensor's fields as a plain tuple: ``(name, dtype, shape, start, end)``."""

_to_info = cast(Callable[[_Row], TensorInfo], partial(tuple.__new__, TensorInfo))
"""The :class:`TensorInfo` of a row, made in C: iterating a table is a hot path."""


class TensorTable(Sequence[TensorInfo]):
    """A header's tensors in offset order: a read-only sequence of :class:`TensorInfo`, each
    built when read from the table's columns (names, dtype codes, shapes, starts, ends).

    A header of a million tensors kept as a million :class:`TensorInfo`, or a million tuples,
    would be a million objects allocated in a row, each one the cyclic garbage collector
    counts, and full collections it triggers while the header is parsed. Five lists of
    strings, ints and shape tuples (one per distinct shape) are five objects to it.
    It equals another table, or a tuple, of the same tensors.
    """

    __slots__ = ("_codes", "_ends", "_names", "_shapes", "_starts")

    def __init__(
        self,
        names: list[str],
        codes: list[str],
        shapes: list[tuple[int, ...]],
        starts: list[int],
        ends: list[int],
    ) -> None:
        self._names = names
        self._codes = codes
        self._shapes = shapes
        self._starts = starts
        self._ends = ends

    @classmethod
    def of(cls, tensors: Iterable[TensorInfo]) -> TensorTable:
        """The table of ``tensors``, in the order given."""
        return cls.of_rows(cast(Iterable[_Row], tensors))

    @classmethod
    def of_rows(cls, rows: Iterable[_Row]) -> TensorTable:
        """The table of these rows of fields, in the order given."""
        columns = tuple(map(list, zip(*rows, strict=True)))
        if not columns:
            return cls([], [], [], [], [])
        names, codes, shapes, starts, ends = columns
        return cls(names, codes, shapes, starts, ends)

    def _rows(self) -> Iterator[_Row]:
        return zip(self._names, self._codes, self._shapes, self._starts, self._ends, strict=True)

    def names(self) -> list[str]:
        """Tensor names in offset order."""
        return self._names.copy()

    def columns(
        self,
    ) -> tuple[list[str], list[str], list[tuple[int, ...]], list[int], list[int]]:
        """The tensors' fields a column each (copies), in offset order: names, dtype codes,
        shapes, starts, ends; no object made per tensor."""
        return (
            self._names.copy(),
            self._codes.copy(),
            self._shapes.copy(),
            self._starts.copy(),
            self._ends.copy(),
        )

    @overload
    def __getitem__(self, index: int) -> TensorInfo: ...

    @overload
    def __getitem__(self, index: slice) -> TensorTable: ...

    def __getitem__(self, index: int | slice) -> TensorInfo | TensorTable:
        """The tensor at position ``index`` (an ``IndexError`` past the end), or a table of the
        ``index`` slice; :class:`~stream_st.ArgumentTypeError` (also a ``TypeError``) for an
        index of another type: a name is looked up in the header (``header[name]``)."""
        if isinstance(index, slice):
            return TensorTable(
                self._names[index],
                self._codes[index],
                self._shapes[index],
                self._starts[index],
                self._ends[index],
            )
        try:
            name = self._names[index]
        except TypeError:
            raise ArgumentTypeError(
                f"a header's tensors are indexed by position, got {type(index).__name__} "
                f"{brief(index)}: look a tensor up by name in the header (header[name])"
            ) from None
        return _to_info(
            (name, self._codes[index], self._shapes[index], self._starts[index], self._ends[index])
        )

    def __iter__(self) -> Iterator[TensorInfo]:
        return map(_to_info, self._rows())

    def __len__(self) -> int:
        return len(self._names)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TensorTable):
            return (self._names, self._codes, self._shapes, self._starts, self._ends) == (
                other._names,
                other._codes,
                other._shapes,
                other._starts,
                other._ends,
            )
        if isinstance(other, tuple):  # a row equals the TensorInfo of the same fields
            return len(other) == len(self) and all(map(operator.eq, self._rows(), other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to tuples, but not one itself

    def __repr__(self) -> str:
        return f"TensorTable(n_tensors={len(self)}, first={_first_tensors(self)})"


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxlong = 40
_SHORT.maxdict = _SHORT.maxtuple = _SHORT.maxlist = 4
_SHOWN = 2
"""How many tensors a :class:`TensorTable` or :class:`Header` shows in its ``repr``, and how many
names of unreadable tensors (:func:`~stream_st.errors.some_names`)."""


def _first_tensors(table: TensorTable) -> str:
    """The first few tensors of ``table`` for a ``repr``: a few hundred characters at most,
    whatever their names and shapes."""
    shown = [
        f"TensorInfo(name={_SHORT.repr(name)}, dtype={_SHORT.repr(dtype)}, "
        f"shape={_SHORT.repr(shape)}, start={start}, end={end})"
        for name, dtype, shape, start, end in table[:_SHOWN]._rows()
    ]
    if len(table) > _SHOWN:
        shown.append("...")
    return f"[{', '.join(shown)}]"


def unreadable_error(info: TensorInfo) -> UnknownDtypeError:
    """The error for reading the data of ``info``, whose dtype stream_st does not know."""
    return UnknownDtypeError(
        f"tensor {info.name!r} has dtype {info.dtype!r}, a packed or unknown dtype stream_st "
        "cannot read: only its header can be (inspect, ls, hash without --content)"
    )


def refuse_unreadable(tensors: Iterable[TensorInfo]) -> None:
    """:class:`~stream_st.UnknownDtypeError` naming the first of ``tensors`` whose dtype stream_st
    does not know, if any: before any of their data is read."""
    for info in tensors:
        if info.dtype not in DTYPES:
            raise unreadable_error(info)


def _positions(names: Sequence[str]) -> dict[str, int]:
    """Each name's position in ``names`` (the last, for a name listed twice)."""
    return dict(zip(names, range(len(names)), strict=True))


_SHARD_NAMES = 1 << 16
"""About how many names one dict of a :class:`NameIndex` is made to hold at most."""


class NameIndex(Mapping[str, int]):
    """Each tensor's position by name, built a piece of the header at a time, in several dicts
    (the name's hash picks one) when more than :data:`_SHARD_NAMES` names are ``expected``.

    A dict that grows doubles its table, copying every entry in one call that nothing can cut
    into steps: at 700,000 names, 58 ms of CPU on a loaded machine, the longest step of a
    10**6-tensor header's parse. A dict here doubles past ``expected / count`` names at most.
    """

    __slots__ = ("_dicts", "_mask")

    def __init__(self, expected: int = 0) -> None:
        count = 1
        while count * _SHARD_NAMES < expected:
            count *= 2
        self._dicts: list[dict[str, int]] = [{} for _ in range(count)]
        self._mask = count - 1

    def add(self, names: Sequence[str], base: int) -> None:
        """Record ``names`` at positions ``base``, ``base + 1``... (a name again: its last)."""
        if not self._mask:
            self._dicts[0].update(zip(names, range(base, base + len(names)), strict=True))
            return
        dicts, mask = self._dicts, self._mask
        for position, name in enumerate(names, base):
            dicts[hash(name) & mask][name] = position

    def __getitem__(self, name: str) -> int:
        return self._dicts[hash(name) & self._mask][name]

    def __contains__(self, name: object) -> bool:
        try:
            return name in self._dicts[hash(name) & self._mask]
        except TypeError:  # unhashable: in no dict
            return False

    def __iter__(self) -> Iterator[str]:
        return chain.from_iterable(self._dicts)

    def __len__(self) -> int:
        return sum(map(len, self._dicts))


@dataclass(frozen=True, slots=True)
class Header:
    """A parsed, fully validated header.

    ``tensors`` is a :class:`TensorTable` in offset order; ``header_size`` is N, the JSON
    length (padding included); ``data_size`` is the length of the data section, i.e. the end
    offset of the last tensor. ``unreadable`` names the tensors whose dtype stream_st does not
    know, in offset order: empty but for a header parsed with ``unknown_dtypes="keep"``.
    """

    tensors: TensorTable
    metadata: dict[str, str]
    header_size: int
    _index: Mapping[str, int] = field(repr=False, compare=False)
    """Each tensor's position in ``tensors`` by name (a dict, or a :class:`NameIndex`): strings
    and ints, so never GC-tracked."""
    unreadable: tuple[str, ...] = field(default=(), compare=False)
    has_metadata: bool = field(default=False, compare=False)
    """Whether the header holds a ``__metadata__`` entry, even an empty one (the reference's
    ``metadata()`` is then ``{}``, not ``None``)."""

    @classmethod
    def from_tensors(
        cls, tensors: Iterable[TensorInfo], metadata: Mapping[str, str], header_size: int
    ) -> Header:
        """A header of ``tensors`` taken as given, in offset order (unlike
        :func:`~stream_st.parse_header`, nothing here checks them), with ``metadata`` and
        ``header_size``; the tensors whose dtype stream_st does not know are its
        ``unreadable``."""
        table = TensorTable.of(tensors)
        unreadable = tuple(t.name for t in table if t.dtype not in DTYPES)
        return cls(table, dict(metadata), header_size, _positions(table.names()), unreadable)

    @property
    def data_start(self) -> int:
        """Absolute file offset of the data section: 8 + N."""
        return LENGTH_PREFIX_SIZE + self.header_size

    @property
    def data_size(self) -> int:
        """Length of the data section: the end offset of the last tensor (0 for none)."""
        ends = self.tensors._ends
        return ends[-1] if ends else 0

    @property
    def file_size(self) -> int:
        """Total bytes of the file: prefix, header and data."""
        return self.data_start + self.data_size

    def names(self) -> list[str]:
        """Tensor names in offset order."""
        return self.tensors.names()

    def __getitem__(self, name: str) -> TensorInfo:
        """The tensor named ``name``: :class:`~stream_st.TensorNotFoundError` if none is,
        :class:`~stream_st.ArgumentTypeError` for an unhashable key, which no name can be."""
        try:
            return self.tensors[self._index[name]]
        except KeyError:
            raise TensorNotFoundError(f"no tensor named {name!r} in the header") from None
        except TypeError:  # unhashable: neither a dict nor a NameIndex can look it up
            raise ArgumentTypeError(
                f"tensor names are str, got {type(name).__name__} {_SHORT.repr(name)}"
            ) from None

    def __contains__(self, name: object) -> bool:
        """Whether a tensor is named ``name``; False for any key but a string (an unhashable
        one too)."""
        return isinstance(name, str) and name in self._index

    def __iter__(self) -> Iterator[TensorInfo]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def __repr__(self) -> str:
        """A bounded summary (a header may list millions of tensors): counts, sizes, the
        metadata shortened, the first tensors, and the first unreadable tensors' names and how
        many more."""
        names = some_names(self.unreadable, _SHOWN)
        unreadable = f", unreadable={names}" if self.unreadable else ""
        return (
            f"Header(n_tensors={len(self)}, data_bytes={self.data_size}, "
            f"header_size={self.header_size}, metadata={_SHORT.repr(self.metadata)}, "
            f"first={_first_tensors(self.tensors)}{unreadable})"
        )


def parse_header_length(
    prefix: bytes | bytearray | memoryview,
    *,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    fixed_limit: bool = False,
) -> int:
    """Decode the 8-byte length prefix and check it against ``max_header_size``.

    Raises :class:`HeaderError` for fewer than 8 bytes or an empty header and
    :class:`HeaderTooLargeError` before anything is allocated for an oversized one; with
    ``fixed_limit`` (a caller that cannot raise the limit: a drop-in's, the reference's 100 MB)
    its message does not advise raising ``max_header_size``.
    """
    if len(prefix) < LENGTH_PREFIX_SIZE:
        raise HeaderError(
            f"a safetensors file starts with an 8-byte header length; got only {len(prefix)} bytes"
        )
    n = int.from_bytes(prefix[:LENGTH_PREFIX_SIZE], "little")
    if n > max_header_size:
        raise HeaderTooLargeError(n, max_header_size, fixed=fixed_limit)
    if n < 2:
        raise HeaderError(f"header length {n} is too small to hold a JSON object")
    return n


def _strict_entry(text: str, name: str) -> Any:
    """The tensor entry ``text`` parsed strictly, when its fast parse may differ.

    The fast parse keeps the last of duplicate keys and reads ``-0`` as 0. An entry that passes
    validation hides neither if its text holds exactly 8 ``"`` and no ``-`` (the test
    :func:`_parse_object` makes): its three keys and its dtype are four strings, and a duplicate
    key would add a fifth. Any other entry is parsed again here.
    """
    return decode_json(text, f"tensor {name!r}", strict=True)


def _parse_metadata(value: object) -> dict[str, str]:
    """The metadata parsed as ``value``, checked: a JSON object of strings."""
    if type(value) is not dict:
        raise _metadata_error(json_type(value))
    for key, item in value.items():
        if type(item) is not str:
            raise _metadata_value_error(key, json_type(item))
        _refuse_metadata_surrogates(key, item)
    return value


_WS = r"[ \t\n\r]*+"
_STRING = r'"[^"\\\x00-\x1f]*+(?:\\.[^"\\\x00-\x1f]*+)*+"'
_ENTRIES = _STRING.join(["(?:", f"{_WS}:{_WS}", f'{_WS}(?:,{_WS}(?=")|(?=\\}})))*+'])
"""A run of a JSON object's members whose values are strings, each with the ``,`` after it
(and the whitespace after that) or, for the last, the ``}`` after it left unread: the
metadata's entries a window at a time (:func:`_merge_entries`). A string's escapes are left to
that parse to check."""
_METADATA_ENTRIES = LazyPattern(_ENTRIES)
_METADATA_ENTRIES_RAW = LazyPattern(_ENTRIES.encode())
_METADATA_HEAD = LazyPattern(f'\\{{{_WS}"{METADATA_KEY}"{_WS}:{_WS}\\{{{_WS}'.encode())
"""A header's start where the metadata is its first member, up to the metadata's first entry."""
_AFTER_METADATA = LazyPattern(f'{_WS},{_WS}(?=")'.encode())
"""The comma after the metadata and the whitespace after it, where a member's name follows (a
comma before the closing ``}`` is no JSON)."""


def _merge_entries(found: dict[str, str], text: str) -> bool:
    """Add to ``found`` the metadata's entries that ``text`` holds (a run of
    :data:`_ENTRIES`); False, ``found`` left as it was, where one of them is no valid JSON, holds
    a lone surrogate or is a key twice (in ``text``, or in ``found`` already): read one at a
    time, they tell which."""
    body = text.rstrip(" \t\n\r").removesuffix(",")
    try:
        entries: dict[str, str] = decode_json("{" + body + "}", "header", strict=True)
        if "\\u" in body:
            for key, item in entries.items():
                _refuse_metadata_surrogates(key, item)
    except HeaderError:
        return False
    if not found.keys().isdisjoint(entries):
        return False
    found.update(entries)
    return True


def _metadata_steps(text: str, at: int) -> Generator[None, None, tuple[dict[str, str], int]]:
    """The metadata whose JSON text starts at ``at``, checked as :func:`_parse_metadata` checks
    it, and the index after it, read in steps of about :data:`PIECE_BYTES`: a run of entries
    of string values at once (:func:`_merge_entries`), any other entry, or a run that does not
    parse, an entry at a time, where a value that is no string is refused as it is met, unread.
    """
    if not text.startswith("{", at):
        raise _metadata_error(kind_at(text, at))
    found: dict[str, str] = {}
    at, more = yield from first_item(text, at, "}")
    pause = at + PIECE_BYTES
    while more:
        run = _METADATA_ENTRIES.compiled.match(text, at, at + PIECE_BYTES)
        end = run.end() if run else at
        if end > at and _merge_entries(found, text[at:end]):
            at = end
            if text.startswith("}", at):
                return found, at + 1
        else:  # one entry, or each of the run, whose error the parse found
            stop = max(end, at + 1)
            while more and at < stop:
                key, at = yield from member_name(text, at)
                if not text.startswith('"', at):
                    raise _metadata_value_error(key, kind_at(text, at))
                item, at = scan_string(text, at)
                if key in found:
                    raise HeaderError(f"duplicate key {key!r} in the JSON header")
                _refuse_metadata_surrogates(key, item)
                found[key] = item
                at, more = yield from next_item(text, at, "}")
        if at >= pause:
            yield
            pause = at + PIECE_BYTES
    return found, at


def _metadata_error(kind: str) -> HeaderError:
    return HeaderError(f"{METADATA_KEY} must be a JSON object, got {kind}")


def _metadata_value_error(key: str, kind: str) -> HeaderError:
    return HeaderError(f"{METADATA_KEY}[{key!r}] must be a string, got {kind}")


def _refuse_metadata_surrogates(key: str, item: str) -> None:
    refuse_surrogates(key, f"{METADATA_KEY} key")
    refuse_surrogates(item, f"{METADATA_KEY}[{key!r}]")


_Layout = tuple[str, tuple[int, ...], int]
"""A checked dtype and shape: the dtype code (the table's own string), the shape, the bytes."""

_KNOWN_LAYOUTS = 4096
"""How many distinct (dtype, shape) pairs one parse remembers as checked."""


def _parse_tensor(
    name: str, entry: Any, known: dict[tuple[Any, ...], _Layout], keep: bool = False
) -> _Row:
    """Validate one tensor entry; ``known`` caches the layouts already checked by this parse
    (tensors alike share one shape tuple). ``keep`` keeps a tensor of an unknown dtype code
    (:func:`_kept_tensor`)."""
    try:
        if len(entry) != 3:
            raise KeyError
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError):
        raise _fields_error(name, entry) from None
    if type(shape) is not list:
        raise _shape_error(name, shape)
    if len(shape) > _NUMPY_MAX_NDIM and _numpy_ndim(code):
        raise _ndim_error(name, len(shape))  # before a look at each dimension
    if not {*map(type, shape)} <= _INT_ONLY:
        raise _shape_error(name, shape)
    layout = known.get((code, *shape)) if type(code) is str else None
    if layout is None:
        if _kept(code, keep):
            dims = checked_dims(name, shape)
            _value_count(name, dims)
            return _kept_tensor(name, code, dims, offsets)
        dtype = _header_dtype(name, code)
        dims = checked_dims(name, shape)
        layout = dtype.code, dims, data_size(name, dtype, dims)
        if len(known) < _KNOWN_LAYOUTS:
            known[(dtype.code, *dims)] = layout
    return _placed(name, layout, offsets)


def _placed(name: str, layout: _Layout, offsets: object) -> _Row:
    """The row of the tensor ``name`` of ``layout`` at ``offsets``, checked: two integers that
    span its bytes, below 2**64."""
    code, dims, nbytes = layout
    if type(offsets) is list and len(offsets) == 2:
        start, end = offsets
        if (
            type(start) is int
            and type(end) is int
            and start >= 0
            and end - start == nbytes
            and end <= U64_MAX
        ):
            return name, code, dims, start, end
    raise _offsets_error(name, offsets, code, dims, nbytes)


def _kept(code: object, keep: bool) -> bool:
    """Whether a tensor of dtype ``code`` is kept unread (``keep``, a code stream_st does not
    know, of the form :data:`_KEPT_CODE`)."""
    return keep and type(code) is str and code not in DTYPES and _keepable(code)


def _keepable(code: str) -> bool:
    """Whether ``code``, not a known code, is one a header-only parse keeps: of the form
    :data:`_KEPT_CODE`, and no known code in other letter case."""
    return bool(_KEPT_CODE.compiled.fullmatch(code)) and code.upper() not in DTYPES


def _numpy_ndim(code: object) -> bool:
    """Whether a tensor of dtype ``code`` is delivered in an array of its own shape, so holds
    no more dimensions than numpy takes: a known code of whole bytes."""
    dtype = DTYPES.get(code) if type(code) is str else None
    return dtype is not None and not dtype.packed


def _kept_tensor(name: str, code: str, dims: tuple[int, ...], offsets: object) -> _Row:
    """The row of a tensor whose dtype code stream_st does not know, sized by its
    ``data_offsets`` alone: its shape ``dims`` is checked as any shape is (each dimension, and
    the count of values, below 2**64: the caller's), not against the bytes."""
    if type(offsets) is list and len(offsets) == 2:
        start, end = offsets
        if type(start) is int and type(end) is int and 0 <= start <= end <= U64_MAX:
            return name, code, dims, start, end
        if type(start) is int and type(end) is int and 0 <= end < start <= U64_MAX:
            raise HeaderError(
                f"tensor {name!r}: dtype {code} ({brief(list(dims))}): data_offsets "
                f"[{start}, {end}] are reversed"
            )
    raise _offsets_form_error(name, offsets)  # not two integers in [0, 2**64)


def _offsets_error(
    name: str, offsets: object, code: str, dims: tuple[int, ...], nbytes: int
) -> HeaderError:
    """What is wrong with ``data_offsets`` of a tensor of ``nbytes`` bytes."""
    if not (
        type(offsets) is list
        and len(offsets) == 2
        and all(type(o) is int and 0 <= o <= U64_MAX for o in offsets)
    ):
        return _offsets_form_error(name, offsets)
    start, end = offsets
    problem = "are reversed" if end < start else f"span {end - start}"
    return HeaderError(
        f"tensor {name!r}: shape {brief(list(dims))} x {code} needs {nbytes} bytes but "
        f"data_offsets [{start}, {end}] {problem}"
    )


def _offsets_form_error(name: str, offsets: object) -> HeaderError:
    return HeaderError(
        f"tensor {name!r}: data_offsets must be exactly two non-negative integers below "
        f"2**64, got {brief(offsets)}"
    )


_INT_ONLY = frozenset({int})


def _fields_error(name: str, entry: object) -> HeaderError:
    """What is wrong with a tensor entry that is no object of the three fields."""
    if type(entry) is not dict:
        return _entry_error(name, json_type(entry))
    missing = _TENSOR_FIELDS - entry.keys()
    if missing:
        return HeaderError(f"tensor {name!r}: missing field(s) {sorted(missing)}")
    return _unknown_fields_error(name, entry.keys() - _TENSOR_FIELDS)


def _entry_error(name: str, kind: str) -> HeaderError:
    return HeaderError(f"tensor {name!r}: entry must be a JSON object, got {kind}")


def _unknown_fields_error(name: str, keys: Iterable[str]) -> HeaderError:
    return HeaderError(f"tensor {name!r}: unknown field(s) {sorted(map(brief, keys))}")


def _shape_error(name: str, shape: object) -> HeaderError:
    return HeaderError(
        f"tensor {name!r}: shape must be a list of non-negative integers below 2**64, "
        f"got {brief(shape)}"
    )


_JSON_KINDS = {dict: "an object", list: "an array", bool: "a boolean", type(None): "null"}
"""What a JSON value other than a string or a number is, by the type it is parsed into."""


def _header_dtype(name: str, code: object) -> DType:
    try:
        return dtype_from_code(code)
    except DtypeError as exc:
        hint = ""
        if type(code) is str and _keepable(code):
            hint = (
                "; only header-only reads accept it (inspect, ls, hash; "
                "read_header(..., unknown_dtypes='keep'))"
            )
        elif type(code) is str and code.upper() in DTYPES:
            hint = f"; codes are upper case ({code.upper()!r})"
        elif type(code) is not str:
            hint = f"; a dtype is a JSON string, got {_JSON_KINDS.get(type(code), 'a number')}"
        raise UnknownDtypeError(f"tensor {name!r}: {exc}{hint}") from None


def checked_dims(name: str, shape: Iterable[int]) -> tuple[int, ...]:
    """``shape`` as a tuple; :class:`HeaderError` unless every dimension is in [0, 2**64)."""
    dims = tuple(shape)
    if dims and not (min(dims) >= 0 and max(dims) <= U64_MAX):
        raise _shape_error(name, list(dims))
    return dims


def _value_count(name: str, shape: tuple[int, ...]) -> int:
    """The number of values of a tensor of ``shape`` (dimensions in [0, 2**64));
    :class:`HeaderError` where it passes 2**64 - 1 at any step, as the reference checks it,
    dimension by dimension (so no number formed exceeds 2**128)."""
    count = 1
    for dim in shape:
        count *= dim
        if count > U64_MAX:
            raise _count_error(name, shape)
    return count


def _count_error(name: str, shape: Iterable[int]) -> HeaderError:
    return HeaderError(
        f"tensor {name!r}: shape {brief(list(shape))} holds more than 2**64 - 1 values"
    )


def _ndim_error(name: str, ndim: int, at_least: bool = False) -> HeaderError:
    """The error for a tensor of ``ndim`` dimensions (``at_least``: that many read so far)
    delivered as an array of more than numpy takes."""
    return HeaderError(
        f"tensor {name!r}: {'at least ' if at_least else ''}{ndim} dimensions, more than the "
        f"{_NUMPY_MAX_NDIM} a numpy array can have"
    )


def data_size(name: str, dtype: DType, shape: tuple[int, ...], count: int | None = None) -> int:
    """Bytes of a tensor of ``dtype`` and ``shape`` (dimensions in [0, 2**64)).

    :class:`HeaderError` for a shape no valid file holds: its element or bit count passes
    2**64 - 1 at any step (as the reference checks it, dimension by dimension), a sub-byte type
    that does not fill whole bytes, or an array numpy cannot make (more than 64 dimensions, 32
    before numpy 2; nonzero dimensions x item size past the largest ``intp``, even for an empty
    tensor). Linear in the number of dimensions: it stops at the first step out of range, so no
    number it forms exceeds 2**128, but for a product of at most 64 dimensions (2**4096).

    A whole-byte type's tensor of no zero dimension and at most :data:`_PLAIN_BITS` bits passes
    every check: its item size is its bits / 8, its array its shape; it is told in one product.
    One of more dimensions than numpy takes is refused before a look at any of them. ``count``
    is the shape's number of values where the caller has checked it already.
    """
    bits_each = dtype.bits
    if not dtype.packed and len(shape) > _NUMPY_MAX_NDIM:
        raise _ndim_error(name, len(shape))
    if bits_each % 8 == 0:
        bits = prod(shape) * bits_each
        if 0 < bits <= _PLAIN_BITS:
            return bits // 8
    if count is None:
        count = _value_count(name, shape)
    bits = count * dtype.bits
    if bits > U64_MAX:
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
        raise _ndim_error(name, len(delivered))
    span = dtype.numpy.itemsize
    for dim in delivered:
        span *= dim or 1
        if span > _NUMPY_MAX_BYTES:
            raise HeaderError(
                f"tensor {name!r}: shape {brief(list(shape))} x {dtype.code} is too large for "
                f"a numpy array (its nonzero dimensions span more than {_NUMPY_MAX_BYTES} bytes)"
            )
    return bits // 8


def _data_order(table: TensorTable) -> TensorTable:
    """``table`` in offset order (``table`` itself if it is); :class:`HeaderError` unless its
    tensors tile the data section.

    Each tensor's own span is already checked. Tensors listed in offset order, as writers list
    them, are not sorted again.
    """
    if _gap(table) is None:
        return table
    spans = list(zip(table._starts, table._ends, strict=True))
    order = sorted(range(len(table)), key=spans.__getitem__)
    names, codes, shapes, starts, ends = (list(map(c.__getitem__, order)) for c in _columns(table))
    table = TensorTable(names, codes, shapes, starts, ends)
    gap = _gap(table)
    if gap is not None:
        at, expected = gap
        name, start, end = table._names[at], table._starts[at], table._ends[at]
        problem = "leave a hole" if start > expected else "overlap the previous tensor"
        raise HeaderError(
            f"tensor {name!r}: data_offsets [{start}, {end}] {problem}; "
            f"expected it to start at {expected}"
        )
    return table


def _columns(table: TensorTable) -> tuple[list[Any], ...]:
    return table._names, table._codes, table._shapes, table._starts, table._ends


def _gap(table: TensorTable) -> tuple[int, int] | None:
    """The position of the first tensor that does not start where the one before it ends (the
    first at 0), and where it should start; ``None`` if they tile the data section."""
    starts, ends = table._starts, table._ends
    if not starts or (starts[0] == 0 and starts[1:] == ends[:-1]):
        return None
    expected = [0, *ends[:-1]]
    at = next(i for i, pair in enumerate(zip(starts, expected, strict=True)) if pair[0] != pair[1])
    return at, expected[at]


def parse_header(
    raw: bytes | bytearray | memoryview,
    *,
    stop: Callable[[], bool] | None = None,
    unknown_dtypes: UnknownDtypes = "refuse",
) -> Header:
    """Parse and fully validate the N header bytes (without the 8-byte prefix).

    Checks UTF-8, a leading ``{``, strict JSON (no duplicate keys at any level, no NaN, no lone
    UTF-16 surrogate in a name or in metadata), every tensor entry's fields and types (a
    dimension or an offset is a plain JSON integer below 2**64: not ``-0``, ``1.0`` or
    ``1e3``), dtype codes, sizes against dtype x shape (sub-byte types must fill whole bytes),
    that the offsets tile the data section from 0 with no hole or overlap, and that numpy can
    hold every shape (see :func:`data_size`).

    Time and memory are linear in the header's size; it stops at the first tensor found bad.
    The work is done in steps of a few milliseconds each (:func:`parse_steps`). ``stop``, asked
    between steps, ends a parse nobody waits for any more with :class:`UsageError`. Without
    ``stop``, where nothing runs between steps, a header of up to :data:`AT_ONCE_BYTES` is
    read in one piece, with no steps.

    A dtype code stream_st does not know is refused (:class:`~stream_st.UnknownDtypeError`)
    unless ``unknown_dtypes="keep"``, for a read of the header alone: then a tensor of such a
    code (a letter, then letters, digits or underscores: the packed ``I4``, ``I2`` other tools
    write) is kept, its shape checked as any shape but its size taken from its
    ``data_offsets`` alone, and named in :attr:`Header.unreadable`; reading its data raises
    :class:`~stream_st.UnknownDtypeError`. Every other check stands.
    """
    keep = _keep(unknown_dtypes)
    with _octets(raw) as octets:
        if len(octets) <= (AT_ONCE_BYTES if stop is None else ONE_PIECE_BYTES):
            # no steps: a plain call, no generator
            header = _parse_one_piece(octets)
            if header is not None:
                return header
            steps = _parse_walk(raw, keep)
        else:
            steps = _parse_steps(raw, octets, keep)
        return run_steps(steps, stop)


_T = TypeVar("_T")

Steps = Generator[None, None, Header]
"""A header's parse, one step of a few milliseconds at a time: it yields between two steps
and returns the :class:`Header`."""


def run_steps(steps: Generator[None, None, _T], stop: Callable[[], bool] | None = None) -> _T:
    """What the generator ``steps`` returns, its steps run one after another; ``stop``, asked
    between two steps, ends them with :class:`UsageError` when it says nobody waits any more."""
    with contextlib.closing(steps):
        try:
            while True:
                next(steps)
                if stop is not None and stop():
                    raise UsageError("the header's parse was stopped: nobody waits for it any more")
        except StopIteration as done:
            return cast(_T, done.value)


ONE_PIECE_BYTES = 2 * PIECE_BYTES
"""A header up to this size is one piece (:func:`~stream_st.core.strict_json.object_pieces`):
parsed in one call, with no steps between."""

AT_ONCE_BYTES = 256 << 10
"""A header up to this size (about 3,500 tensors, a few milliseconds of work on a quiet
machine) is read by :func:`parse_header` without ``stop`` as one piece: steps run back to back
would hold the caller as long, and cost their pieces' cuts and joins (8 % at 1,000 tensors)."""


def parse_steps(
    raw: bytes | bytearray | memoryview, *, unknown_dtypes: UnknownDtypes = "refuse"
) -> Steps:
    """:func:`parse_header` of ``raw`` as a generator that yields between steps of a few
    milliseconds each (a piece of about :data:`~stream_st.core.strict_json.PIECE_BYTES` of the
    header) and returns the :class:`Header`: a caller on an event loop lets the loop run
    between two steps. A header of one piece (up to :data:`ONE_PIECE_BYTES`) is parsed without
    a yield."""
    keep = _keep(unknown_dtypes)
    with _octets(raw) as octets:
        return (yield from _parse_steps(raw, octets, keep))


def _keep(unknown_dtypes: object) -> bool:
    """Whether ``unknown_dtypes`` keeps tensors of unknown dtypes; :class:`UsageError` for a
    value that is neither ``"refuse"`` nor ``"keep"``."""
    if unknown_dtypes not in ("refuse", "keep"):
        raise UsageError(f"unknown_dtypes is 'refuse' or 'keep', got {unknown_dtypes!r}")
    return unknown_dtypes == "keep"


def _octets(raw: object) -> memoryview:
    """``raw`` as a flat view of bytes (to release once parsed); :class:`UsageError` for
    anything that holds no bytes."""
    try:
        view = memoryview(raw)  # type: ignore[arg-type]  # checked here
    except TypeError:
        raise UsageError(f"a header is bytes, got {type(raw).__name__}") from None
    with view:
        return view.cast("B")


def _parse_steps(raw: bytes | bytearray | memoryview, octets: memoryview, keep: bool) -> Steps:
    """:func:`parse_steps` of ``raw``, whose bytes ``octets`` are: the fast parse, else the
    member walk."""
    if len(octets) <= ONE_PIECE_BYTES:
        header = _parse_one_piece(octets)
    else:
        header = yield from _parse_fast(octets)
    if header is not None:
        return header
    return (yield from _parse_walk(raw, keep))


def _parse_walk(raw: bytes | bytearray | memoryview, keep: bool) -> Steps:
    """The member walk of ``raw`` (:func:`_parse_object`), which tells what is wrong with a
    header the fast parse declined, or accepts an unusual one."""
    try:
        text = str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        raise HeaderError(f"header is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    if not text.startswith("{"):
        raise HeaderError(f"header must begin with '{{', begins with {text[:16]!r}")
    return (yield from _parse_object(text, len(raw), keep))


_dtype_of = operator.itemgetter("dtype")
_shape_of = operator.itemgetter("shape")
_offsets_of = operator.itemgetter("data_offsets")
_first = operator.itemgetter(0)
_second = operator.itemgetter(1)
_DICT_ONLY = frozenset({dict})
_LIST_ONLY = frozenset({list})
_STR_ONLY = frozenset({str})
_THREE = frozenset({3})
_TWO = frozenset({2})
_DECLINED = (UnicodeDecodeError, HeaderError, DtypeError, ValueError)
"""What the fast parse takes as a header to leave to the member walk, which names the tensor
at fault (ValueError: an integer of more digits than int() takes)."""


def _parse_one_piece(raw: memoryview) -> Header | None:
    """:func:`_parse_fast` of ``raw`` as one piece (up to :data:`AT_ONCE_BYTES`), in one
    plain call."""
    try:
        part = _read_piece(str(raw, "utf-8"), {}, first=True)  # each reader wants a leading {
    except _DECLINED:
        return None
    if part is None:
        return None
    metadata, table, in_order = part
    if table is None:
        empty = TensorTable([], [], [], [], [])
        return Header(empty, metadata or {}, len(raw), {}, has_metadata=metadata is not None)
    index = _positions(table._names)
    if len(index) != len(table._names):
        return None  # a name twice
    if not in_order or table._starts[0]:  # else in offset order from 0 already
        table = _data_order(table)
        index = _positions(table._names)
    return Header(table, metadata or {}, len(raw), index, has_metadata=metadata is not None)


def _read_piece(piece: str, known: _Known, first: bool) -> _Piece | None:
    """A piece of a header (see :func:`_parse_fast`) read by the compiled reader
    (``stream_st/core/_compact.c``: the reference writer's layout, every tensor of a whole-byte
    dtype and no zero dimension, plain strings in the metadata) where it was built, else by
    :func:`_compact_piece` if it is written as the reference writes a header, else by
    :func:`_json_piece`; ``None`` for one that does not plainly pass every check."""
    if _COMPILED_PIECE is not None and (part := _COMPILED_PIECE(piece, first)) is not None:
        return part
    part = _compact_piece(piece, known, first)
    return part if part is not None else _json_piece(piece, known)


def _parse_fast(raw: memoryview) -> Generator[None, None, Header | None]:
    """The :class:`Header` of ``raw``, if it is a header that plainly passes every check of
    :func:`_parse_object`, found a piece of members at a time (:func:`object_pieces`), the
    metadata that opens it a window at a time before them (:func:`_plain_metadata`), with
    whole-list operations; ``None`` for any other (invalid, or unusual: a dtype the table
    lacks, an escape that may hide a ``-0``...), which :func:`_parse_object` reads member by
    member to tell what is wrong, or accept. Each piece is read by :func:`_read_piece`.
    """
    if raw[:1].tobytes() != b"{":
        return None
    columns: tuple[list[Any], ...] = ([], [], [], [], [])
    count = 0  # the tensors in ``columns`` so far (they may hold more places: see _allotted)
    index = NameIndex(len(raw) // _LEAST_MEMBER)
    metadata: dict[str, str] | None = None
    begin = 0  # where the pieces start: past the metadata, where it is read first
    known: _Known = {}
    ordered = True
    try:
        head = _METADATA_HEAD.compiled.match(raw)
        if head is not None:  # read before the pieces: it may be long
            plain = yield from _plain_metadata(raw, head.end())
            if plain is None:
                return None
            metadata, begin = plain
        for at, piece in enumerate(object_pieces(raw, begin)):
            if at:
                yield  # between two pieces
            part = _read_piece(piece, known, first=not (at or begin))
            if part is None:
                return None
            found, new, in_order = part
            if found is not None:
                if metadata is not None:
                    return None
                metadata = found
            if new:
                ends = columns[4]
                ordered = (
                    ordered and in_order and new._starts[0] == (ends[count - 1] if count else 0)
                )
                end = count + len(new)
                index.add(new._names, count)
                if len(index) != end:
                    return None  # a name in two pieces
                if not count and 2 * len(piece) < len(raw) - begin:  # more pieces to come
                    columns = yield from _allotted((len(raw) - begin) * end // len(piece))
                for column, more in zip(columns, _columns(new), strict=True):
                    column[count:end] = more  # past the places allotted, the list grows
                count = end
    except _DECLINED:
        return None
    for column in columns:
        del column[count:]  # the places allotted but not taken: no copy, the list keeps them
    table = TensorTable(*columns)
    if not ordered:
        table = _data_order(table)
        index.add(table._names, 0)
    return Header(table, metadata or {}, len(raw), index, has_metadata=metadata is not None)


def _plain_metadata(
    raw: memoryview, at: int
) -> Generator[None, None, tuple[dict[str, str], int] | None]:
    """The metadata that ``raw`` opens with, whose first entry is at ``at``
    (:data:`_METADATA_HEAD`), if its entries plainly pass (their values strings:
    :func:`_merge_entries`) and a tensor's member follows it, and the byte where that member
    starts; ``None`` for any other. Read about :data:`PIECE_BYTES` at a time, with a yield
    between two windows: metadata of a million entries holds no step longer than one window's.
    """
    found: dict[str, str] = {}
    while True:
        run = _METADATA_ENTRIES_RAW.compiled.match(raw, at, at + PIECE_BYTES)
        end = run.end() if run else at
        closed = raw[end : end + 1].tobytes() == b"}"
        if end == at and not closed:
            return None  # an entry of another value, or one longer than a window
        if not _merge_entries(found, str(raw[at:end], "utf-8")):
            return None
        if closed:
            after = _AFTER_METADATA.compiled.match(raw, end + 1)
            return (found, after.end()) if after else None
        at = end
        yield


def _allotted(guess: int) -> Generator[None, None, tuple[list[Any], ...]]:
    """The five columns of a header of about ``guess`` tensors, each ``None`` in a tenth more
    places than that, one column a step. Filled in place, they never grow: a list that grows
    past a few MiB is copied whole in one call (glibc's ``realloc``) that nothing can cut into
    steps, 10 to 17 ms of a 10**6-tensor header's parse each time, the longest steps it had.

    Each column is untracked by the garbage collector where the compiled module was built
    (:data:`_UNTRACK`): it holds only strings, integers, None and shape tuples of integers, so
    no reference cycle can pass through it, and a collection that walked its places held the
    loop for 35-89 ms at 10**6 tensors, the longest stalls of that parse."""
    places = guess + guess // 10 + 16
    columns: list[list[Any]] = []
    for _ in range(5):
        column: list[Any] = [None] * places
        _UNTRACK(column)
        columns.append(column)
        yield
    return tuple(columns)


_Piece = tuple[dict[str, str] | None, TensorTable | None, bool]
"""What a piece of a header holds: its metadata (``None`` if not there), the table of its
tensors (``None`` if none), and whether they follow each other in the data section."""

_LEAST_MEMBER = 48
"""Bytes a tensor's member takes at least (``"":{"dtype":"U8","shape":[],"data_offsets":[0,0]}``
and a comma: 50): a header of N bytes lists fewer than N / 48 tensors."""

_METADATA_START = '{"__metadata__":'
_SPACE = " \t\n\r"
_Known = dict[tuple[str, str | tuple[int, ...]], _Layout]
"""The layouts one fast parse has checked, by dtype code and shape (as a tuple or as text)."""

_NUMBER = "(?:0|[1-9][0-9]*+)"
"""A plain JSON integer's text: digits, no leading zero, no sign."""
_COMPACT_MEMBER = LazyPattern(
    rf'"([^"\\\x00-\x1f]*+)":\{{"dtype":"([^"\\]*+)","shape":\[((?:{_NUMBER}(?:,{_NUMBER})*+)?+)\],'
    rf'"data_offsets":\[({_NUMBER}),({_NUMBER})\]\}}'
)
"""A tensor's member as the reference writer writes it,
``"name":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}``: a name and a dtype without a
quote or a backslash (a name, nor a control character, as JSON wants), its fields in that
order, no whitespace; its groups are the name, the
dtype, the shape's text (``2,3``), the start and the end. Possessive: the text of a valid
member leaves nothing to try again (12 % faster than backtracking)."""
_GROUPS = 6
"""Items :meth:`re.Pattern.split` gives per member of :data:`_COMPACT_MEMBER`: the text before
it, then its five groups."""


def _compiled() -> tuple[
    Callable[[str, bool], _Piece | None] | None, Callable[[list[Any]], object]
]:
    """The compiled reader of a piece (:func:`stream_st.core._compact.piece`, as
    :func:`_read_piece` calls it: ``(text, first)``) and what takes a big header's column off the
    garbage collector's lists (:func:`stream_st.core._compact.untracked`); ``None`` and a
    function that does nothing where the package was installed without them (no C compiler at
    hand): the Python parse then reads every piece, and the columns stay tracked."""
    try:
        from ._compact import piece, untracked
    except ImportError:
        return None, _tracked
    dtypes = {code: (dtype.code, dtype.bits) for code, dtype in DTYPES.items()}
    return partial(piece, TensorTable, dtypes, _NUMPY_MAX_NDIM, _PLAIN_BITS), untracked


def _tracked(column: list[Any]) -> None:
    """Leave ``column`` as it is (where :func:`stream_st.core._compact.untracked` was not built)."""


_COMPILED_PIECE, _UNTRACK = _compiled()


def _compact_piece(piece: str, known: _Known, first: bool) -> _Piece | None:
    """The piece ``piece`` (a braced run of a header's members; ``first``: the header's start,
    where the metadata may be), if every member is written as the reference writes it
    (:data:`_COMPACT_MEMBER`) and plainly passes :func:`_parse_tensor`;
    ``None`` if not.

    The piece is split at its members in one call: the texts between them must then be the
    opening brace (after the metadata, if any), commas and the closing brace (whitespace after
    it), and the fields are checked a column at a time. A handful of calls over the whole
    piece; no Python code runs per tensor, only per distinct layout.
    """
    parts = _COMPACT_MEMBER.compiled.split(piece)
    n = len(parts) // _GROUPS
    between = parts[::_GROUPS]  # before the first member, between two, after the last
    head = between[0]
    metadata = None
    if head != "{" and first and head.startswith(_METADATA_START):
        value, at = scan_value(head, len(_METADATA_START))
        metadata = _parse_metadata(value)
        head = "{" + head[at + 1 :] if head.startswith(",", at) else head[at:]
    if not n:
        empty = head.rstrip(_SPACE) == ("}" if metadata is not None else "{}")
        return (metadata, None, True) if empty else None
    if head != "{" or between[-1].rstrip(_SPACE) != "}" or between.count(",") != n - 1:
        return None
    names = parts[1::_GROUPS]
    if METADATA_KEY in names:
        return None  # the metadata as a tensor
    starts_text, ends_text = parts[4::_GROUPS], parts[5::_GROUPS]
    ends = list(map(int, ends_text))
    in_order = starts_text[1:] == ends_text[:-1]
    starts = [int(starts_text[0]), *ends[:-1]] if in_order else list(map(int, starts_text))
    checked = _checked_rows(names, parts[2::_GROUPS], parts[3::_GROUPS], starts, ends, known)
    return None if checked is None else (metadata, checked, in_order)


def _json_piece(piece: str, known: _Known) -> _Piece | None:
    """The piece ``piece`` read as JSON (:func:`scan_piece`), if each tensor entry plainly passes
    :func:`_parse_tensor`; ``None`` if not.

    Duplicate keys, which the fast parse merges, are found by counting: a piece whose tensors
    all hold exactly their three fields and a string dtype, and whose metadata holds strings,
    holds 5 strings per tensor plus 1 + 2 per metadata entry, and one more per duplicate key.
    """
    found = scan_piece(piece)
    if found is None:
        return None
    strings = 5 * len(found)
    metadata = None
    if METADATA_KEY in found:
        metadata = _parse_metadata(found.pop(METADATA_KEY))
        strings += 2 * len(metadata) - 4
    if string_count(piece) != strings:
        return None  # a duplicate key
    if not all(map(str.isascii, found)):
        for name in found:
            refuse_surrogates(name, "tensor name")
    entries = list(found.values())
    if not entries:
        return metadata, None, True
    if {*map(type, entries)} != _DICT_ONLY or {*map(len, entries)} != _THREE:
        return None
    try:
        codes = list(map(_dtype_of, entries))
        shapes = list(map(_shape_of, entries))
        offsets = list(map(_offsets_of, entries))
    except KeyError:
        return None
    if (
        {*map(type, codes)} != _STR_ONLY
        or {*map(type, shapes)} != _LIST_ONLY
        or {*map(type, offsets)} != _LIST_ONLY
        or {*map(len, offsets)} != _TWO
        or not {*map(type, chain.from_iterable(shapes))} <= _INT_ONLY
    ):
        return None
    starts = list(map(_first, offsets))
    ends = list(map(_second, offsets))
    if {*map(type, starts)} != _INT_ONLY or {*map(type, ends)} != _INT_ONLY or min(starts) < 0:
        return None
    shape_tuples = list(map(tuple, shapes))
    checked = _checked_rows(list(found), codes, shape_tuples, starts, ends, known)
    return None if checked is None else (metadata, checked, starts[1:] == ends[:-1])


def _checked_rows(
    names: list[str],
    codes: list[str],
    shapes: Sequence[str | tuple[int, ...]],
    starts: list[int],
    ends: list[int],
    known: _Known,
) -> TensorTable | None:
    """The table of these tensors' fields (shapes as tuples, or as their text in compact
    members, see :func:`_dims`), if each passes :func:`_parse_tensor`; else ``None``, or
    :class:`HeaderError`, :class:`DtypeError` or :class:`ValueError` naming no tensor (the
    member walk tells which).
    ``known`` caches the layouts checked by this parse, as there. Each step is one call over
    the whole list: no Python code runs per tensor, only per distinct layout (one map of it
    per column: sizes, shapes, codes)."""
    if max(ends) > U64_MAX:  # starts are not negative (see the callers)
        return None
    code = codes[0]
    one_dtype = codes.count(code) == len(codes)  # as in most files
    keys: Sequence[Any] = shapes if one_dtype else list(zip(codes, shapes, strict=True))
    codes_of: dict[Any, str] = {}
    dims: dict[Any, tuple[int, ...]] = {}
    sizes: dict[Any, int] = {}
    for key in {*keys}:
        codes_of[key], dims[key], sizes[key] = (
            _layout(code, key, known) if one_dtype else _layout(key[0], key[1], known)
        )
    if list(map(operator.sub, ends, starts)) != list(map(sizes.__getitem__, keys)):
        return None
    if one_dtype:  # the table's own string for the code, once per tensor
        table_codes = [codes_of[keys[0]]] * len(keys)
    else:
        table_codes = list(map(codes_of.__getitem__, keys))
    return TensorTable(names, table_codes, list(map(dims.__getitem__, keys)), starts, ends)


def _layout(code: str, shape: str | tuple[int, ...], known: _Known) -> _Layout:
    """The checked layout of tensors of dtype ``code`` and ``shape`` (as in
    :func:`_checked_rows`), from ``known`` or checked now and kept there."""
    layout = known.get((code, shape))
    if layout is None:
        dtype = DTYPES.get(code) or dtype_from_code(code)  # the second raises
        ndim = shape.count(",") + 1 if isinstance(shape, str) and shape else len(shape)
        if not dtype.packed and ndim > _NUMPY_MAX_NDIM:
            raise _ndim_error("", ndim)  # before the text is read as numbers
        dims = checked_dims("", _dims(shape))
        layout = dtype.code, dims, data_size("", dtype, dims)
        if len(known) < _KNOWN_LAYOUTS:
            known[(code, shape)] = layout
    return layout


def _dims(shape: str | tuple[int, ...]) -> tuple[int, ...]:
    """A shape given as a tuple, or as its text in a compact member (``2,3``: plain JSON
    integers joined by commas, see :data:`_COMPACT_MEMBER`)."""
    if isinstance(shape, tuple):
        return shape
    return tuple(map(int, shape.split(","))) if shape else ()


def _parse_object(text: str, header_size: int, keep: bool = False) -> Steps:
    """The :class:`Header` of the JSON object ``text``, validated member by member, in steps of
    about :data:`PIECE_BYTES` of its text: a member's value is parsed at once where its text is
    plainly that short (:func:`scan_short`), else in steps (:func:`_metadata_steps`,
    :func:`_tensor_steps`), so no step reads much more, whatever the header's shape."""
    metadata: dict[str, str] | None = None
    index: dict[str, int] = {}
    rows: list[_Row] = []
    known: dict[tuple[Any, ...], _Layout] = {}
    pause = PIECE_BYTES
    at, more = yield from first_item(text, 0, "}")
    while more:
        if at >= pause:
            yield
            pause = at + PIECE_BYTES
        name, start = yield from member_name(text, at)
        if name in index or (name == METADATA_KEY and metadata is not None):
            raise HeaderError(f"duplicate key {name!r} in the JSON header")
        if not name.isascii():
            refuse_surrogates(name, "tensor name")
        if name == METADATA_KEY:
            metadata, end = yield from _metadata_steps(text, start)
        else:
            short = scan_short(text, start)
            if short is None:
                row, end = yield from _tensor_steps(name, text, start, keep)
            else:
                value, end = short
                if text.count('"', start, end) != 8 or text.find("-", start, end) >= 0:
                    value = _strict_entry(text[start:end], name)
                row = _parse_tensor(name, value, known, keep)
            index[name] = len(rows)
            rows.append(row)
        at, more = yield from next_item(text, end, "}")
    if (yield from skip_space(text, at)) != len(text):
        raise HeaderError(f"header is not valid JSON: extra data at char {at}")
    rows_table = TensorTable.of_rows(rows)
    table = _data_order(rows_table)
    if table is not rows_table:
        index = _positions(table._names)
    unreadable = tuple(t.name for t in table if t.dtype not in DTYPES) if keep else ()
    return Header(
        table, metadata or {}, header_size, index, unreadable, has_metadata=metadata is not None
    )


_ITEM_CHARS = 256
"""The most characters a tensor's field read in steps takes for one value: its dtype (a code
of 32 characters at most, 194 where each is written as a ``\\u`` escape), a dimension or an
offset (20 digits). A longer one is refused unread."""


def _tensor_steps(
    name: str, text: str, at: int, keep: bool
) -> Generator[None, None, tuple[_Row, int]]:
    """The row of the tensor ``name`` whose entry's text, at ``at``, is not plainly short (see
    :func:`_parse_object`), checked as :func:`_parse_tensor` checks it, and the index after it,
    read a field at a time in steps of about :data:`PIECE_BYTES`. An entry that is no object,
    a field other than the three, or a field given twice is refused where it is met; the shape
    and the offsets are read an item at a time (:func:`_array_steps`), the dimensions checked
    as they come (:class:`_Dims`); any other value is read from its first :data:`_ITEM_CHARS`
    characters."""
    if not text.startswith("{", at):
        raise _entry_error(name, kind_at(text, at))
    entry: dict[str, Any] = {}
    dims: _Dims | None = None
    at, more = yield from first_item(text, at, "}")
    while more:
        field, at = yield from member_name(text, at)
        if field in entry:
            raise HeaderError(f"duplicate key {field!r} in the JSON header")
        if field not in _TENSOR_FIELDS:
            raise _unknown_fields_error(name, [field])
        what = f"tensor {name!r}: {field}"
        if field == "dtype" or not text.startswith("[", at):
            found = scan_bounded(text, at, _ITEM_CHARS)
            if found is None:
                raise _long_value_error(what, at)
            entry[field], at = found
        elif field == "shape":
            dims = _Dims(name, entry.get("dtype"))
            at = yield from _array_steps(what, text, at, dims.take)
            entry[field] = dims.dims
        else:
            offsets: list[Any] = []
            at = yield from _array_steps(what, text, at, partial(_take_offsets, name, offsets))
            entry[field] = offsets
        at, more = yield from next_item(text, at, "}")
    if dims is None or len(entry) != len(_TENSOR_FIELDS):
        return _parse_tensor(name, entry, {}, keep), at
    code, offsets = entry["dtype"], entry["data_offsets"]
    shape = tuple(dims.dims)
    if _kept(code, keep):
        return _kept_tensor(name, code, shape, offsets), at
    dtype = _header_dtype(name, code)
    return _placed(
        name, (dtype.code, shape, data_size(name, dtype, shape, dims.count)), offsets
    ), at


class _Dims:
    """A tensor's shape read in steps (:func:`_array_steps`), checked as it comes, as
    :func:`_parse_tensor` checks a shape: each dimension an integer in [0, 2**64), the running
    count of values below 2**64, and, where the dtype read before it is delivered in an array
    of its own shape, at most the dimensions numpy takes."""

    __slots__ = ("count", "dims", "most", "name")

    def __init__(self, name: str, code: object) -> None:
        self.name = name
        self.dims: list[int] = []
        self.count = 1
        self.most = _NUMPY_MAX_NDIM if _numpy_ndim(code) else None

    def take(self, items: list[Any]) -> None:
        """Add the next dimensions, ``items``; :class:`HeaderError` for one that is not a
        dimension, or for the shape they make."""
        if not {*map(type, items)} <= _INT_ONLY or min(items) < 0 or max(items) > U64_MAX:
            raise _shape_error(self.name, self.dims + items)
        self.dims += items
        if self.most is not None and len(self.dims) > self.most:
            raise _ndim_error(self.name, len(self.dims), at_least=True)
        count = self.count
        if count:  # 0 stays 0, whatever comes
            for dim in items:
                count *= dim
                if count > U64_MAX:
                    raise _count_error(self.name, self.dims)
            self.count = count


def _take_offsets(name: str, offsets: list[Any], items: list[Any]) -> None:
    """Add the next items of a tensor's ``data_offsets``; :class:`HeaderError` past two."""
    offsets += items
    if len(offsets) > 2:
        raise _offsets_form_error(name, offsets)


_INT_RUN = LazyPattern(r"(?:(?:0|[1-9][0-9]{0,19})[ \t\n\r]*,[ \t\n\r]*)*+")
"""A run of an array's items that are plain integers of up to 20 digits, each followed by its
``,`` (whitespace allowed around it)."""


def _array_steps(
    what: str, text: str, at: int, take: Callable[[list[Any]], object]
) -> Generator[None, None, int]:
    """Read the JSON array whose ``[`` is at ``at`` in steps of about :data:`PIECE_BYTES`,
    giving its items to ``take`` in order: a run of plain integers at once (:data:`_INT_RUN`),
    any other item alone, parsed from its first :data:`_ITEM_CHARS` characters (a longer one
    is refused, naming ``what``); the index after its ``]``."""
    at, more = yield from first_item(text, at, "]")
    pause = at + PIECE_BYTES
    while more:
        run = _INT_RUN.compiled.match(text, at, pause)
        end = run.end() if run else at
        if end > at:
            take(list(map(int, text[at:end].split(",")[:-1])))
            at = end
            if at + _ITEM_CHARS >= pause:
                yield
                pause = at + PIECE_BYTES
                continue
        at = yield from skip_space(text, at)
        found = scan_bounded(text, at, _ITEM_CHARS)
        if found is None:
            raise _long_value_error(what, at)
        item, at = found
        take([item])
        at, more = yield from next_item(text, at, "]")
        if at >= pause:
            yield
            pause = at + PIECE_BYTES
    return at


def _long_value_error(what: str, at: int) -> HeaderError:
    return HeaderError(
        f"{what}: expected a JSON value of at most {_ITEM_CHARS} characters at char {at}"
    )
