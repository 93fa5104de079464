"""``stream-st cp``: copy between any source and destination, converting dtypes or dequantizing."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import warnings
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Unpack
from urllib.parse import quote

import anyio
import numpy as np

from .._api import header_of
from .._util import allow_open_files, canonical_decimal
from ..core.codecs import (
    Codec,
    became_infinite,
    codec_from_metadata,
    decoded,
    get_codec,
    original_code,
    to_bfloat16,
    warn_infinite,
)
from ..core.digests import (
    ALGORITHM_KEY,
    DEFAULT_ALGORITHM,
    Digests,
    algorithm_named,
    asked_for,
    is_record_key,
)
from ..core.dtypes import dtype_from_code, wire_bytes
from ..core.header import Header, TensorInfo
from ..core.layout import TensorSpec
from ..core.shards import (
    INDEX_SUFFIX,
    join_address,
    literal_scheme,
    scheme_of,
    shard_address,
    split_address,
)
from ..core.stats import LoadStats, record_last
from ..core.strict_json import decode_json
from ..errors import (
    CodecError,
    HeaderError,
    IntegrityError,
    SafetensorsError,
    StreamStWarning,
    TensorNotFoundError,
    TransportError,
    UsageError,
    redact,
)
from ..kv.layout import KVLayout, digest_name
from ..reader import Include, TensorStream
from ..reader.stream import listed
from ..sharded.reader import MAX_INDEX_SIZE, ShardedStream, ShardIndex
from ..sharded.writer import checkpoint_files, remove_unlisted
from ..transports import store
from ..transports.file.atomic import local_path
from ..transports.file.sink import COPY_TURN
from ..transports.file.source import FileSource
from ..transports.http import HTTPStatusError
from ..transports.options import Clock, Transport, TransportOptions
from ..transports.registry import Sink, SinkLike, SourceLike, open_sink, read_object
from ..writer import TensorWriter
from .common import (
    KEPT_KEY,
    QUANTIZED_KEY,
    Progress,
    checked_progress,
    command_clock,
    expect_totals,
    included,
    kept_tensors,
    merged_metadata,
    naming,
    opened,
    quantization_record,
    tensors_of,
    varied_metadata,
    with_wire_tensors,
)

__all__ = ["CONVERTIBLE", "Copy", "address_in", "cp", "local_path", "make_directory", "mirror"]


CONVERTIBLE = ("F16", "BF16", "F32", "F64")
"""Floating-point dtypes that ``cp`` converts (``dtype=``) or quantizes (``quantize=``)."""


_TARGETS = {"bf16": "BF16", "f16": "F16", "f32": "F32"}


_DEQUANTIZED_KEY = "dequantized_from"
"""What ``--dequantize`` records in place of the codec's keys it drops."""
_ORIGINALS_KEY = "original_dtypes"
"""``__metadata__`` key of a file whose quantized tensors were of several dtypes (in place of
the codec's ``original_dtype``, which every reader applies to all), a JSON object of each one's
numpy dtype name: what ``--dequantize`` restores."""


@dataclass
class Copy:
    """What :func:`cp` wrote: the header, how many tensors it converted, quantized or
    dequantized (0 when every tensor was copied as it is), and the read's statistics."""

    header: Header
    converted: int
    load: LoadStats


def _convert(array: np.ndarray[Any, Any], code: str, name: str) -> np.ndarray[Any, Any]:
    """``array`` (tensor ``name``) as dtype ``code``; finite values beyond its range become
    infinite, and a :class:`~stream_st.StreamStWarning` says how many."""
    converted: np.ndarray[Any, Any]
    if code == "BF16":
        converted = to_bfloat16(array)  # round to nearest even, never truncation
    else:
        # over: counted below; invalid: a signaling NaN cast stays a NaN, as it should
        with np.errstate(over="ignore", invalid="ignore"):
            converted = array.astype(dtype_from_code(code).numpy)
    warn_infinite(name, code, became_infinite(converted, array))
    return converted


def _target_dtype(dtype: str | None) -> str | None:
    """The dtype code ``cp``'s ``dtype=`` names (``None`` for none)."""
    if dtype is None:
        return None
    target = _TARGETS.get(dtype.lower()) if isinstance(dtype, str) else None
    if target is None:
        raise UsageError(f"dtype= (--dtype) must be one of {', '.join(_TARGETS)}, not {dtype!r}")
    return target


def _quantized_by(metadata: Mapping[str, str]) -> Codec | None:
    """The codec a file's ``__metadata__`` says its tensors were quantized with, if any."""
    codec = codec_from_metadata(metadata)
    return None if codec.key == "none" else codec


class _Transfer:
    """A KV transfer (:func:`~stream_st.send_kv`'s, its ``kv_*`` metadata announcing its
    ``layout``) that ``cp`` converts. Its ``layer_{i}_digest`` tensors, each the SHA-256 of its
    layer's wire tensors (``docs/kv-wire-format.md``), are checked against the bytes of the
    layer as ``source`` gives them (a damaged layer would be given a digest it passes) and
    computed anew over the copy's: kept as they were, :func:`~stream_st.receive_kv` refused the
    copy (an :class:`~stream_st.IntegrityError`)."""

    def __init__(self, layout: KVLayout, source: str) -> None:
        self.layout, self.source = layout, source
        self.layer_of = {
            spec.name: layer
            for layer in range(layout.num_layers)
            for spec in layout.layer_specs(layer)
        }
        self.digests = {digest_name(layer) for layer in range(layout.num_layers)}
        self.read: dict[int, hashlib._Hash] = {}  # layer -> its source bytes hashed so far
        self.written: dict[int, hashlib._Hash] = {}  # layer -> its copy's bytes hashed so far

    def resigned(
        self, name: str, array: np.ndarray[Any, Any], parts: list[tuple[str, np.ndarray[Any, Any]]]
    ) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """``parts``, the tensors written for the source tensor ``name`` (``array``), with a
        layer's digest computed over the copy's tensors of the layer; an
        :class:`~stream_st.IntegrityError` where the source's layer fails its digest."""
        if not self.layout.digest:
            return parts
        layer = self.layer_of[name]
        if name != digest_name(layer):
            self.read.setdefault(layer, hashlib.sha256()).update(wire_bytes(array))
            written = self.written.setdefault(layer, hashlib.sha256())
            for _, part in parts:
                written.update(wire_bytes(part))
            return parts
        if array.tobytes() != self.read.pop(layer).digest():
            raise IntegrityError(
                f"layer {layer} from {self.source} failed its SHA-256 check ({name}); nothing "
                "written",
                name=name,
                source=self.source,
                layer=layer,
            )
        return [(name, np.frombuffer(self.written.pop(layer).digest(), np.uint8))]


