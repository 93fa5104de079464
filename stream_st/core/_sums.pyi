"""Stub of the compiled module ``stream_st/core/_sums.c``: the sums of F16, BF16 and F32 values."""

from typing import Any

from numpy.typing import NDArray

Values = NDArray[Any] | bytes | bytearray | memoryview

def sums(values: Values, kind: str, shift: float, portable: bool = False, /) -> tuple[float, float]:
    """The sums of ``x - shift`` and of its square over the finite values of dtype ``kind`` (F16,
    BF16 or F32) that fill ``values`` (C-contiguous, any alignment); ``portable``: without the
    CPU's AVX2 and F16C."""

def path() -> str:
    """``"avx2"`` or ``"portable"``: how :func:`sums` widens and adds on this CPU."""
