"""The layout of a KV-cache transfer: tensor names, :class:`KVLayout` from a header (stream_st's
metadata or a seed-style cache inferred from names and shapes).
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._util import canonical_decimal
from ..core.codecs import (
    DEFAULT_GROUP_SIZE,
    Codec,
    Int4Codec,
    codec_from_metadata,
    get_codec,
)
from ..core.dtypes import dtype_for
from ..core.header import Header
from ..core.layout import TensorSpec, integer_shape
from ..core.strict_json import decode_json
from ..errors import ArgumentTypeError, HeaderError, IntegrityError, UsageError, boolean

__all__ = ["DIGEST_SIZE", "IntegrityError", "KVLayout"]

Array = np.ndarray[Any, Any]
DIGEST_SIZE = 32
"""Bytes of a layer's digest tensor, ``layer_{i}_digest`` (U8 of this shape): the SHA-256 of
the layer's key and value wire bytes."""


def key_name(layer: int) -> str:
    return f"layer_{layer}_key"


def value_name(layer: int) -> str:
    return f"layer_{layer}_value"


def digest_name(layer: int) -> str:
    return f"layer_{layer}_digest"


@dataclass(frozen=True)
class KVLayout:
    """What a transfer carries: ``num_layers`` of key and value, each of ``shape`` and ``dtype``
    (a safetensors code: F16, BF16, F32), through ``codec`` ("none", "int8", "int4") with its
    ``group_size`` for INT4. With ``digest`` each layer ends in a SHA-256 of its bytes, which
    the receiver checks before it hands the layer out. ``wire_dtype``, ``style`` and ``notes``
    describe a layout as received: :func:`receive_kv` sets them for a seed-style cache."""

    num_layers: int
    shape: tuple[int, ...]
    dtype: str = "F16"
    codec: str = "none"
    group_size: int = DEFAULT_GROUP_SIZE
    """INT4's group size (a positive even integer); any other codec has none, and its layout
    holds the default, whatever was given, as the one received does."""
    digest: bool = True
    wire_dtype: str | None = None
    """With codec "none", the dtype the tensors travel in when it is not ``dtype``: a
    seed-style cache written in one float type whose ``original_dtype`` names another, as
    :func:`receive_kv` reads it (decoding casts). None when it is ``dtype``. :func:`send_kv`
    sends no such layout: a stream_st transfer's tensors are of its ``kv_dtype``."""
    style: str = "stream_st"
    """"stream_st": laid out by :func:`send_kv`, its metadata announces it. "seed": inferred
    from ``layer_{i}_key`` / ``layer_{i}_value`` names and shapes alone (the exchange format
    other programs write; see ``docs/kv-wire-format.md``), any tensor order."""
    notes: tuple[str, ...] = field(default=(), compare=False)
    """What the receiver decided about the header where it was ambiguous (a seed-style cache
    whose metadata contradicts its tensors)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_layers, int | np.integer) or isinstance(self.num_layers, bool):
            raise ArgumentTypeError(
                f"a KV layout's num_layers is an integer, not {type(self.num_layers).__name__}"
            )
        object.__setattr__(self, "num_layers", int(self.num_layers))
        object.__setattr__(self, "shape", integer_shape(self.shape))  # a list, numpy integers
        if self.num_layers < 1 or len(self.shape) != 4 or min(self.shape) < 0:
            raise UsageError(
                "a KV layout needs >= 1 layer and a [batch, heads, seq, head_dim] shape of "
                f"sizes >= 0, got {self.num_layers} layers of {list(self.shape)}"
            )
        # "INT4" names the codec as "int4" does: one spelling, so that the group size applies
        # and a layout sent compares equal to the one received
        object.__setattr__(self, "codec", get_codec(self.codec).key)
        if self.codec == "int4":
            Int4Codec(group_size=self.group_size)  # a CodecError for a size it cannot group by
        else:  # never sent: the receiver's layout holds the default
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE)
        for dtype in (self.dtype, self.wire_dtype or self.dtype):
            if dtype not in ("F16", "BF16", "F32"):
                raise UsageError(f"KV dtype must be F16, BF16 or F32, not {dtype!r}")
        if self.wire_dtype == self.dtype:  # one spelling: equal to a layout without it
            object.__setattr__(self, "wire_dtype", None)
        object.__setattr__(self, "digest", boolean("a KV layout's digest", self.digest))
        if self.style not in ("stream_st", "seed"):
            raise UsageError(f"KV layout style must be 'stream_st' or 'seed', not {self.style!r}")
        self.layer_specs(0)  # a codec that cannot carry this shape says so now, not mid-send

    @property
    def numpy_dtype(self) -> np.dtype[Any]:
        """``dtype`` as a numpy (or ml_dtypes) dtype: what the layers are handed out in."""
        return dtype_for(self.dtype).numpy

    def get_codec(self) -> Codec:
        """The codec that carries the layers, with this layout's group size for INT4."""
        return get_codec(self.codec, group_size=self.group_size if self.codec == "int4" else None)

    def layer_specs(self, layer: int) -> list[TensorSpec]:
        """The wire tensors of one layer: key parts, value parts, then the digest."""
        codec = self.get_codec()
        wire = self.wire_dtype or self.dtype
        specs = [
            *codec.specs(key_name(layer), self.shape, wire),
            *codec.specs(value_name(layer), self.shape, wire),
        ]
        if self.digest:
            specs.append(TensorSpec(digest_name(layer), "U8", (DIGEST_SIZE,)))
        return specs

    def plan(self) -> list[TensorSpec]:
        """Every wire tensor of the transfer, in the order they are sent: :meth:`layer_specs`
        of layer 0, 1, ..."""
        return [spec for layer in range(self.num_layers) for spec in self.layer_specs(layer)]

    def metadata(self) -> dict[str, str]:
        """The ``__metadata__`` :func:`send_kv` writes for this layout: the codec's entries
        and ``kv_layers``, ``kv_shape``, ``kv_dtype``, ``kv_digest`` and ``kv_layout``, from
        which :meth:`from_header` reads it back."""
        meta = self.get_codec().metadata(self.numpy_dtype)
        meta.update(
            kv_layers=str(self.num_layers),
            kv_shape=json.dumps(list(self.shape)),
            kv_dtype=self.dtype,
            kv_digest="sha256" if self.digest else "none",
            kv_layout="layer_{i}_key / layer_{i}_value: [batch, n_kv_heads, seq, head_dim]",
        )
        return meta

    @property
    def layer_bytes(self) -> int:
        """Wire bytes of one layer (key, value, codec siblings and digest)."""
        return sum(
            math.prod(spec.shape) * dtype_for(spec.dtype).bits // 8 for spec in self.layer_specs(0)
        )

    @classmethod
    def from_header(cls, header: Header) -> KVLayout:
        """The layout a header announces (``kv_*`` metadata, as :func:`send_kv` writes it) or,
        without any ``kv_*`` key, the seed-style layout its tensor names and shapes imply.
        :class:`~stream_st.HeaderError` if it is neither."""
        meta = header.metadata
        if not any(key in meta for key in _KV_KEYS):
            return _seed_layout(header)
        try:
            layout = cls(
                num_layers=_metadata_number(meta, "kv_layers"),
                shape=_kv_shape(meta["kv_shape"]),
                dtype=meta["kv_dtype"],
                codec=codec_from_metadata(meta).key,
                group_size=_metadata_number(meta, "group_size", "64"),
                digest=_kv_digest(meta.get("kv_digest", "sha256")),
            )
        except (KeyError, ValueError, TypeError, OverflowError) as exc:
            raise HeaderError(
                f"not a KV-cache transfer: bad or missing KV metadata ({exc})"
            ) from None
        except UsageError as exc:
            raise HeaderError(f"not a KV-cache transfer: {exc}") from None
        each = len(layout.layer_specs(0))
        if layout.num_layers * each != len(header.tensors):
            raise HeaderError(  # checked before the plan is built: kv_layers may be anything
                f"the metadata announces {layout.num_layers} KV layers of {each} tensors "
                f"(codec {layout.codec}, {'a' if layout.digest else 'no'} digest), "
                f"the header holds {len(header.tensors)} tensors"
            )
        plan = layout.plan()
        expected = {s.name: (dtype_for(s.dtype).code, s.shape) for s in plan}
        if expected != {t.name: (t.dtype, t.shape) for t in header.tensors}:
            raise HeaderError("the tensors do not follow the KV layout their metadata announces")
        # in the plan's order in the data section; an empty tensor that starts where another
        # does has no order of its own (the JSON's, which the format leaves free)
        for before, after in itertools.pairwise(plan):
            if header[after.name].start < header[before.name].end:
                raise HeaderError(
                    "the tensors do not follow the KV layout their metadata announces: "
                    f"{after.name!r} lies before {before.name!r} in the data section"
                )
        return layout


