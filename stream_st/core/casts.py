"""Float casts and error measures the codecs and the command share: :func:`to_bfloat16` (round to
nearest, ties to even, never truncating) and :func:`error_stats` (how far a decoded tensor is from
its original).
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ..errors import CodecError

__all__ = ["ErrorStats", "error_stats", "to_bfloat16"]

Array = npt.NDArray[Any]

_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _round_to_odd_f32(values: Array) -> Array:
    """float64 -> float32 rounded to odd: truncate toward zero, then set the last bit if inexact.

    Rounding to odd with at least two extra bits makes a following round-to-nearest-even correct
    (float32 keeps 16 bits more than bfloat16, subnormals included).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype(np.float32)
    flat = out.reshape(-1)
    source = values.reshape(-1)
    inexact = np.isfinite(source) & (flat.astype(np.float64) != source)
    if inexact.any():
        got = flat[inexact]
        away = np.abs(got.astype(np.float64)) > np.abs(source[inexact])
        truncated = np.where(away, np.nextafter(got, np.float32(0)), got)
        flat[inexact] = (truncated.view(np.uint32) | np.uint32(1)).view(np.float32)
    return out


def to_bfloat16(array: npt.ArrayLike) -> Array:
    """``array`` (float16, float32, float64 or bfloat16) as bfloat16, rounded to nearest-even.

    Not truncation: ``1 + 2**-8 + 2**-9`` becomes ``1 + 2**-7``. Values beyond the bfloat16 range
    round to +-Inf, NaN stays a (quiet) NaN with its sign, and +-Inf stays +-Inf.
    """
    values = np.asarray(array)
    if not values.dtype.isnative:  # big-endian floats: the same values in the machine's order
        values = values.astype(values.dtype.newbyteorder("="))
    if values.dtype == _BF16:
        return values.copy()
    if values.dtype == _F64:
        values = _round_to_odd_f32(values)
    elif values.dtype not in (_F16, _F32):
        raise CodecError(
            f"to_bfloat16 converts float16, float32 or float64 arrays, not {values.dtype}"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(_BF16)


class ErrorStats(TypedDict):
    """How far a decoded tensor is from the original (see :func:`error_stats`)."""

    rmse: float
    max_abs_error: float
    snr_db: float


def _exponent(values: Array) -> int:
    """``e`` with ``max|values| < 2**e`` (0 for none, all zeros, or a NaN or Inf among them):
    dividing by ``2**e``, exact, brings every value into (-1, 1)."""
    top = float(np.max(np.abs(values))) if values.size else 0.0
    return math.frexp(top)[1] if 0.0 < top < math.inf else 0


def _squares(values: Array) -> tuple[float, int]:
    """``sum(values**2)`` as ``(total, e)``, meaning ``total * 4**e``: the values are scaled by
    ``2**-e`` first, so that neither the largest square nor the sum overflows or underflows."""
    e = _exponent(values)
    scaled = np.ldexp(values, -e)
    return float(np.sum(scaled * scaled)), e


def _times_two_to(value: float, e: int) -> float:
    """``value * 2**e``, infinite where that is beyond float64."""
    with np.errstate(over="ignore"):
        return float(np.ldexp(value, e))


def error_stats(original: npt.ArrayLike, decoded: npt.ArrayLike) -> ErrorStats:
    """Root-mean-square error, largest absolute error and signal-to-noise ratio, in float64.

    ``snr_db = 10 * log10(sum(x**2) / sum((x - y)**2))``: ``inf`` when the two are equal (also for
    empty arrays), ``-inf`` when the original is all zeros and the decoded one is not. Values are
    scaled by powers of two before they are squared, so the figures hold for values of any
    magnitude (1e-200 as 1e160).
    """
    x = np.asarray(original)
    y = np.asarray(decoded)
    if x.shape != y.shape:
        raise CodecError(f"error_stats: shapes differ, {list(x.shape)} vs {list(y.shape)}")
    if x.size == 0:
        return {"rmse": 0.0, "max_abs_error": 0.0, "snr_db": math.inf}
    with np.errstate(invalid="ignore"):  # a signaling NaN: a quiet one, with no warning
        x, y = x.astype(np.float64), y.astype(np.float64)
        shift = max(_exponent(x), _exponent(y))  # x - y cannot overflow in units of 2**shift
        x, y = np.ldexp(x, -shift), np.ldexp(y, -shift)
    diff = x - y
    noise, noise_e = _squares(diff)
    signal, signal_e = _squares(x)
    if noise == 0.0:
        snr = math.inf
    elif signal == 0.0:
        snr = -math.inf
    else:
        snr = 10.0 * math.log10(signal / noise) + 20.0 * math.log10(2.0) * (signal_e - noise_e)
    return {
        "rmse": _times_two_to(math.sqrt(noise / x.size), noise_e + shift),
        "max_abs_error": _times_two_to(float(np.max(np.abs(diff))), shift),
        "snr_db": snr,
    }
