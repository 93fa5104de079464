"""``core.moments`` on 16-bit floats and F32: min and max from bit patterns, F16 widened by its
bits, both sums by the compiled ``core._sums`` on each of its paths and by numpy without it."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from stream_st.core import moments
from stream_st.core.moments import CHUNK, HALF_CHUNK, CompiledSums, Moments, moments_of

try:
    from stream_st.core import _sums
except ImportError:  # installed without a C compiler
    _sums = None  # type: ignore[assignment]

Array = np.ndarray[Any, Any]
HALVES = [np.float16, ml_dtypes.bfloat16]
PATHS = ["avx2", "portable", "numpy"]


def compiled(path: str) -> CompiledSums:
    """The compiled sums taking ``path`` ("avx2" or "portable"), or a skip where there are none."""
    if _sums is None:
        pytest.skip("stream_st.core._sums was not built (no C compiler at install)")
    if path == "avx2" and _sums.path() != "avx2":
        pytest.skip("this CPU lacks AVX2, FMA or F16C")
    portable = path == "portable"
    return lambda values, kind, shift: _sums.sums(values, kind, shift, portable)


@pytest.fixture(autouse=True, params=PATHS)
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test runs with each way the sums of 16-bit values are taken."""
    chosen: str = request.param
    monkeypatch.setattr(moments, "_SUMS", None if chosen == "numpy" else compiled(chosen))
    return chosen


def assert_matches_numpy(found: Moments, values: Array) -> None:
    """``found`` agrees with numpy in float64: min and max exactly, mean and std to 1e-12, and
    the NaN and Inf counts."""
    wide = values.astype(np.float64)
    finite = wide[np.isfinite(wide)]
    assert (found.nan, found.inf) == (np.isnan(wide).sum(), np.isinf(wide).sum())
    assert found.count == finite.size
    if not finite.size:
        assert found.std is None
        return
    assert (found.low, found.high) == (finite.min(), finite.max())
    std = float(finite.std())
    assert found.std is not None and math.isclose(found.std, std, rel_tol=1e-12, abs_tol=1e-300)
    assert math.isclose(found.mean, float(finite.mean()), rel_tol=1e-12, abs_tol=1e-12 * std)


def cases(dtype: type) -> list[Array]:
    rng = np.random.default_rng(11)
    limits = ml_dtypes.finfo(dtype)
    tiny, big = float(limits.smallest_subnormal), float(limits.max)
    return [
        (rng.standard_normal(HALF_CHUNK + 12_345) * 0.02).astype(dtype),  # two chunks
        (100 + rng.standard_normal(300_000)).astype(dtype),  # far from 0: shifted
        -(100 + rng.standard_normal(300_000)).astype(dtype),  # every value negative
        (rng.standard_normal(100_000) * 1e3 * tiny).astype(dtype),  # subnormals
        np.array([-big, big, tiny, -tiny, -0.0, 0.0], dtype),
        np.array([-0.0], dtype),
        np.full(70_000, -3, dtype),
        np.zeros(5, dtype),
        # chunk by chunk: all positive, all negative, both signs, the chunks far apart
        np.concatenate(
            [
                np.abs(rng.standard_normal(HALF_CHUNK)) + 5,
                -np.abs(rng.standard_normal(HALF_CHUNK)) - 30,
                rng.standard_normal(HALF_CHUNK // 2),
            ]
        ).astype(dtype),
    ]


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
def test_finite_values_match_numpy(dtype: type) -> None:
    for values in cases(dtype):
        assert_matches_numpy(moments_of(values), values)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
def test_nan_and_inf_of_either_sign_in_one_chunk_of_several(dtype: type) -> None:
    rng = np.random.default_rng(12)
    values: Array = rng.standard_normal(2 * HALF_CHUNK + 5).astype(dtype)
    values[[HALF_CHUNK + 1, HALF_CHUNK + 7]] = np.nan
    values[HALF_CHUNK + 2] = -np.nan
    values[HALF_CHUNK + 3] = np.inf
    values[2 * HALF_CHUNK - 1] = -np.inf
    found = moments_of(values)
    assert (found.nan, found.inf) == (3, 2)
    assert_matches_numpy(found, values)
    only: Array = np.array([np.nan, -np.inf, np.inf, -np.nan], dtype)
    assert_matches_numpy(moments_of(only), only)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
def test_parts_of_16_bit_values_merge_to_the_whole(dtype: type) -> None:
    values: Array = (np.random.default_rng(13).standard_normal(1_500_000) * 3 + 7).astype(dtype)
    total = Moments()
    for start in range(0, values.size, 400_001):
        total.merge(moments_of(values, start, start + 400_001))
    assert_matches_numpy(total, values)
    assert_matches_numpy(moments_of(values, 5, 6), values[5:6])


def test_scaling_moments_is_exact_for_powers_of_two() -> None:
    values = np.random.default_rng(14).standard_normal(1000)
    scaled = moments_of(values).times(2.0**-40)
    assert_matches_numpy(scaled, values * 2.0**-40)


COMPILED = pytest.mark.parametrize("path", ["avx2", "portable"], indirect=True)
"""The compiled sums' own checks: on their two paths only."""


@COMPILED
@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
def test_every_finite_pattern_is_widened_exactly(dtype: type, path: str) -> None:
    """Each finite value 16 times over (a whole vector step of the compiled sums, whose sums
    of equal values are exact): both sums are exactly 16 times the value and its square."""
    sums = compiled(path)
    patterns = np.arange(1 << 16, dtype=np.uint16)
    with np.errstate(invalid="ignore"):  # NaN patterns
        values = patterns.view(dtype).astype(np.float64)
    finite = np.isfinite(values)
    groups = np.repeat(patterns[finite], 16).reshape(-1, 16)
    for bits, value in zip(groups, values[finite], strict=True):
        kind = "BF16" if dtype is ml_dtypes.bfloat16 else "F16"
        assert sums(bits, kind, 0.0) == (16 * value, 16 * value * value)


@COMPILED
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32], ids=str)
def test_compiled_sums_take_unaligned_buffers_and_refuse_partial_values(
    dtype: type, path: str
) -> None:
    sums = compiled(path)
    kind = {np.float16: "F16", ml_dtypes.bfloat16: "BF16", np.float32: "F32"}[dtype]
    values: Array = np.random.default_rng(15).standard_normal(5003).astype(dtype)
    raw = bytearray(1) + values.tobytes()
    unaligned = np.frombuffer(raw, np.uint8, offset=1)
    assert unaligned.ctypes.data % 2
    wide = values.astype(np.float64)
    s1, s2 = sums(unaligned, kind, 0.5)
    assert math.isclose(s1, float(np.sum(wide - 0.5)), rel_tol=1e-12)
    assert math.isclose(s2, float(np.sum((wide - 0.5) ** 2)), rel_tol=1e-12)
    with pytest.raises(ValueError, match="not a whole number of"):
        sums(unaligned[:-1], kind, 0.0)
    with pytest.raises(ValueError, match="is not F16, BF16 or F32"):
        sums(unaligned, "F64", 0.0)