_KV_KEYS = ("kv_layers", "kv_shape", "kv_dtype", "kv_digest")
"""Metadata keys of a transfer laid out by :func:`send_kv`; a header with none of them is read
as a seed-style cache."""

_FLOAT_CODES = ("F16", "BF16", "F32")
_SEED_PARTS = {  # name suffix after layer_{i}_ -> (role, codec part)
    "key": ("key", ""),
    "value": ("value", ""),
    "key.scale": ("key", ".scale"),
    "value.scale": ("value", ".scale"),
    "key.scales": ("key", ".scales"),
    "value.scales": ("value", ".scales"),
}


def _metadata_number(meta: dict[str, str], key: str, default: str | None = None) -> int:
    """The canonical decimal under ``key`` in the metadata (``default`` when absent); a KeyError
    when it is absent without a default, a ValueError when it is not one."""
    text = meta[key] if default is None else meta.get(key, default)
    number = canonical_decimal(text)
    if number is None:
        raise ValueError(f"{key!r} must be a decimal integer, not {text!r}")
    return number


def _kv_shape(text: str) -> tuple[int, ...]:
    """The ``kv_shape`` metadata (a JSON list of integers, from a peer) parsed by the header's
    strict, bounded parser: a ValueError (a :class:`~stream_st.HeaderError` where it is not
    JSON, however deeply nested) for anything else."""
    shape = decode_json(text, "'kv_shape'", strict=True)
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) for d in shape
    ):
        raise ValueError("'kv_shape' is not a JSON list of integers")
    return tuple(shape)


