"""``stream-st validate``: statistics of every tensor, checked for NaN, Inf and layers missing."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Unpack

import anyio
import numpy as np

from ..core.digests import ALGORITHM_KEY, Digests
from ..core.header import Header, TensorInfo
from ..errors import IntegrityError, TensorNotFoundError
from ..reader import TensorStream
from ..transports.options import TransportOptions, checked_number
from ..transports.registry import SourceLike
from .common import Progress, command_clock, expect_totals, opened, plural, tensors_of

__all__ = ["TensorStats", "Validation", "check_layers", "tensor_stats", "validate"]


_STATS_CHUNK = 1 << 22
"""Statistics are accumulated over this many values at a time (bounded scratch memory)."""


@dataclass
class TensorStats:
    """Statistics of one tensor (``nan`` and ``inf`` counted for floating types)."""

    name: str
    dtype: str
    shape: list[int]
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    nan: int = 0
    inf: int = 0


@dataclass
class Validation:
    """Per-tensor statistics, errors (fail) and warnings (reported apart)."""

    source: str
    tensors: list[TensorStats] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    digests: str = ""  # the header's digests: which algorithm, how many tensors verified

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def tensor_stats(
    name: str, dtype: str, shape: Sequence[int], array: np.ndarray[Any, Any]
) -> TensorStats:
    """min, max, mean, std (float64 accumulation), NaN and Inf counts, in bounded scratch memory.

    Packed sub-byte types (F4, F6) have no values to summarise: ``None`` everywhere.
    """
    stats = TensorStats(name, dtype, list(shape), None, None, None, None)
    if dtype in ("F4", "F6_E2M3", "F6_E3M2") or array.size == 0:
        return stats
    flat = array.reshape(-1)
    is_float = not (np.issubdtype(flat.dtype, np.integer) or flat.dtype == np.bool_)
    is_complex = np.issubdtype(flat.dtype, np.complexfloating)
    low, high = math.inf, -math.inf
    total = total_sq = 0.0
    count = 0
    for start in range(0, flat.size, _STATS_CHUNK):
        chunk = flat[start : start + _STATS_CHUNK]
        values = np.abs(chunk).astype(np.float64) if is_complex else chunk.astype(np.float64)
        if is_float:
            nan = np.isnan(values)
            inf = np.isinf(values)
            stats.nan += int(nan.sum())
            stats.inf += int(inf.sum())
            values = values[~(nan | inf)]
        if values.size:
            low = min(low, float(values.min()))
            high = max(high, float(values.max()))
            total += float(values.sum())
            total_sq += float(np.square(values).sum())
            count += values.size
    if count:
        mean = total / count
        stats.min, stats.max, stats.mean = low, high, mean
        stats.std = math.sqrt(max(0.0, total_sq / count - mean * mean))
    return stats


_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)\.")


def check_layers(names: Iterable[str], required: Sequence[str]) -> list[str]:
    """For every layer index found in ``names`` (``...layers.N....``), the ``required`` name
    parts (e.g. ``q_proj``) that no tensor of that layer contains."""
    layers: dict[int, list[str]] = {}
    for name in names:
        match = _LAYER.search(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
    problems = []
    for layer in sorted(layers):
        missing = [part for part in required if not any(part in n for n in layers[layer])]
        if missing:
            problems.append(f"layer {layer} has no tensor for {', '.join(missing)}")
    if required and not layers:
        problems.append("no layered tensors found (names like 'layers.N.')")
    return problems


async def validate(
    source: SourceLike,
    *,
    expect_shapes: Mapping[str, Sequence[int]] | None = None,
    expect_layers: Sequence[str] = (),
    warn_abs: float = 1e4,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> Validation:
    """Stream every tensor and check it: NaN and Inf are errors, as are shapes differing from
    ``expect_shapes`` (name -> shape; a missing tensor too) and layers lacking a part of
    ``expect_layers``. Warnings: all-zero or constant tensors, values beyond ``warn_abs``."""
    checked_number("warn_abs", warn_abs)
    async with opened(source, command_clock(options), verify=False) as (stream, headers):
        return await _validate_stream(
            str(source), stream, headers, expect_shapes, expect_layers, warn_abs, progress
        )


async def _validate_stream(
    source: str,
    stream: TensorStream,
    headers: Sequence[Header],
    expect_shapes: Mapping[str, Sequence[int]] | None,
    expect_layers: Sequence[str],
    warn_abs: float,
    progress: Progress | None,
) -> Validation:
    result = Validation(source)
    infos = {t.name: t for t in tensors_of(headers)}
    if not infos:
        result.warnings.append("the file holds no tensors")
    for name, shape in (expect_shapes or {}).items():
        if name not in infos:
            result.errors.append(f"{name}: expected shape {list(shape)}, tensor missing")
        elif list(infos[name].shape) != list(shape):
            result.errors.append(f"{name}: shape {list(infos[name].shape)}, expected {list(shape)}")
    result.errors.extend(check_layers(infos, expect_layers))
    algorithms = {h.metadata[ALGORITHM_KEY] for h in headers if ALGORITHM_KEY in h.metadata}
    digests, failed = _recorded_digests(result, headers)
    expect_totals(progress, list(infos.values()))
    done_bytes = checked = 0
    async for name, array in stream:  # every tensor, whichever fails its digest
        recorded = digests.get(name)
        if recorded is not None:
            try:
                await recorded.check_view(name, array, source)
                checked += 1
            except IntegrityError as exc:
                result.errors.append(str(exc))
                failed += 1
        await _check_tensor(result, infos, name, array, warn_abs)
        done_bytes += array.nbytes
        if progress is not None:
            progress(done_bytes, len(result.tensors))
        del array
    if failed:
        verified = f"FAILED ({plural(failed, 'tensor')} of {len(infos)})"
    else:
        verified = f"{plural(checked, 'tensor')} verified"
    result.digests = f"{', '.join(sorted(algorithms))}: {verified}" if algorithms else "none"
    return result


def _recorded_digests(
    result: Validation, headers: Sequence[Header]
) -> tuple[dict[str, Digests], int]:
    """Each tensor's recorded digests (the :class:`Digests` of its header), and how many headers
    record digests that cannot be checked (each an error in ``result``)."""
    found: dict[str, Digests] = {}
    damaged = 0
    for header in headers:
        try:
            digests = Digests.from_header(header)
        except IntegrityError as exc:
            result.errors.append(str(exc))
            damaged += 1
            continue
        if digests is not None:
            found.update(dict.fromkeys(digests.values, digests))
    return found, damaged


async def _check_tensor(
    result: Validation,
    infos: Mapping[str, TensorInfo],
    name: str,
    array: np.ndarray[Any, Any],
    warn_abs: float,
) -> None:
    """Add ``array``'s statistics, errors and warnings to ``result``."""
    info = infos.get(name)
    if info is None:
        raise TensorNotFoundError(f"{name} streamed but not in the header")
    stats = await anyio.to_thread.run_sync(tensor_stats, name, info.dtype, info.shape, array)
    result.tensors.append(stats)
    if stats.nan:
        result.errors.append(f"{name}: {plural(stats.nan, 'NaN value')}")
    if stats.inf:
        result.errors.append(f"{name}: {plural(stats.inf, 'Inf value')}")
    if stats.max is not None and stats.min is not None:
        if max(abs(stats.max), abs(stats.min)) > warn_abs:
            result.warnings.append(
                f"{name}: values up to {max(abs(stats.max), abs(stats.min)):.4g} "
                f"(beyond {warn_abs:g})"
            )
        if stats.min == stats.max and info.nelements > 1 and not (stats.nan or stats.inf):
            what = "all zeros" if stats.min == 0 else f"constant {stats.min:.4g}"
            result.warnings.append(f"{name}: {what}")
