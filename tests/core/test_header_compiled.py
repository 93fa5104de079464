"""The compiled reader of a header piece (``stream_st/core/_compact.c``) against the Python parse.

The compiled reader takes only pieces written as the reference writer writes them, whose every
tensor plainly passes the checks, and declines every other (None): the Python parse then reads
the piece as before. So wherever it accepts a piece it must give exactly what the Python parse
gives, and whole headers must parse to the same header, index and metadata, or the same error,
with it and without it. Skipped where the package was installed without a C compiler.
"""

from __future__ import annotations

import gc
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as reference_save

from stream_st import HeaderError, parse_header
from stream_st.core import header as core_header
from stream_st.core.dtypes import DTYPES as ALL_DTYPES
from stream_st.core.header import parse_steps, run_steps
from stream_st.core.strict_json import PIECE_BYTES

compiled = pytest.importorskip("stream_st.core._compact", reason="the C module was not built")

DTYPES = {code: (dtype.code, dtype.bits) for code, dtype in ALL_DTYPES.items()}


def read(text: str, first: bool = True) -> Any:
    """What the compiled reader gives for ``text``: a piece, or None."""
    return core_header._COMPILED_PIECE(text, first) if core_header._COMPILED_PIECE else None


def python_piece(text: str, first: bool) -> Any:
    """What the Python reader of a piece in the reference writer's layout gives for ``text``."""
    try:
        return core_header._compact_piece(text, {}, first)
    except (UnicodeDecodeError, HeaderError, ValueError) as exc:
        return type(exc)


def rows(piece: Any) -> Any:
    """A piece as plain values (its table as a list of rows)."""
    if piece is None or isinstance(piece, type):
        return piece
    metadata, table, in_order = piece
    return metadata, None if table is None else list(table), in_order


def outcome(raw: bytes) -> Any:
    """The header of ``raw`` with its index and metadata, or its error's type and message."""
    try:
        found = parse_header(raw)
    except HeaderError as exc:
        return type(exc), str(exc)
    return list(found.tensors), dict(found._index), found.metadata, found.unreadable


def agree(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``outcome(raw)`` with the compiled reader, checked to be the Python parse's."""
    with monkeypatch.context() as patch:
        patch.setattr(core_header, "_COMPILED_PIECE", None)
        python = outcome(raw)
    assert outcome(raw) == python
    return python


def test_the_reference_writers_headers_are_read_by_the_compiled_reader(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "b": np.zeros((2, 3), np.float32),
        "a": np.arange(5, dtype=np.int64),
        "s": np.array(2.5),
        "é名": np.ones(4, np.uint8),
        "c": np.zeros((1, 1, 1, 7), np.complex64),
    }
    for metadata in (None, {"format": "np", "ключ": "значение", "": ""}):
        data = reference_save(arrays, metadata=metadata)
        n = int.from_bytes(data[:8], "little")
        text = data[8 : 8 + n].decode()
        got = read(text)
        assert got is not None  # taken by the compiled reader
        assert rows(got) == rows(python_piece(text, True))
        assert got[1]._codes[0] is DTYPES[got[1]._codes[0]][0]  # the table's own string
        found = agree(data[8 : 8 + n], monkeypatch)
        assert found[2] == (metadata or {})


def test_tensors_of_one_shape_share_its_tuple() -> None:
    members = ",".join(
        f'"t{i}":{{"dtype":"F32","shape":[2,3],"data_offsets":[{24 * i},{24 * i + 24}]}}'
        for i in range(4)
    )
    got = read("{" + members + "}")
    assert got is not None and got[2] is True
    shapes = got[1]._shapes
    assert shapes == [(2, 3)] * 4 and all(shape is shapes[0] for shape in shapes)


MEMBER = '"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}'


@pytest.mark.parametrize(
    "text",
    [
        "{" + MEMBER.replace("[2]", "[0]").replace("8]", "0]") + "}",  # an empty tensor
        "{" + MEMBER.replace("F32", "F4").replace("8]", "1]") + "}",  # a sub-byte dtype
        "{" + MEMBER.replace("F32", "I4") + "}",  # not a dtype stream_st knows
        "{" + MEMBER.replace('"t"', '"a\\"b"') + "}",  # an escape in a name
        "{" + MEMBER.replace('"t"', '"a\tb"') + "}",  # a raw control character
        "{" + MEMBER.replace('"t"', '"__metadata__"') + "}",
        "{ " + MEMBER + "}",  # whitespace inside
        "{" + MEMBER + "}x",
        "{" + MEMBER + "," + "}",
        "{" + MEMBER + MEMBER.replace('"t"', '"u"') + "}",  # no comma between
        "{" + MEMBER.replace("[2]", "[02]") + "}",  # a leading zero
        "{" + MEMBER.replace("[0,8]", "[0,18446744073709551616]") + "}",  # past 2**64 - 1
        "{" + MEMBER.replace("[2]", "[4611686018427387904,2]") + "}",  # too many bits
        "{" + MEMBER.replace("[2]", "[" + ",".join(["1"] * 65) + "]").replace("8]", "4]") + "}",
        "{" + MEMBER.replace("8]", "9]") + "}",  # offsets that do not span the bytes
        '{"__metadata__":{"a":"1","a":"2"},' + MEMBER + "}",  # a metadata key twice
        '{"__metadata__":{"a":"\\u0041"},' + MEMBER + "}",  # an escape in the metadata
        '{"__metadata__":{"a":1},' + MEMBER + "}",
        '{"__metadata__":{}}',  # no tensor
        "{}",
        "{" + MEMBER,  # cut short
        "{" + MEMBER.replace('"t"', '"\ud800"') + "}",  # a lone surrogate (no UTF-8)
    ],
)
def test_what_is_not_plain_is_declined(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert read(text) is None
    try:
        raw = text.encode()
    except UnicodeEncodeError:
        return
    agree(raw, monkeypatch)


def test_metadata_is_read_only_in_the_first_piece() -> None:
    text = '{"__metadata__":{"format":"pt"},' + MEMBER + "}"
    assert read(text, first=True) is not None
    assert read(text, first=False) is None


def test_out_of_order_offsets_are_read_and_sorted_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    second = MEMBER.replace('"t"', '"u"').replace("[0,8]", "[8,16]")
    text = "{" + second + "," + MEMBER + "}"
    got = read(text)
    assert got is not None and got[2] is False
    assert rows(got) == rows(python_piece(text, True))
    tensors, index, _, _ = agree(text.encode(), monkeypatch)
    assert [t.name for t in tensors] == ["t", "u"] and index == {"t": 0, "u": 1}


# ------------------------------------------------------------------ generated, differential

PLAIN_NAMES = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=6)
NAMES = PLAIN_NAMES.filter(lambda name: '"' not in name and "\\" not in name) | st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from('"\\\x00\x1f\x7f'),
    max_size=6,
)
"""Names mostly plain (no quote, backslash or control character), sometimes not."""
NUMBERS = st.sampled_from(
    ["0", "1", "2", "3", "7", "01", "-1", "1.0", "1e3", "18446744073709551615"]
)