def _kv_digest(text: str) -> bool:
    """Whether ``kv_digest`` announces a digest per layer: ``"sha256"`` or ``"none"``, a
    ValueError for anything else (another word would be read as no digest, and the layout's
    tensors then miscounted)."""
    if text not in ("sha256", "none"):
        raise ValueError(f"'kv_digest' must be 'sha256' or 'none', not {text!r}")
    return text == "sha256"


def _seed_name(name: str) -> tuple[int, str] | None:
    """``(layer, suffix)`` of a seed-style tensor name, or None if it is not one."""
    if not name.startswith("layer_"):
        return None
    number, _, suffix = name[len("layer_") :].partition("_")
    layer = canonical_decimal(number)  # "layer_01_key", "layer_+1_key": not canonical
    if layer is None or suffix not in _SEED_PARTS:
        return None
    return layer, suffix


_FLOAT_NAMES = {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}
_ORIGINAL_CODES = {
    **_FLOAT_NAMES,
    **{f"torch.{name}": code for name, code in _FLOAT_NAMES.items()},
    **{code: code for code in _FLOAT_CODES},
}
"""The seed's ``original_dtype`` spellings, as ``docs/kv-wire-format.md`` names them, to their
codes: no other numpy or torch name of a float (``half``, ``<f2``, ``torch.half``), which
``cp --dequantize`` takes."""


def _original_dtype(meta: dict[str, str]) -> str | None:
    """The seed's ``original_dtype`` (``"float32"``, ``"torch.float16"``, ``"F16"``...) as a
    safetensors code, or None when absent."""
    raw = meta.get("original_dtype")
    if raw is None:
        return None
    code = _ORIGINAL_CODES.get(raw)
    if code is None:
        raise HeaderError(
            f"not a KV cache: original_dtype {raw!r} is not float16, bfloat16 or float32 "
            "(with or without torch.), or F16, BF16 or F32"
        )
    return code


