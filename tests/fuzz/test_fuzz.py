"""Short fuzz runs and the regression corpus (long runs: ``python -m tests.fuzz.fuzz_header``).

``tests/fuzz/regressions/<class>__<case>.bin`` holds every input that ever found a bug, hand-made
minimal ones and the fuzzer's own finds; each is judged like a fuzzed input (reference
``safetensors`` as the oracle, read from bytes and from several chunkings). A class listed in
:data:`OPEN_BUGS` is not fixed yet: its cases are expected to fail, strictly, so the marker must
go when the fix lands.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from .fuzz_files import Judge, fuzz, regression_cases
from .fuzz_header import check, hypothesis_run

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


def test_the_hypothesis_run_goes_on_past_its_first_round() -> None:
    """Settings used to be re-applied each round, which hypothesis refuses."""
    assert hypothesis_run(None, 12, round_size=5) >= 12


OPEN_BUGS: dict[str, tuple[str, list[str]]] = {}
"""Bug classes not fixed yet: the reason, and fragments of the fuzzer's finding signatures."""


def _raw(header: Any, data: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


GENERATED = {
    # The fuzzer's finds are megabytes. A suite cannot time it: today the size's message raises
    # a plain ValueError; the long fuzz run reports the slowness ("hang", "slow").
    "super_linear__many_twos": lambda: _raw(
        {"a": {"dtype": "U8", "shape": [2] * 100_000, "data_offsets": [0, 1]}}, b"\x07"
    ),
}


def _cases() -> list[Any]:
    cases: list[tuple[str, Any]] = [(p.stem, p.read_bytes) for p in regression_cases()]
    cases += list(GENERATED.items())
    params = []
    for name, make in cases:
        bug = OPEN_BUGS.get(name.split("__")[0])
        marks = [pytest.mark.xfail(strict=True, reason=bug[0])] if bug else []
        params.append(pytest.param(make, id=name, marks=marks))
    return params


@pytest.mark.parametrize("make", _cases())
async def test_regression_case(make: Any) -> None:
    data: bytes = make()
    (n,) = struct.unpack("<Q", data[:8])
    step = max(3, len(data) // 256)  # at most a few hundred chunks, as the fuzzer cuts them
    with Judge(math.inf) as judge:  # the suite times nothing: the long fuzz run judges speed
        for cuts in ([], [1, 8, 9], list(range(3, len(data), step)), [8 + n, 8 + n]):
            verdict = await judge.judge(data, cuts)
            assert verdict.finding is None, f"{verdict.finding}: {verdict.detail}"


def test_every_open_bug_has_a_case() -> None:
    names = {p.stem.split("__")[0] for p in regression_cases()} | {
        name.split("__")[0] for name in GENERATED
    }
    assert set(OPEN_BUGS) <= names


async def test_a_short_fixed_seed_run_finds_nothing_new(tmp_path: Path) -> None:
    """Findings of a known open class are tolerated (their cases are above); nothing else."""
    report = await fuzz(seed=0, inputs=4000, findings=tmp_path, slow=math.inf)
    known = [fragment for _, fragments in OPEN_BUGS.values() for fragment in fragments]
    new = [sig for sig in report.findings if not any(k in sig for k in known)]
    assert not new, f"{new}: reproducers in {tmp_path}"
    assert report.outcomes["accepted"] > 100 and report.outcomes["refused by both"] > 100
