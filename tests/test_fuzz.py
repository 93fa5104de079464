"""A short run of the header fuzz target (the long run is ``python -m tests.fuzz_header``)."""

from __future__ import annotations

import json
from typing import Any

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from .fuzz_header import check

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=6)
    | st.sampled_from(["F16", "BF16", "F4", "F6_E2M3", "U8", "BOOL"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=12,
)


@st.composite
def header_like(draw: st.DrawFn) -> bytes:
    """JSON headers near the valid ones: tensor entries with fields of random values."""
    entries: dict[str, Any] = {}
    for name in draw(st.lists(st.text(max_size=5), max_size=4)):
        entries[name] = {
            "dtype": draw(st.sampled_from(["F16", "F4", "F6_E3M2", "U8", "C64", "F8_E8M0"])),
            "shape": draw(st.lists(st.integers(0, 4), max_size=3) | json_values),
            "data_offsets": draw(
                st.lists(st.integers(0, 40), min_size=2, max_size=2) | json_values
            ),
        }
    if draw(st.booleans()):
        entries["__metadata__"] = draw(json_values)
    text = json.dumps(entries) + " " * draw(st.integers(0, 9))
    return text.encode() + draw(st.binary(max_size=64))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=256) | header_like())
def test_header_core_and_reader_raise_only_safetensors_errors(data: bytes) -> None:
    check(data)
