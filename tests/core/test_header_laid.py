"""The compiled layout of a plan (``stream_st/core/_compact.c``, ``laid``) against the Python one.

The compiled layout takes only plain plans (names JSON writes as they are, each once, rows of
hashable dtypes and shapes, data below 2**64) and declines every other (None): the Python loop
then lays the plan out, which raises what is wrong. So a plan must give exactly the same header
bytes, table, index and metadata, or the same error, with it and without it. Skipped where the
package was installed without a C compiler.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_st import TensorSpec
from stream_st.core import layout
from stream_st.core.layout import _dtype_named, _layout_by, build_header
from stream_st.core.message import lay_out
from stream_st.errors import SafetensorsError

compiled = pytest.importorskip("stream_st.core._compact", reason="the C module was not built")


def outcome(call: Any) -> Any:
    """What ``call()`` lays out: the prefix, the table's rows, the index and the metadata; or
    its error's type and message."""
    try:
        prefix, header = call()
    except SafetensorsError as exc:
        return type(exc), str(exc)
    return prefix, list(header.tensors), dict(header._index), header.metadata


def both(call: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """``call``'s outcome with the compiled layout, then with the Python loop alone."""
    with_c = outcome(call)
    with monkeypatch.context() as patch:
        patch.setattr(layout, "_LAID", None)
        return with_c, outcome(call)


def test_a_plain_plan_is_laid_out_in_c() -> None:
    rows = [TensorSpec("a", "F32", (2, 3)), TensorSpec("b", np.float16, (4,))]
    layout_of = _layout_by(_dtype_named)
    laid = compiled.laid(rows, ("name", "dtype", "shape"), '"__metadata__":{}', layout_of)
    assert laid is not None
    text, names, codes, shapes, starts, ends, positions = laid
    assert text == (
        b'{"__metadata__":{},"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]},'
        b'"b":{"dtype":"F16","shape":[4],"data_offsets":[24,32]}}'
    )
    assert (names, codes, shapes) == (["a", "b"], ["F32", "F16"], [(2, 3), (4,)])
    assert (starts, ends, positions) == ([0, 24], [24, 32], {"a": 0, "b": 1})


class Name(str):
    """A str subclass: a plan's names may be one."""


@pytest.mark.parametrize(
    "rows",
    [
        [("a", "F32", (1,)), ("a", "F32", (1,))],  # twice
        [("__metadata__", "F32", (1,))],
        [('say "hi"', "F32", (1,))],  # JSON escapes the quote
        [("back\\slash", "F32", (1,))],
        [("line\nbreak", "F32", (1,))],
        [("\ud800", "F32", (1,))],  # no UTF-8
        [(Name("a"), "F32", (1,))],
        [("a", "F32", (1,)), ("b", ["F32"], (1,))],  # unhashable dtype
        [("a", "F32", (1,), "extra")],
        [(f"t{i}", "U8", (2**61 - 1,)) for i in range(9)],  # past 2**64 - 1 bytes
    ],
)
def test_what_is_not_plain_is_declined(rows: list[Any]) -> None:
    layout_of = _layout_by(_dtype_named)
    assert compiled.laid(rows, None, "", layout_of) is None


def test_a_layout_error_is_the_rows_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dtype safetensors has no code for raises at its row, after the rows before it."""
    arrays = {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.str_), "c": np.zeros(1)}
    with_c, in_python = both(lambda: lay_out(arrays, order="plan")[:2], monkeypatch)
    assert with_c == in_python
    assert "'b'" in with_c[1]


def test_a_lone_surrogate_in_the_metadata_is_refused_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = [TensorSpec("a", "F32", (1,))]
    with_c, in_python = both(lambda: build_header(plan, {"k": "\udcff"}), monkeypatch)
    assert with_c == in_python
    assert "Unicode" in with_c[1]


def test_a_big_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    plan = [TensorSpec(f"layers.{i}.kv", "BF16", (2, 8, i % 7 + 1)) for i in range(20_000)]
    with_c, in_python = both(lambda: build_header(plan, {"format": "pt"}), monkeypatch)
    assert with_c == in_python


NAMES = st.text(st.characters(codec="utf-8"), max_size=6) | st.sampled_from(
    ["a", "b", "__metadata__", 'q"', "\\", "\x00", "\ud800", "é", "日本"]
)
DTYPES = st.sampled_from(
    ["F32", "F16", "BF16", "I64", "BOOL", "F4", "F8_E4M3", "C64", "U1", "nope", np.float64]
)
NUMPY_DTYPES = st.sampled_from(
    [np.dtype(np.int8), np.dtype(ml_dtypes.bfloat16), np.dtype(">f4"), np.dtype("U3")]
)
SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 7, 2**32, 2**63, 2**64 - 1, 2**64]), max_size=4).map(
    tuple
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(st.tuples(NAMES, DTYPES | NUMPY_DTYPES, SHAPES), max_size=6),
    metadata=st.none() | st.dictionaries(NAMES, NAMES, max_size=2),
)
def test_the_same_header_or_error(rows: list[Any], metadata: dict[str, str] | None) -> None:
    """Any plan: the same header bytes, table, index and metadata, or the same error."""

    def plan() -> Any:
        return build_header([TensorSpec(*row) for row in rows], metadata)

    with pytest.MonkeyPatch.context() as monkeypatch:
        with_c, in_python = both(plan, monkeypatch)
    assert with_c == in_python
