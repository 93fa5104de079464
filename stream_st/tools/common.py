"""What every command shares: the options' clock, the headers of any source (one file or a
sharded index), progress reporting, a model directory's sources.
"""

from __future__ import annotations

import json
import os
from collections.abc import (
    AsyncIterator,
    Callable,
    Collection,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import fields, is_dataclass
from typing import TYPE_CHECKING

from .._api import header_of, stream_for
from .._util import canonical_decimal
from ..core.codecs import CODECS, Codec
from ..core.digests import is_record_key
from ..core.header import _SHORT, Header, TensorInfo, UnknownDtypes
from ..core.shards import HELD_NAME, INDEX_SUFFIX, MANIFEST_NAME, is_index
from ..core.strict_json import decode_json
from ..errors import (
    ArgumentTypeError,
    CodecError,
    HeaderError,
    SafetensorsError,
    SourceNotFoundError,
    TransportError,
    UnsupportedSourceError,
    UsageError,
    redact,
)
from ..reader import Include, TensorStream
from ..sharded.reader import ShardedStream, shard_headers
from ..transports.file.atomic import local_path
from ..transports.options import Clock, TransportOptions, clock_of
from ..transports.registry import SourceLike

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

__all__ = ["Progress", "headers_of", "model_sources", "naming", "plural"]


Progress = Callable[[int, int], None]
"""Called with (bytes done, tensors done); an optional ``totals(bytes, tensors)`` method is told
what to expect once the headers are known."""


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """``1 tensor``, ``2 tensors``: ``count`` and ``noun`` in agreement (``nouns`` where the plural
    is not the noun and an s)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def checked_progress(progress: object) -> Progress | None:
    """``progress=`` checked before anything is read or written: None or a callable;
    :class:`~stream_st.ArgumentTypeError` naming it for anything else (it failed as a bare
    ``TypeError`` at the first tensor)."""
    if progress is not None and not callable(progress):
        raise ArgumentTypeError(
            f"progress takes a callable of (bytes done, tensors done) or None, "
            f"got {type(progress).__name__}"
        )
    return progress


def result_repr(result: DataclassInstance, **leading: object) -> str:
    """The ``repr`` of a command's result, bounded however many tensors it lists: ``leading``
    (what its properties say), then each field as :func:`_brief` shows it."""
    shown = {**leading, **{f.name: getattr(result, f.name) for f in fields(result) if f.repr}}
    parts = ", ".join(f"{name}={_brief(value)}" for name, value in shown.items())
    return f"{type(result).__name__}({parts})"


def _brief(value: object) -> str:
    """A field of a command's result for its ``repr``: a list or dict (which may hold an entry
    per tensor) as its first entry and, when it holds more, its length; a dataclass (a
    tensor's statistics) field by field; anything else shortened as a header's ``repr``
    shortens it (a string cut, a list or dict to its first entries)."""
    if isinstance(value, dict) and value:
        key = next(iter(value))
        first, close = f"{{{_SHORT.repr(key)}: {_brief_entry(value[key])}", "}"
    elif isinstance(value, list) and value:
        first, close = f"[{_brief_entry(value[0])}", "]"
    else:
        return _brief_entry(value)
    return first + close if len(value) == 1 else f"{first}, ...{close} ({len(value)} in all)"


def _brief_entry(value: object) -> str:
    if is_dataclass(value) and not isinstance(value, type):
        return result_repr(value)
    return _SHORT.repr(value)


def command_clock(options: TransportOptions) -> Clock:
    """The clock of one command, started now."""
    clock = clock_of(options)
    clock.start()
    return clock


async def headers_of(
    source: SourceLike, clock: Clock, *, unknown_dtypes: UnknownDtypes = "refuse"
) -> list[Header]:
    """The header of ``source``, or of every shard of an index (in shard order).
    ``unknown_dtypes="keep"`` for commands that read the headers alone (inspect, ls, the
    structural hash): a tensor of a dtype stream_st does not know is kept, not refused."""
    if is_index(source):
        return await shard_headers(source, clock, unknown_dtypes=unknown_dtypes)
    return [await header_of(source, clock, unknown_dtypes=unknown_dtypes)]


def tensors_of(headers: Iterable[Header]) -> list[TensorInfo]:
    return [info for header in headers for info in header]


def expect_totals(progress: Progress | None, tensors: Sequence[TensorInfo]) -> None:
    """Tell ``progress`` (if it has a ``totals`` method) the bytes and tensors to come."""
    totals = getattr(progress, "totals", None)
    if totals is not None:
        totals(sum(t.nbytes for t in tensors), len(tensors))


def model_sources(path: str | os.PathLike[str]) -> list[str]:
    """The sources a command argument names: ``path`` itself (as a string), or for a local
    directory (a path or a ``file://`` URL) its index (``*.safetensors.index.json`` or
    ``dataset_manifest.json``) when it holds exactly one, else every ``*.safetensors`` file in
    it, in name order, by their paths. A directory with neither raises
    :class:`~stream_st.SourceNotFoundError`; a ``path`` neither a ``str`` nor an
    ``os.PathLike`` of one, :class:`~stream_st.ArgumentTypeError`."""
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise ArgumentTypeError(
            f"model_sources takes a path or URL (a str or os.PathLike), got {type(path).__name__}"
        )
    local = local_path(path, UnsupportedSourceError) or path
    if not os.path.isdir(local):
        return [path]
    try:
        names = sorted(n for n in os.listdir(local) if not HELD_NAME.fullmatch(n))
    except OSError as exc:  # unreadable (EACCES), out of descriptors, a damaged folder
        raise TransportError(f"listing failed: {exc.strerror or exc}", url=path) from exc
    indexes = [n for n in names if n.endswith(".safetensors" + INDEX_SUFFIX) or n == MANIFEST_NAME]
    if len(indexes) == 1:
        return [os.path.join(local, indexes[0])]
    files = [os.path.join(local, n) for n in names if n.endswith(".safetensors")]
    if len(indexes) > 1:
        raise UsageError(f"{path} holds several indexes ({', '.join(indexes)}): name one")
    if not files:
        raise SourceNotFoundError(
            "no safetensors files in this directory (no *.safetensors, no index)", url=path
        )
    return files


def varied_metadata(headers: Sequence[Header]) -> set[str]:
    """The ``__metadata__`` keys whose value differs between the shards holding them."""
    first: dict[str, str] = {}
    return {
        key
        for header in headers
        for key, value in header.metadata.items()
        if first.setdefault(key, value) != value
    }


def shard_labels(keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """The label each of ``keys`` is reported under: a key is a name and the shard holding this
    value of it (-1 for a name labelled by itself), labelled ``name`` or ``name (shard N)``,
    `` (shard N)`` added again while that label is taken (by a name labelled by itself,
    spelled so in the file, or by an earlier key's label), so that no two keys show alike."""
    keys = list(keys)
    labels = {key: key[0] for key in keys if key[1] < 0}
    taken = set(labels.values())
    for name, shard in keys:
        if shard >= 0 and (name, shard) not in labels:
            label = f"{name} (shard {shard})"
            while label in taken:
                label += f" (shard {shard})"
            labels[name, shard] = label
            taken.add(label)
    return labels


def shard_metadata(headers: Sequence[Header]) -> dict[str, str]:
    """The ``__metadata__`` of ``headers`` (a checkpoint's shards) as one mapping: a key of one
    value in every shard holding it once, a key whose value differs between shards once per
    shard holding it, as ``key (shard N)`` (as ``diff`` reports it; see :func:`shard_labels`
    for a label a key of the file is spelled as already)."""
    varied = varied_metadata(headers)
    values = {
        (key, shard if key in varied else -1): value
        for shard, header in enumerate(headers)
        for key, value in header.metadata.items()
    }
    labels = shard_labels(values)
    return {labels[key]: value for key, value in values.items()}


QUANTIZED_KEY = "quantized_tensors"
"""``__metadata__`` key ``cp`` records the number of quantized tensors under."""
KEPT_KEY = "kept_tensors"
"""``__metadata__`` key naming, as a JSON list, the tensors of the codes' dtype (I8) that
``cp --quantize`` copied as they were: not codes lacking their scale, which a shard of a mirror,
whose ``quantized_tensors`` counts the whole checkpoint's, cannot tell by its count."""
CONVERSION_COUNTS = frozenset({"converted_to", QUANTIZED_KEY, "dequantized_from", KEPT_KEY})
"""``__metadata__`` keys ``cp`` records a conversion's counts (and the tensors it kept as they
were) under: a mirror made before it recorded the whole checkpoint's held each shard's own, as
do shards converted each on its own, which no merged file can say (but for the quantized ones:
see :func:`quantization_record`)."""


def kept_tensors(metadata: Mapping[str, str]) -> list[str]:
    """The tensors :data:`KEPT_KEY` says ``cp --quantize`` copied as they were; none in a file
    quantized before it was recorded, or with no such tensor. A :class:`~stream_st.CodecError`
    where it is no JSON list of names."""
    raw = metadata.get(KEPT_KEY)
    if raw is None:
        return []
    try:
        recorded = decode_json(raw, f"metadata {KEPT_KEY}")
    except HeaderError as exc:
        raise CodecError(str(exc)) from None
    if not isinstance(recorded, list) or not all(isinstance(name, str) for name in recorded):
        raise CodecError(
            f"metadata {KEPT_KEY} must be a JSON list of tensor names, got {raw!r:.100}"
        )
    return recorded


def with_wire_tensors(codec: Codec, names: Collection[str]) -> Iterator[tuple[str, list[str]]]:
    """Each of ``names`` (sorted) that lies beside every wire tensor of ``codec``
    (``<name>.scale``...), with those wire tensors' names: what ``cp --dequantize`` rebuilds."""
    for name in sorted(names):
        wire = codec.part_names(name)
        if all(part in names for part in wire):
            yield name, wire


def _paired(header: Header) -> int | None:
    """How many tensors of ``header`` lie beside every wire tensor of the codec its
    ``__metadata__`` names (:func:`with_wire_tensors`), as ``cp --dequantize`` counts those it
    rebuilds; None where it names no codec that has any."""
    codec = CODECS.get(header.metadata.get("compression", "").lower())
    if codec is None or codec.key == "none":
        return None
    return sum(1 for _ in with_wire_tensors(codec, set(header.names())))


def quantization_record(headers: Sequence[Header], *, merging: bool) -> dict[str, str]:
    """The :data:`QUANTIZED_KEY` and :data:`KEPT_KEY` that say what ``headers`` (a checkpoint's
    shards, quantized by ``cp``) hold together: a mirror's shards each record the whole
    checkpoint's (one value of each), shards quantized each on its own record each its own,
    their counts equal only by chance. ``kept_tensors`` names every shard's (the one value, or
    all the lists' names, left out where one is no list of names); ``quantized_tensors`` is the
    one value every shard records, unless each of two or more shards counts just its own
    tensors beside their scales (quantized apart: no mirror's, which counts them all, does):
    their sum where ``merging`` them into one file, else (a mirror, whose shards may not all be
    read) left out, as it is where shards record different counts."""
    record: dict[str, str] = {}
    kept = {h.metadata[KEPT_KEY] for h in headers if KEPT_KEY in h.metadata}
    if len(kept) == 1:
        record[KEPT_KEY] = kept.pop()
    elif kept:
        try:
            names = [name for h in headers for name in kept_tensors(h.metadata)]
            record[KEPT_KEY] = json.dumps(list(dict.fromkeys(names)), separators=(",", ":"))
        except CodecError:  # one no list of names: what --dequantize of the merge says
            pass
    holding = [h for h in headers if QUANTIZED_KEY in h.metadata]
    counts = [canonical_decimal(h.metadata[QUANTIZED_KEY]) for h in holding]
    apart = len(holding) > 1 and all(
        count is not None and count == _paired(h) for count, h in zip(counts, holding, strict=True)
    )
    if apart and merging:
        record[QUANTIZED_KEY] = str(sum(count or 0 for count in counts))
    elif not apart and len({h.metadata[QUANTIZED_KEY] for h in holding}) == 1:
        record[QUANTIZED_KEY] = holding[0].metadata[QUANTIZED_KEY]
    return record


def merged_metadata(headers: Sequence[Header]) -> dict[str, str]:
    """The ``__metadata__`` a file merging ``headers`` (a checkpoint's shards) carries: every
    key but the checksum records (which describe each shard's own tensors), and but the
    :data:`CONVERSION_COUNTS` whose value differs between shards, the quantized ones as
    :func:`quantization_record` merges them; any other key whose value differs between shards
    is a :class:`~stream_st.UsageError`, as one file holds one value."""
    merged: dict[str, str] = {}
    counts: set[str] = set()
    for shard, header in enumerate(headers):
        for key, value in header.metadata.items():
            if is_record_key(key) or merged.setdefault(key, value) == value:
                continue
            if key in CONVERSION_COUNTS:
                counts.add(key)
                continue
            first = next(i for i, h in enumerate(headers) if key in h.metadata)
            raise UsageError(
                f"the shards' __metadata__ differ at {_SHORT.repr(key)} (shard {first}: "
                f"{_SHORT.repr(merged[key])}, shard {shard}: {_SHORT.repr(value)}): a merged "
                "file holds one value of each key"
            )
    record = quantization_record(headers, merging=True)
    counts.update({QUANTIZED_KEY, KEPT_KEY})  # the record says which are kept, and as what
    return {
        key: record.get(key, value)
        for key, value in merged.items()
        if key in record or key not in counts
    }


@contextmanager
def naming(source: SourceLike) -> Iterator[None]:
    """A :class:`~stream_st.SafetensorsError` raised inside whose message does not name
    ``source`` (a path or an address) is made to begin with it: where a command reads two
    sources, or reads one and writes another, a header that is not safetensors (whose error
    cannot know where the bytes came from) is said to be that source's."""
    try:
        yield
    except SafetensorsError as exc:
        if isinstance(source, str | os.PathLike):
            name, text = redact(os.fspath(source)), str(exc)
            if name not in text:
                exc.args = (f"{name}: {text}", *exc.args[1:])
        raise


@asynccontextmanager
async def opened(
    source: SourceLike,
    clock: Clock,
    *,
    include: Include = None,
    verify: bool = True,
    unknown_dtypes: UnknownDtypes = "refuse",
) -> AsyncIterator[tuple[TensorStream, list[Header]]]:
    """The source opened once, with its headers: a stream may not be readable twice.
    ``verify=False`` leaves a checksummed file's digests unchecked (the caller checks them);
    ``unknown_dtypes`` as for :func:`headers_of`. An error reading the headers names the source
    (see :func:`naming`)."""
    stream = stream_for(
        source, include=include, clock=clock, verify=verify, unknown_dtypes=unknown_dtypes
    )
    async with AsyncExitStack() as stack:
        with naming(source):
            await stack.enter_async_context(stream)
            if isinstance(stream, ShardedStream):  # every shard's header, up front
                headers = await headers_of(source, clock, unknown_dtypes=unknown_dtypes)
            else:
                headers = [stream.header]
        yield stream, headers


def included(include: Include, name: str) -> bool:
    if include is None:
        return True
    if callable(include):
        return bool(include(name))
    if isinstance(include, str):
        return name == include
    return name in include