def _transfer(
    stream: TensorStream, headers: Sequence[Header], wanted: Sequence[TensorInfo]
) -> _Transfer | None:
    """The KV transfer ``cp`` converts, None where the source (``stream``, ``headers``) is none:
    its ``__metadata__`` lacks a key of :data:`_TRANSFER_KEYS` (a checkpoint may record a
    ``kv_dtype`` of its own), or its tensors do not follow the layout those keys announce
    (:func:`~stream_st.receive_kv` would refuse it: copied as any file). Its layout and layer
    digests cover every layer: a :class:`~stream_st.UsageError` where it is read from shards or
    ``include=`` takes some of its tensors only (``wanted``)."""
    if not any(all(key in header.metadata for key in _TRANSFER_KEYS) for header in headers):
        return None
    layout = None
    if not isinstance(stream, ShardedStream):
        try:
            layout = KVLayout.from_header(stream.header)
        except HeaderError:
            return None
    if layout is None or len(wanted) != len(stream.header):
        raise UsageError(
            "the source is a KV transfer (kv_* keys in its __metadata__), whose layout and layer "
            "digests cover every layer: convert it whole, one file, without include= (--include)"
        )
    return _Transfer(layout, stream.source.name)


_TRANSFER_KEYS = ("kv_layers", "kv_shape", "kv_dtype")
"""The ``__metadata__`` keys :func:`~stream_st.send_kv` always writes, which a KV transfer has."""


class _Plan:
    """How ``cp`` turns each source tensor into the tensors it writes: as it is, converted to
    ``target``, quantized with ``encoder`` or dequantized from ``decoder``'s wire tensors.
    ``every`` names all the source's tensors, ``wanted`` those copied (``include=``'s): a
    tensor ``decoder`` rebuilds is taken whole or not at all (see :func:`_taken_whole`). A KV
    ``transfer``'s tensors are rebuilt as its ``kv_dtype``, which its copy records as the
    dtype of its values, and its layer digests are computed anew (:class:`_Transfer`)."""

    def __init__(
        self,
        wanted: Sequence[TensorInfo],
        metadata: Mapping[str, str],
        target: str | None,
        encoder: Codec | None,
        decoder: Codec | None,
        every: Collection[str],
        transfer: _Transfer | None = None,
    ) -> None:
        self.target, self.encoder, self.decoder = target, encoder, decoder
        self.specs: list[TensorSpec] = []
        self.changed: set[str] = set()  # source tensors converted or quantized
        self.parts: dict[str, str] = {}  # decoder: wire tensor -> the tensor it rebuilds
        self.rebuilt_as: dict[str, str] = {}  # decoder: rebuilt tensor -> its dtype code
        names = {t.name for t in wanted}
        rebuilt: dict[str, TensorSpec] = {}  # decoder: each tensor rebuilt from wire tensors
        if decoder is not None:
            _taken_whole(decoder, names, every)
            originals = _originals(metadata)
            # a KV transfer's original_dtype is informative: its kv_dtype decides
            recorded = _original(metadata) if transfer is None else transfer.layout.dtype
            for info in wanted:
                wire = decoder.part_names(info.name)
                if all(part in names for part in wire):
                    self.parts.update(dict.fromkeys(wire, info.name))
                    code = self.rebuilt_as[info.name] = target or originals.get(info.name, recorded)
                    rebuilt[info.name] = TensorSpec(info.name, code, _decoded_shape(decoder, info))
        # a rebuilt tensor is written once its last wire tensor has come (a stream's writer
        # takes tensors in header order): it is planned where that one lies in the source
        last = {self.parts[t.name]: t.name for t in wanted if t.name in self.parts}
        at = {part: rebuilt[whole] for whole, part in last.items()}
        for info in wanted:
            convertible = decoder is None and info.dtype in CONVERTIBLE  # dequantize: as it is
            if info.name in at:
                self.specs.append(at[info.name])
            elif info.name in self.parts:
                continue  # a wire tensor of a tensor rebuilt further on
            elif convertible and encoder is not None:
                self.specs.extend(encoder.specs(info.name, info.shape, info.dtype))
                self.changed.add(info.name)
            elif convertible and target is not None and info.dtype != target:
                self.specs.append(TensorSpec(info.name, target, info.shape))
                self.changed.add(info.name)
            else:
                self.specs.append(TensorSpec(info.name, info.dtype, info.shape))
        self.transfer = transfer if self.converted else None
        self.owned, self.record = self._record(metadata, wanted)
        self.metadata = self.recorded(metadata)

    @property
    def rebuilt(self) -> set[str]:
        """The tensors rebuilt from wire tensors."""
        return set(self.parts.values())

    @property
    def converted(self) -> int:
        return len(self.changed) + len(self.rebuilt)

    def _record(
        self, metadata: Mapping[str, str], wanted: Sequence[TensorInfo]
    ) -> tuple[set[str], dict[str, str]]:
        """The ``__metadata__`` keys the conversion answers for (the source's say nothing of
        the copy), and the entries it records in their place: a KV transfer's those of
        :meth:`_conversion_record`, and the dtype of its values (``kv_dtype``, and a plain
        transfer's ``original_dtype``: they said the source's, and
        :func:`~stream_st.receive_kv` refused the copy)."""
        owned, record = self._conversion_record(metadata, wanted)
        if self.transfer is None:
            return owned, record
        values = {"kv_dtype": self.target or self.transfer.layout.dtype}
        if self.target is not None and self.decoder is None:  # dequantized: the codec's dropped
            values["original_dtype"] = dtype_from_code(self.target).numpy.name
        return owned | set(values), record | values

    def _conversion_record(
        self, metadata: Mapping[str, str], wanted: Sequence[TensorInfo]
    ) -> tuple[set[str], dict[str, str]]:
        """The ``__metadata__`` keys the conversion answers for, and the entries it records in
        their place, for any file (see :meth:`_record`)."""
        if self.decoder is not None:
            # The codec's keys no longer describe the file: say what they were, in one key.
            dropped = [
                *self.decoder.metadata("float32"),
                QUANTIZED_KEY,
                _ORIGINALS_KEY,
                KEPT_KEY,
            ]
            described = " ".join(f"{key}={metadata[key]}" for key in dropped if key in metadata)
            said = f"{len(self.rebuilt)} tensors ({described})"
            return {*dropped, _DEQUANTIZED_KEY}, {_DEQUANTIZED_KEY: said}
        if self.encoder is not None:
            kept = [t.name for t in wanted if t.dtype == _CODES[self.encoder.key]]  # no float
            record = {
                **self.encoder.metadata(),
                QUANTIZED_KEY: str(len(self.changed)),
                **_original_dtypes([t for t in wanted if t.name in self.changed]),
                **({KEPT_KEY: json.dumps(kept, separators=(",", ":"))} if kept else {}),
            }
            return {*record, "original_dtype", _ORIGINALS_KEY, KEPT_KEY}, record
        if self.target is not None and self.changed:
            note = ", round to nearest even)" if self.target == "BF16" else ")"
            return {"converted_to"}, {
                "converted_to": f"{self.target} ({len(self.changed)} tensors{note}"
            }
        return set(), {}

    def recorded(self, metadata: Mapping[str, str]) -> dict[str, str]:
        """``metadata`` with this plan's record in place of the keys its conversion answers
        for: the copy's, or, of a mirror's plan over all its shards, each shard's (whose own
        counts would differ from shard to shard)."""
        return {k: v for k, v in metadata.items() if k not in self.owned} | self.record

    async def parts_of(
        self, name: str, array: np.ndarray[Any, Any], pending: dict[str, dict[str, Any]]
    ) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """The tensors to write for the source tensor ``name``; wire tensors are held in
        ``pending`` until every part of theirs has come, and a KV transfer's layer digests are
        computed anew (:meth:`_Transfer.resigned`)."""
        parts = await self._converted(name, array, pending)
        if self.transfer is None:
            return parts
        return await anyio.to_thread.run_sync(self.transfer.resigned, name, array, parts)

    async def _converted(
        self, name: str, array: np.ndarray[Any, Any], pending: dict[str, dict[str, Any]]
    ) -> list[tuple[str, np.ndarray[Any, Any]]]:
        """The tensors converted from the source tensor ``name`` (see :meth:`parts_of`)."""
        if self.decoder is not None and name in self.parts:
            whole = self.parts[name]
            got = pending.setdefault(whole, {})
            got[name] = array
            if len(got) < len(self.decoder.part_names(whole)):
                return []
            del pending[whole]
            # --dtype: decoded straight into it, as the codec decodes (INT4 values up to half a
            # step beyond its range saturate), not decoded as the original then converted
            values = await anyio.to_thread.run_sync(
                decoded, self.decoder, whole, got, self.rebuilt_as[whole]
            )
            return [(whole, values)]
        if name in self.changed and self.encoder is not None:
            return self.encoder.encode(name, array)
        if name in self.changed and self.target is not None:
            return [(name, await anyio.to_thread.run_sync(_convert, array, self.target, name))]
        return [(name, array)]


