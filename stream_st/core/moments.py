"""Statistics of an array's values in one pass over cache-sized chunks, exact to float64.

:func:`moments_of` summarises a run of values as :class:`Moments`: the count of finite values,
their min, max, mean and sum of squared deviations (``m2``), and the NaN and Inf counts.
Summaries of parts merge exactly (:meth:`Moments.merge`, the pairwise update of Chan, Golub and
LeVeque), so a big tensor is summarised in parts by several threads and merged in order. The mean
is kept as two float64s, ``mean`` and the ``tail`` that it lacks, and each chunk's as its shift
and its offset from it, so that the difference of two means, squared into ``m2`` as parts merge,
keeps float64's accuracy in units of the values' spread: at 1e8 +- 1e-3, float64's spacing
(1.5e-8) is a hundredth of the difference of two chunks' means (the std over several chunks was
1.35e-8 off, that of 1e15 plus 0 to 3 9e-6, where one float64 held each mean). ``m2`` is
kept in units of a power of 4 where float64 could not hold it (values far from 1, as
:func:`~stream_st.core.casts.error_stats` keeps its sums of squares): the std of F64 values near
1e300 or 1e-200 is theirs, not infinite or 0.

Integer (and boolean) values keep their min and max exact, as Python ints taken in their own
dtype (a 64-bit integer beyond 2**53 is not rounded through float64), and their exact sum
(``integer_sum``, each chunk summed in integers: 64-bit values in their own type, modulo 2**64,
set right by the chunk's float64 sum), so that their mean is that sum divided by the count,
rounded once to float64. Their ``m2`` is taken in float64 as any other type's, 64-bit values'
from their differences from an integer shift, taken modulo 2**64 (:func:`_add_integers`:
values a few units apart beyond 2**53 are not made equal by float64 first), and parts' means
compared by their exact sums where parts merge.

Each chunk of :data:`CHUNK` values (a few hundred KiB: it stays in the CPU's caches while every
statistic is taken from it) is handled with a few numpy calls, most of which release the GIL:

* min and max in the array's own type (a NaN or an infinity shows in them: only then are the
  chunk's non-finite values counted and dropped); for F16 and BF16, from the values' bit patterns
  (two integer reductions over each chunk of :data:`HALF_CHUNK` values, cheaper than on the
  values, and the first read of the chunk: the passes after it find it in the core's cache);
* the values as float64 in scratch memory, minus a shift ``K`` (the mean so far; for the first
  chunk the midpoint of its min and max; none for values about 0), then their sum ``s1``, by
  ``einsum`` over blocks of :data:`BLOCK` values, and their sum of squares ``s2``, by BLAS dot
  products of the same blocks (one numpy call each for all the blocks of a chunk; the squares'
  ``matmul`` holds the GIL, but is 1.5 to 2 times as fast as any call that does not). The chunk's
  mean is ``K + s1/n`` and its ``m2`` is ``s2 - s1**2/n``: with ``K`` near the mean there is
  little to cancel. Where ``s1**2/n`` is close to ``s2`` anyway (the chunk's mean far from ``K``
  in units of its spread) the chunk's deviations are taken again from its own mean (more passes
  over the chunk, still in cache), so every result keeps float64 accuracy: the std of values at
  1000 +- 0.01 agrees with numpy's float64 ``std`` to ~1e-13, where the mean of squares minus
  the squared mean loses six digits.

F16, BF16 and F32 chunks are summed by the compiled :mod:`stream_st.core._sums` where it was built
(each value widened exactly and both sums taken in one pass, the GIL released: 0.3 ns a value on
AVX2 against 0.7 to 1.5 with numpy, and worker threads on every core at once). Without it, and for
the other types: BF16 and the 8-bit floats are widened to float64 by ml_dtypes' casts, F16 by a
move of its bits into float32's (:func:`f16_over_unit`: numpy's float16 cast is several times
slower), complex values are summarised by their magnitudes (taken in float64), booleans as 0 and
1. Packed sub-byte types (F4, F6) have no values here: :func:`summarisable` says which dtypes do.
No I/O.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .casts import _times_two_to

__all__ = [
    "CHUNK",
    "F16_UNIT",
    "Moments",
    "f16_over_unit",
    "moments_of",
    "sign_extremes",
    "summarisable",
]

Array = np.ndarray[Any, Any]

CHUNK = 1 << 16
"""Values taken per chunk: 256 KiB of F32 plus 512 KiB of float64 scratch, in a core's cache
(measured best of 16 Ki to 256 Ki values: 2.6 GB of F32 per CPU-second, 2.0 at 16 Ki)."""

HALF_CHUNK = 1 << 17
"""16-bit values taken per chunk: 1 MiB of float64 scratch."""

BLOCK = 1 << 13
"""Values per block summed, and per BLAS dot product. OpenBLAS runs a dot product of more than
10 000 values on several threads, which on busy cores costs far more than it saves (a 64 Ki-value
one measured up to 25 times slower than 8 of these; its threads wait for work spinning, a CPU's
worth), and the statistics' worker threads already use every CPU."""