def rarely(draw: st.DrawFn) -> bool:
    """True one time in ten: where a generated member departs from the plain case."""
    return draw(st.integers(0, 9)) == 0


@st.composite
def member_text(draw: st.DrawFn, start: int) -> tuple[str, int]:
    """A member, mostly valid and written as the reference writes it, sometimes not; and the
    offset after it."""
    code = draw(st.sampled_from(["F32", "BF16", "U8", "I64", "C64"]))
    if rarely(draw):
        code = draw(st.sampled_from([*DTYPES, "I4", "f32", ""]))
    bits = DTYPES.get(code, ("", 8))[1]
    dims = draw(st.lists(st.integers(0 if rarely(draw) else 1, 5), max_size=3))
    size = int(np.prod(dims, dtype=object)) * bits // 8 if dims else bits // 8
    shape = ",".join(map(str, dims))
    if rarely(draw):
        shape = draw(st.sampled_from(["", "1,", ",1", "1,,1", "1 ,1"])) or draw(NUMBERS)
    end = start + size + (draw(st.sampled_from([1, -1])) if rarely(draw) else 0)
    offsets = f"{start},{end}"
    if rarely(draw):
        offsets = f"{draw(NUMBERS)},{draw(NUMBERS)}"
    name = draw(NAMES)
    if rarely(draw):  # as JSON text: escapes
        name = json.dumps(name, ensure_ascii=draw(st.booleans()))[1:-1]
    text = f'"{name}":{{"dtype":"{code}","shape":[{shape}],"data_offsets":[{offsets}]}}'
    return text, max(end, start)


@st.composite
def piece_text(draw: st.DrawFn) -> str:
    """A piece of a header, mostly as the reference writes one, sometimes not."""
    members, at = [], 0
    for _ in range(draw(st.integers(0, 5))):
        if rarely(draw):
            at = draw(st.integers(0, at + 8))  # out of order, or a hole
        text, at = draw(member_text(at))
        members.append(text)
    inner = ",".join(members)
    metadata = draw(
        st.none()
        | st.dictionaries(NAMES, NAMES, max_size=3).map(
            lambda d: json.dumps(d, ensure_ascii=False, separators=(",", ":"))
        )
    )
    if rarely(draw):
        metadata = draw(
            st.sampled_from(['{"a":"1","a":"1"}', "{}", '{"a":1}', "[]", '{"a":"\\n"}'])
        )
    if metadata is not None:
        inner = f'"__metadata__":{metadata}' + ("," + inner if inner else "")
    tail = draw(st.sampled_from(["", " ", "  \n"]))
    if rarely(draw):
        tail = draw(st.sampled_from([",", "x", "}", "\x00"]))
    return "{" + inner + "}" + tail


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(piece_text(), st.booleans())
def test_generated_pieces_read_as_the_python_parse_reads_them(text: str, first: bool) -> None:
    got = read(text, first)
    with pytest.MonkeyPatch.context() as patch:
        python = rows(python_piece(text, first))
        if got is not None:  # accepted: exactly the Python reader's piece
            assert rows(got) == python
        try:
            raw = text.encode()
        except UnicodeEncodeError:
            return
        agree(raw, patch)


def test_a_big_headers_columns_are_not_walked_by_the_garbage_collector(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The columns a big header is parsed into hold only strings, integers and shape tuples:
    untracked, no collection walks their places while the parse runs (or after)."""
    count = 4 * PIECE_BYTES // 50
    raw = (
        "{"
        + ",".join(
            f'"t{i}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}'
            for i in range(count)
        )
        + "}"
    ).encode()
    header = run_steps(parse_steps(raw))
    table = header.tensors
    columns = (table._names, table._codes, table._shapes, table._starts, table._ends)
    assert not any(map(gc.is_tracked, columns))
    assert len(header) == count and header["t7"].start == 7
    with monkeypatch.context() as patch:
        patch.setattr(core_header, "_COMPILED_PIECE", None)
        patch.setattr(core_header, "_UNTRACK", core_header._tracked)
        python = run_steps(parse_steps(raw))
    assert list(python.tensors) == list(table) and dict(python._index) == dict(header._index)
    assert gc.is_tracked(python.tensors._names)  # the Python parse's, as before
    with pytest.raises(TypeError):
        compiled.untracked(())
