"""The compiled layout of a plan (``stream_st/core/_compact.c``, ``laid``) against the Python one.

The compiled layout takes only plain plans (names JSON writes as they are, each once, rows of
hashable dtypes and shapes, data below 2**64) and declines every other (None): the Python loop
then lays the plan out, which raises what is wrong. So a plan must give exactly the same header
bytes, table, index and metadata, or the same error, with it and without it. Skipped where the
package was installed without a C compiler.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stream_st import HeaderError, TensorSpec
from stream_st.core import layout
from stream_st.core.layout import _dtype_named, _layout, build_header
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
    laid = compiled.laid(
        rows, ("name", "dtype", "shape"), '"__metadata__":{}', _dtype_named, _layout
    )
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
        [("a", "F32", (1,)), ("b", "F32", [1])],  # an unhashable shape
        [("a", "F32", (1,), "extra")],
        [(f"t{i}", "U8", (2**61 - 1,)) for i in range(9)],  # past 2**64 - 1 bytes
    ],
)
def test_what_is_not_plain_is_declined(rows: list[Any]) -> None:
    assert compiled.laid(rows, None, "", _dtype_named, _layout) is None


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


class Lying:
    """A dtype-like object (numpy reads ``.dtype``) that equals every other and hashes as one."""

    def __init__(self, dtype: str) -> None:
        self.dtype = np.dtype(dtype)

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return 1


class Raising(Lying):
    """A dtype-like object whose hash and == raise."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("== boom")

    def __hash__(self) -> int:
        raise ValueError("hash boom")


class NoDtype:
    """An object that hashes as ``"F32"``, equals everything and names no dtype."""

    def __eq__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return hash("F32")


@pytest.mark.parametrize(
    "dtypes",
    [
        [Lying("f4"), Lying("f2")],
        ["F32", NoDtype()],
        [Raising("f4"), Raising("f2")],
    ],
)
def test_dtypes_are_told_apart_as_the_python_layout_tells_them(
    dtypes: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row's dtype is looked up whenever its object is not the row before's, never by its
    == or hash: a lying or raising dtype object gives the Python layout's header or error."""
    plan = [TensorSpec(name, dtype, (2,)) for name, dtype in zip("ab", dtypes, strict=True)]
    with_c, in_python = both(lambda: build_header(plan), monkeypatch)
    assert with_c == in_python


class IdName(str):
    """A name whose == and hash are the object's own: two of them never compare equal."""

    __eq__ = object.__eq__
    __hash__ = object.__hash__


@pytest.mark.parametrize("names", [["a", "a"], ["__metadata__"]])
def test_a_str_subclass_name_is_checked_as_its_text(names: list[str]) -> None:
    """Names are taken as plain str: one whose == and hash are its identity does not pass twice,
    nor as ``__metadata__``, in a plan or in a dict of arrays."""
    with pytest.raises(HeaderError):
        build_header([TensorSpec(IdName(name), "F32", (1,)) for name in names])
    with pytest.raises(HeaderError):
        lay_out({IdName(name): np.zeros(1, np.float32) for name in names})


def laid_changing(change: Callable[[list[Any]], None]) -> Any:
    """``laid`` of a plan of one row whose ``name`` getter calls ``change(rows)`` on the list
    being laid out (code a caller defined, run as the compiled layout reads the row)."""
    rows: list[Any] = []

    class Spec:
        dtype = "F32"
        shape = (1,)

        @property
        def name(self) -> str:
            change(rows)
            return "a"

    rows.append(Spec())
    return compiled.laid(rows, ("name", "dtype", "shape"), "", _dtype_named, _layout)


def test_a_row_stays_held_while_its_attributes_run_code() -> None:
    """A row whose attribute getter empties the rows list was read after it was freed (a
    borrowed reference): the row is held while its attributes are read."""

    def empty(rows: list[Any]) -> None:
        rows.clear()
        gc.collect()
        _ = [bytearray(64) for _ in range(1000)]  # the freed row's memory taken again

    assert laid_changing(empty) is None  # no crash; the list changed: left to the Python loop


def test_rows_added_while_laid_out_are_left_to_the_python_loop() -> None:
    """A row added to the list while the plan is laid out was dropped (the columns sized to the
    rows at the start), where the Python loop, going through the same list, lays it out too."""

    def grow(rows: list[Any]) -> None:
        if len(rows) == 1:
            rows.append(TensorSpec("b", "F32", (1,)))

    assert laid_changing(grow) is None