_FAR, _NEAR = 2.0**400, 2.0**-400
"""Chunks whose largest magnitude is not in [_NEAR, _FAR) (F64 and C128 only) are summed scaled
by a power of 2 into [1, 2), their ``m2`` kept in those units: their sums and squares would
overflow float64 (a mean of NaN where two values near the largest float64 were added, a std of
``inf``) or underflow (a std of 0 for values of 1e-200 that differ). Within them, no square, sum
of squares (of up to 2**60 values) or difference of means squared does either."""

_RECENTRE = 1e-3
"""A chunk whose ``m2`` is below this fraction of its shifted sum of squares (three digits or
more cancelled) is summed again about its own mean."""

_MIN, _MAX = np.minimum.reduce, np.maximum.reduce  # without the methods' Python layer

_PACKED = frozenset({"F4", "F6_E2M3", "F6_E3M2"})
_F16 = np.dtype(np.float16)
_INFINITY_BITS = {np.dtype(ml_dtypes.bfloat16): 0x7F80, _F16: 0x7C00}
"""The bit pattern of +Inf of each 16-bit float type: those of NaN are above it (and those of -Inf
and the negative NaNs the same with the sign bit, :data:`_SIGN`, set)."""
_HALVES = frozenset(_INFINITY_BITS)
_SIGN = 0x8000
F16_UNIT = 2.0**112
"""F16 values are widened divided by this (:func:`f16_over_unit`); their moments multiplied back."""
_UNPACK_F32, _UNPACK_F16 = struct.Struct("<f").unpack, struct.Struct("<e").unpack

Sums = tuple[float, float]
"""The sum of some values and the sum of their squares."""

CompiledSums = Callable[[Array, str, float], Sums]
"""``sums(values, kind, shift) -> (s1, s2)``: the sums of ``x - shift`` and of its square over
the finite ``values`` (C-contiguous) of safetensors dtype ``kind``: F16, BF16 or F32."""


def _compiled_sums() -> CompiledSums | None:
    """:func:`stream_st.core._sums.sums`, None where the package was installed without it (no C
    compiler at hand): numpy then does the same work."""
    try:
        from ._sums import sums
    except ImportError:
        return None
    return sums


_SUMS = _compiled_sums()
_F32 = np.dtype(np.float32)


def _bf16_value(bits: int) -> float:
    """The value of BF16 bit pattern ``bits``."""
    value: float = _UNPACK_F32((bits << 16).to_bytes(4, "little"))[0]
    return value


def _f16_value(bits: int) -> float:
    """The value of F16 bit pattern ``bits``."""
    value: float = _UNPACK_F16(bits.to_bytes(2, "little"))[0]
    return value


_VALUE_OF = {np.dtype(ml_dtypes.bfloat16): _bf16_value, _F16: _f16_value}
"""The value of each 16-bit float type's bit pattern (a Python int)."""


