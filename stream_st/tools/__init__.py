"""The library side of the ``stream-st`` commands: inspect, hash, diff, validate, cp.

Each takes any source :func:`~stream_st.open_stream` takes (a path, ``http(s)://``, ``s3://``,
``tcp://``, a sharded ``*.index.json``) and works in constant memory: one tensor at a time.
``progress``, where accepted, is called with ``(bytes_done, tensors_done)`` as data moves; if it
also has a ``totals`` method, that is called once with ``(bytes, tensors)`` to expect, as soon as
the headers are read (so a progress bar needs no look-up of its own, and works on a pipe or a
``tcp://`` peer, which give their bytes once). :func:`model_sources` turns a local model
directory into the sources it holds.
Each takes the options of :func:`~stream_st.open_stream` (``timeout``, ``deadline``,
``speed_limit``, ``speed_time``, ``headers``, ``ssl_context``), which apply to the whole command:
every source and destination it opens.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, Unpack

import anyio
import numpy as np

from .._api import header_of, stream_for
from .._util import task_group
from ..core.codecs import Codec, codec_from_metadata, get_codec, to_bfloat16
from ..core.digests import ALGORITHM_KEY, DEFAULT_ALGORITHM, Digests, algorithm_named
from ..core.dtypes import dtype_from_code, wire_bytes
from ..core.header import Header, TensorInfo, TensorSpec
from ..core.shards import INDEX_SUFFIX, MANIFEST_NAME, is_index
from ..errors import IntegrityError, SourceNotFoundError, TensorNotFoundError, UsageError
from ..reader import Include, TensorStream
from ..sharded.reader import ShardedStream, shard_headers
from ..transports.options import Clock, TransportOptions, checked_number, clock_of
from ..transports.registry import SinkLike, SourceLike, open_source
from ..writer import TensorWriter

__all__ = [
    "CONVERTIBLE",
    "Copy",
    "Diff",
    "Inspection",
    "TensorStats",
    "Validation",
    "content_digests",
    "cp",
    "diff",
    "hash",
    "inspect",
    "model_sources",
    "structural_hash",
    "validate",
]

Progress = Callable[[int, int], None]
"""Called with (bytes done, tensors done); an optional ``totals(bytes, tensors)`` method is told
what to expect once the headers are known."""

_STATS_CHUNK = 1 << 22
"""Statistics are accumulated over this many values at a time (bounded scratch memory)."""


def _clock(options: TransportOptions) -> Clock:
    """The clock of one command, started now."""
    clock = clock_of(options)
    clock.start()
    return clock


async def headers_of(source: SourceLike, clock: Clock) -> list[Header]:
    """The header of ``source``, or of every shard of an index (in shard order)."""
    if is_index(source):
        return await shard_headers(source, clock)
    return [await header_of(source, clock)]


def _tensors(headers: Iterable[Header]) -> list[TensorInfo]:
    return [info for header in headers for info in header]


def _expect(progress: Progress | None, tensors: Sequence[TensorInfo]) -> None:
    """Tell ``progress`` (if it has a ``totals`` method) the bytes and tensors to come."""
    totals = getattr(progress, "totals", None)
    if totals is not None:
        totals(sum(t.nbytes for t in tensors), len(tensors))


def model_sources(path: str) -> list[str]:
    """The sources a command argument names: ``path`` itself, or for a local directory its index
    (``*.safetensors.index.json`` or ``dataset_manifest.json``) when it holds exactly one, else
    every ``*.safetensors`` file in it, in name order. A directory with neither raises
    :class:`~stream_st.SourceNotFoundError`."""
    if not os.path.isdir(path):
        return [path]
    names = sorted(os.listdir(path))
    indexes = [n for n in names if n.endswith(".safetensors" + INDEX_SUFFIX) or n == MANIFEST_NAME]
    if len(indexes) == 1:
        return [os.path.join(path, indexes[0])]
    files = [os.path.join(path, n) for n in names if n.endswith(".safetensors")]
    if len(indexes) > 1 and files:
        raise UsageError(f"{path} holds several indexes ({', '.join(indexes)}): name one")
    if not files:
        raise SourceNotFoundError(
            "no safetensors files in this directory (no *.safetensors, no index)", url=path
        )
    return files


def _merged_metadata(headers: Sequence[Header]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for header in headers:
        merged.update(header.metadata)
    return merged


# ---------------------------------------------------------------- inspect


@dataclass
class Inspection:
    """What a header says: every tensor, sizes, parameter count and metadata."""

    source: str
    tensors: list[dict[str, Any]]
    tensor_count: int
    parameter_count: int
    data_bytes: int
    header_bytes: int
    metadata: dict[str, str]
    shards: int = 1

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def inspect(source: SourceLike, **options: Unpack[TransportOptions]) -> Inspection:
    """Read only the header (ranged requests on remote sources) and describe it."""
    headers = await headers_of(source, _clock(options))
    tensors = _tensors(headers)
    return Inspection(
        source=str(source),
        tensors=[
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
            for t in tensors
        ],
        tensor_count=len(tensors),
        parameter_count=sum(t.nelements for t in tensors),
        data_bytes=sum(h.data_size for h in headers),
        header_bytes=sum(h.header_size for h in headers),
        metadata=_merged_metadata(headers),
        shards=len(headers),
    )


# ---------------------------------------------------------------- hash


def structural_hash(tensors: Iterable[TensorInfo]) -> str:
    """sha256 (hex) of the structure, independent of layout and JSON key order.

    The hashed text is the compact JSON (sorted keys, UTF-8) of
    ``{"format": "safetensors", "tensors": [{"name", "dtype" (lower case), "shape",
    "byte_length"}, ... sorted by name]}``.
    """
    document = {
        "format": "safetensors",
        "tensors": [
            {
                "name": t.name,
                "dtype": t.dtype.lower(),
                "shape": list(t.shape),
                "byte_length": t.nbytes,
            }
            for t in sorted(tensors, key=lambda t: t.name)
        ],
    }
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@asynccontextmanager
async def _opened(
    source: SourceLike, clock: Clock, *, include: Include = None
) -> AsyncIterator[tuple[TensorStream, list[Header]]]:
    """The source opened once, with its headers: a stream may not be readable twice."""
    stream = stream_for(source, include=include, clock=clock)
    async with stream:
        if isinstance(stream, ShardedStream):  # every shard's header, up front
            yield stream, await headers_of(source, clock)
        else:
            yield stream, [stream.header]


async def _digest_stream(stream: TensorStream, progress: Progress | None) -> dict[str, str]:
    """sha256 of each tensor's bytes; hashing runs in a thread while the next tensor is read."""
    digests: dict[str, str] = {}
    done_bytes = 0
    done = 0

    def sha256(array: np.ndarray[Any, Any]) -> str:
        return hashlib.sha256(wire_bytes(array)).hexdigest()

    async def digest(name: str, array: np.ndarray[Any, Any], finished: anyio.Event) -> None:
        digests[name] = await anyio.to_thread.run_sync(sha256, array)
        finished.set()

    previous: anyio.Event | None = None
    async with task_group() as group:
        async for name, array in stream:
            if previous is not None:
                await previous.wait()  # one tensor hashing while the next is read, no more
            previous = anyio.Event()
            group.start_soon(digest, name, array, previous)
            done_bytes += array.nbytes
            done += 1
            if progress is not None:
                progress(done_bytes, done)
            del array
    return digests


