"""Tensor codecs carried inside a safetensors stream, and a correctly rounded bfloat16 cast.

Pure numpy, no I/O. A codec turns one floating-point tensor into one or more *wire tensors* (plain
safetensors tensors written by any writer and read by any reader) and back. The wire tensors of a
tensor are planned from its name, shape and dtype alone (:meth:`Codec.specs`), before the data
exists, so a writer can lay out offsets up front; :meth:`Codec.encode` then produces exactly those
names, dtypes and shapes. Which codec was used goes into ``__metadata__`` (:meth:`Codec.metadata`)
so the receiver can rebuild it with :func:`codec_from_metadata` and call :meth:`Codec.decode`.

Wire layouts, for a tensor ``name`` of shape ``[..., n]`` and dtype F16, BF16, F32 (or F64)::

    "none"  name            <original dtype>  [..., n]        the tensor itself, untouched

    "int8"  name            I8   [..., n]     code = clip(round(x * scale), -127, 127), halves
                                              rounded away from zero (2.5 -> 3)
            name + ".scale" F32  [1]          scale = 127 / max|x| over the whole tensor
            decode: x ~= code / scale         error per value <= 0.5 / scale

    "int4"  name            U8   [..., n / 2] two codes per byte, low nibble first: byte j holds
                                              code 2j in bits 0-3 and code 2j+1 in bits 4-7, each
                                              as a 4-bit two's complement number
            name + ".scales" F16 [..., n / g] one step per group of g = group_size consecutive
                                              values along the last axis (default g = 64)
            code = clip(round(x / step), -7, 7), step = max|x| over the group / 7
            decode: x ~= code * step          error per value <= step / 2

Details and edge cases:

* INT8 is symmetric and per tensor: ``scale`` multiplies on encode and divides on decode, as in
  ``scale = 127 / max|x|``. ``round`` is C's ``round()``: halves go away from zero (2.5 -> 3,
  -2.5 -> -3), not to even, so that every implementation of the exchange format agrees. An
  all-zero (or empty) tensor gets ``scale = 1.0`` and all-zero codes, so nothing is ever divided
  by zero. If ``127 / max|x|`` overflows float32 (``max|x|`` below about
  3.7e-37) the scale is clamped to the largest finite float32; the error bound still holds. A
  float64 tensor whose ``max|x|`` is so large that the scale would not be a normal float32 (above
  about 1e40) is refused.
* INT4 is symmetric and group-wise along the last axis. The last dimension must be a multiple of
  ``group_size`` (there is no padding, so the original shape is recoverable from the wire shapes);
  ``group_size`` must be a positive even number. Codes use the symmetric range [-7, 7]; the
  nibble ``0b1000`` (-8) is never written but decodes to -8 if present. The F16 step is rounded
  *up* from ``max|x| / 7`` so that no code ever needs clipping; an all-zero group gets step 0
  (decode multiplies, so this is exact and divides by nothing). The step must fit F16: a group
  with ``max|x| > 7 * 65504`` is refused, and groups with ``max|x|`` below ``7 * 2**-14`` (about
  4.3e-4) get a subnormal, hence coarser, step. Decoding saturates a product beyond the
  requested dtype's largest finite value by at most ``step / 2`` to that value: the F16 group
  whose ``max|x|`` is 65504 has step 9360, and ``7 * 9360 = 65520`` would round to Inf in F16.
* Inputs containing NaN or +-Inf are refused by INT8 and INT4 with :class:`CodecError` (a
  :class:`~stream_st.errors.SafetensorsError` and a ``ValueError``); "none" passes anything.
* Encoding computes in float32 (float64 for float64 inputs); F16 and BF16 values are exact in
  float32. Decoding returns the requested original dtype: float16, bfloat16, float32 or float64.

``__metadata__`` keys written by :meth:`Codec.metadata` (all values are strings):

* ``compression``: ``"NONE"``, ``"INT8"`` or ``"INT4"`` (the KV-cache exchange format's key).
* ``original_dtype``: numpy name of the dtype to decode to, e.g. ``"float16"``, ``"bfloat16"``;
  present when passed to :meth:`Codec.metadata`. :meth:`Codec.decode` accepts it as is.
* ``group_size``: INT4 only, values per F16 step, e.g. ``"64"``.
* ``scale``: INT8 and INT4, a human-readable statement of the scale convention.
* ``scale_tensor``: INT8 and INT4, the suffix of the sibling scale tensor (``".scale"`` or
  ``".scales"``).
* ``packing``: INT4 only, how codes are packed into U8 bytes.

:func:`to_bfloat16` rounds to nearest, ties to even (never truncates) and keeps NaN as a quiet NaN
and +-Inf as +-Inf. ml_dtypes' own ``astype(bfloat16)`` already does this for float32 and float16,
so it is used for those; for float64 ml_dtypes first rounds to float32, which can round twice
(``1 + 2**-8 + 2**-40`` would become 1.0 instead of ``1 + 2**-7``), so float64 is first rounded to
float32 *to odd*, which makes the second rounding correct.
"""