def summarisable(dtype: str) -> bool:
    """Whether tensors of safetensors dtype ``dtype`` have values to summarise."""
    return dtype not in _PACKED


@dataclass
class Moments:
    """The summary of some values: ``count`` finite values, their ``low`` and ``high``, ``mean``
    and ``m2`` (sum of squared deviations from the mean, in units of ``4**e``: the deviations
    in units of ``2**e``), and the ``nan`` and ``inf`` values left out of them. ``low`` and
    ``high`` are ``inf`` and ``-inf`` while ``count`` is 0; for integer values they are exact
    Python ints. ``integer_sum``: the exact sum of integer values (None for floating ones), of
    which ``mean`` is then the quotient by ``count``, rounded once. ``tail``: what ``mean``
    lacks of the mean (floating values' mean is ``mean + tail`` to about twice float64's
    precision; 0 with an integer sum, which says more).
    """

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    low: int | float = math.inf
    high: int | float = -math.inf
    nan: int = 0
    inf: int = 0
    integer_sum: int | None = None
    e: int = 0
    tail: float = 0.0

    @property
    def variance(self) -> float | None:
        """The population variance (``m2 / count``, ``inf`` beyond float64), None without
        finite values."""
        return _times_two_to(max(self.m2, 0.0) / self.count, 2 * self.e) if self.count else None

    @property
    def std(self) -> float | None:
        """The population standard deviation (numpy's ``std``), None without finite values."""
        if not self.count:
            return None
        return _times_two_to(math.sqrt(max(self.m2, 0.0) / self.count), self.e)

    def times(self, factor: float) -> Moments:
        """These moments of the values multiplied by ``factor`` (exact for a power of 2)."""
        mantissa, exponent = math.frexp(factor)  # factor = 2 * mantissa * 2**(exponent - 1)
        return Moments(  # no integer sum: the values scaled are floating-point ones
            self.count,
            self.mean * factor,
            self.m2 * (2 * mantissa) ** 2,
            self.low * factor,
            self.high * factor,
            self.nan,
            self.inf,
            e=self.e + exponent - 1,
            tail=self.tail * factor,
        )

    def add(
        self,
        count: int,
        mean: float,
        m2: float,
        e: int,
        exact: float | None = None,
        tail: float = 0.0,
    ) -> None:
        """Add ``count`` (> 0) more values, of mean ``mean + tail`` and ``m2`` in units of
        ``4**e``, to the count, mean and ``m2`` of these (Chan, Golub and LeVeque's pairwise
        update). The means' difference is taken part by part, ``mean - self.mean`` (exact where
        they are close) and ``tail - self.tail``: ``mean`` may be a chunk's shift, and ``tail``
        its mean's offset from it. Where float64 might not hold the sum of ``m2`` (see
        :data:`_FAR`), it is taken in the units of its largest term. ``exact``: the means'
        difference where it is known better than from them (integer values' means, rounded to
        float64, from their exact sums)."""
        if not self.count:
            self.count, self.m2, self.e = count, m2, e
            self.mean, self.tail = _two_sum(mean, tail)
            return
        total = self.count + count
        weight = self.count * (count / total)
        delta = (mean - self.mean) + (tail - self.tail) if exact is None else exact
        if self.e == e == 0 and (not delta or _NEAR <= abs(delta) < _FAR):
            self.m2 += m2 + delta * delta * weight  # nothing over- or underflows
        else:  # the means' difference in units of 2**unit, the greater mean's in [0.5, 1)
            unit = math.frexp(max(abs(mean + tail), abs(self.mean)))[1]  # mean: maybe a shift
            if exact is None:
                apart = math.ldexp(mean, -unit) - math.ldexp(self.mean, -unit)
                apart += math.ldexp(tail - self.tail, -unit)
            else:
                apart = math.ldexp(exact, -unit)
            terms = ((self.m2, self.e), (m2, e), (apart * apart * weight, unit))
            self.m2, self.e = _sum_of_squares(terms)
        if math.isfinite(delta):
            self.mean, self.tail = _two_sum(self.mean, self.tail + delta * (count / total))
        else:  # means near float64's ends, of opposite signs: weighted, they cannot overflow
            self.mean = self.mean * (self.count / total) + mean * (count / total)
            self.tail = 0.0
        self.count = total

    def merge(self, other: Moments) -> None:
        """Add ``other``'s values to these (exact: Chan, Golub and LeVeque's pairwise update)."""
        self.nan += other.nan
        self.inf += other.inf
        if not other.count:
            return
        first = not self.count
        exact = None
        if not first and self.integer_sum is not None and other.integer_sum is not None:
            exact = (other.integer_sum * self.count - self.integer_sum * other.count) / (
                self.count * other.count
            )  # the means' difference, rounded once
        self.add(other.count, other.mean, other.m2, other.e, exact, other.tail)
        if first:
            self.integer_sum = other.integer_sum
        elif self.integer_sum is None or other.integer_sum is None:
            self.integer_sum = None
        else:
            self.integer_sum += other.integer_sum
            self.mean, self.tail = self.integer_sum / self.count, 0.0  # exact, rounded once
        self.low = min(self.low, other.low)
        self.high = max(self.high, other.high)


