"""The header's fast parse, a piece of members at a time, against the member walk.

:func:`~stream_st.parse_header` reads a header in pieces of about ``PIECE_BYTES`` with
whole-list operations and hands anything it does not plainly accept to the member walk
(``_parse_object``), which tells what is wrong. Every header here spans several pieces, with the
case placed in a later one; each parse must give what the walk alone gives: the same header and
index, or the same error.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from stream_st import Header, HeaderError, parse_header
from stream_st.core.header import (
    _compact_piece,
    _parse_fast,
    _parse_object,
    parse_steps,
    run_steps,
)
from stream_st.core.strict_json import PIECE_BYTES, object_pieces
from stream_st.errors import DtypeError, UsageError

from .._util import stepped

COUNT = 2 * PIECE_BYTES // 44 + 200
"""Tensors of about 50 bytes each: two pieces."""
LATE = COUNT - 100
"""A tensor in the last piece."""


def member(name: str, dtype: str = "U8", shape: str = "1", offsets: str = "0,1") -> str:
    """A tensor's member as the reference writer writes it (``name`` as JSON string text)."""
    return f'"{name}":{{"dtype":"{dtype}","shape":[{shape}],"data_offsets":[{offsets}]}}'


def members(**late: str) -> list[str]:
    """``COUNT`` one-byte tensors ``t0``, ``t1``... back to back; ``late`` replaces fields of
    tensor ``LATE``."""
    return [
        member(**({"name": f"t{i}", "offsets": f"{i},{i + 1}"} | (late if i == LATE else {})))
        for i in range(COUNT)
    ]


def header(parts: list[str], metadata: str | None = None) -> bytes:
    if metadata is not None:
        parts = [f'"__metadata__":{metadata}', *parts]
    return ("{" + ",".join(parts) + "}").encode()


def outcome(raw: bytes, *, stepwise: bool = False, **options: Any) -> Any:
    """What parsing ``raw`` gives: the header, its index and metadata, or the error. A header
    of a few pieces is parsed as one piece by ``parse_header`` (no ``stop``); ``stepwise``, by
    ``parse_steps``, a piece at a time."""
    try:
        found = run_steps(parse_steps(raw, **options)) if stepwise else parse_header(raw, **options)
    except HeaderError as exc:
        return type(exc), str(exc)
    return found, found._index, found.metadata, found.unreadable


def walked(raw: bytes, keep: bool = False) -> Any:
    """What the member walk alone gives."""
    try:
        found = run_steps(_parse_object(str(raw, "utf-8"), len(raw), keep))
    except HeaderError as exc:
        return type(exc), str(exc)
    return found, found._index, found.metadata, found.unreadable


def agree(raw: bytes) -> Any:
    """The header of ``raw`` or its error, checked to be the walk's."""
    assert len(raw) > 2 * PIECE_BYTES
    result = outcome(raw)
    assert result == walked(raw) == outcome(raw, stepwise=True)
    return result[0] if isinstance(result[0], Header) else result


def fast(raw: bytes) -> Header | None:
    return run_steps(_parse_fast(memoryview(raw)))


@pytest.mark.parametrize("metadata", [None, '{"format":"pt","a\\"b":"c\\\\"}'])
def test_the_reference_writers_layout_is_read_fast(metadata: str | None) -> None:
    raw = header(members(), metadata)
    found = agree(raw)
    assert isinstance(found, Header) and len(found) == COUNT and fast(raw) == found
    assert found["t7"].start == 7 and found.names()[LATE] == f"t{LATE}"


def test_other_layouts_are_read_fast_too() -> None:
    obj = json.loads(header(members()))
    spaced = json.dumps(obj).encode()  # ", " and ": ": one piece, json's scanner
    found = agree(spaced)
    assert isinstance(found, Header) and fast(spaced) == found
    keys_reordered = json.dumps(
        {name: dict(reversed(entry.items())) for name, entry in obj.items()}, separators=(",", ":")
    ).encode()  # cut into pieces, none in the reference's layout
    reordered = agree(keys_reordered)
    assert reordered.tensors == found.tensors and fast(keys_reordered) == reordered


@pytest.mark.parametrize(
    "late",
    [
        {"name": "t3"},  # a name in an earlier piece
        {"name": f"t{LATE + 1}"},  # a name in the same piece
        {"name": "__metadata__"},  # the metadata, written as a tensor
        {"offsets": f"{LATE},{LATE + 2}"},  # too many bytes for its shape
        {"shape": "-0", "offsets": f"{LATE},{LATE}"},  # -0 reads as 0 in json
        {"offsets": f"-0,{LATE + 1}"},
        {"offsets": f"{LATE}.0,{LATE + 1}"},
        {"offsets": f"{LATE},1{'0' * 5000}"},  # more digits than int() takes
        {"shape": "1,18446744073709551616"},
        {"dtype": "F32"},
        {"dtype": "I4"},  # a packed dtype, refused without unknown_dtypes="keep"
        {"name": "a\\ud800"},  # a lone surrogate
        {"name": "a\x01"},  # a control character
    ],
)
def test_a_bad_tensor_in_a_later_piece_is_left_to_the_walk(late: dict[str, str]) -> None:
    raw = header(members(**late))
    assert fast(raw) is None  # parse_header then gives what the walk gives
    with pytest.raises(HeaderError):
        parse_header(raw)


