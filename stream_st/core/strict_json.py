"""The strict, bounded JSON reading a safetensors header needs.

:func:`json.loads` alone accepts what a header must not hold (duplicate keys, NaN) and escapes
with errors other than :class:`~stream_st.HeaderError` on hostile input (nesting too deep,
undecodable bytes, integers too long). Here every failure is a :class:`~stream_st.HeaderError`,
and a large JSON object is walked one member at a time (:func:`member_name`, :func:`next_item`),
so a header is validated as it is parsed and never exists as a whole as JSON objects; each
step of the walk reads a bounded stretch of the text, whatever its shape. No I/O.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Callable, Generator, Iterator
from contextlib import contextmanager
from json.scanner import make_scanner
from typing import Any, cast

from .._regex import LazyPattern
from ..errors import HeaderError

__all__ = [
    "MAX_PIECE_BYTES",
    "PIECE_BYTES",
    "Number",
    "brief",
    "decode_json",
    "first_item",
    "json_errors",
    "json_type",
    "kind_at",
    "member_name",
    "next_item",
    "object_pieces",
    "refuse_surrogates",
    "scan_bounded",
    "scan_piece",
    "scan_short",
    "scan_string",
    "scan_value",
    "skip_space",
    "string_count",
]


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise HeaderError(f"duplicate key {key!r} in a JSON object")
            seen.add(key)
    return result


def _refuse_constant(name: str) -> Any:
    raise HeaderError(f"{name} is not valid JSON")


class Number(str):
    """A JSON number that is no plain non-negative integer (``1.0``, ``1e3``, ``-0``), kept as
    its text. Never an ``int``, so never a dimension or an offset, as for the reference's parser,
    which reads ``-0`` as the float ``-0.0``; messages show the number as written."""

    __slots__ = ()

    def __repr__(self) -> str:
        return str(self)


def _json_int(digits: str) -> int | Number:
    return Number(digits) if digits == "-0" else int(digits)


_NO_CONSTANTS: dict[str, Any] = {"parse_constant": _refuse_constant}
_STRICT_JSON: dict[str, Any] = {
    **_NO_CONSTANTS,
    "object_pairs_hook": _refuse_duplicates,
    "parse_float": Number,
    "parse_int": _json_int,
}


def decode_json(text: str | bytes, what: str, *, strict: bool = False) -> Any:
    """Parse the JSON document ``text``; :class:`HeaderError` naming ``what`` if it is invalid.

    Covers what escapes :func:`json.loads` on hostile input: nesting too deep for the parser
    (``RecursionError``), undecodable bytes and integers too long to convert. ``strict`` also
    refuses duplicate keys at any level and NaN / Infinity, as a safetensors header must, and
    reads every number but a plain integer (``1.0``, ``-0``) as a :class:`Number`.
    """
    with json_errors(what):
        return json.loads(text, **(_STRICT_JSON if strict else {}))


@contextmanager
def json_errors(what: str) -> Iterator[None]:
    """Turn what :mod:`json` raises on hostile input into :class:`HeaderError`."""
    try:
        yield
    except HeaderError:
        raise
    except (ValueError, RecursionError) as exc:
        raise _json_error(what, exc) from None


def _json_error(what: str, exc: ValueError | RecursionError) -> HeaderError:
    """The :class:`HeaderError` for what :mod:`json` raised on hostile input."""
    if isinstance(exc, RecursionError):
        return HeaderError(f"{what} JSON is nested too deeply")
    # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
    return HeaderError(f"{what} is not valid JSON: {exc}")


class _Brief(reprlib.Repr):
    """``reprlib``'s short ``repr``, also of an integer too long for ``repr`` itself (Python
    refuses to write one of over 4,300 digits: said by its size in bits instead)."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 4000 * 3:  # 3,600 digits or more: a size is all a message needs
            return f"<an integer of {x.bit_length()} bits>"
        return super().repr_int(x, level)


_BRIEF = _Brief()
_BRIEF.maxlist = _BRIEF.maxtuple = 8
_BRIEF.maxstring = _BRIEF.maxother = 60


def brief(value: object) -> str:
    """A short one-line ``repr`` of a parsed value for a message, however large or deep."""
    return _BRIEF.repr(value)


_JSON_TYPES: dict[type, str] = {
    dict: "an object",
    list: "an array",
    str: "a string",
    Number: "a number",
}