def _seed_layout(header: Header) -> KVLayout:
    """The layout of a cache written by another program: ``layer_{i}_key`` / ``layer_{i}_value``
    of one 4-D shape, no ``kv_*`` metadata, no per-layer digests, any tensor order.

    The tensors decide what the bytes are; the seed's metadata is honoured where it agrees:
    ``compression`` must match the wire tensors when they are encoded (I8 + ``.scale``: INT8,
    U8 + ``.scales``: INT4) and is recorded as a note when the tensors are plain floats (they are
    read as they are: decoding them as INT4 would misread every byte); ``group_size`` is a
    decimal whatever the codec, and must match the INT4 scales' shape; ``original_dtype`` is the
    dtype the layers are handed out in.
    """
    meta = header.metadata
    tensors = {info.name: info for info in header.tensors}
    if not tensors:
        raise HeaderError("not a KV cache: no KV metadata and no layer_{i}_key tensors")
    layers: dict[int, dict[str, str]] = {}
    for name in tensors:
        parsed = _seed_name(name)
        if parsed is None:
            raise HeaderError(
                f"not a KV cache: tensor {name!r} is not layer_{{i}}_key or layer_{{i}}_value "
                "(or a codec's .scale / .scales of one), and there is no KV metadata"
            )
        layer, suffix = parsed
        layers.setdefault(layer, {})[suffix] = name
    num_layers = len(layers)
    if max(layers) != num_layers - 1:  # then some layer below num_layers is missing
        missing = [layer for layer in range(num_layers) if layer not in layers]
        raise HeaderError(
            f"not a KV cache: layer_{{i}} tensors for layers up to {max(layers)}, "
            f"but layers {missing[:5]} are missing"
        )
    first = tensors.get(key_name(0))
    if first is None:
        raise HeaderError("not a KV cache: layer_0_key is missing")
    codec = {
        "I8": "int8",
        "U8": "int4",
    }.get(first.dtype, "none" if first.dtype in _FLOAT_CODES else "")
    if not codec:
        raise HeaderError(
            f"not a KV cache: layer_0_key is {first.dtype}; a KV cache holds F16, BF16 or F32 "
            "tensors, or INT8 (I8 + .scale) or INT4 (U8 + .scales) codes"
        )
    wanted = {"none": {"key", "value"}, "int8": {"key", "value", "key.scale", "value.scale"}}
    wanted["int4"] = {"key", "value", "key.scales", "value.scales"}
    for layer, parts in layers.items():
        if set(parts) != wanted[codec]:
            raise HeaderError(
                f"not a KV cache: layer {layer} has {sorted(parts)}; a {codec} cache has "
                f"{sorted(wanted[codec])} in every layer"
            )
    notes: list[str] = []
    declared = meta.get("compression")
    if declared is not None and declared.lower() not in ("none", "int8", "int4"):
        raise HeaderError(f"not a KV cache: unknown compression {declared!r} in the metadata")
    if declared is not None and declared.lower() != codec:
        if codec != "none":
            raise HeaderError(
                f"the metadata says compression {declared!r}, the tensors are {codec.upper()} "
                "codes: which one is meant cannot be told"
            )
        notes.append(
            f"compression {declared!r} in the metadata, but the tensors are plain "
            f"{first.dtype} values: read as they are (the metadata describes how they were "
            "produced, not how they are stored)"
        )
    original = _original_dtype(meta)
    group_size = 64
    if codec == "none":
        shape = first.shape
        dtype, wire = original or first.dtype, first.dtype
    else:
        dtype, wire = original or "F32", None
        if original is None:
            notes.append("no original_dtype in the metadata: decoded to float32")
        scales = tensors[layers[0]["key" + (".scale" if codec == "int8" else ".scales")]]
        if codec == "int8":
            shape = first.shape
        else:
            if len(first.shape) != 4 or len(scales.shape) != 4 or scales.shape[-1] < 1:
                raise HeaderError(
                    f"not a KV cache: INT4 codes {list(first.shape)} and scales "
                    f"{list(scales.shape)} are not [batch, heads, seq, head_dim / 2] and "
                    "[batch, heads, seq, head_dim / group_size]"
                )
            shape = (*first.shape[:-1], 2 * first.shape[-1])
            group_size = shape[-1] // scales.shape[-1]
            if group_size * scales.shape[-1] != shape[-1]:
                raise HeaderError(
                    f"not a KV cache: INT4 codes of {shape[-1]} values a row do not split into "
                    f"{scales.shape[-1]} equal groups"
                )
    if "group_size" in meta:  # a decimal whatever the codec; a size INT4's alone
        raw = meta["group_size"]
        declared_size = canonical_decimal(raw)
        int4 = codec == "int4" or (declared or "").lower() == "int4"
        if declared_size is None or (int4 and not declared_size):
            raise HeaderError(f"not a KV cache: group_size {raw!r} is not a positive integer")
        if codec == "int4" and declared_size != group_size:
            raise HeaderError(
                f"the metadata says group_size {raw}, the INT4 scales' shape says {group_size}"
            )
    try:
        layout = KVLayout(
            num_layers=num_layers,
            shape=tuple(shape),
            dtype=dtype,
            codec=codec,
            group_size=group_size,
            digest=False,
            wire_dtype=wire,
            style="seed",
            notes=tuple(notes),
        )
    except (UsageError, ValueError) as exc:  # ValueError: CodecError, a shape INT4 cannot carry
        raise HeaderError(f"not a KV cache: {exc}") from None
    by_name = {s.name: (dtype_for(s.dtype).code, s.shape) for s in layout.plan()}
    for name, info in tensors.items():
        if by_name.get(name) != (info.dtype, info.shape):
            want = by_name.get(name)
            raise HeaderError(
                f"not a KV cache: {name!r} is {info.dtype} {list(info.shape)}, the cache's "
                f"layer_0 makes it {want[0]} {list(want[1])}"
                if want
                else f"not a KV cache: unexpected tensor {name!r}"
            )
    return layout