def test_a_hole_in_a_later_piece_is_refused_as_the_walk_refuses_it() -> None:
    refused = agree(header(members(offsets=f"{LATE + 1},{LATE + 2}")))
    assert refused[0] is HeaderError and "leave a hole" in refused[1]


def test_a_duplicate_field_in_a_later_piece_is_refused() -> None:
    parts = members()
    parts[LATE] = parts[LATE].replace('{"dtype":"U8",', '{"dtype":"U8","dtype":"U8",')
    assert fast(header(parts)) is None
    with pytest.raises(HeaderError, match="duplicate key 'dtype'"):
        parse_header(header(parts))


def test_metadata_in_a_later_piece() -> None:
    parts = members()
    parts.insert(LATE, '"__metadata__":{"k":"v"}')
    assert agree(header(parts)).metadata == {"k": "v"}
    twice = header(parts, metadata='{"k":"v"}')
    assert "duplicate key '__metadata__'" in agree(twice)[1]
    parts[LATE] = '"__metadata__":{"k":["v"]}'
    assert "must be a string" in agree(header(parts))[1]


@pytest.mark.parametrize("name", ['a\\"b', "c\\\\d", "\\u00e9", "\u00e9\u4e2d"])
def test_names_with_escapes_or_beyond_ascii(name: str) -> None:
    found = agree(header(members(name=name)))
    assert found.names()[LATE] == json.loads(f'"{name}"')


def test_names_that_look_like_a_place_to_cut() -> None:
    """A name ending in ``},`` puts ``},"`` inside a member: a cut there leaves no object."""
    parts = [
        member(f"t{i}}},", offsets=f"{i},{i + 1}") if i % 50 == 0 else part
        for i, part in enumerate(members())
    ]
    found = agree(header(parts))
    assert isinstance(found, Header) and "t100}," in found


def test_tensors_out_of_offset_order_across_pieces() -> None:
    parts = members()
    reordered = header(parts[LATE:] + parts[:LATE])
    found = agree(reordered)
    assert found.names() == [f"t{i}" for i in range(COUNT)] and found["t0"] == found.tensors[0]
    assert found == fast(reordered)


def test_unknown_dtypes_kept_in_a_later_piece() -> None:
    raw = header(members(dtype="I4", shape="2"))
    kept = outcome(raw, unknown_dtypes="keep")
    assert kept == walked(raw, keep=True) == outcome(raw, stepwise=True, unknown_dtypes="keep")
    assert kept[0].unreadable == (f"t{LATE}",)


def test_a_parse_nobody_waits_for_stops() -> None:
    with pytest.raises(UsageError, match="stopped"):
        parse_header(header(members()), stop=lambda: True)


LONG_METADATA = {f'key {i} "\u00e9"': f"value\\{i}\n\u4e2d" for i in range(20_000)}
"""Metadata of many windows of entries (about 20 pieces' worth), with escapes and text beyond
ASCII."""


@pytest.mark.parametrize("first", [True, False], ids=["first", "last"])
@pytest.mark.parametrize("layout", ["reference", "json.dumps"])
def test_long_metadata_is_read_a_window_at_a_time(first: bool, layout: str) -> None:
    """Metadata that opens a header is read before its pieces, a window of entries at a time,
    by the fast parse (as the reference writes it, and as json.dumps does); anywhere else, by
    the walk; each as the walk reads it."""
    if layout == "reference":
        text = json.dumps(LONG_METADATA, ensure_ascii=False, separators=(",", ":"))
    else:
        text = json.dumps(LONG_METADATA)
    assert len(text) > 20 * PIECE_BYTES
    parts = members()
    raw = header(parts, text) if first else header([*parts, f'"__metadata__":{text}'])
    found = agree(raw)
    assert isinstance(found, Header) and found.metadata == LONG_METADATA
    if first:
        assert fast(raw) == found


@pytest.mark.parametrize(
    ("late", "error"),
    [
        ('"key 7":"again"', "duplicate key 'key 7'"),  # a key of an earlier window
        ('"k":"\\ud800"', "lone UTF-16 surrogate"),
        ('"k":"\\x"', "Invalid \\\\escape"),
        ('"k":["v"]', r"__metadata__\['k'\] must be a string, got an array"),
        ('"k":1', "must be a string, got a number"),
    ],
)
@pytest.mark.parametrize("first", [True, False], ids=["first", "last"])
def test_a_bad_entry_in_a_later_window_of_metadata(first: bool, late: str, error: str) -> None:
    entries = [f'"key {i}":"v"' for i in range(10_000)]
    entries.insert(9_000, late)
    text = "{" + ",".join(entries) + "}"
    raw = header(members(), text) if first else header([*members(), f'"__metadata__":{text}'])
    assert fast(raw) is None
    refused = agree(raw)
    assert refused[0] is HeaderError and re.search(error, refused[1])