async def content_digests(
    source: SourceLike,
    *,
    include: Iterable[str] | None = None,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> dict[str, str]:
    """sha256 (hex) of each tensor's bytes, streamed one tensor at a time."""
    selected = None if include is None else list(include)
    async with _opened(source, _clock(options), include=selected) as (stream, headers):
        _expect(progress, [t for t in _tensors(headers) if _included(selected, t.name)])
        return await _digest_stream(stream, progress)


def _combined_content(digests: Mapping[str, str]) -> str:
    text = "".join(f"{name}\0{digests[name]}\n" for name in sorted(digests))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


async def hash(  # the command's name (shadows the builtin only inside this module)
    source: SourceLike,
    *,
    content: bool = False,
    file: bool = False,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> dict[str, Any]:
    """The structural hash (header only); with ``content``, also a hash of the data; with
    ``file``, the plain sha256 of the file's bytes (``file_sha256``: what ``sha256sum`` prints,
    and a Hugging Face Hub LFS file's oid).

    The content hash is sha256 over ``name NUL sha256(tensor bytes) LF`` for every tensor in name
    order, so it does not depend on the layout either.
    """
    clock = _clock(options)
    if not content:
        result = _structure(source, await headers_of(source, clock))
    else:
        async with _opened(source, clock) as (stream, headers):
            result = _structure(source, headers)
            _expect(progress, _tensors(headers))
            result["content_hash"] = _combined_content(await _digest_stream(stream, progress))
    if file:
        result["file_sha256"] = await _file_sha256(source, clock)
    return result


async def _file_sha256(source: SourceLike, clock: Clock) -> str:
    """sha256 of every byte of one file, read front to back."""
    if isinstance(source, str | os.PathLike) and is_index(source):
        raise UsageError("the sha256 of a file takes one file, not a sharded checkpoint's index")
    opened = await open_source(source, clock)
    try:
        await opened.start(read_all=True)
        sha = hashlib.sha256()
        chunk = memoryview(bytearray(FILE_CHUNK))
        while got := await opened.fill(chunk):
            await anyio.to_thread.run_sync(sha.update, chunk[:got])
        return sha.hexdigest()
    finally:
        await opened.aclose()


FILE_CHUNK = 8 << 20


def _structure(source: SourceLike, headers: Sequence[Header]) -> dict[str, Any]:
    return {
        "source": str(source),
        "structural_hash": structural_hash(_tensors(headers)),
        "tensor_count": sum(len(h) for h in headers),
    }


# ---------------------------------------------------------------- diff


@dataclass
class Diff:
    """Differences between two files; ``equal`` when there are none."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, dict[str, Any]] = field(default_factory=dict)
    metadata_added: list[str] = field(default_factory=list)
    metadata_removed: list[str] = field(default_factory=list)
    metadata_changed: dict[str, list[str]] = field(default_factory=dict)
    content_differs: list[str] = field(default_factory=list)
    content_compared: bool = False

    @property
    def equal(self) -> bool:
        return not (
            self.added
            or self.removed
            or self.changed
            or self.metadata_added
            or self.metadata_removed
            or self.metadata_changed
            or self.content_differs
        )

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "equal": self.equal}


async def diff(
    a: SourceLike,
    b: SourceLike,
    *,
    content: bool = False,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> Diff:
    """Compare tensors (names, dtypes, shapes, byte lengths) and metadata; with ``content``, also
    the bytes of tensors the two have in common, both streamed at once in constant memory."""
    clock = _clock(options)
    compared: set[str] = set()  # filled once both headers are known, before any data is read
    async with (
        _opened(a, clock, include=compared.__contains__) as (stream_a, headers_a),
        _opened(b, clock, include=compared.__contains__) as (stream_b, headers_b),
    ):
        result, common = _compare(headers_a, headers_b)
        if content:
            compared.update(common)
            _expect(progress, [t for t in _tensors([*headers_a, *headers_b]) if t.name in compared])
            digests: list[dict[str, str]] = [{}, {}]
            totals = [0, 0]
            counts = [0, 0]

            def report(side: int) -> Progress:
                def update(done_bytes: int, done: int) -> None:
                    totals[side], counts[side] = done_bytes, done
                    if progress is not None:
                        progress(totals[0] + totals[1], counts[0] + counts[1])

                return update

            async def run(side: int, stream: TensorStream) -> None:
                digests[side] = await _digest_stream(stream, report(side))

            async with task_group() as group:
                group.start_soon(run, 0, stream_a)
                group.start_soon(run, 1, stream_b)
            result.content_compared = True
            result.content_differs = [n for n in common if digests[0][n] != digests[1][n]]
    return result


def _compare(headers_a: Sequence[Header], headers_b: Sequence[Header]) -> tuple[Diff, list[str]]:
    """What differs between two files' headers, tensors (names, dtypes, shapes, byte lengths)
    and metadata; and the names of the tensors both hold alike, whose bytes may be compared."""
    tensors_a = {t.name: t for t in _tensors(headers_a)}
    tensors_b = {t.name: t for t in _tensors(headers_b)}
    result = Diff(
        added=sorted(tensors_b.keys() - tensors_a.keys()),
        removed=sorted(tensors_a.keys() - tensors_b.keys()),
    )
    for name in sorted(tensors_a.keys() & tensors_b.keys()):
        ta, tb = tensors_a[name], tensors_b[name]
        changes = {
            key: [va, vb]
            for key, va, vb in (
                ("dtype", ta.dtype, tb.dtype),
                ("shape", list(ta.shape), list(tb.shape)),
                ("byte_length", ta.nbytes, tb.nbytes),
            )
            if va != vb
        }
        if changes:
            result.changed[name] = changes
    meta_a, meta_b = _merged_metadata(headers_a), _merged_metadata(headers_b)
    result.metadata_added = sorted(meta_b.keys() - meta_a.keys())
    result.metadata_removed = sorted(meta_a.keys() - meta_b.keys())
    result.metadata_changed = {
        k: [meta_a[k], meta_b[k]]
        for k in sorted(meta_a.keys() & meta_b.keys())
        if meta_a[k] != meta_b[k]
    }
    same = [n for n in sorted(tensors_a.keys() & tensors_b.keys()) if n not in result.changed]
    return result, same


# ---------------------------------------------------------------- validate


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
    async with _opened(source, _clock(options)) as (stream, headers):
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
    infos = {t.name: t for t in _tensors(headers)}
    if not infos:
        result.warnings.append("the file holds no tensors")
    for name, shape in (expect_shapes or {}).items():
        if name not in infos:
            result.errors.append(f"{name}: expected shape {list(shape)}, tensor missing")
        elif list(infos[name].shape) != list(shape):
            result.errors.append(f"{name}: shape {list(infos[name].shape)}, expected {list(shape)}")
    result.errors.extend(check_layers(infos, expect_layers))
    algorithms = {h.metadata[ALGORITHM_KEY] for h in headers if ALGORITHM_KEY in h.metadata}
    _expect(progress, list(infos.values()))
    done_bytes = 0
    try:
        async for name, array in stream:
            await _check_tensor(result, infos, name, array, warn_abs)
            done_bytes += array.nbytes
            if progress is not None:
                progress(done_bytes, len(result.tensors))
            del array
    except IntegrityError as exc:
        result.errors.append(str(exc))
    verified = f"{len(result.tensors)} tensors verified" if not result.errors else "FAILED"
    result.digests = f"{', '.join(sorted(algorithms))}: {verified}" if algorithms else "none"
    return result


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
        result.errors.append(f"{name}: {stats.nan} NaN values")
    if stats.inf:
        result.errors.append(f"{name}: {stats.inf} Inf values")
    if stats.max is not None and stats.min is not None:
        if max(abs(stats.max), abs(stats.min)) > warn_abs:
            result.warnings.append(
                f"{name}: values up to {max(abs(stats.max), abs(stats.min)):.4g} "
                f"(beyond {warn_abs:g})"
            )
        if stats.min == stats.max and info.nelements > 1:
            what = "all zeros" if stats.min == 0 else f"constant {stats.min:.4g}"
            result.warnings.append(f"{name}: {what}")


# ---------------------------------------------------------------- cp

CONVERTIBLE = ("F16", "BF16", "F32", "F64")
"""Floating-point dtypes that ``cp`` converts (``dtype=``) or quantizes (``quantize=``)."""

_TARGETS = {"bf16": "BF16", "f16": "F16", "f32": "F32"}

_QUANTIZED_KEY = "quantized_tensors"
"""``__metadata__`` key ``cp`` records the number of quantized tensors under."""


@dataclass
class Copy:
    """What :func:`cp` wrote: the header, and how many tensors it converted, quantized or
    dequantized (0 when every tensor was copied as it is)."""

    header: Header
    converted: int


def _convert(array: np.ndarray[Any, Any], code: str) -> np.ndarray[Any, Any]:
    if code == "BF16":
        return to_bfloat16(array)  # round to nearest even, never truncation
    converted: np.ndarray[Any, Any] = array.astype(dtype_from_code(code).numpy)
    return converted


def _target_dtype(dtype: str | None) -> str | None:
    """The dtype code ``cp``'s ``dtype=`` names (``None`` for none)."""
    if dtype is None:
        return None
    target = _TARGETS.get(dtype.lower())
    if target is None:
        raise UsageError(f"dtype must be one of {', '.join(_TARGETS)}, not {dtype!r}")
    return target


def _quantized_by(metadata: Mapping[str, str]) -> Codec | None:
    """The codec a file's ``__metadata__`` says its tensors were quantized with, if any."""
    codec = codec_from_metadata(metadata)
    return None if codec.key == "none" else codec


class _Plan:
    """How ``cp`` turns each source tensor into the tensors it writes: as it is, converted to
    ``target``, quantized with ``encoder`` or dequantized from ``decoder``'s wire tensors."""

    def __init__(
        self,
        wanted: Sequence[TensorInfo],
        metadata: dict[str, str],
        target: str | None,
        encoder: Codec | None,
        decoder: Codec | None,
    ) -> None:
        self.target, self.encoder, self.decoder = target, encoder, decoder
        self.specs: list[TensorSpec] = []
        self.changed: set[str] = set()  # source tensors converted or quantized
        self.parts: dict[str, str] = {}  # decoder: wire tensor -> the tensor it rebuilds
        names = {t.name for t in wanted}
        recorded = _ORIGINAL.get(metadata.get("original_dtype", ""), "F32")
        self.out_dtype = target or recorded  # of the tensors rebuilt from wire tensors
        for info in wanted:
            if decoder is not None:
                wire = decoder.part_names(info.name)
                if all(part in names for part in wire):
                    self.parts.update(dict.fromkeys(wire, info.name))
                    shape = _decoded_shape(decoder, info)
                    self.specs.append(TensorSpec(info.name, self.out_dtype, shape))
                elif info.name not in self.parts:
                    self.specs.append(TensorSpec(info.name, info.dtype, info.shape))
            elif info.dtype in CONVERTIBLE and encoder is not None:
                self.specs.extend(encoder.specs(info.name, info.shape, info.dtype))
                self.changed.add(info.name)
            elif info.dtype in CONVERTIBLE and target is not None and info.dtype != target:
                self.specs.append(TensorSpec(info.name, target, info.shape))
                self.changed.add(info.name)
            else:
                self.specs.append(TensorSpec(info.name, info.dtype, info.shape))
        rebuilt = self.rebuilt  # a wire tensor planned before its whole was known goes
        self.specs = [s for s in self.specs if s.name not in self.parts or s.name in rebuilt]
        self.metadata = self._metadata(metadata, wanted)

    @property
    def rebuilt(self) -> set[str]:
        """The tensors rebuilt from wire tensors."""
        return set(self.parts.values())

    @property
    def converted(self) -> int:
        return len(self.changed) + len(self.rebuilt)

    def _metadata(self, metadata: dict[str, str], wanted: Sequence[TensorInfo]) -> dict[str, str]:
        if self.decoder is not None:
            for key in [*self.decoder.metadata("float32"), _QUANTIZED_KEY]:
                metadata.pop(key, None)
            return metadata
        if self.encoder is not None:
            metadata.update(self.encoder.metadata())
            metadata[_QUANTIZED_KEY] = str(len(self.changed))
            kinds = {t.dtype for t in wanted if t.name in self.changed}
            if len(kinds) == 1:  # what --dequantize restores
                metadata["original_dtype"] = dtype_from_code(kinds.pop()).numpy.name
            else:
                metadata.pop("original_dtype", None)
        if self.target is not None and self.changed:
            note = ", round to nearest even)" if self.target == "BF16" else ")"
            metadata["converted_to"] = f"{self.target} ({len(self.changed)} tensors{note}"
        return metadata

    async def parts_of(
        self, name: str, array: np.ndarray[Any, Any], pending: dict[str, dict[str, Any]]
    ) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """The tensors to write for the source tensor ``name``; wire tensors are held in
        ``pending`` until every part of theirs has come."""
        if self.decoder is not None and name in self.parts:
            whole = self.parts[name]
            got = pending.setdefault(whole, {})
            got[name] = array
            if len(got) < len(self.decoder.part_names(whole)):
                return []
            del pending[whole]
            decoded = await anyio.to_thread.run_sync(
                self.decoder.decode, whole, got, dtype_from_code(self.out_dtype).numpy
            )
            return [(whole, decoded)]
        if name in self.changed and self.encoder is not None:
            return self.encoder.encode(name, array)
        if name in self.changed and self.target is not None:
            return [(name, await anyio.to_thread.run_sync(_convert, array, self.target))]
        return [(name, array)]


_ORIGINAL = {dtype_from_code(code).numpy.name: code for code in CONVERTIBLE}
"""The dtype codes of the numpy names ``original_dtype`` is written with."""


def _decoded_shape(codec: Codec, info: TensorInfo) -> tuple[int, ...]:
    """The shape of the tensor whose first wire tensor is ``info``."""
    if codec.key == "int4":  # two codes per byte along the last axis
        return (*info.shape[:-1], info.shape[-1] * 2)
    return tuple(info.shape)


async def cp(
    src: SourceLike,
    dst: SinkLike,
    *,
    include: Include = None,
    dtype: str | None = None,
    quantize: str | None = None,
    dequantize: bool = False,
    checksums: bool | str | None = None,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> Copy:
    """Copy ``src`` to ``dst`` as a stream, tensor by tensor, never holding the whole file.

    ``include`` selects tensors. ``dtype`` (``"bf16"``, ``"f16"``, ``"f32"``) converts every
    floating-point tensor not of that dtype yet (BF16 rounds to nearest even).
    ``quantize="int8"`` stores every floating-point tensor as I8 codes plus a sibling F32
    ``<name>.scale`` (symmetric, per tensor: ``scale = 127 / max|x|``, ``x ~= code / scale``),
    recorded in ``__metadata__``; a source whose metadata says it is quantized already is
    refused. ``dequantize`` rebuilds the floating-point tensors of a source quantized with the
    int8 or int4 codec (its ``__metadata__`` names it) as their ``original_dtype`` (F32 when
    unrecorded, or ``dtype``). Other tensors are copied as they are, and a copy that changes
    nothing is byte-identical to a source written in offset order (the reference writer's).
    A copy that fails or is interrupted leaves nothing at ``dst``.

    The source's digests, if it has some, are verified as it is read: a tensor that fails
    leaves nothing at ``dst``. ``checksums`` (True or an algorithm's name) records digests in
    the copy; ``None`` (the default) does so when the source has them, with its algorithm. Copied
    digests of tensors copied as they are go out with the header, so any destination takes them;
    digests to compute need a destination that can be patched at the end (a file, S3): asked
    for, they are a :class:`~stream_st.UsageError` elsewhere; inherited, they are left out.
    """
    if quantize is not None and (dtype is not None or dequantize):
        raise UsageError("choose one of dtype=, quantize= and dequantize=")
    target = _target_dtype(dtype)
    encoder = None
    if quantize is not None:
        if quantize.lower() != "int8":
            raise UsageError(f"quantize supports int8, not {quantize!r}")
        encoder = get_codec("int8")
    clock = _clock(options)
    async with _opened(src, clock, include=include) as (stream, headers):
        metadata = {
            k: v for k, v in _merged_metadata(headers).items() if not k.startswith(ALGORITHM_KEY)
        }
        decoder = _quantized_by(metadata) if encoder is not None or dequantize else None
        if encoder is not None and decoder is not None:
            raise UsageError(
                f"the source is quantized already ({metadata['compression']} in __metadata__): "
                "dequantize it first"
            )
        if dequantize and decoder is None:
            raise UsageError("the source is not quantized (no compression in __metadata__)")
        wanted = [t for t in _tensors(headers) if _included(include, t.name)]
        plan = _Plan(wanted, metadata, target, encoder, decoder if dequantize else None)
        digests = _copied_digests(checksums, headers, [t.name for t in wanted], plan.converted > 0)
        _expect(progress, wanted)
        done_bytes = done = 0
        pending: dict[str, dict[str, Any]] = {}
        async with TensorWriter(
            dst,
            plan.specs,
            metadata=plan.metadata or None,
            checksums=digests,
            clock=clock,
            # Digests only inherited from the source, to compute: a destination that cannot
            # take them at the end (a pipe, a socket, an HTTP upload) gets the copy without.
            digests_up_front=(lambda algorithm: None) if checksums is None else None,
        ) as writer:
            async for name, array in stream:
                for part_name, part in await plan.parts_of(name, array, pending):
                    await writer.write(part_name, part)
                done_bytes += array.nbytes
                done += 1
                if progress is not None:
                    progress(done_bytes, done)
                del array
        return Copy(writer.header, plan.converted)


def _copied_digests(
    checksums: bool | str | None, headers: Sequence[Header], names: list[str], converting: bool
) -> bool | str | Digests:
    """What ``cp`` records (see there): the source's digests for ``names`` when no tensor
    changes and the algorithm is the one asked for, else the algorithm to compute."""
    found = {h.metadata.get(ALGORITHM_KEY) for h in headers}
    source = found.pop() if len(found) == 1 else None  # one algorithm, in every header
    if checksums is None:
        checksums = source or False
    if checksums is False:
        return False
    name = algorithm_named(DEFAULT_ALGORITHM if checksums is True else checksums).name
    if converting or source != name:
        return name
    values: dict[str, str] = {}
    for header in headers:
        recorded = Digests.from_header(header)
        assert recorded is not None
        values.update(recorded.values)
    return Digests(name, {n: values[n] for n in names})


def _included(include: Include, name: str) -> bool:
    if include is None:
        return True
    if callable(include):
        return bool(include(name))
    if isinstance(include, str):
        return name == include
    return name in include