from __future__ import annotations

import contextlib
import math
import operator
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import ml_dtypes
import numpy as np
import numpy.typing as npt

from .._util import canonical_decimal
from ..errors import ArgumentTypeError, CodecError, DtypeError, StreamStWarning
from .casts import ErrorStats, error_stats, to_bfloat16
from .dtypes import dtype_for, dtype_from_code
from .layout import TensorSpec, integer_shape
from .moments import F16_UNIT, f16_over_unit, sign_extremes
from .strict_json import brief

__all__ = [
    "CODECS",
    "Codec",
    "CodecError",
    "ErrorStats",
    "Int4Codec",
    "Int8Codec",
    "NoneCodec",
    "codec_from_metadata",
    "decoded",
    "error_stats",
    "get_codec",
    "to_bfloat16",
    "warn_infinite",
]

_TORCH_NAMES = {"float": "float32"}
"""torch's dtype names that mean another dtype in numpy (``torch.float`` is float32, numpy's
``float`` float64); the others (``half``, ``double``, ``bfloat16``...) agree."""


def original_code(raw: str) -> str:
    """The dtype code an ``original_dtype`` record names: a numpy name as the codecs write it,
    or a ``torch.`` name or a code as other writers do (``"float16"``, ``"torch.float"``,
    ``"F16"``); "" where it names no dtype. Whether a float is for the caller to say."""
    name = raw.removeprefix("torch.")
    if name != raw:
        name = _TORCH_NAMES.get(name, name)
    try:
        return dtype_for(name).code
    except DtypeError:
        return ""


Array = npt.NDArray[Any]
DTypeLike = str | np.dtype[Any] | type
"""A safetensors code (``"F16"``), a numpy name (``"bfloat16"``) or a numpy / ml_dtypes dtype."""

