"""Messages and reprs name a few of many names through one helper, :func:`some_names`: bounded
whatever the number and the length of the names, telling how many more there are, each name
quoted as ``repr`` quotes it (a line break, a NUL, a bidirectional override show as escapes)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

import stream_st
from stream_st.core.header import parse_header
from stream_st.errors import NAMES_SHOWN, some_names
from stream_st.integrations.dataset import Piece, describe_dataset, plan_pieces

BOUND = 1000
"""The most characters a list of names may take in a message."""

MILLION = 10**6

HUGE = "head" + "x" * (10 << 20) + "tail"
"""A name of 10 MiB."""


def test_no_name_and_one_name_are_shown_as_lists() -> None:
    assert some_names([]) == "[]"
    assert some_names(["a"]) == "['a']"
    assert some_names(("a", "b")) == "['a', 'b']"


def test_names_up_to_the_limit_are_shown_whole_as_repr_shows_them() -> None:
    names = [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(NAMES_SHOWN)]
    assert some_names(names) == repr(names)


def test_a_million_names_show_the_first_and_how_many_more() -> None:
    names = [f"n{i}" for i in range(MILLION)]
    said = some_names(names)
    assert said == f"{names[:NAMES_SHOWN]} and {MILLION - NAMES_SHOWN} more"
    assert len(said) < BOUND


def test_a_ten_megabyte_name_is_cut_in_the_middle() -> None:
    """Its start and end show, quoted; the message stays short (it was 10 MiB)."""
    said = some_names([HUGE])
    assert len(said) < BOUND, len(said)
    assert said.startswith("['headxxx") and said.endswith("xxxtail']") and "..." in said


def test_a_million_huge_names_are_bounded_and_counted() -> None:
    said = some_names([HUGE] * MILLION)
    assert len(said) < BOUND, len(said)
    assert said.endswith(f" and {MILLION - NAMES_SHOWN} more") and said.count("head") == NAMES_SHOWN


@pytest.mark.parametrize(
    "name", ["a\nb", "nul\x00", "tab\t", "quote'", 'double"', "\u202eevil", "\ud800", " ", ""]
)
def test_odd_characters_show_as_repr_escapes_them(name: str) -> None:
    assert some_names([name, "b"]) == f"[{name!r}, 'b']"


def test_odd_characters_in_a_cut_name_stay_escaped() -> None:
    said = some_names(["\n\x00\u202e" * (1 << 20)])
    assert len(said) < BOUND
    assert said.isprintable() and "\\n" in said and "\\x00" in said and "\\u202e" in said


def header_of_unreadable(count: int) -> bytes:
    """A safetensors header whose ``count`` tensors are all of an unknown dtype."""
    tensors = {
        f"t{i}": {"dtype": "I4", "shape": [2], "data_offsets": [i, i + 1]} for i in range(count)
    }
    text = json.dumps(tensors).encode()
    return struct.pack("<Q", len(text)) + text


def test_a_headers_repr_tells_how_many_tensors_are_unreadable() -> None:
    """It showed the first four names and ``...``: how many more went unsaid."""
    raw = header_of_unreadable(12)
    header = parse_header(raw[8:], unknown_dtypes="keep")
    assert len(header.unreadable) == 12
    text = repr(header)
    assert "unreadable=['t0', 't1'] and 10 more" in text, text


def test_a_pieces_repr_tells_how_many_names_more() -> None:
    piece = Piece("file.safetensors", tuple(f"k{i}" for i in range(MILLION)))
    text = repr(piece)
    assert f"names=['k0'] and {MILLION - 1} more" in text and len(text) < BOUND, text
    assert "names=[]" in repr(Piece("file.safetensors", ()))


async def test_a_missing_column_error_tells_how_many_columns_more(tmp_path: Path) -> None:
    """It showed four columns and ``...``, each cut to 40 characters (``'ccc...c00'``), and the
    column asked for whole, a name of megabytes too."""
    columns = [f"{'c' * 60}{i:02}" for i in range(12)]
    async with stream_st.open_dataset_writer(tmp_path) as writer:
        await writer.write_batch({c: np.zeros(2, np.uint8) for c in columns}, samples=2)
    dataset = await describe_dataset(tmp_path)
    with pytest.raises(stream_st.UsageError) as caught:
        plan_pieces(dataset, ["nope"])
    said = str(caught.value)
    assert said.startswith("the dataset has no column ['nope'] "), said
    assert f"(it has 12 columns: {columns[:NAMES_SHOWN]} and 4 more)" in said, said
    with pytest.raises(stream_st.UsageError) as caught:
        plan_pieces(dataset, [HUGE, "nope"])
    assert len(str(caught.value)) < 2 * BOUND, len(str(caught.value))
