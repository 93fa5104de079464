"""What the models check of what they are given, the error they raise, and their short
``repr`` (:func:`short_repr`): shared by the BERT encoder (:mod:`.bert`) and the Llama decoder
(:mod:`.llm`).

Token ids must be integers (floats would be truncated, a string is no id) and rows of the
weights they index (-1 would silently be the last row); weights floating point numbers (numpy's
or ml_dtypes', not a void nor a record); a configuration's sizes integers of at least 1 and its
epsilon a finite number >= 0, read from a JSON file only as JSON integers and numbers (``true``
is no size, the string ``"nan"`` no epsilon).
"""

from __future__ import annotations

import math
from collections.abc import Sized
from dataclasses import fields
from typing import Any

import numpy as np

from ..core.strict_json import Number
from ..errors import ArgumentTypeError, ModelError

Array = np.ndarray[Any, Any]


def integer_ids(tokens: object, what: str) -> Array:
    """``tokens`` as an int64 array of their shape; :class:`~stream_st.ArgumentTypeError`
    unless they are integers (a sequence, nested or not, or an array of them)."""
    try:
        raw = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:  # ragged, or past int64
        raise ArgumentTypeError(f"{what} must be integer token ids: {exc}") from None
    if raw.size and raw.dtype.kind not in "iu":  # an empty list reads as float64
        raise ArgumentTypeError(
            f"{what} must be integer token ids, got {raw.dtype} ({type(tokens).__name__})"
        )
    if raw.dtype.kind == "u" and raw.size and raw.max() > np.iinfo(np.int64).max:
        raise ModelError(f"{what} must be ids in the vocabulary, got {int(raw.max())}")
    return raw.astype(np.int64)


def check_ids(ids: Array, bound: int, what: str) -> None:
    """:class:`ModelError` unless every id of ``ids`` (integers) is in ``[0, bound)``: a row of
    the weights it indexes (numpy would take -1 as the last one)."""
    if ids.size and (ids.min() < 0 or ids.max() >= bound):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise ModelError(f"{what} must be ids in [0, {bound}), got {bad}")


def floating(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` holds floating point numbers: numpy's (kind "f") or ml_dtypes'
    (bfloat16, float8...: numpy's kind "V", as a void, a record or an ml_dtypes integer is,
    which are not)."""
    if dtype.kind != "V":
        return dtype.kind == "f"
    import ml_dtypes  # on first use, as stream_st.core.dtypes imports it: milliseconds

    try:
        ml_dtypes.finfo(dtype)  # type: ignore[no-untyped-call]
    except ValueError:  # a void, a record, an ml_dtypes integer
        return False
    return True


def counts(*values: object) -> bool:
    """Whether every one of ``values`` is an integer (numpy's too, not a ``bool``) >= 1."""
    return all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) and bool(v >= 1) for v in values
    )


def epsilon(value: object) -> bool:
    """Whether ``value`` is a finite real number (numpy's too, not a ``bool``) >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        return False
    try:
        return math.isfinite(value) and bool(value >= 0)
    except OverflowError:  # an integer past float's range: no finite number
        return False


def config_number(what: str, key: str, value: object, kind: type) -> int | float:
    """``value`` of configuration field ``key`` as ``kind``, as the strict JSON parser gives
    it: an integer field takes a JSON integer only; a float field any finite JSON number (an
    integer, or the :class:`~stream_st.core.strict_json.Number` text of any other); a
    :class:`ModelError` (``"{what} gives {key} = {value}"``) for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if kind is int else float(value)
    if kind is float and isinstance(value, Number) and math.isfinite(number := float(value)):
        return number
    raise ModelError(f"{what} gives {key} = {value!r}")


def short_repr(model: Any) -> str:
    """The repr of the dataclass ``model`` with each array, list, dict or other collection (but
    a string) shown by its size alone: a model holding many weights, keys, values or tokens stays
    short to print (``asyncio.run`` formats a task's result, and
    :func:`~stream_st.models.bert.run_streaming` returns its model)."""
    shown = (f"{f.name}={_sized(getattr(model, f.name))}" for f in fields(model) if f.repr)
    return f"{type(model).__name__}({', '.join(shown)})"


def _sized(value: object) -> str:
    """``value``'s repr, or its shape and dtype (an array), its type and length (a collection)."""
    if isinstance(value, np.ndarray):
        return f"<array {list(value.shape)} {value.dtype}>"
    if isinstance(value, Sized) and not isinstance(value, str):
        return f"<{type(value).__name__} of {len(value)}>"
    return repr(value)