@pytest.mark.parametrize("after", [",}", ", }", ",\n}"])
def test_long_metadata_then_a_comma_and_no_tensor_is_refused(after: str) -> None:
    """A header of long metadata alone whose last member is followed by a comma is no JSON:
    refused by every parse, as by the walk (the fast parse once read the ``}`` after the
    comma as an empty piece of tensors, and took the file for a valid one with no tensor)."""
    text = json.dumps(LONG_METADATA, ensure_ascii=False, separators=(",", ":"))
    raw = f'{{"__metadata__":{text}{after}'.encode()
    assert fast(raw) is None
    refused = agree(raw)
    assert refused[0] is HeaderError and "expected a name" in refused[1]


def compact(text: str) -> Any:
    """What the reader of the reference writer's layout makes of one piece (None: declined,
    or an error naming no tensor, as :func:`_parse_fast` takes it)."""
    try:
        return _compact_piece(text, {}, first=True)
    except (ValueError, HeaderError, DtypeError):
        return None


def test_the_compact_reader_takes_names_full_of_json_punctuation() -> None:
    names = ['a":{', "],[", "},", ":", "{}", "\u00e9\u4e2d", "\x7f\u2028", ""]  # JSON takes all
    parts = [member(n, offsets=f"{i},{i + 1}") for i, n in enumerate(names)]
    text = "{" + ",".join(parts) + "}  "
    metadata, table, in_order = compact(text.replace('a":{', "a:{"))
    assert table.names() == ["a:{", *names[1:]] and in_order and metadata is None
    assert parse_header(text.replace('a":{', "a:{").encode()).names() == table.names()


def test_the_compact_reader_takes_mixed_dtypes_and_tensors_out_of_order() -> None:
    parts = [member("b", "F16", "2,3", "12,24"), member("a", "U8", "", "0,1")]
    text = "{" + ",".join(parts) + "}"
    _, table, in_order = compact(text)
    assert [tuple(t) for t in table] == [("b", "F16", (2, 3), 12, 24), ("a", "U8", (), 0, 1)]
    assert not in_order


@pytest.mark.parametrize(
    "part",
    [
        member("a", offsets="00,1"),  # a leading zero
        member("a", offsets="+0,1"),  # int() takes a sign, JSON does not
        member("a", offsets=" 0,1"),
        member("a", offsets="0,1_0"),  # nor underscores
        member("a", shape="01"),
        member("a", shape="1,"),
        member("a", shape="\u0661"),  # a digit int() takes, beyond ASCII
        member("a", offsets="0,1,2"),
        member("a", offsets="0"),
        member("a\\u0041"),  # an escape: the JSON scanner reads it
        member("a\x1f"),  # a control character, which JSON wants escaped
        member("a").replace('"dtype":"U8","shape":[1]', '"shape":[1],"dtype":"U8"'),
        member("a").replace(",", ", "),
        member("a").replace('"dtype"', '"dtypes"'),
    ],
)
def test_the_compact_reader_declines_what_it_cannot_plainly_read(part: str) -> None:
    text = "{" + ",".join([part, member("b", offsets="1,2")]) + "}"
    assert compact(text) is None
    assert outcome(text.encode()) == walked(text.encode())


def test_a_parse_yields_between_pieces_only() -> None:
    raw = header(members())
    found, yields = stepped(raw)
    columns = 5  # allotted once the first piece tells the tensors' size, one a step
    assert yields == len(list(object_pieces(memoryview(raw)))) - 1 + columns > columns
    assert found == parse_header(raw)
    assert list(parse_steps(header(members()[:100]))) == []  # one piece, one step


@pytest.mark.parametrize("first", ["short", "long"], ids=["guess-low", "guess-high"])
def test_columns_allotted_from_a_wrong_guess_hold_every_tensor(first: str) -> None:
    """The columns are allotted from the first piece's tensors per byte: a first piece of
    long members (metadata, long names) guesses too few tensors, so the columns grow past
    their places; one of short members, too many, and the places left over are dropped."""
    long_name = "x" * 300
    parts = [
        member(
            f"{long_name}{i}" if (first == "long") == (i < COUNT // 4) else f"t{i}",
            offsets=f"{i},{i + 1}",
        )
        for i in range(COUNT)
    ]
    found = agree(header(parts))
    assert len(found.tensors) == COUNT and len(found.tensors._names) == COUNT
    assert [t.start for t in found.tensors] == list(range(COUNT))