def _two_sum(high: float, low: float) -> tuple[float, float]:
    """``high + low`` as the float64 nearest it and what that lacks, exactly (Knuth's TwoSum:
    six additions, right whichever of the two is the greater)."""
    total = high + low
    part = total - high
    return total, (high - (total - part)) + (low - part)


def _sum_of_squares(terms: tuple[tuple[float, int], ...]) -> tuple[float, int]:
    """The sum of ``value * 4**e`` over ``terms`` (values >= 0), as ``(total, e)``: each term
    taken in the units of the largest (one too small to count there becomes 0), so that neither
    a term nor the sum over- or underflows."""
    powers = [
        (mantissa, exponent + 2 * e)
        for value, e in terms
        if value > 0
        for mantissa, exponent in [math.frexp(value)]
    ]
    if not powers:
        return 0.0, 0
    unit = -(-max(power for _, power in powers) // 2)
    return math.fsum(math.ldexp(mantissa, power - 2 * unit) for mantissa, power in powers), unit


def _floating(dtype: np.dtype[Any]) -> bool:
    """Whether values of ``dtype`` may be NaN or infinite (numpy and ml_dtypes floats, complex)."""
    return dtype.kind in "fcV"


def _narrow_float(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is a float narrower than float32 (F16, BF16, the F8 types)."""
    return dtype.kind in "fV" and dtype.itemsize < 4


def _widen(values: Array, scratch: Array) -> Array:
    """``values`` as a type numpy's reductions handle natively: the floats narrower than float32
    as float64 (into ``scratch``, float64 of at least their size), and complex values' magnitudes
    (there too, from the parts widened to float64: ``np.abs`` of complex64 rounds them to
    float32), 0 and 1 (uint8) for bool, whose every nonzero byte is true (as numpy and the
    reference read it); others as they are."""
    dtype = values.dtype
    if _narrow_float(dtype):
        out = scratch[: values.size]
        np.copyto(out, values, casting="unsafe")
        return out
    if dtype == np.bool_:
        return np.minimum(values.view(np.uint8), 1)
    if dtype.kind == "c":  # hypot of the widened parts, as numpy's abs of complex128
        out = scratch[: values.size]
        np.hypot(values.real, values.imag, out=out, dtype=np.float64)
        return out
    return values


def moments_of(values: Array, start: int = 0, stop: int | None = None) -> Moments:
    """The :class:`Moments` of ``values.reshape(-1)[start:stop]`` (any numeric dtype, F4 and F6
    excepted), taken chunk by chunk in bounded scratch memory; numpy releases the GIL for the
    work, so threads may summarise parts of one array at once."""
    flat = values.reshape(-1)
    stop = flat.size if stop is None else min(stop, flat.size)
    result = Moments()
    if stop <= start:
        return result
    with np.errstate(all="ignore"):  # NaN and Inf are counted, overflow shows as Inf
        if flat.dtype in _HALVES:
            _add_halves(result, flat, start, stop)
        else:
            _add_chunks(result, flat, start, stop)
    return result


def _add_chunks(result: Moments, flat: Array, start: int, stop: int) -> None:
    """Merge the moments of ``flat[start:stop]`` (``start < stop``) into ``result``, chunk by
    chunk, each chunk's min and max taken first."""
    floating = _floating(flat.dtype)
    integer = flat.dtype.kind in "iub"
    compiled = _SUMS if flat.dtype == _F32 else None
    size = min(CHUNK, stop - start) if compiled is None else 0
    scratch = np.empty(size + -size % BLOCK, np.float64)
    for at in range(start, stop, CHUNK):
        chunk = _widen(flat[at : min(at + CHUNK, stop)], scratch)
        low, high = _MIN(chunk), _MAX(chunk)
        if floating and not (math.isfinite(low) and math.isfinite(high)):
            chunk = _finite(result, chunk)
            if not chunk.size:
                continue
            low, high = _MIN(chunk), _MAX(chunk)
        if integer:  # min and max exact, in the values' own type (float64 rounds beyond 2**53)
            _add_integers(result, chunk, int(low), int(high), scratch)
            continue
        low, high = float(low), float(high)
        if compiled is not None:
            _add_sums(result, chunk.size, low, high, _compiled(compiled, chunk, "F32"))
        elif (top := max(-low, high)) and not _NEAR <= top < _FAR:  # F64 far from 1: scaled
            factor = 2.0 ** min(1 - math.frexp(top)[1], 1022)  # it and its inverse are finite
            part = Moments()
            np.multiply(chunk, factor, out=scratch[: chunk.size])
            _add_finite(part, scratch[: chunk.size], low * factor, high * factor, scratch)
            part = part.times(1 / factor)
            part.low, part.high = low, high  # exact (a tiny one scaled down and back is 0)
            result.merge(part)
        else:
            _add_finite(result, chunk, low, high, scratch)


def _add_integers(result: Moments, chunk: Array, low: int, high: int, scratch: Array) -> None:
    """Merge the moments of integer ``chunk`` (from ``low`` to ``high``) into ``result``, with
    their exact sum (:func:`_integer_sum`) and its quotient by the count as their mean. 64-bit
    values are taken less an integer shift, the midpoint of ``low`` and ``high`` rounded up, in
    int64 arithmetic (modulo 2**64, U64 values and the shift read as int64: the differences, from
    ``-2**63`` to ``2**63 - 1``, come out right) before they become float64 in ``scratch``, in
    the same numpy call: exact while the chunk's values span less than 2**53, where float64 would
    round each value itself (values a few units apart near 2**62 became equal). Narrower values
    are exact in float64 as they are."""
    shift = low + (high - low + 1) // 2 if chunk.dtype.itemsize == 8 else 0
    values = chunk
    if shift:
        values = scratch[: chunk.size]
        wrapped = np.int64((shift + 2**63) % 2**64 - 2**63)
        np.subtract(chunk, wrapped, values, dtype=np.int64, casting="unsafe")
    part = Moments()
    _add_finite(part, values, low - shift, high - shift, scratch)
    part.integer_sum = _integer_sum(chunk, (part.mean + shift) * part.count)
    part.mean, part.tail = part.integer_sum / part.count, 0.0
    part.low, part.high = low, high
    result.merge(part)


def _integer_sum(chunk: Array, near: float) -> int:
    """The exact sum of ``chunk`` (integers, at most :data:`CHUNK` of them), ``near`` its sum
    as float64 gave it. Values narrower than 64 bits are summed in int64, which they cannot
    overflow; 64-bit ones in their own type, which gives the sum modulo 2**64 (numpy's integers
    wrap), the multiple of 2**64 to add being the one that brings it nearest ``near``: float64
    sums of 64 Ki values are off by far less than 2**62 (one pass, no scratch)."""
    if chunk.dtype.itemsize < 8:
        return int(np.add.reduce(chunk, dtype=np.int64))
    wrapped = int(np.add.reduce(chunk))
    return wrapped + round((near - wrapped) / 2**64) * 2**64


def _add_halves(result: Moments, flat: Array, start: int, stop: int) -> None:
    """:func:`_add_chunks` for F16 and BF16 (``start < stop``), chunk by chunk of
    :data:`HALF_CHUNK` values: the chunk's min and max from its bit patterns (two integer
    reductions over the 16-bit values, which bring the chunk into the core's cache for the rest),
    then the values as float64 (BF16 by ml_dtypes' cast, F16 by :func:`f16_over_unit`) straight
    into :func:`_add_finite`, or both sums by the compiled :data:`_SUMS` where it is there.
    A chunk holding a NaN or an Inf goes the general way."""
    f16 = flat.dtype == _F16
    infinity = _INFINITY_BITS[flat.dtype]
    value_of = _VALUE_OF[flat.dtype]
    compiled = _SUMS
    size = min(HALF_CHUNK, stop - start) if compiled is None else 0
    scratch = np.empty(size + -size % BLOCK, np.float64)
    wide = np.empty(size if f16 else 0, np.uint32)
    unit = F16_UNIT if f16 and compiled is None else 1.0
    scaled = Moments()  # the finite chunks' values divided by ``unit``
    for at in range(start, stop, HALF_CHUNK):
        chunk = flat[at : min(at + HALF_CHUNK, stop)]
        bits = chunk.view(np.uint16)
        top, big = sign_extremes(bits)
        if top >= infinity or big >= _SIGN | infinity:
            _add_chunks(result, flat, at, at + chunk.size)
            continue
        if top < 0 or big < _SIGN:  # all of one sign: the pattern nearest 0 is the other end
            small = int(_MIN(bits))
            top, big = (small, big) if top < 0 else (top, small)
        low, high = value_of(big) / unit, value_of(top) / unit
        if compiled is not None:
            kind = "F16" if f16 else "BF16"
            _add_sums(scaled, chunk.size, low, high, _compiled(compiled, chunk, kind))
            continue
        shifted = scratch[: chunk.size]
        if f16:
            np.copyto(shifted, f16_over_unit(chunk, wide))
        else:
            np.copyto(shifted, chunk, casting="unsafe")
        _add_finite(scaled, shifted, low, high, scratch)
    result.merge(scaled.times(unit))


def _compiled(compiled: CompiledSums, values: Array, kind: str) -> Shifts:
    """The :data:`Shifts` of ``values`` (a chunk, of dtype ``kind``) by ``compiled``: each call
    one pass over them, from the values themselves (the shifts add up). A strided chunk (of a
    view) is copied first: the compiled sums read contiguous values."""
    values = np.ascontiguousarray(values)
    total = 0.0

    def sums(shift: float) -> Sums:
        nonlocal total
        total += shift
        return compiled(values, kind, total)

    return sums


def f16_over_unit(values: Array, wide: Array) -> Array:
    """F16 ``values`` divided by :data:`F16_UNIT` (``2**112``), exactly, as float32: their bit
    patterns made float32's in ``wide`` (uint32 of at least their size, returned as float32), the
    sign extended to 32 bits, shifted up by 13 and the three bits between the sign and the
    exponent cleared (numpy's own float16 cast is several times slower; F16 subnormals become
    float32 subnormals). NaN and Inf would come out finite: the values must have neither."""
    bits = wide[: values.size]
    np.copyto(bits.view(np.int32), values.view(np.int16))
    np.left_shift(bits, 13, out=bits)
    np.bitwise_and(bits, 0x8FFF_FFFF, out=bits)
    return bits.view(np.float32)


def sign_extremes(flat: Array) -> tuple[int, int]:
    """The greatest bit pattern of float array ``flat`` (not empty) read as a signed integer,
    and the greatest read as unsigned (two integer reductions, no float conversion): the first,
    if not negative, is that of the greatest value with the sign bit clear, the second, if it has
    the sign bit, that of the least value with it (the negative of greatest magnitude). NaN
    patterns lie beyond Inf's, Inf's beyond every finite value's."""
    width = flat.dtype.itemsize
    unsigned = flat.view(f"u{width}")
    return int(_MAX(unsigned.view(f"i{width}"))), int(_MAX(unsigned))


def _finite(result: Moments, chunk: Array) -> Array:
    """The finite values of ``chunk``, its NaN and Inf values counted into ``result``."""
    finite = np.isfinite(chunk)
    nan = int(np.count_nonzero(np.isnan(chunk)))
    kept = int(np.count_nonzero(finite))
    result.nan += nan
    result.inf += chunk.size - kept - nan
    return chunk[finite]


def _sums(scratch: Array, n: int) -> Sums:
    """The sum and the sum of squares of ``scratch[:n]``, in blocks of :data:`BLOCK` values (the
    last padded with zeros, ``scratch`` being long enough: a multiple of BLOCK values), added up:
    the sums by one ``einsum`` (which releases the GIL, and reads the values once: 1.6 times as
    fast as a BLAS product with a vector of ones, which numpy's ``matmul`` runs holding the GIL),
    the squares by BLAS dot products, all in one ``matmul`` call."""
    padded = -n % BLOCK
    if padded:
        scratch[n : n + padded] = 0.0
    rows = scratch[: n + padded].reshape(-1, BLOCK)
    s1 = float(np.add.reduce(np.einsum("ij->i", rows)))
    s2 = float(np.add.reduce(np.matmul(rows[:, None, :], rows[:, :, None]), axis=None))
    return s1, s2


Shifts = Callable[[float], Sums]
"""``sums(shift)``: the values less ``shift`` (taken from them as the calls before left them: the
shifts add up), and their :data:`Sums`."""


def _add_finite(result: Moments, chunk: Array, low: float, high: float, scratch: Array) -> None:
    """Merge the moments of ``chunk`` (finite values, from ``low`` to ``high``) into ``result``.
    ``scratch``: float64 of at least the chunk's size rounded up to a multiple of
    :data:`BLOCK`, where ``chunk`` may be already (the values are taken there, shifted)."""
    n = chunk.size
    shifted = scratch[:n]
    if not np.may_share_memory(chunk, shifted):
        np.copyto(shifted, chunk, casting="unsafe")  # exact unless it spans 2**53 (64-bit ints)

    def sums(shift: float) -> Sums:
        if shift:
            np.subtract(shifted, shift, out=shifted)
        return _sums(scratch, n)

    _add_sums(result, n, low, high, sums)


def _add_sums(result: Moments, n: int, low: float, high: float, sums: Shifts) -> None:
    """Merge into ``result`` the moments of ``n`` finite values from ``low`` to ``high``, whose
    sums ``sums`` gives about a shift: first about the mean so far (for the first values the
    midpoint of ``low`` and ``high``; none for values about 0), then, where that cancelled most
    digits, about the float64 nearest their own mean. Their mean goes to ``result`` as the
    shift and the offset from it (``s1 / n``, in the units of the values' spread), not rounded
    to float64 as one: far from 0, float64's spacing of means can be much of their spread."""
    shift = result.mean if result.count else low + (high - low) / 2
    if abs(shift) <= high - low:  # values about 0: little to cancel, one pass saved
        shift = 0.0
    s1, s2 = sums(shift)
    m2 = s2 - s1 * (s1 / n)
    offset = s1 / n
    if m2 < _RECENTRE * s2:  # cancelled: deviations again, from the chunk's own mean
        # the shifts add up to the float64 nearest that mean, as the compiled sums take them
        centre = (shift + offset) - shift  # exact where |offset| <= |shift|
        r1, r2 = sums(centre)
        m2 = r2 - r1 * (r1 / n)
        offset = centre + r1 / n
    result.add(n, shift, max(m2, 0.0), 0, tail=offset)
    result.low = min(result.low, low)
    result.high = max(result.high, high)