class _Pairing:
    """The tensors ``cp --quantize`` writes: one file's, or every shard's of a mirror, each
    file's joining them as it is planned, before any of it is written. ``--dequantize`` rebuilds
    every tensor ``t`` written beside all of its wire tensors (``t`` and ``t.scale``) from them,
    so a tensor not written as codes beside such names (an I8 ``x`` kept as it is beside an F32
    ``x.scale``, which becomes ``x.scale`` and ``x.scale.scale``) would be taken for codes, and
    its neighbours for its scale: a copy that could not be dequantized, a
    :class:`~stream_st.UsageError` naming them. So is a mirror's tensor written into two shards
    (``w`` quantized in one, ``w.scale`` in another); within one file the writer refuses it."""

    def __init__(self, codec: Codec) -> None:
        self.codec = codec
        self.written: dict[str, str] = {}  # tensor -> the file it is written into
        self.waiting: dict[str, list[str]] = {}  # wire tensor not written -> the tensors it pairs

    def add(self, plan: _Plan, where: str) -> None:
        """Add the tensors of ``plan``, written into ``where``; a :class:`UsageError` where
        ``--dequantize`` would pair them otherwise than as quantized."""
        names = {spec.name for spec in plan.specs}
        twice = sorted(names.intersection(self.written))
        if twice:
            first = twice[0]
            raise UsageError(
                f"quantize= (--quantize) would write tensor {first!r} into both "
                f"{self.written[first]} and {where} (a tensor's {self.codec.key} scale beside a "
                "tensor of that name): leave one of them out (include=, --include)"
            )
        self.written.update(dict.fromkeys(names, where))
        for name in sorted(names.difference(plan.changed)):  # kept as they are, and scales
            for part in self._unwritten(name):
                self.waiting.setdefault(part, []).append(name)
        for part in sorted(names.intersection(self.waiting)):  # earlier files' tensors
            for name in self.waiting.pop(part):
                self._unwritten(name)

    def _unwritten(self, name: str) -> list[str]:
        """The wire tensors of ``name`` (not written as codes) not written yet; a
        :class:`UsageError` where there is none."""
        wire = [part for part in self.codec.part_names(name) if part != name]
        unwritten = [part for part in wire if part not in self.written]
        if not unwritten:
            beside = ", ".join(map(repr, wire))
            raise UsageError(
                f"quantize= (--quantize) would write tensor {name!r}, not {self.codec.key} codes, "
                f"beside {beside}: dequantize= (--dequantize) would take {name!r} for "
                f"{self.codec.key} codes and {beside} for their scale; leave one of them out "
                "(include=, --include) or rename it"
            )
        return unwritten


_ORIGINAL_NAMES = tuple(dtype_from_code(code).numpy.name for code in CONVERTIBLE)
"""The numpy names of the dtypes ``original_dtype`` may name, as the codecs write them: what the
messages of a bad one list."""


def _original_dtypes(quantized: Sequence[TensorInfo]) -> dict[str, str]:
    """The ``__metadata__`` key that records the dtype of each of the ``quantized`` tensors:
    the codec's ``original_dtype`` (its numpy name) where all share one, else
    :data:`_ORIGINALS_KEY` naming each tensor's (``original_dtype`` then says nothing: a reader
    that knows only it, an older stream_st or the KV reader, decodes every tensor to it, and
    without it to F32, which loses nothing for F16 and BF16). Without either, an F64 tensor
    quantized beside F32 ones came back F32 (its values beyond F32's range infinite)."""
    dtypes = {info.name: dtype_from_code(info.dtype).numpy.name for info in quantized}
    kinds = set(dtypes.values())
    if len(kinds) == 1:
        return {"original_dtype": kinds.pop()}
    return {_ORIGINALS_KEY: json.dumps(dtypes, separators=(",", ":"))} if dtypes else {}


def _original(metadata: Mapping[str, str]) -> str:
    """The dtype code ``original_dtype`` names (a numpy name as the codecs write it, a torch
    name, with or without its ``torch.`` prefix, or a code), F32 where there is none; a
    :class:`~stream_st.CodecError` where it names no floating-point dtype (``int32``), where
    the tensors were rebuilt as F32 without a word."""
    raw = metadata.get("original_dtype")
    if raw is None:
        return "F32"
    code = original_code(raw)
    if code not in CONVERTIBLE:
        raise CodecError(
            f"metadata original_dtype must name one of {', '.join(_ORIGINAL_NAMES)}, "
            f"got {raw!r:.100}"
        )
    return code


def _originals(metadata: Mapping[str, str]) -> dict[str, str]:
    """The dtype code :data:`_ORIGINALS_KEY` records for each tensor it names, each name read as
    ``original_dtype``'s (:func:`_original`); none in a file quantized before it was written, or
    with all tensors of one dtype. A :class:`~stream_st.CodecError` where it is no JSON object of
    floating-point dtype names (or JSON nested too deeply to read)."""
    raw = metadata.get(_ORIGINALS_KEY)
    if raw is None:
        return {}
    try:
        recorded = decode_json(raw, f"metadata {_ORIGINALS_KEY}")
    except HeaderError as exc:
        raise CodecError(str(exc)) from None
    codes = (
        {
            tensor: original_code(name) if isinstance(name, str) else ""
            for tensor, name in recorded.items()
        }
        if isinstance(recorded, dict)
        else None
    )
    if codes is None or not all(code in CONVERTIBLE for code in codes.values()):
        raise CodecError(
            f"metadata {_ORIGINALS_KEY} must be a JSON object of tensor names to "
            f"{', '.join(_ORIGINAL_NAMES)}, got {raw!r:.100}"
        )
    return codes


