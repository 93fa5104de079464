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


def error_stats(original: npt.ArrayLike, decoded: npt.ArrayLike) -> ErrorStats:
    """Root-mean-square error, largest absolute error and signal-to-noise ratio, in float64.

    ``snr_db = 10 * log10(sum(x**2) / sum((x - y)**2))``: ``inf`` when the two are equal (also for
    empty arrays), ``-inf`` when the original is all zeros and the decoded one is not.
    """
    x = np.asarray(original).astype(np.float64)
    y = np.asarray(decoded).astype(np.float64)
    if x.shape != y.shape:
        raise CodecError(f"error_stats: shapes differ, {list(x.shape)} vs {list(y.shape)}")
    if x.size == 0:
        return {"rmse": 0.0, "max_abs_error": 0.0, "snr_db": math.inf}
    diff = x - y
    noise = float(np.sum(diff * diff))
    signal = float(np.sum(x * x))
    if noise == 0.0:
        snr = math.inf
    elif signal == 0.0:
        snr = -math.inf
    else:
        snr = 10.0 * math.log10(signal / noise)
    return {
        "rmse": math.sqrt(noise / x.size),
        "max_abs_error": float(np.max(np.abs(diff))),
        "snr_db": snr,
    }