@pytest.mark.parametrize(
    "values",
    [
        np.random.default_rng(16).standard_normal(CHUNK * 2 + 77) * 1e-3 + 1000,  # far from 0
        np.random.default_rng(17).standard_normal(CHUNK + 5) * 1e30,
        np.array([np.inf, 1.0, np.nan, -2.5, -np.inf, 3e-42]),  # Inf, NaN, a subnormal
        np.full(CHUNK + 1, 7.0),
    ],
    ids=["far", "huge", "non-finite", "constant"],
)
def test_f32_matches_numpy(values: Array) -> None:
    as_f32 = values.astype(np.float32)
    assert_matches_numpy(moments_of(as_f32), as_f32)


@pytest.mark.parametrize("dtype", [*HALVES, np.float32, ">f4", ">f2"], ids=str)
def test_strided_and_byte_swapped_values(dtype: Any) -> None:
    """Views of every stride (a column, every other value, a transpose) and big-endian values
    give numpy's figures: nothing reads them as if they were contiguous native values."""
    values: Array = (np.random.default_rng(18).standard_normal((600, 300)) * 4 + 2).astype(dtype)
    for view in (values[:, 7], values.reshape(-1)[::3], values.T, values[::2, ::5]):
        assert_matches_numpy(moments_of(view), view)


@pytest.mark.parametrize(
    "values",
    [[0.0, 1e160], [1.7e308, 0.99 * 1.7e308] * 300, [-1.7e308, 1.7e308], [1e300, 2e300, 3e300]],
    ids=["spread", "near-max", "both-ends", "huge"],
)
def test_f64_sums_that_overflow_are_taken_scaled(values: list[float]) -> None:
    """The mean of F64 values whose sums overflow float64 is right (it was NaN), and so is their
    std (it was infinite, as numpy's): their variance overflows, not the std."""
    array = np.array(values, dtype=np.float64)
    scale = 2.0**1000
    found = moments_of(array)
    assert math.isclose(found.mean, float((array / scale).mean()) * scale, rel_tol=1e-12)
    assert (found.low, found.high) == (array.min(), array.max())
    assert found.std is not None
    assert math.isclose(found.std, float((array / scale).std()) * scale, rel_tol=1e-12)