def _warn_unconverted(plan: _Plan, wanted: Sequence[TensorInfo]) -> None:
    """A :class:`~stream_st.StreamStWarning` counting the floating-point tensors of ``wanted``
    that ``plan``'s ``--dtype`` or ``--quantize`` copies as they are, of a dtype not in
    :data:`CONVERTIBLE` (F8, F6, F4): they went without a word. ``--dequantize`` copies every
    tensor but its codes as it is, and says nothing of them."""
    others = [t.dtype for t in wanted if t.dtype.startswith("F") and t.dtype not in CONVERTIBLE]
    if not others or plan.decoder is not None or (plan.target is None and plan.encoder is None):
        return
    option = "dtype= (--dtype)" if plan.encoder is None else "quantize= (--quantize)"
    converted = f"{', '.join(CONVERTIBLE[:-1])} and {CONVERTIBLE[-1]}"
    warnings.warn(
        f"{option} converts {converted} tensors: {len(others)} tensors of other floating-point "
        f"dtypes ({', '.join(sorted(set(others)))}) copied as they are",
        StreamStWarning,
        stacklevel=3,
    )


def _decoded_shape(codec: Codec, info: TensorInfo) -> tuple[int, ...]:
    """The shape of the tensor whose first wire tensor is ``info``; :class:`CodecError` where
    INT4 codes are 0-d (they pack the last axis: there is none)."""
    if codec.key == "int4":  # two codes per byte along the last axis
        if not info.shape:
            raise CodecError(
                f"tensor {info.name!r}: INT4 codes of shape [] (a scalar) pack no axis"
            )
        return (*info.shape[:-1], info.shape[-1] * 2)
    return tuple(info.shape)


def _taken_whole(decoder: Codec, wanted: Collection[str], every: Collection[str]) -> None:
    """A :class:`~stream_st.UsageError` where ``wanted`` (the tensors ``include=`` takes of the
    source's ``every``) holds some of the wire tensors a quantized tensor is rebuilt from, not
    all: ``--dequantize`` copied codes without their scale as they were, I8 values nothing said
    were codes any more (the codec's keys dropped), and a scale without its codes."""
    if len(wanted) == len(every):
        return
    for name in sorted(every):
        wire = decoder.part_names(name)
        taken = [part for part in wire if part in wanted]
        if taken and len(taken) < len(wire) and all(part in every for part in wire):
            left = ", ".join(repr(part) for part in wire if part not in wanted)
            raise UsageError(
                f"dequantize= (--dequantize) rebuilds tensor {name!r} from "
                f"{' and '.join(map(repr, wire))}, and include= (--include) leaves out {left}: "
                f"include {left} as well, or leave out {', '.join(map(repr, taken))}"
            )


_CODES = {"int8": "I8", "int4": "U8"}
"""The dtype code of each codec's codes (the first of its wire tensors)."""