_F16 = np.dtype(np.float16)
_BF16 = np.dtype(ml_dtypes.bfloat16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_FLOATS = (_F16, _BF16, _F32, _F64)

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32
_F16_INF = np.float16(np.inf)

INT8_MAX = 127
"""INT8 codes lie in [-INT8_MAX, INT8_MAX]."""
INT4_MAX = 7
"""INT4 codes are written in [-INT4_MAX, INT4_MAX]."""
DEFAULT_GROUP_SIZE = 64
"""INT4 values per F16 step unless configured otherwise."""


@runtime_checkable
class Codec(Protocol):
    """How one tensor is carried as wire tensors. Implementations are stateless and reusable."""

    @property
    def key(self) -> str:
        """The registry key: ``"none"``, ``"int8"`` or ``"int4"``."""
        ...

    @property
    def compression(self) -> str:
        """The ``"compression"`` metadata value: ``"NONE"``, ``"INT8"`` or ``"INT4"``."""
        ...

    def part_names(self, name: str) -> list[str]:
        """Names of the wire tensors carrying tensor ``name``, the codes (or data) first."""
        ...

    def specs(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> list[TensorSpec]:
        """The wire tensors planned for a tensor of ``shape`` and ``dtype``, in
        :meth:`part_names` order; equal in names, dtypes and shapes to what :meth:`encode`
        produces for such a tensor."""
        ...

    def encode(self, name: str, array: Array) -> list[tuple[str, Array]]:
        """The wire tensors ``(wire_name, array)`` carrying ``array``, in :meth:`part_names`
        order."""
        ...

    def decode(self, name: str, parts: Mapping[str, Array], dtype: DTypeLike) -> Array:
        """Rebuild tensor ``name`` from its wire tensors (``parts`` may hold others too), with its
        original shape and the given ``dtype``."""
        ...

    def metadata(self, original_dtype: DTypeLike | None = None) -> dict[str, str]:
        """``__metadata__`` entries describing this codec (and the original dtype, if given)."""
        ...


# ---------------------------------------------------------------- helpers


def _resolve(dtype: DTypeLike) -> np.dtype[Any]:
    """A dtype from a safetensors code, a numpy name or a dtype (DtypeError if unknown)."""
    return dtype_for(dtype).numpy


def _float_dtype(dtype: DTypeLike, name: str, codec: str) -> np.dtype[Any]:
    resolved = _resolve(dtype)
    if resolved not in _FLOATS:
        raise CodecError(
            f"tensor {name!r}: {codec} carries float16, bfloat16, float32 or float64 tensors, "
            f"not {resolved.name}"
        )
    return resolved


def _work_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """float64 for float64, else float32 (exact for F16 and BF16)."""
    return _F64 if dtype == _F64 else _F32


def _check_finite(name: str, work: Array, codec: str) -> None:
    finite = np.isfinite(work)
    if not finite.all():
        nan = int(np.count_nonzero(np.isnan(work)))
        inf = work.size - int(np.count_nonzero(finite)) - nan
        first = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise CodecError(
            f"tensor {name!r}: {codec} cannot encode non-finite values "
            f"({nan} NaN, {inf} Inf; first at index {list(first)})"
        )


def _prepare(name: str, array: Array, codec: str) -> Array:
    """``array`` as the work dtype, checked to be a supported float dtype and finite."""
    source = np.asarray(array)
    dtype = _float_dtype(source.dtype, name, codec)
    work = source.astype(_work_dtype(dtype), copy=False)
    _check_finite(name, work, codec)
    return work


def _part(name: str, parts: Mapping[str, Array], part: str) -> Array:
    try:
        return np.asarray(parts[part])
    except KeyError:
        raise CodecError(f"tensor {name!r}: wire tensor {part!r} is missing") from None


def _saturate(values: Array, dtype: np.dtype[Any], slack: Array, reach: float) -> None:
    """Clip decoded ``values`` in place to ``dtype``'s largest finite magnitude where they lie
    beyond it by at most ``slack`` (the error bound, broadcast against ``values``): a finite
    value of ``dtype`` decodes to them (INT4's ``7 * 9360 = 65520`` from a group whose ``max|x|``
    is 65504), which the cast to ``dtype`` would round to +-Inf. Values further out stay, and
    overflow as any cast does. ``reach`` bounds ``|values|``: nothing is read when it is within
    ``dtype``'s range."""
    below_inf = np.array([np.inf], dtype=dtype).view(_bits(dtype)) - 1  # the largest finite
    limit = float(below_inf.view(dtype)[0])
    if reach <= limit:
        return
    magnitude = np.abs(values)
    near = (magnitude > limit) & (magnitude <= limit + slack)
    np.copyto(values, np.copysign(values.dtype.type(limit), values), where=near)


def _metadata(
    compression: str, original_dtype: DTypeLike | None, extra: Mapping[str, str]
) -> dict[str, str]:
    out = {"compression": compression}
    if original_dtype is not None:
        out["original_dtype"] = _resolve(original_dtype).name
    out.update(extra)
    return out


# ---------------------------------------------------------------- none


@dataclass(frozen=True, slots=True)
class NoneCodec:
    """Passthrough: the tensor travels as itself, in its own dtype."""

    @property
    def key(self) -> str:
        """The registry key, ``"none"``."""
        return "none"

    @property
    def compression(self) -> str:
        """The ``"compression"`` metadata value, ``"NONE"``."""
        return "NONE"

    def part_names(self, name: str) -> list[str]:
        """``[name]``: the tensor is its own wire tensor."""
        return [name]

    def specs(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> list[TensorSpec]:
        """One wire tensor, ``name`` of ``shape`` and ``dtype`` as given."""
        return [TensorSpec(name, dtype, tuple(shape))]

    def encode(self, name: str, array: Array) -> list[tuple[str, Array]]:
        """``array`` itself (as an array, not copied) under ``name``."""
        return [(name, np.asarray(array))]

    def decode(self, name: str, parts: Mapping[str, Array], dtype: DTypeLike) -> Array:
        """Tensor ``name`` as ``dtype``; a signaling NaN becomes a quiet one, without numpy's
        bare "invalid value" warning."""
        with np.errstate(invalid="ignore"):
            return _part(name, parts, name).astype(_resolve(dtype), copy=False)

    def metadata(self, original_dtype: DTypeLike | None = None) -> dict[str, str]:
        """``compression`` (and ``original_dtype``, if given)."""
        return _metadata(self.compression, original_dtype, {})


# ---------------------------------------------------------------- int8

_INT8_BLOCK = 1 << 16
"""Values quantized per step: a block and its temporaries (512 KiB) stay in the CPU's cache, and
each numpy call has enough work (F16 measured 1.25x as fast as with 16 Ki values)."""


def _bits(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The unsigned integer dtype as wide as float ``dtype``."""
    return np.dtype(f"u{dtype.itemsize}")


def _max_abs_bits(flat: Array) -> float:
    """``max|x|`` of a contiguous 1-d float array (NaN beats Inf beats every finite value), from
    its bit patterns (:func:`~stream_st.core.moments.sign_extremes`: two integer reductions, no
    float conversion); 0 for no values."""
    if not flat.size:
        return 0.0
    top, big = sign_extremes(flat)
    sign = 1 << (8 * flat.dtype.itemsize - 1)
    magnitude = max(top, big ^ sign if big >= sign else 0)
    return float(np.array([magnitude], dtype=_bits(flat.dtype)).view(flat.dtype)[0])


def _int8_codes(flat: Array, scale: np.floating[Any]) -> Array:
    """``clip(round(x * scale), -127, 127)`` as int8 for a contiguous 1-d ``flat`` (finite)
    whose ``max|x| * scale <= 127``, rounding halves away from zero (2.5 -> 3, -2.5 -> -3) as the
    C ``round()`` the INT8 exchange format names does.

    Each value becomes ``trunc(y + copysign(h, y))`` with ``y = x * scale`` and ``h`` the float
    just below 0.5: exact for every ``|y| < 2**22`` (with 0.5 itself, ``0.49999997 + 0.5`` would
    round to 1.0 and give 1). The cast to int8 truncates toward zero; ``|y| <= 127 * (1 + 2**-23)``
    (the scale is rounded once) keeps ``y + h`` below 128, so no clipping is needed. Works block by
    block in ``scale``'s float type (float32, or float64 for float64 input). F16 is widened by its
    bits (:func:`~stream_st.core.moments.f16_over_unit`, several times faster than numpy's cast),
    to ``x / 2**112``, and multiplied by ``scale * 2**112``: the same ``y``, rounded once from the
    same product (in two steps, ``2**112`` then ``scale``, where ``scale * 2**112`` would not be a
    finite float32: ``max|x|`` below about 0.002).
    """
    work = scale.dtype
    bits = _bits(work)
    sign = bits.type(1 << (8 * bits.itemsize - 1))
    half = np.array([np.nextafter(work.type(0.5), work.type(0.0))], dtype=work).view(bits)[0]
    f16 = flat.dtype == _F16
    factors = [scale]
    if f16:
        unit = work.type(F16_UNIT)
        with np.errstate(over="ignore"):
            folded = scale * unit
        factors = [folded] if np.isfinite(folded) else [unit, scale]
    codes = np.empty(flat.size, dtype=np.int8)
    size = min(flat.size, _INT8_BLOCK)
    scaled = np.empty(size, dtype=work)
    offset = np.empty(size, dtype=bits)
    for start in range(0, flat.size, _INT8_BLOCK):
        block = flat[start : start + _INT8_BLOCK]
        y, h = scaled[: block.size], offset[: block.size]
        if f16:
            f16_over_unit(block, y.view(bits))  # widened in place
            block = y
        for factor in factors:  # F16 / BF16 -> float32 is exact
            np.multiply(block, factor, out=y, casting="unsafe")
            block = y
        np.bitwise_and(y.view(bits), sign, out=h)
        np.bitwise_or(h, half, out=h)  # copysign(half, y), without a float pass
        np.add(y, h.view(work), out=y)
        np.copyto(codes[start : start + block.size], y, casting="unsafe")  # truncates
    return codes


@dataclass(frozen=True, slots=True)
class Int8Codec:
    """Symmetric per-tensor INT8: codes ``round(x * scale)`` in [-127, 127] (halves away from
    zero), ``scale = 127 / max|x|`` as F32 in ``name + ".scale"`` (shape ``[1]``); decode
    ``code / scale``."""

    suffix: ClassVar[str] = ".scale"
    """The scale tensor's name: the tensor's name and this suffix."""

    @property
    def key(self) -> str:
        """The registry key, ``"int8"``."""
        return "int8"

    @property
    def compression(self) -> str:
        """The ``"compression"`` metadata value, ``"INT8"``."""
        return "INT8"

    def part_names(self, name: str) -> list[str]:
        """``[name, name + ".scale"]``: the codes, then the scale."""
        return [name, name + self.suffix]

    def specs(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> list[TensorSpec]:
        """I8 codes of ``shape`` and an F32 scale of shape ``[1]``; a :class:`CodecError`
        unless ``dtype`` is a float."""
        _float_dtype(dtype, name, "INT8")
        return [TensorSpec(name, "I8", tuple(shape)), TensorSpec(name + self.suffix, "F32", (1,))]

    @staticmethod
    def scale_for(name: str, max_abs: float) -> np.float32:
        """The F32 scale for a tensor whose largest magnitude is ``max_abs`` (see module doc)."""
        if max_abs == 0.0:
            return np.float32(1.0)
        scale = min(INT8_MAX / max_abs, _F32_MAX)
        if scale < _F32_TINY:
            raise CodecError(
                f"tensor {name!r}: max|x| = {max_abs:g} is too large for an INT8 F32 scale "
                f"(127 / max|x| must be at least {_F32_TINY:g})"
            )
        return np.float32(scale)

    def encode(self, name: str, array: Array) -> list[tuple[str, Array]]:
        """The I8 codes of ``array`` and its F32 scale; a :class:`CodecError` for a tensor
        that is not a float, holds NaN or Inf, or is too large for an F32 scale."""
        source = np.asarray(array)
        if not source.dtype.isnative:  # the bit patterns below are read in this machine's order
            source = source.astype(source.dtype.newbyteorder("="))
        work = _work_dtype(_float_dtype(source.dtype, name, "INT8"))
        flat = np.ascontiguousarray(source).reshape(-1)
        max_abs = _max_abs_bits(flat)
        if not math.isfinite(max_abs):
            _check_finite(name, source.astype(work), "INT8")  # raises, saying where
        scale = self.scale_for(name, max_abs)
        codes = _int8_codes(flat, work.type(scale)).reshape(source.shape)
        return [(name, codes), (name + self.suffix, np.array([scale], dtype=np.float32))]

    def decode(self, name: str, parts: Mapping[str, Array], dtype: DTypeLike) -> Array:
        """Tensor ``name`` as ``dtype``, ``code / scale``; a :class:`CodecError` for a missing
        wire tensor, codes that are not I8 or a scale that is not one finite, positive F32."""
        out_dtype = _float_dtype(dtype, name, "INT8")
        codes = _part(name, parts, name)
        scale_arr = _part(name, parts, name + self.suffix)
        if codes.dtype != np.int8:
            raise CodecError(f"tensor {name!r}: INT8 codes must be int8, got {codes.dtype}")
        if scale_arr.shape != (1,) or scale_arr.dtype != np.float32:
            raise CodecError(
                f"tensor {name!r}: INT8 scale must be float32 of shape [1], got "
                f"{scale_arr.dtype} of shape {brief(list(scale_arr.shape))}"
            )
        scale = float(scale_arr.reshape(-1)[0])
        if not (math.isfinite(scale) and scale > 0.0):
            raise CodecError(f"tensor {name!r}: INT8 scale must be finite and > 0, got {scale}")
        work = _work_dtype(out_dtype)
        values = codes.astype(work)
        values /= work.type(scale)
        return values.astype(out_dtype, copy=False)

    def metadata(self, original_dtype: DTypeLike | None = None) -> dict[str, str]:
        """``compression``, ``scale`` and ``scale_tensor`` (and ``original_dtype``, if
        given)."""
        return _metadata(
            self.compression,
            original_dtype,
            {
                "scale": "per-tensor symmetric (127 / max|x|); code = round(x * scale) in "
                "[-127, 127], halves away from zero; x = code / scale",
                "scale_tensor": self.suffix,
            },
        )


# ---------------------------------------------------------------- int4


@dataclass(frozen=True, slots=True)
class Int4Codec:
    """Symmetric group-wise INT4 along the last axis: codes in [-7, 7] packed two per U8 byte
    (low nibble first, two's complement), one F16 step ``max|x| / 7`` per ``group_size`` values in
    ``name + ".scales"`` of shape ``[..., n // group_size]``; decode ``code * step``."""

    group_size: int = DEFAULT_GROUP_SIZE
    suffix: ClassVar[str] = ".scales"
    """The steps tensor's name: the tensor's name and this suffix."""

    def __post_init__(self) -> None:
        """Hold ``group_size`` to a positive even integer (a numpy one too, kept as an int; not
        a bool); a :class:`CodecError` echoing it cut short otherwise."""
        g = self.group_size
        size: int | None = None
        if not isinstance(g, bool):
            with contextlib.suppress(TypeError):
                size = operator.index(g)
        if size is None or size <= 0 or size % 2:
            raise CodecError(f"INT4 group_size must be a positive even integer, got {brief(g)}")
        object.__setattr__(self, "group_size", size)

    @property
    def key(self) -> str:
        """The registry key, ``"int4"``."""
        return "int4"

    @property
    def compression(self) -> str:
        """The ``"compression"`` metadata value, ``"INT4"``."""
        return "INT4"

    def part_names(self, name: str) -> list[str]:
        """``[name, name + ".scales"]``: the packed codes, then the steps."""
        return [name, name + self.suffix]

    def _check_shape(self, name: str, shape: Sequence[int]) -> tuple[int, ...]:
        """``shape`` as ints (:class:`~stream_st.ArgumentTypeError` unless integers), checked
        to be one INT4 can group: a :class:`CodecError` for a scalar, a negative dimension or a
        last one no multiple of the group size."""
        try:
            dims = integer_shape(shape)
        except ArgumentTypeError as exc:
            raise ArgumentTypeError(f"tensor {name!r}: {exc}") from None
        if not dims:
            raise CodecError(f"tensor {name!r}: INT4 needs at least one dimension (got a scalar)")
        if min(dims) < 0:
            raise CodecError(f"tensor {name!r}: shape {brief(list(dims))} has a negative dimension")
        if dims[-1] % self.group_size:
            raise CodecError(
                f"tensor {name!r}: INT4 needs the last dimension to be a multiple of the group "
                f"size {brief(self.group_size)}; shape {brief(list(dims))} has {brief(dims[-1])}"
            )
        return dims

    def specs(self, name: str, shape: Sequence[int], dtype: DTypeLike) -> list[TensorSpec]:
        """U8 codes of shape ``[..., n // 2]`` and F16 steps of shape ``[..., n // group_size]``
        for ``shape`` ``[..., n]``; a :class:`CodecError` unless ``dtype`` is a float and ``n``
        a multiple of the group size."""
        _float_dtype(dtype, name, "INT4")
        dims = self._check_shape(name, shape)
        *lead, n = dims
        return [
            TensorSpec(name, "U8", (*lead, n // 2)),
            TensorSpec(name + self.suffix, "F16", (*lead, n // self.group_size)),
        ]

    def encode(self, name: str, array: Array) -> list[tuple[str, Array]]:
        """The packed U8 codes of ``array`` and its F16 steps; a :class:`CodecError` for a
        tensor that is not a float or that :meth:`specs` refuses, that holds NaN or Inf, or
        whose group's ``max|x|`` exceeds ``7 * 65504``."""
        work = _prepare(name, array, "INT4")
        dims = self._check_shape(name, work.shape)
        *lead, n = dims
        g = self.group_size
        groups = work.reshape(*lead, n // g, g)
        step = np.max(np.abs(groups), axis=-1) / work.dtype.type(INT4_MAX)
        with np.errstate(over="ignore"):
            steps = step.astype(np.float16)
        # Round the step up so that |x| / step <= 7 and no code needs clipping.
        low = steps.astype(work.dtype) < step
        steps[low] = np.nextafter(steps[low], _F16_INF)
        if not np.isfinite(steps).all():
            worst = float(np.max(step)) * INT4_MAX
            raise CodecError(
                f"tensor {name!r}: a group's max|x| = {worst:g} exceeds what an INT4 F16 step "
                f"can represent ({INT4_MAX} * 65504 = {INT4_MAX * 65504})"
            )
        divisor = steps.astype(work.dtype)[..., None]
        q = np.divide(groups, divisor, out=np.zeros_like(groups), where=divisor != 0)
        np.rint(q, out=q)
        np.clip(q, -INT4_MAX, INT4_MAX, out=q)
        nibbles = q.astype(np.int8).reshape(dims).view(np.uint8) & np.uint8(0x0F)
        packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << np.uint8(4))
        return [(name, packed), (name + self.suffix, steps)]

    def decode(self, name: str, parts: Mapping[str, Array], dtype: DTypeLike) -> Array:
        """Tensor ``name`` as ``dtype``, ``code * step``; a :class:`CodecError` for a missing
        wire tensor, codes that are not U8, steps that are not F16, shapes that do not match
        the group size, or a step that is negative, NaN or Inf."""
        out_dtype = _float_dtype(dtype, name, "INT4")
        packed = _part(name, parts, name)
        steps = _part(name, parts, name + self.suffix)
        if packed.dtype != np.uint8 or steps.dtype != _F16:
            raise CodecError(
                f"tensor {name!r}: INT4 needs uint8 codes and float16 scales, got "
                f"{packed.dtype} and {steps.dtype}"
            )
        g = self.group_size
        if (
            packed.ndim == 0
            or steps.ndim == 0
            or steps.shape[:-1] != packed.shape[:-1]
            or packed.shape[-1] * 2 != steps.shape[-1] * g
        ):
            raise CodecError(
                f"tensor {name!r}: INT4 codes of shape {brief(list(packed.shape))} and scales of "
                f"shape {brief(list(steps.shape))} do not match group size {brief(g)} (expected "
                "codes [..., n/2] and scales [..., n/group_size])"
            )
        if not np.isfinite(steps).all():
            raise CodecError(f"tensor {name!r}: INT4 scales contain NaN or Inf")
        if (steps < 0).any():  # the encoder's are max|x| / 7: the values came back sign-flipped
            raise CodecError(f"tensor {name!r}: INT4 scales must be >= 0, got {steps.min()}")
        *lead, half = packed.shape
        n = half * 2
        low = (packed & np.uint8(0x0F)).astype(np.int8)
        high = (packed >> np.uint8(4)).astype(np.int8)
        codes = np.stack([low, high], axis=-1)
        codes ^= np.int8(8)  # sign-extend the 4-bit two's complement nibbles
        codes -= np.int8(8)
        work = _work_dtype(out_dtype)
        values = codes.reshape(*lead, n // g, g).astype(work)
        wide_steps = steps.astype(work)
        values *= wide_steps[..., None]
        if steps.size:  # codes lie in [-8, 7]
            reach = 8 * float(np.max(np.abs(wide_steps)))
            _saturate(values, out_dtype, np.abs(wide_steps[..., None]) / 2, reach)
        return values.reshape(*lead, n).astype(out_dtype, copy=False)

    def metadata(self, original_dtype: DTypeLike | None = None) -> dict[str, str]:
        """``compression``, ``group_size``, ``scale``, ``scale_tensor`` and ``packing`` (and
        ``original_dtype``, if given)."""
        return _metadata(
            self.compression,
            original_dtype,
            {
                "group_size": str(self.group_size),
                "scale": "per-group symmetric along the last axis, F16 step = max|x| / 7 "
                "(rounded up); code = round(x / step) in [-7, 7]; x = code * step",
                "scale_tensor": self.suffix,
                "packing": "U8, two codes per byte, low nibble first, 4-bit two's complement",
            },
        )


# ---------------------------------------------------------------- registry

CODECS: dict[str, Codec] = {"none": NoneCodec(), "int8": Int8Codec(), "int4": Int4Codec()}
"""The codecs by key, with default settings (INT4 group size 64)."""


def get_codec(key: str, *, group_size: int | None = None) -> Codec:
    """The codec for ``key`` (case-insensitive); ``group_size`` configures INT4 only."""
    if not isinstance(key, str):
        raise ArgumentTypeError(f"a codec is named by a str ({', '.join(CODECS)}), not {key!r}")
    lowered = key.lower()
    if lowered not in CODECS:
        raise CodecError(f"unknown codec {key!r}; known: {', '.join(CODECS)}")
    if group_size is not None:
        if lowered != "int4":
            raise CodecError(f"group_size applies to the int4 codec only, not {key!r}")
        return Int4Codec(group_size=group_size)
    return CODECS[lowered]


def codec_from_metadata(metadata: Mapping[str, str]) -> Codec:
    """The codec a stream's ``__metadata__`` declares; "none" when it has no ``compression``.
    :class:`~stream_st.CodecError` for a compression or ``group_size`` it cannot take (the value
    echoed up to 100 characters); :class:`~stream_st.ArgumentTypeError` for a ``metadata``
    that is no mapping."""
    if not isinstance(metadata, Mapping):
        raise ArgumentTypeError(
            f"codec_from_metadata reads a mapping (a stream's __metadata__), not "
            f"{type(metadata).__name__}"
        )
    compression = metadata.get("compression", "NONE")
    if not isinstance(compression, str) or compression.lower() not in CODECS:
        raise CodecError(f"unknown compression {compression!r:.100} in metadata")
    key = compression.lower()
    if key == "int4" and "group_size" in metadata:
        raw = metadata["group_size"]
        # a canonical decimal, as the KV reader's (not '6_4', ' 64', '+64' or other digits)
        size = canonical_decimal(raw) if isinstance(raw, str) else None
        if size is None:
            raise CodecError(f"metadata group_size must be a decimal, got {raw!r:.100}")
        return get_codec(key, group_size=size)
    return CODECS[key]


def decoded(codec: Codec, name: str, parts: Mapping[str, Array], code: str) -> Array:
    """Tensor ``name`` rebuilt by ``codec`` from its wire tensors ``parts`` as dtype ``code``;
    finite values decoded beyond its range (from a scale far smaller than the codec writes, or
    a "none" tensor wider than ``code``) become infinite, and a
    :class:`~stream_st.StreamStWarning` says how many (:func:`warn_infinite`), not numpy's bare
    overflow warning. NaN and Inf a "none" tensor carries are handed out as they were, uncounted.
    """
    with np.errstate(over="ignore"):
        values = codec.decode(name, parts, dtype_from_code(code).numpy)
    # INT8's and INT4's codes and scales are finite: each value they decode to Inf was lost
    source = _part(name, parts, name) if codec.key == "none" else None
    warn_infinite(name, code, became_infinite(values, source))
    return values


def became_infinite(converted: Array, source: Array | None = None) -> int:
    """How many values of ``converted`` are not finite where ``source`` (of its shape; ``None``
    for all finite) was: the finite values a conversion took beyond its dtype's range. NaN and
    Inf that were so already are not counted. ``source`` is read only where ``converted`` is not
    finite, and one boolean mask is the only temporary as large as the tensor."""
    with np.errstate(invalid="ignore"):  # a signaling NaN (BF16's) is not finite, no warning
        lost = np.isfinite(converted, out=np.empty(np.shape(converted), np.bool_))  # 0-d too
        np.logical_not(lost, out=lost)
        if source is None or not lost.any():
            return int(np.count_nonzero(lost))
        return int(np.count_nonzero(np.isfinite(np.asarray(source)[lost])))


def warn_infinite(name: str, code: str, lost: int) -> None:
    """Warn that ``lost`` finite values of tensor ``name`` became infinite as dtype ``code``."""
    if lost:
        warnings.warn(
            StreamStWarning(
                f"tensor {name!r}: {lost} finite values beyond {code}'s range became infinite"
            ),
            stacklevel=3,
        )


# ---------------------------------------------------------------- bfloat16


# ---------------------------------------------------------------- error statistics