@pytest.mark.parametrize("power", [1000, 600, -600, -900, -1060])
def test_f64_std_far_from_1_is_taken_scaled(power: int) -> None:
    """Values at 2**1000 or 2**-900: the squares overflowed (std inf) or underflowed (std 0,
    or digits lost among subnormals), in one chunk and across chunks whose means differ, where
    the difference of means squared did the same; constant chunks apart by little. Each is
    compared with numpy's std of the values scaled to about 1, which is exact."""
    rng = np.random.default_rng(19)
    integers = rng.integers(-(2**12), 2**12, 3 * CHUNK + 5).astype(np.float64)  # exact scaled
    integers[CHUNK : 2 * CHUNK] += 2**13  # a chunk whose mean is far from the others'
    small = [[1.0, 2.0, 3.0], [3.0, -3.0, 1.0, -2.0]]
    steps = np.repeat([5.0, 6.0, 7.0], CHUNK)  # constant chunks: only their means differ
    for values in (integers, *map(np.array, small), steps):
        array = np.ldexp(values, power)
        found = moments_of(array)
        assert found.std is not None and found.std > 0
        assert math.isclose(found.std, math.ldexp(float(values.std()), power), rel_tol=1e-12)
        assert (found.low, found.high) == (array.min(), array.max())
        assert (found.low, found.high) == (array.min(), array.max())


def test_f64_chunks_far_from_1_and_near_it_merge() -> None:
    """A chunk near 1 between two at 2**1000 (summed scaled): merged in their units; and one
    near 2**20 after one at 2**-900 (summed scaled up), in units of the greater mean."""
    values = np.random.default_rng(20).integers(-(2**12), 2**12, CHUNK).astype(np.float64)
    array = np.concatenate([np.ldexp(values, 1000), values, np.ldexp(values + 9, 1000)])
    found = moments_of(array)
    expected = math.ldexp(float(np.ldexp(array, -1000).std()), 1000)
    assert found.std is not None and math.isclose(found.std, expected, rel_tol=1e-12)
    array = np.concatenate([np.ldexp(values, -900), values + 2**20])
    found = moments_of(array)
    assert found.std is not None and math.isclose(found.std, float(array.std()), rel_tol=1e-12)


@pytest.mark.parametrize(
    "values", [[1e-300, 1e200], [-1e200, 1e-300], [5e-324, 1e300, 2.0], [-5e-324, -1e300]]
)
def test_f64_min_and_max_stay_exact_beside_a_value_taken_scaled(values: list[float]) -> None:
    """A chunk with a value beyond 2**500 is summed scaled down: its tiny end is still its min
    or max (scaled down and back it was 0)."""
    array = np.array(values)
    found = moments_of(array)
    assert (found.low, found.high) == (array.min(), array.max())


def test_f64_chunks_with_means_at_both_ends_merge_to_a_finite_mean() -> None:
    """Chunks at -1.5e308 and +1.5e308: the difference of their means overflows float64, their
    merged mean is 0 (it was inf); the variance overflows, the std is theirs (it was inf)."""
    array = np.concatenate([np.full(CHUNK, -1.5e308), np.full(CHUNK, 1.5e308)])
    found = moments_of(array)
    assert (found.mean, found.std, found.variance) == (0.0, 1.5e308, math.inf)
    total = Moments(1, -1.5e308, 0.0, -1.5e308, -1.5e308)
    total.merge(Moments(2, 1.5e308, 0.0, 1.5e308, 1.5e308))  # weighed 1/3 and 2/3
    assert math.isclose(total.mean, 0.5e308, rel_tol=1e-15)


def int64_cases() -> dict[str, np.ndarray[Any, Any]]:
    """I64 and U64 values a few units apart near either end of their range (and beyond 2**53),
    spanning the whole range, and over several chunks: in steps, in constant chunks whose means
    differ by a unit or two, and as noise (big-endian too)."""
    rng = np.random.default_rng(8)
    noise = rng.integers(0, 10, 2 * CHUNK + 3).astype(np.uint64)
    return {
        "i64 near 2**62": np.array([2**62 + 1, 2**62 + 2, 2**62 + 3], np.int64),
        "i64 bottom": np.array([-(2**63), -(2**63) + 1, -(2**63) + 3], np.int64),
        "i64 top": np.array([2**63 - 1, 2**63 - 2, 2**63 - 4], np.int64),
        "u64 top": np.array([2**64 - 1, 2**64 - 2, 2**64 - 3, 2**64 - 4], np.uint64),
        "i64 both ends": np.array([-(2**63), 2**63 - 1, 5], np.int64),
        "u64 both ends": np.array([0, 2**64 - 1, 2**64 - 3], np.uint64),
        "i64 steps": 2**60 + 7 * np.arange(3 * CHUNK + 5, dtype=np.int64),
        "i64 constant chunks": 2**62 + np.repeat(np.array([0, 1, 3], np.int64), CHUNK),
        "u64 noise at the top": np.uint64(2**64 - 1) - noise,
        "i64 noise at the bottom": np.int64(-(2**63)) + noise.astype(np.int64),
        "u64 big-endian": (np.uint64(2**63) + noise).astype(">u8"),
    }


