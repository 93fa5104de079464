"""The strict, bounded JSON reading a safetensors header needs.

:func:`json.loads` alone accepts what a header must not hold (duplicate keys, NaN) and escapes
with errors other than :class:`~stream_st.HeaderError` on hostile input (nesting too deep,
undecodable bytes, integers too long). Here every failure is a :class:`~stream_st.HeaderError`,
and :func:`members` walks a large JSON object one member at a time, so a header is validated as
it is parsed and never exists as a whole as JSON objects. No I/O.
"""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from json.scanner import make_scanner
from typing import Any, cast

from ..errors import HeaderError

__all__ = [
    "PIECE_BYTES",
    "Number",
    "brief",
    "decode_json",
    "json_errors",
    "json_type",
    "members",
    "object_pieces",
    "refuse_surrogates",
    "scan_piece",
    "scan_value",
    "string_count",
]


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
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an int of 4300+ digits
        raise HeaderError(f"{what} is not valid JSON: {exc}") from None
    except RecursionError:
        raise HeaderError(f"{what} JSON is nested too deeply") from None


_BRIEF = reprlib.Repr()
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


def members(text: str, strict_name: str) -> Iterator[tuple[str, Any, int, int]]:
    """The members of the JSON object ``text`` (it starts with ``{``), one at a time.

    Yields ``(name, value, start, end)`` where ``text[start:end]`` is the value's JSON text.
    Values are parsed fast (duplicate keys and ``-0`` pass: the caller parses again with
    :func:`decode_json` what it must see strictly), the member named ``strict_name`` strictly.
    """
    ws = _skip_whitespace
    with json_errors("header"):
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
                scan = _STRICT_SCAN if name == strict_name else _FAST_SCAN
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


PIECE_BYTES = 32 << 10
"""About how many bytes of a large JSON object :func:`object_pieces` puts in one piece: each
piece is parsed in one step (about 400 tensors, under a millisecond on a quiet machine, a few
at load 10 on 2 cores), and an event loop gets its turns between; the steps' own cost is lost
in the noise (``benchmarks/bench_header.py``)."""

_CUT = re.compile(rb'\}[ \t\n\r]*(,)[ \t\n\r]*"')
"""Where an object of objects may be cut: after a member's ``}``, at the ``,`` before the next
member's name (``},"`` as the reference writes it, ``}, "`` as :func:`json.dumps` does)."""


def object_pieces(raw: memoryview) -> Iterator[str]:
    """The JSON object ``raw`` (UTF-8, starting with ``{``) as JSON objects of about
    :data:`PIECE_BYTES` each, in order: each one is a run of ``raw``'s members, braced.

    ``raw`` is cut where its text reads ``},"`` (whitespace around the comma allowed), a guess:
    one that falls inside a string leaves a piece that is no JSON object (its parse state at the
    cut is the whole text's, which is inside the string), so a caller that parses every piece
    and finds each a whole object knows every cut fell between two members.
    :class:`UnicodeDecodeError` for a piece that is not UTF-8 (cuts fall on ASCII bytes, never
    inside a character).
    """
    size = len(raw)
    start = 0
    while True:
        match = _CUT.search(raw, start + PIECE_BYTES) if size - start > 2 * PIECE_BYTES else None
        if match is None:
            text = str(raw[start:], "utf-8")
            yield "{" + text if start else text
            return
        text = str(raw[start : match.start() + 1], "utf-8")
        yield ("{" + text if start else text) + "}"
        start = match.end(1)


_MINUS_ZERO = re.compile(r"[\[,:][ \t\n\r]*-0")
"""Where a ``-0`` number may begin (or a string holds such text: a false alarm, never a miss)."""


def scan_piece(piece: str) -> dict[str, Any] | None:
    """The JSON object ``piece``, parsed fast (duplicate keys pass, the last kept; numbers but
    plain integers are :class:`Number`); ``None`` if it is no single JSON object or may hold a
    ``-0`` (the fast parse reads it as 0): :func:`members` then tells what is wrong."""
    if "-0" in piece and _MINUS_ZERO.search(piece):
        return None
    try:
        value, end = _FAST_SCAN(piece, 0)
    except (StopIteration, ValueError, RecursionError, HeaderError):
        return None
    if type(value) is not dict or _skip_whitespace(piece, end) != len(piece):
        return None
    return cast(dict[str, Any], value)


_ESCAPE = re.compile(r"\\(.)", re.DOTALL)


def string_count(text: str) -> int:
    """How many strings the valid JSON ``text`` holds: a duplicate key adds one that the parsed
    value lacks."""
    quotes = text.count('"')
    if "\\" in text:
        quotes -= _ESCAPE.findall(text).count('"')  # escapes, in order: \\ then \" is not one
    return quotes // 2


def scan_value(text: str, at: int) -> tuple[Any, int]:
    """The JSON value at ``text[at:]``, parsed strictly (as :func:`decode_json` with
    ``strict``), and the index after it; :class:`HeaderError` if there is none."""
    with json_errors("header"):
        try:
            return _STRICT_SCAN(text, at)
        except StopIteration:
            raise HeaderError(f"header is not valid JSON: expected a value at char {at}") from None