def _decodable(
    decoder: Codec,
    metadata: Mapping[str, str],
    wanted: Sequence[TensorInfo],
    every: Collection[str],
) -> None:
    """A :class:`~stream_st.CodecError` where ``--dequantize`` would not rebuild what the
    source's ``__metadata__`` says it quantized: no tensor of ``every`` beside all its wire
    tensors, unless ``quantized_tensors`` is recorded (``cp``'s record: a mirror's shard with no
    float tensor, a file quantized with none to quantize, copied as they are); a tensor of
    ``wanted`` of the codes' dtype without its scale (copied as it was, the codes then plain
    integers), unless :data:`KEPT_KEY` names it or ``quantized_tensors`` counts the tensors
    rebuilt (it was kept as it was; a mirror's shard counts the whole checkpoint's); more
    tensors rebuilt than that counts; or a wire tensor of two tensors (``w.scale`` the scale of
    ``w`` and the codes of ``w.scale.scale``)."""
    said = f"__metadata__ says compression={metadata.get('compression')}"
    owner: dict[str, str] = {}
    for name, wire in with_wire_tensors(decoder, every):
        for part in wire:
            if part in owner:
                raise CodecError(
                    f"dequantize= (--dequantize): tensor {part!r} is a wire tensor of both "
                    f"{owner[part]!r} and {name!r} ({said}): rename one of them"
                )
            owner[part] = name
    rebuilt = len(set(owner.values()))
    recorded = canonical_decimal(metadata.get(QUANTIZED_KEY, ""))
    if not rebuilt and recorded is None:
        spelled = " and ".join(decoder.part_names("<name>"))
        raise CodecError(
            f"dequantize= (--dequantize): the {said}, but no tensor has its wire tensors "
            f"({spelled})"
        )
    if recorded is not None and recorded < rebuilt:
        raise CodecError(
            f"dequantize= (--dequantize): the {said} and {QUANTIZED_KEY}={recorded}, but "
            f"{rebuilt} tensors have their wire tensors"
        )
    codes, kept = _CODES[decoder.key], set(kept_tensors(metadata))
    orphans = [
        t.name for t in wanted if t.dtype == codes and t.name not in owner and t.name not in kept
    ]
    if orphans and recorded != rebuilt:
        scales = " and ".join(map(repr, decoder.part_names(orphans[0])[1:]))
        raise CodecError(
            f"dequantize= (--dequantize): the {said}, but {_CODES[decoder.key]} tensor "
            f"{orphans[0]!r} has no {scales} (its codes would be copied as plain integers)"
        )


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
    F16, BF16, F32 and F64 tensor (:data:`CONVERTIBLE`) not of that dtype yet (BF16 rounds to
    nearest even; a finite value beyond the dtype's range becomes infinite, and a
    :class:`~stream_st.StreamStWarning` says how many).
    ``quantize="int8"`` stores every such tensor as I8 codes plus a sibling F32
    ``<name>.scale`` (symmetric, per tensor: ``scale = 127 / max|x|``, ``x ~= code / scale``),
    recorded in ``__metadata__``; a source whose metadata says it is quantized already is refused,
    as is a tensor not quantized written beside ``<its name>.scale`` (``dequantize`` would take them
    for codes and their scale), before anything is written. Both copy floating-point tensors of
    other dtypes (F8, F6, F4) as they are, and a :class:`~stream_st.StreamStWarning` counts them.
    ``dequantize`` rebuilds the
    floating-point tensors of a source quantized with the int8 or int4 codec (its ``__metadata__``
    names it) each as the dtype it was quantized from (``original_dtype`` where all were of one
    dtype, else ``original_dtypes`` naming each tensor's; F32 when unrecorded; a
    :class:`~stream_st.CodecError` where either names no float dtype; values decoded beyond its
    range become infinite, with a warning as ``dtype``'s), or as ``dtype``. Other tensors are copied
    as they are, and a copy that changes nothing is byte-identical to a source written in offset
    order (the reference writer's). A copy that fails or is interrupted leaves nothing at ``dst``.

    The source's digests, if it has some, are verified as it is read: a tensor that fails
    leaves nothing at ``dst``. ``None`` (the default ``checksums``) records digests in the copy
    when the source has them, with its algorithm, and ``True`` does so in any case (xxh3-128
    for a source without them): a source's digests are kept, not computed anew, for the tensors
    copied as they are. An algorithm's name records digests of that algorithm (the source's
    kept where they are of it, else computed). Copied digests of tensors copied as they are go
    out with the header, so any destination takes them; digests to compute need a destination
    that can be patched at the end (a file, S3): asked for, they are a
    :class:`~stream_st.UsageError` elsewhere; inherited, they are left out.
    """
    progress = checked_progress(progress)
    include = listed(include)  # names taken once, or an ArgumentTypeError saying what it takes
    target, encoder = _conversion(dtype, quantize, dequantize)
    checksums = _asked(checksums)
    return await _copy(
        src,
        dst,
        command_clock(options),
        include=include,
        target=target,
        encoder=encoder,
        dequantize=dequantize,
        checksums=checksums,
        progress=progress,
    )


def _asked(checksums: object) -> bool | str | None:
    """``checksums=`` checked before anything is opened, its mistakes the argument's, not a
    source's: an algorithm's name (:func:`~stream_st.core.digests.algorithm_named`), True or
    False (numpy's ``bool_`` too), or None; a :class:`~stream_st.UsageError` otherwise."""
    if isinstance(checksums, str):
        algorithm_named(checksums, "checksums=")
        return checksums
    return None if checksums is None else asked_for(checksums, "an algorithm name or None")


def _conversion(
    dtype: str | None, quantize: str | None, dequantize: bool
) -> tuple[str | None, Codec | None]:
    """``cp``'s conversion options checked: the dtype code ``dtype`` names and the codec
    ``quantize`` names (each None for none); a :class:`~stream_st.UsageError` for a bad value
    or more than one conversion."""
    if quantize is not None and (dtype is not None or dequantize):
        raise UsageError(
            "choose one of --dtype, --quantize and --dequantize (dtype=, quantize= and dequantize=)"
        )
    target = _target_dtype(dtype)
    if quantize is None:
        return target, None
    if not isinstance(quantize, str) or quantize.lower() != "int8":
        raise UsageError(f"quantize= (--quantize) supports int8, not {quantize!r}")
    return target, get_codec("int8")


def _decoder(
    metadata: Mapping[str, str], target: str | None, encoder: Codec | None, dequantize: bool
) -> Codec | None:
    """The codec ``--dequantize`` decodes the source with, as its ``__metadata__`` names it
    (None without ``dequantize``); a :class:`~stream_st.UsageError` where the source is not
    quantized, where ``encoder`` would quantize a source quantized already, or where ``target``
    would convert one's tensors without ``dequantize`` (its codec's float scales with the
    rest: a copy still said to be quantized whose scales the codec refuses)."""
    converting = target is not None or encoder is not None
    decoder = _quantized_by(metadata) if converting or dequantize else None
    if decoder is not None and not dequantize:
        codec = f"({metadata['compression']} in __metadata__)"
        if encoder is not None:
            raise UsageError(
                f"the source is quantized already {codec}: dequantize it first "
                "(dequantize=, --dequantize)"
            )
        raise UsageError(
            f"dtype= (--dtype): the source is quantized {codec}, and converting it would convert "
            "its codec's scales: add dequantize= (--dequantize) to rebuild its tensors as that "
            "dtype"
        )
    if dequantize and decoder is None:
        said = metadata.get("compression")
        why = f"its __metadata__ says compression={said}" if said else "no compression key"
        raise UsageError(f"dequantize= (--dequantize): the source is not quantized ({why})")
    return decoder if dequantize else None


async def _copy(
    src: SourceLike,
    dst: SinkLike,
    clock: Clock,
    *,
    include: Include,
    target: str | None,
    encoder: Codec | None,
    dequantize: bool,
    checksums: bool | str | None,
    progress: Progress | None,
    pairing: _Pairing | None = None,
    shard: str = "",
    expect: Callable[[Header], None] | None = None,
    checkpoint: _Plan | None = None,
) -> Copy:
    """:func:`cp`'s copy, its arguments checked (``target`` and ``encoder`` as
    :func:`_conversion` gives them), within ``clock``: that of the operation it is part of (a
    mirror's, for each of its shards), started. A mirror's copy of ``shard`` passes its
    ``pairing``, across its shards (a copy of its own checks its tensors alone), ``expect``,
    which checks the source's header before anything is written, and, converting, its
    ``checkpoint`` plan (:func:`_planned`), whose record of the conversion the shard takes."""
    async with opened(src, clock, include=include) as (stream, headers):
        if expect is not None:
            expect(headers[0])
        metadata = merged_metadata(headers)
        tensors = tensors_of(headers)
        wanted = [t for t in tensors if included(include, t.name)]
        every = {t.name for t in tensors}
        decoder = _decoder(metadata, target, encoder, dequantize)
        transfer = None
        if target is not None or encoder is not None or decoder is not None:
            with naming(src):
                transfer = _transfer(stream, headers, wanted)
        if decoder is not None and checkpoint is None:  # a mirror's: checked over every shard
            signed = set() if transfer is None else transfer.digests  # U8, not INT4 codes
            _decodable(decoder, metadata, [t for t in wanted if t.name not in signed], every)
        plan = _Plan(wanted, metadata, target, encoder, decoder, every, transfer)
        if checkpoint is None:  # a mirror's: said once, of every shard's
            _warn_unconverted(plan, wanted)
        if encoder is not None:
            (pairing or _Pairing(encoder)).add(plan, shard)
        with naming(src):  # a damaged digest record is the source's
            digests = _copied_digests(
                checksums, headers, [t.name for t in wanted], plan.converted > 0
            )
        expect_totals(progress, wanted)
        done_bytes = done = 0
        pending: dict[str, dict[str, Any]] = {}
        written = plan.metadata if checkpoint is None else checkpoint.recorded(plan.metadata)
        async with TensorWriter(
            dst,
            plan.specs,
            metadata=written or None,
            checksums=digests,
            clock=clock,
            # Digests only inherited from the source, to compute: a destination that cannot
            # take them at the end (a pipe, a socket, an HTTP upload) gets the copy without.
            digests_up_front=(lambda algorithm: None) if checksums is None else _not_up_front,
        ) as writer:
            if await _copied_by_kernel(stream, plan, writer, progress):
                return Copy(writer.header, plan.converted, stream.stats)
            async for name, array in stream:
                for part_name, part in await plan.parts_of(name, array, pending):
                    await writer.write(part_name, part)
                done_bytes += array.nbytes
                done += 1
                if progress is not None:
                    progress(done_bytes, done)
                del array
        return Copy(writer.header, plan.converted, stream.stats)


async def _copied_by_kernel(
    stream: TensorStream,
    plan: _Plan,
    writer: TensorWriter,
    progress: Progress | None,
) -> bool:
    """Copy every tensor of a local file that ``cp`` copies as it is to a local file by the
    kernel (:meth:`~stream_st.TensorWriter.copy_from_file`: none of the bytes passes through this
    process, about 1.2x the speed of reading and writing them). Returns False, nothing copied,
    where that does not apply: another source or destination, a tensor converted, digests to
    verify (the source's, checked as they are read) or to compute. The read's figures
    (``stream.stats``) count the tensors copied as handed out."""
    if isinstance(stream, ShardedStream) or plan.converted:  # shards: no one file to copy from
        return False
    source = stream.source
    if not isinstance(source, FileSource) or any(
        map(is_record_key, stream.header.metadata)
    ):  # digests, even damaged ones: the reading way checks them, or says what is wrong
        return False
    fd, start, done_bytes, done = source.fileno(), stream.header.data_start, 0, 0
    for run in _runs(stream.selected(), writer.header):
        first, *then = run
        for _ in run:
            stream.stats.asked()
        if not await writer.copy_from_file(
            first.name, fd, start + first.start, source.name, then=[t.name for t in then]
        ):
            return False  # the first run: nothing copied yet
        for info in run:  # as the reading way reports them, one tensor after another
            stream.stats.handed(info.nbytes)
            done_bytes += info.nbytes
            done += 1
            if progress is not None:
                progress(done_bytes, done)
    return True


async def _copied_as_it_is(
    src: str,
    sink: Sink,
    clock: Clock,
    expect: Callable[[Header], None],
    progress: Progress | None,
) -> Copy:
    """A dataset manifest's shard ``src`` copied byte for byte into ``sink`` (left to commit),
    within ``clock``: its header as it is, padding kept (a dataset writer's leaves room), so that
    the copy has the size the manifest counts (the bytes the stream read it from, the shard read
    once), then its tensors, read (their digests checked) as
    :func:`cp` reads them. ``expect`` checks the source's header before anything is written."""
    async with opened(src, clock) as (stream, _):
        header = stream.header
        expect(header)
        assert stream.head is not None  # open, not iterated yet
        prefix, raw = stream.head
        wanted = stream.selected()  # every tensor, in offset order: the data section
        expect_totals(progress, wanted)
        await sink.allocate(header.file_size)
        await sink.send(memoryview(prefix))
        await sink.send(raw)
        done_bytes = done = 0
        async for _, array in stream:
            await sink.send(wire_bytes(array))
            done_bytes += array.nbytes
            done += 1
            if progress is not None:
                progress(done_bytes, done)
            del array
        await sink.aclose()
    return Copy(header, 0, stream.stats)


def _runs(tensors: Iterable[TensorInfo], written: Header) -> Iterator[list[TensorInfo]]:
    """``tensors`` (the source's, in order) in runs that lie with no gap, one after the other,
    both in the source and in ``written`` (the copy's header), of at most :data:`COPY_TURN`
    bytes (a longer tensor alone): each is copied by the kernel in one call."""
    run: list[TensorInfo] = []
    size = 0
    for info in tensors:
        if run:
            last = run[-1]
            apart = info.start != last.start + last.nbytes or (
                written[info.name].start != written[last.name].start + last.nbytes
            )
            if apart or size + info.nbytes > COPY_TURN:
                yield run
                run, size = [], 0
        run.append(info)
        size += info.nbytes
    if run:
        yield run


def _not_up_front(algorithm: str) -> Digests | None:
    """What ``cp`` does when digests asked for must go out with the header (a destination
    written front to back): it computes them as it copies, so it says so."""
    raise UsageError(
        f"cp computes the {algorithm} digests asked for (checksums=, --checksums) as it copies, "
        "and records them at the end: the destination, written front to back (a pipe, a "
        "socket, an HTTP upload), cannot take them there; copy to a file or to S3, or without "
        "checksums"
    )


def _copied_digests(
    checksums: bool | str | None, headers: Sequence[Header], names: list[str], converting: bool
) -> bool | str | Digests:
    """What ``cp`` records (see there): the source's digests for ``names`` when no tensor
    changes and the algorithm is the one asked for, else the algorithm to compute. With no
    algorithm named (``checksums`` None or True) it is the source's: shards with digests of
    several algorithms, or only some with digests, are recorded with one of theirs (the default
    where it is one), computed anew, and a source without digests with the default (True) or
    with none (None)."""
    found = {h.metadata.get(ALGORITHM_KEY) for h in headers}
    source = next(iter(found)) if len(found) == 1 else None  # one algorithm, in every header
    if checksums is False:
        return False
    if isinstance(checksums, str):
        name = algorithm_named(checksums).name
    else:  # None or True: no algorithm named
        for header in headers:  # records to inherit must be ones to check, as the read says
            Digests.from_header(header)
        kinds = sorted(kind for kind in found if kind is not None)
        mixed = DEFAULT_ALGORITHM if DEFAULT_ALGORITHM in kinds else next(iter(kinds), None)
        kept = source or mixed or (DEFAULT_ALGORITHM if checksums else None)
        if kept is None:
            return False
        name = algorithm_named(kept).name
    if converting or source != name:
        return name
    values: dict[str, str] = {}
    for header in headers:
        recorded = Digests.from_header(header)
        assert recorded is not None
        values.update(recorded.values)
    return Digests(name, {n: values[n] for n in names})


def address_in(into: str, name: str) -> str:
    """The address of ``name`` (a relative path) inside the directory or prefix ``into``."""
    if scheme_of(into) is None:
        return os.path.join(into, *name.split("/"))
    parts = split_address(into)
    if not parts.netloc and parts.scheme.lower() != "file":  # s3:// then names a local path
        raise UsageError(f"{into} names no bucket or host to write {name} into")
    quoted = name if literal_scheme(parts.scheme) else quote(name)  # file:// decodes it
    path = parts.path if parts.path.endswith("/") else parts.path + "/"
    return join_address(parts.scheme, parts.netloc, path + quoted, parts.query)


async def _shard_replaces(written: list[str], clock: Clock) -> bool:
    """Whether a mirror's commit into a directory or prefix (``written``: its shards' addresses,
    then its index's) puts a shard where a file or object is: a reader of the older index of
    the same name would then find new shards beside old ones. Within the mirror's ``clock``."""
    *shards, index = written
    if not store.listable(index):  # http(s): each shard was committed as its upload ended
        return False
    try:
        return await store.any_exists(shards, clock)
    except HTTPStatusError as exc:
        if exc.status != 403:
            raise
        return False  # credentials that may not read the keys: the older index stays, as before


async def _unindexed(written: list[str], clock: Clock) -> None:
    """At the start of a mirror's commit where a shard takes the place of a file or object
    (:func:`_shard_replaces`), remove the index there (``written``'s last address): a process
    killed in the commit, or a commit that fails, then leaves no index (loading it fails)
    rather than the older index over a mix of new and old shards. The new index is committed
    last. Within the mirror's ``clock``."""
    try:
        await store.remove(written[-1], clock)
    except HTTPStatusError as exc:
        if exc.status != 403:
            raise  # credentials that may not delete it: the older index stays, as before


_INDEX_END = ".safetensors" + INDEX_SUFFIX


async def _superseded(written: list[str], into: str, prefix: str, clock: Clock) -> str | None:
    """The address of the single file ``{prefix}.safetensors`` in ``into`` where a mirror's
    index ``{prefix}.safetensors.index.json`` (``written``'s last address, its shards' before
    it) names no such shard, None if there is no such file: loaders take it before the index,
    so the commit removes it (:func:`~stream_st.sharded.writer.checkpoint_files`). A local folder
    of that name is no file, left as the writer leaves it (no loader takes it). Within the
    mirror's ``clock``."""
    *shards, index = written
    single = address_in(into, f"{prefix}.safetensors")
    if not store.listable(index) or single in shards:
        return None
    local = local_path(single)
    if local is not None and await anyio.Path(local).is_dir():
        return None
    try:
        return single if await store.any_exists([single], clock) else None
    except HTTPStatusError as exc:
        if exc.status != 403:
            raise
        return None  # credentials that may not read the key: the file stays, as before


async def _remove_superseded(single: str, clock: Clock) -> None:
    """Remove the single file a mirror's index supersedes (:func:`_superseded`), in the middle
    of the commit: where it cannot be removed, the index is committed all the same (a checkpoint
    without one would be left) and a :class:`~stream_st.StreamStWarning` says which file loaders
    may still take first."""
    try:
        await store.remove(single, clock)
    except TransportError as exc:
        warnings.warn(
            f"{redact(single)}: not removed ({exc}); loaders that take it before an index "
            "read the older checkpoint",
            StreamStWarning,
            stacklevel=2,
        )


class _Held(Sink):
    """``sink`` with its commit held back: the writer's ``aclose`` only gets the message ready
    (:meth:`~stream_st.transports.base.Sink.prepare`), :meth:`commit` commits it. A sink that
    cannot hold a complete message unseen (an HTTP upload) commits it at once."""

    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        super().__init__()
        self.name = sink.name
        self.random_access = sink.random_access
        self.kernel_copies = sink.kernel_copies
        self._holding = False

    @property
    def clock(self) -> Clock:
        return self.sink.clock

    @clock.setter
    def clock(self, clock: Clock) -> None:
        self.sink.clock = clock

    @property
    def position(self) -> int:
        return self.sink.position

    @position.setter
    def position(self, position: int) -> None:
        self.sink.position = position

    def add_transport(self, transport: Transport) -> None:
        self.sink.add_transport(transport)

    async def send(self, buffer: memoryview) -> None:
        await self.sink.send(buffer)

    async def allocate(self, size: int) -> None:
        await self.sink.allocate(size)

    async def write_at(self, offset: int, buffer: memoryview) -> None:
        await self.sink.write_at(offset, buffer)

    async def copy_in(self, source: int, at: int, offset: int, count: int) -> int:
        return await self.sink.copy_in(source, at, offset, count)

    async def hold_head(self, size: int) -> bool:
        return await self.sink.hold_head(size)

    async def patch_head(self, buffer: memoryview) -> None:
        await self.sink.patch_head(buffer)

    async def aclose(self) -> None:
        """The message is complete: get it ready to commit, or commit it if it cannot wait."""
        self._holding = await self.sink.prepare()
        if not self._holding:
            await self.sink.aclose()

    async def commit(self) -> None:
        """Commit the message held since :meth:`aclose`."""
        if self._holding:
            self._holding = False
            await self.sink.aclose()

    async def abort(self) -> None:
        await self.sink.abort()


def make_directory(path: str, made: list[str]) -> None:
    """Make the local directory ``path`` and its missing parents, adding those made to ``made``
    (parents first)."""
    parent = os.path.dirname(path)
    if not path or os.path.isdir(path):
        return
    if parent != path:
        make_directory(parent, made)
    try:
        os.mkdir(path)
    except FileExistsError:
        if os.path.isdir(path):  # made meanwhile by someone else
            return
        raise TransportError("cannot make the directory: a file is in the way", url=path) from None
    except OSError as exc:
        raise TransportError(f"cannot make the directory: {exc.strerror}", url=path) from exc
    made.append(path)


async def _discard(held: Sequence[_Held], made: Sequence[str], failure: BaseException) -> None:
    """Abort every message in ``held`` and remove the directories ``made`` if they are empty;
    what may be left (an upload that could not be aborted) is noted on ``failure``."""
    with anyio.CancelScope(shield=True):
        for sink in held:
            try:
                await sink.abort()
            except SafetensorsError as problem:
                failure.add_note(str(problem))
    for directory in reversed(made):
        with contextlib.suppress(OSError):  # not empty, or gone: leave it
            os.rmdir(directory)


async def _planned(
    shards: ShardIndex,
    chosen: Sequence[tuple[str, str, Sequence[str] | None]],
    clock: Clock,
    target: str | None,
    encoder: Codec | None,
    dequantize: bool,
) -> tuple[_Plan, dict[str, Header]]:
    """A converting mirror's plan over all the tensors it copies (``chosen``: each shard to
    write, its address, and the tensors ``include=`` takes of it, None for all), the shards'
    headers read, each checked against the index, before any shard is written. Its record of
    the conversion (the counts, the original dtypes: see :meth:`_Plan.recorded`) is the whole
    checkpoint's, written into every shard: each shard's own made shards a merge refuses. Of
    the source's keys it describes (``--dequantize``'s), those whose value differs between the
    shards are left out, but ``kept_tensors``, every shard's names, and ``quantized_tensors``,
    left out too where each shard counts its own (:func:`quantization_record`). ``--dequantize``
    refuses a tensor some of whose wire tensors
    ``include=`` leaves out (:func:`_taken_whole`, over all the index's tensors, those of shards
    not written too), or whose wire tensors lie in different shards: a mirror copies each shard
    on its own, and copied such codes as they were. Returns the plan and the headers by shard,
    which the shards' copies must find again (:func:`_unchanged`)."""
    headers: dict[str, Header] = {}
    for shard, where, _ in chosen:
        with naming(where):
            header = await header_of(where, clock)
        shards.check(shard, where, header)
        headers[shard] = header
    varied = varied_metadata(list(headers.values()))
    common = {
        key: value
        for header in headers.values()
        for key, value in header.metadata.items()
        if key not in {*varied, QUANTIZED_KEY, KEPT_KEY}
    } | quantization_record(list(headers.values()), merging=False)
    wanted: list[TensorInfo] = []
    for shard, _, names in chosen:
        taken = None if names is None else set(names)
        wanted.extend(info for info in headers[shard] if taken is None or info.name in taken)
    weight_map = shards.weight_map
    assert weight_map is not None  # a manifest is mirrored as it is
    if "compression" in varied and (target is not None or encoder is not None or dequantize):
        codecs = sorted(
            {h.metadata["compression"] for h in headers.values() if "compression" in h.metadata}
        )
        raise UsageError(
            "the shards' __metadata__ name different codecs (compression "
            f"{', '.join(map(repr, codecs))}): convert each shard on its own"
        )
    decoder = _decoder(common, target, encoder, dequantize)
    if decoder is not None:
        _decodable(decoder, common, wanted, weight_map)
    plan = _Plan(wanted, common, target, encoder, decoder, weight_map)
    _warn_unconverted(plan, wanted)
    for part, name in plan.parts.items():
        if weight_map[part] != weight_map[name]:
            raise UsageError(
                f"dequantize= (--dequantize) rebuilds tensor {name!r} (in {weight_map[name]}) from "
                f"{part!r} too (in {weight_map[part]}), and a mirror rebuilds each shard's "
                "tensors from that shard alone: merge the checkpoint into one file (cp(), --merge)"
            )
    return plan, headers


def _unchanged(known: Header, where: str, header: Header) -> None:
    """A :class:`~stream_st.HeaderError` unless the ``header`` of the shard at ``where`` is the
    one its mirror was planned with, ``known``."""
    if header != known:
        raise HeaderError(f"{where}: the shard changed while it was mirrored (its header differs)")


async def mirror(
    index: str,
    into: str,
    *,
    include: Include = None,
    dtype: str | None = None,
    quantize: str | None = None,
    dequantize: bool = False,
    checksums: bool | str | None = None,
    progress: Progress | None = None,
    **options: Unpack[TransportOptions],
) -> list[str]:
    """Copy the sharded checkpoint ``index`` (a ``*.index.json`` or ``dataset_manifest.json``)
    into the directory or prefix ``into``: every shard under its name (each as :func:`cp` copies
    it; a manifest's byte for byte, its header's padding kept, as the manifest counts its bytes),
    then the index. ``options`` are the whole mirror's: ``deadline`` bounds it all, from
    reading the index to the commit, not each shard. The index is copied as it is when no
    tensor changes; otherwise a Hugging Face index is written anew (``weight_map`` and
    ``total_size`` of the shards written), and a manifest, whose byte counts would change, is a
    :class:`~stream_st.UsageError`. A shard left with no tensor by ``include`` is not written.
    Returns the addresses written, the index last; the shards' reads together are
    :func:`~stream_st.last_stats`.

    All or nothing: every shard and the index are written whole and checked (a local file
    nameless or under a hidden name, an S3 multipart upload with every part sent but not
    completed) before any is committed; any failure, cancellation or stopping signal until then
    discards them all (and the directories made), leaving the destination as it was. Then they
    are committed in order, the index last, shielded from cancellation: renames on a local
    disk, CompleteMultipartUpload calls on S3, after the older index there is removed where a
    shard takes the place of a file or object. Only in that short step can a reader of an old
    index of the same shard names find new shards beside old ones, and a failure there keeps
    the shards committed before it, with no index. As the sharded writer's, the commit removes
    an older ``{prefix}.safetensors`` beside ``{prefix}.safetensors.index.json`` that the index
    does not name (loaders take it before the index), just before the index, the older index
    removed first; in a local directory, once the index is in place, the older shards
    ``{prefix}-NNNNN-of-NNNNN.safetensors`` it does not name too
    (:func:`~stream_st.sharded.writer.checkpoint_files`). An HTTP upload cannot be held: each
    shard is committed as its upload completes, and a failure leaves those uploaded (the index
    is not written)."""
    progress = checked_progress(progress)
    target, encoder = _conversion(dtype, quantize, dequantize)
    checksums = _asked(checksums)
    clock = command_clock(options)
    raw, home = await read_object(index, clock, limit=MAX_INDEX_SIZE)
    shards = ShardIndex(raw, index, home)
    given = [
        f"{option}= (--{option})"
        for option, value in (
            ("include", include is not None),
            ("dtype", dtype),
            ("quantize", quantize),
            ("dequantize", dequantize),
            ("checksums", checksums),
        )
        if value
    ]
    changing = bool(given)
    if changing and shards.weight_map is None:
        raise UsageError(
            f"{index}: a dataset manifest is mirrored as it is (its byte counts would change): "
            f"drop {', '.join(given)}, or merge it into one file (cp(), --merge)"
        )
    # a path, or a file:// URL's decoded as its reader opened it; else the URL's path
    index_name = posixpath.basename(local_path(index) or split_address(index).path)
    prefix = index_name[: -len(_INDEX_END)] if index_name.endswith(_INDEX_END) else None
    allow_open_files(len(shards.shards) + 1)
    written: list[str] = []
    held: list[_Held] = []
    made: list[str] = []  # local directories made for the copy
    pairing = None if encoder is None else _Pairing(encoder)  # across the shards

    async def opened_at(target: str) -> _Held:
        local = local_path(target)
        if local is not None:  # a path or a file:// URL
            make_directory(os.path.dirname(local), made)
        sink = _Held(await open_sink(target, clock=clock))
        held.append(sink)
        written.append(target)
        return sink

    weight_map: dict[str, str] = {}
    total = 0
    reads: list[LoadStats] = []
    selected = shards.selector(include)  # every name include= lists is in the index
    chosen = []  # each shard to write, its address, and the tensors include= takes (None: all)
    for shard in shards.shards:
        names = shards.names_in(shard)  # None for a manifest: include= is None then
        wanted = None if include is None or names is None else sorted(filter(selected, names))
        if wanted != []:
            chosen.append((shard, shard_address(shards.home, shard), wanted))
    try:
        checkpoint: _Plan | None = None
        known: dict[str, Header] = {}
        if target is not None or encoder is not None or dequantize:
            checkpoint, known = await _planned(shards, chosen, clock, target, encoder, dequantize)
        for shard, where, wanted in chosen:
            sink = await opened_at(address_in(into, shard))
            expect = partial(shards.check, shard, where)  # for a shard copied whole
            if checkpoint is not None:  # read and checked as it was planned: found again
                expect = partial(_unchanged, known[shard], where)
            try:
                if shards.weight_map is None:  # a manifest's shard: the size it counts kept
                    copied = await _copied_as_it_is(where, sink, clock, expect, progress)
                else:
                    copied = await _copy(
                        where,
                        sink,
                        clock,
                        include=None if wanted is None else set(wanted),
                        target=target,
                        encoder=encoder,
                        dequantize=dequantize,
                        checksums=checksums,
                        progress=progress,
                        pairing=pairing,
                        shard=shard,
                        expect=expect if wanted is None or checkpoint is not None else None,
                        checkpoint=checkpoint,
                    )
            except TensorNotFoundError:  # include= took the index's word for the shard's names
                if wanted is None:
                    raise
                raise HeaderError(
                    f"{where}: the shard's tensors differ from those the index assigns it (it "
                    f"lacks some of {wanted[:5]})"
                ) from None
            weight_map.update(dict.fromkeys(copied.header.names(), shard))
            total += copied.header.data_size
            reads.append(copied.load)
        if changing:
            document = {
                "metadata": {**shards.metadata, "total_size": total},
                "weight_map": weight_map,
            }
            raw = (json.dumps(document, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
        sink = await opened_at(address_in(into, index_name))
        await sink.allocate(len(raw))
        await sink.send(memoryview(raw))
        await sink.aclose()
        replacing = await _shard_replaces(written, clock)
        stale = None
        if prefix is not None:
            stale = await _superseded(written, into, prefix, clock)
        with anyio.CancelScope(shield=True):  # the commit: a signal waits for it
            if replacing or stale is not None:
                await _unindexed(written, clock)
            while len(held) > 1:  # the shards
                await held[0].commit()
                del held[0]
            if stale is not None:  # gone before the index names the shards beside it
                await _remove_superseded(stale, clock)
            await held[0].commit()
            del held[0]
    except BaseException as exc:
        await _discard(held, made, exc)
        raise
    folder = local_path(into)
    if folder is not None and prefix is not None:  # an earlier checkpoint's shards, unnamed
        kept = {shard for shard, _, _ in chosen}
        ours = checkpoint_files(prefix)
        await anyio.to_thread.run_sync(remove_unlisted, Path(folder), ours, kept)
    record_last(LoadStats.total(reads))
    return written
