"""Stub of the compiled module ``stream_st/core/_half.c``: the sums of F16 and BF16 values."""

from typing import Any

from numpy.typing import NDArray

Bits = NDArray[Any] | bytes | bytearray | memoryview

def sums(bits: Bits, bf16: bool, shift: float, portable: bool = False, /) -> tuple[float, float]:
    """The sums of ``x - shift`` and of its square over the finite F16 (BF16 if ``bf16``) values
    whose bit patterns fill ``bits``; ``portable``: without the CPU's AVX2 and F16C."""

def path() -> str:
    """``"avx2"`` or ``"portable"``: how :func:`sums` widens and adds on this CPU."""
