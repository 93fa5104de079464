"""``core.moments`` on 16-bit floats: min and max from bit patterns, F16 widened by its bits."""

from __future__ import annotations

import math
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from stream_st.core.moments import HALF_CHUNK, Moments, moments_of

Array = np.ndarray[Any, Any]
HALVES = [np.float16, ml_dtypes.bfloat16]


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