def json_type(value: object) -> str:
    """What kind of JSON value ``value`` was parsed from, for a message (``"an array"``)."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int):
        return "a number"
    return _JSON_TYPES.get(type(value), type(value).__name__)


def refuse_surrogates(text: str, what: str) -> None:
    """:class:`HeaderError` if ``text`` holds a lone UTF-16 surrogate (a ``\\ud800`` escape).

    Valid UTF-8 cannot carry one, but a JSON escape can; it is no Unicode text and could not be
    printed or encoded again.
    """
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise HeaderError(
                f"{what} {brief(text)} holds a lone UTF-16 surrogate "
                f"{exc.object[exc.start]!r}, which is not valid Unicode"
            ) from None


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_space_run = cast(Callable[[str, int, int], "re.Match[str]"], _WHITESPACE.match)
"""``_WHITESPACE.match``, which always matches (``*``)."""


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


_FAST_SCAN = _scanner({**_NO_CONSTANTS, "parse_float": Number})
_STRICT_SCAN = _scanner(_STRICT_JSON)
_scanstring = cast(
    Callable[[str, int], tuple[str, int]],
    json.decoder.scanstring,  # type: ignore[attr-defined]  # not in the stubs
)

_SPACE = " \t\n\r"
"""JSON's whitespace. ``"" in _SPACE`` holds too, which sends the end of the text to the slow
path, where it is handled."""


def skip_space(text: str, at: int) -> Generator[None, None, int]:
    """The index of the first character at or after ``at`` that is not JSON whitespace, found
    :data:`PIECE_BYTES` characters at a time, yielding between two: a run of whitespace of any
    length is read in steps."""
    while True:
        end = _space_run(text, at, at + PIECE_BYTES).end()
        if end < at + PIECE_BYTES:
            return end
        at = end
        yield


def _short_space(text: str, at: int) -> int:
    """The index past the whitespace at ``at`` where there is none or it runs for less than
    :data:`PIECE_BYTES` (one plain call: no step), else the index that many characters on,
    left to :func:`skip_space`."""
    if text[at : at + 1] not in _SPACE:
        return at
    return _space_run(text, at, at + PIECE_BYTES).end()


def first_item(text: str, at: int, close: str) -> Generator[None, None, tuple[int, bool]]:
    """At the ``{`` or ``[`` at ``at``: the index of its first item (a member's name, an
    array's value) and True; or, where it is empty, the index after its ``close`` and False."""
    at = _short_space(text, at + 1)
    if text[at : at + 1] in _SPACE:
        at = yield from skip_space(text, at)
    if text.startswith(close, at):
        return at + 1, False
    return at, True


def next_item(text: str, at: int, close: str) -> Generator[None, None, tuple[int, bool]]:
    """After an item of an object or array (closed by ``close``) whose text ends at ``at``: the
    index of the next item and True, after a ``,``; or the index after ``close`` and False."""
    after = text[at : at + 1]
    if after in _SPACE:
        at = yield from skip_space(text, at)
        after = text[at : at + 1]
    if after == close:
        return at + 1, False
    if after != ",":
        raise HeaderError(f"header is not valid JSON: expected ',' or '{close}' at char {at}")
    at = _short_space(text, at + 1)
    if text[at : at + 1] in _SPACE:
        at = yield from skip_space(text, at)
    return at, True


def member_name(text: str, at: int) -> Generator[None, None, tuple[str, int]]:
    """The name of the member whose text starts at ``at`` and the index of its value (past the
    ``:`` and any whitespace)."""
    if not text.startswith('"', at):
        raise HeaderError(f"header is not valid JSON: expected a name at char {at}")
    name, at = scan_string(text, at)
    if text[at : at + 1] != ":":
        at = yield from skip_space(text, at)
        if not text.startswith(":", at):
            raise HeaderError(f"header is not valid JSON: expected ':' at char {at}")
    at = _short_space(text, at + 1)
    if text[at : at + 1] in _SPACE:
        at = yield from skip_space(text, at)
    return name, at


def scan_string(text: str, at: int) -> tuple[str, int]:
    """The JSON string whose opening quote is at ``at`` and the index after it."""
    try:
        return _scanstring(text, at + 1)
    except ValueError as exc:
        raise _json_error("header", exc) from None


_SHORT = re.compile(r"\{[^{}\\]*+\}")
"""A JSON object's text that holds no other brace and no escape."""


def scan_short(text: str, at: int) -> tuple[Any, int] | None:
    """The JSON object at ``at``, parsed fast (as a piece is: duplicate keys and ``-0`` pass),
    and the index after it, where its text plainly ends within :data:`PIECE_BYTES`: its first
    ``}`` closes it (no other brace and no ``\\`` before it, and an even count of ``"``, so
    that ``}`` is in no string), and json's scanner, which reads no further than that ``}``,
    costs no more. ``None`` for any other value, to be read in steps."""
    short = _SHORT.match(text, at, at + PIECE_BYTES)
    if short is None or text.count('"', at, short.end()) % 2:
        return None
    try:
        return _FAST_SCAN(text, at)
    except HeaderError:
        raise
    except (ValueError, RecursionError) as exc:
        raise _json_error("header", exc) from None
    except StopIteration as stop:  # a value missing within it
        raise _no_value(stop.value) from None


def scan_bounded(text: str, at: int, most: int) -> tuple[Any, int] | None:
    """The JSON value at ``at``, parsed strictly, and the index after it, where its text ends
    within ``most`` characters: it is parsed from a copy of that many, so a longer one costs no
    more. ``None`` where no value ends there (however the text goes on); :class:`HeaderError`
    where none starts there, or for a duplicate key or NaN within it."""
    part = text[at : at + most]
    try:
        value, end = _STRICT_SCAN(part, 0)
    except HeaderError:
        raise
    except StopIteration as stop:
        if stop.value == 0:  # none starts there
            raise _no_value(at) from None
        return None
    except (ValueError, RecursionError):
        return None
    if end + 3 > len(part) and at + len(part) < len(text):
        return None  # a number may go on past the copy (1e+5 read as 1)
    return value, at + end


def kind_at(text: str, at: int) -> str:
    """What kind of JSON value starts at ``at``, for a message (``"an array"``): an array or an
    object by its first character, unread (a refusal does not wait for it), a scalar parsed
    (:func:`scan_value`)."""
    first = text[at : at + 1]
    if first == "[":
        return "an array"
    if first == "{":
        return "an object"
    return json_type(scan_value(text, at)[0])


PIECE_BYTES = 32 << 10
"""About how many bytes of a large JSON object :func:`object_pieces` puts in one piece: each
piece is parsed in one step (about 400 tensors, under a millisecond on a quiet machine, a few
at load 10 on 2 cores), and an event loop gets its turns between; the steps' own cost is lost
in the noise (``benchmarks/bench_header.py``)."""

MAX_PIECE_BYTES = 4 * PIECE_BYTES
"""The most bytes :func:`object_pieces` looks through for the end of a piece: a member so long
that none ends within this many bytes of a piece's start (or a layout with no cut it knows)
ends the pieces, so that no piece, nor the search for one, is longer."""

_CUT = LazyPattern(rb'\}[ \t\n\r]*(,)[ \t\n\r]*"')
"""Where an object of objects may be cut: after a member's ``}``, at the ``,`` before the next
member's name (``},"`` as the reference writes it, ``}, "`` as :func:`json.dumps` does)."""


def object_pieces(raw: memoryview, start: int = 0) -> Iterator[str]:
    """The JSON object ``raw`` (UTF-8, starting with ``{``) as JSON objects of about
    :data:`PIECE_BYTES` each, in order: each one is a run of ``raw``'s members, braced. With
    ``start``, the members from that byte on (the first member's name, after a ``,``).

    ``raw`` is cut where its text reads ``},"`` (whitespace around the comma allowed), a guess:
    one that falls inside a string leaves a piece that is no JSON object (its parse state at the
    cut is the whole text's, which is inside the string), so a caller that parses every piece
    and finds each a whole object knows every cut fell between two members.
    :class:`UnicodeDecodeError` for a piece that is not UTF-8 (cuts fall on ASCII bytes, never
    inside a character); :class:`ValueError` where no cut comes within :data:`MAX_PIECE_BYTES`
    of a piece's start (a member that long), where the pieces end.
    """
    size = len(raw)
    while True:
        if size - start <= 2 * PIECE_BYTES:
            text = str(raw[start:], "utf-8")
            yield "{" + text if start else text
            return
        match = _CUT.compiled.search(raw, start + PIECE_BYTES, start + MAX_PIECE_BYTES)
        if match is None:
            raise ValueError(f"no member ends within {MAX_PIECE_BYTES} bytes of byte {start}")
        text = str(raw[start : match.start() + 1], "utf-8")
        yield ("{" + text if start else text) + "}"
        start = match.end(1)


_MINUS_ZERO = LazyPattern(r"[\[,:][ \t\n\r]*-0")
"""Where a ``-0`` number may begin (or a string holds such text: a false alarm, never a miss)."""


def scan_piece(piece: str) -> dict[str, Any] | None:
    """The JSON object ``piece``, parsed fast (duplicate keys pass, the last kept; numbers but
    plain integers are :class:`Number`); ``None`` if it is no single JSON object or may hold a
    ``-0`` (the fast parse reads it as 0): the member walk then tells what is wrong."""
    if "-0" in piece and _MINUS_ZERO.compiled.search(piece):
        return None
    try:
        value, end = _FAST_SCAN(piece, 0)
    except (StopIteration, ValueError, RecursionError, HeaderError):
        return None
    if type(value) is not dict or _skip_whitespace(piece, end) != len(piece):
        return None
    return cast(dict[str, Any], value)


_ESCAPE = LazyPattern(r"\\(.)", re.DOTALL)


def string_count(text: str) -> int:
    """How many strings the valid JSON ``text`` holds: a duplicate key adds one that the parsed
    value lacks."""
    quotes = text.count('"')
    if "\\" in text:
        # escapes, in order: \\ then \" is not one
        quotes -= _ESCAPE.compiled.findall(text).count('"')
    return quotes // 2


def scan_value(text: str, at: int) -> tuple[Any, int]:
    """The JSON value at ``text[at:]``, parsed strictly (as :func:`decode_json` with
    ``strict``), and the index after it; :class:`HeaderError` if there is none."""
    with json_errors("header"):
        try:
            return _STRICT_SCAN(text, at)
        except StopIteration as stop:
            raise _no_value(stop.value) from None


def _no_value(at: int) -> HeaderError:
    """The error for no JSON value at ``at``, where one must be (json's scanner raises
    :class:`StopIteration` with that index)."""
    return HeaderError(f"header is not valid JSON: expected a value at char {at}")