@pytest.mark.parametrize("name", list(int64_cases()))
def test_std_of_64_bit_integers_takes_their_differences_exactly(name: str) -> None:
    """I64 and U64 values were rounded to float64 before their differences were taken: values a
    few units apart near 2**62 or 2**64 had a std of 0, ``2**60 + 7k`` one 0.07 % off. Their std
    agrees with the exact one (Python ints) to 1e-12, their mean is the exact one rounded once,
    in one call and merged from parts (as validate merges a big tensor's)."""
    values = int64_cases()[name]
    exact = [int(v) for v in values.tolist()]
    n, total = len(exact), sum(exact)
    variance = Fraction(n * sum(v * v for v in exact) - total * total, n * n)
    step = CHUNK + 1_000 if n > CHUNK else 1
    merged = Moments()
    for start in range(0, n, step):
        merged.merge(moments_of(values, start, start + step))
    for found in (moments_of(values), merged):
        assert (found.count, found.low, found.high) == (n, min(exact), max(exact))
        assert found.mean == total / n
        assert found.std is not None
        assert math.isclose(found.std, math.sqrt(variance), rel_tol=1e-12), (found.std, name)


def exact_mean_and_std(values: Array) -> tuple[Fraction, float]:
    """The exact mean of float ``values`` and their exact std rounded once, from Python ints:
    each value is an integer times a power of 2 (its 53-bit mantissa times ``2**(e - 53)``)."""
    mantissas, exponents = np.frexp(values.astype(np.float64))
    unit = int(exponents.min()) - 53
    integers = np.ldexp(mantissas, 53).astype(np.int64).tolist()
    scaled = [m << s for m, s in zip(integers, (exponents - 53 - unit).tolist(), strict=True)]
    n, total = len(scaled), sum(scaled)
    variance = Fraction(n * sum(v * v for v in scaled) - total * total, n * n)
    return Fraction(total, n) * Fraction(2) ** unit, math.ldexp(math.sqrt(variance), unit)


def far_mean_cases() -> dict[str, Array]:
    """Values whose mean is far from zero in units of their spread, over several chunks (a
    number that no chunk divides, too): F64 at 1e8 +- 1e-3, 1e15 plus 0 to 3 (every value
    exact), -3e9 +- 1e-4, near 2**997 (summed scaled) a few thousand units apart, and F32 at
    2**23 plus 0 or 1 (its compiled sums)."""
    rng = np.random.default_rng(21)
    near_top = 2**52 + rng.integers(0, 2**10, 2 * CHUNK + 7)
    return {
        "1e8 +- 1e-3": 1e8 + rng.standard_normal(200_000) * 1e-3,
        "1e15 + 0..3": 1e15 + rng.integers(0, 4, 1 << 20).astype(np.float64),
        "-3e9 +- 1e-4": -(3e9 + rng.standard_normal(3 * CHUNK + 12_345) * 1e-4),
        "2**997 + 2**945 k": np.ldexp(near_top.astype(np.float64), 945),
        "f32 2**23 + 0 or 1": (2**23 + rng.integers(0, 2, 16 * CHUNK + 5)).astype(np.float32),
    }


@pytest.mark.parametrize("name", list(far_mean_cases()))
def test_std_of_values_far_from_zero_over_several_chunks_is_exact(name: str) -> None:
    """Each chunk's mean was rounded to float64, and so was the mean so far, and their
    difference came from the two: the std of F64 values at 1e8 +- 1e-3 over several chunks
    was 1.35e-8 off, that of 1e15 plus 0 to 3 8.9e-6 (numpy's float64 std: 2e-10 and 8e-8),
    that of F32 values at 2**23 plus 0 or 1 up to 5e-12 where parts merged.
    It agrees with the exact one (Python ints) to 1e-12, its mean is the exact one to a unit
    in the last place, in one call and merged from parts (as validate merges a big tensor's)."""
    values = far_mean_cases()[name]
    mean, std = exact_mean_and_std(values)
    step = 100_003  # parts that end inside chunks
    merged = Moments()
    for start in range(0, values.size, step):
        merged.merge(moments_of(values, start, start + step))
    for found in (moments_of(values), merged):
        assert found.count == values.size
        assert abs(Fraction(found.mean) - mean) <= math.ulp(float(mean)), (found.mean, name)
        assert found.std is not None
        assert math.isclose(found.std, std, rel_tol=1e-12), (found.std, std, name)
