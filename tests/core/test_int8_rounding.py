"""INT8 codes round halves away from zero, as the exchange format's C ``round()`` does."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

from stream_st.core.codecs import CODECS

Array = np.ndarray[Any, Any]


def codes(x: Array) -> list[int]:
    parts = dict(CODECS["int8"].encode("t", x))
    result: list[int] = parts["t"].tolist()
    return result


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float32, np.float64])
def test_halves_round_away_from_zero(dtype: Any) -> None:
    # max|x| = 127 gives scale 1.0: the codes are the values rounded
    x = np.array([127.0, 0.5, 1.5, 2.5, 3.5, -0.5, -2.5, -3.5, 126.5, -126.5], dtype=dtype)
    assert codes(x) == [127, 1, 2, 3, 4, -1, -3, -4, 127, -127]


def test_just_below_a_half_rounds_down() -> None:
    below = float(np.nextafter(np.float32(0.5), np.float32(0)))  # 0.49999997
    x = np.array([127.0, below, -below, 2.5 - 2**-22, 1.5 + 2**-23], dtype=np.float32)
    assert codes(x) == [127, 0, 0, 2, 2]


def test_matches_a_reference_on_many_values() -> None:
    rng = np.random.default_rng(7)
    x = rng.standard_normal(100_003).astype(np.float32)
    x[:1000] = rng.integers(-254, 255, 1000) / np.float32(2)  # many exact halves
    x[1000] = 127.0
    parts = dict(CODECS["int8"].encode("t", x))
    scale = float(parts["t.scale"][0])
    y = (x * np.float32(scale)).astype(np.float64)
    expected = np.clip(np.sign(y) * np.floor(np.abs(y) + 0.5), -127, 127)
    assert np.array_equal(parts["t"], expected.astype(np.int8))
    assert np.count_nonzero(np.abs(y - np.trunc(y)) == 0.5) > 400  # the ties were tested


def test_codes_keep_the_shape_of_zero_d_and_strided_input() -> None:
    scalar = dict(CODECS["int8"].encode("t", np.array(2.5, dtype=np.float32)))["t"]
    assert scalar.shape == () and int(scalar) == 127
    strided = np.arange(40, dtype=np.float32).reshape(5, 8)[:, ::2]
    got = dict(CODECS["int8"].encode("t", strided))["t"]
    assert got.shape == (5, 4)
    assert got[-1].tolist() == [107, 114, 120, 127]  # 32, 34, 36, 38 times 127 / 38
