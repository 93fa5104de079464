"""The structural ID of the weight-inspect tool (``weight-inspect id``), computed as it does.

weight-inspect hashes a canonical JSON text of the file's *artifact*: SHA-256 (hex) of the
compact JSON object ``{"format": "safetensors", "metadata": {...}, "tensors": {...}}`` with

* ``metadata``: every ``__metadata__`` key in byte order, each value written as weight-inspect's
  canonical value text (a string becomes itself in double quotes, with ``"``, ``\\``, newline,
  carriage return and tab escaped by a backslash and other ASCII control characters as
  ``\\u00xx``), that text then a JSON string of its own;
* ``tensors``: every tensor name in byte order, each ``{"name", "dtype" (lower case), "shape",
  "byte_length" (the end minus the start of its ``data_offsets``)}`` in that key order.

A GGUF file's artifact has ``"gguf_version"`` between ``format`` and ``metadata``. Its ID reads
``wi:<format>:<gguf version, 0 for safetensors>:<the hash's first 8 hex digits>``.
weight-inspect refuses a tensor whose ``data_offsets`` are empty (end not above start): such a
file has no ID, and asking for one is a :class:`~stream_st.UsageError` here too.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

from ..core.header import Header
from ..core.shards import is_index
from ..errors import UsageError, redact
from ..transports.options import TransportOptions
from ..transports.registry import SourceLike
from .common import command_clock, headers_of

__all__ = [
    "Identity",
    "WeightInspectId",
    "canonical_artifact",
    "weight_inspect",
    "weight_inspect_id",
]


class WeightInspectId(TypedDict):
    """weight-inspect's identity of a file (:func:`weight_inspect_id`)."""

    id: str
    structural_hash: str
    tensor_count: int
    metadata_count: int


class Identity(WeightInspectId):
    """What :func:`weight_inspect` gives (``stream-st hash --format weight-inspect --json``
    prints it): the file's :class:`WeightInspectId` with its ``source`` (any credentials in it
    redacted) and weight-inspect's ``schema`` and ``format``."""

    source: str
    schema: int
    format: str


def _canonical_string(text: str) -> str:
    """weight-inspect's canonical text of a string value: quoted, its own escapes."""
    out = []
    for c in text:
        if c == '"':
            out.append('\\"')
        elif c == "\\":
            out.append("\\\\")
        elif c == "\n":
            out.append("\\n")
        elif c == "\r":
            out.append("\\r")
        elif c == "\t":
            out.append("\\t")
        elif ord(c) < 0x20 or ord(c) == 0x7F:
            out.append(f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


def canonical_artifact(
    format: str,
    metadata: Mapping[str, str],
    tensors: Iterable[tuple[str, str, Sequence[int], int]],
    *,
    gguf_version: int | None = None,
) -> str:
    """The canonical JSON text weight-inspect hashes, of ``tensors`` given as ``(name, dtype,
    shape, byte_length)`` and string-valued ``metadata``."""
    artifact: dict[str, Any] = {"format": format}
    if gguf_version is not None:
        artifact["gguf_version"] = gguf_version
    artifact["metadata"] = {key: _canonical_string(metadata[key]) for key in sorted(metadata)}
    rows = sorted(tensors, key=lambda row: row[0])
    artifact["tensors"] = {
        name: {"name": name, "dtype": dtype.lower(), "shape": list(shape), "byte_length": size}
        for name, dtype, shape, size in rows
    }
    return json.dumps(artifact, ensure_ascii=False, separators=(",", ":"))


def weight_inspect_id(header: Header) -> WeightInspectId:
    """weight-inspect's identity of the file whose header is ``header``: ``id``
    (``wi:safetensors:0:<8 hex>``), ``structural_hash``, ``tensor_count``, ``metadata_count``."""
    empty = next((t.name for t in header if t.end <= t.start), None)
    if empty is not None:
        raise UsageError(
            f"weight-inspect gives no ID for this file: it refuses the empty tensor {empty!r}"
        )
    text = canonical_artifact(
        "safetensors",
        header.metadata,
        [(t.name, t.dtype, t.shape, t.end - t.start) for t in header],
    )
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return {
        "id": f"wi:safetensors:0:{digest[:8]}",
        "structural_hash": digest,
        "tensor_count": len(header),
        "metadata_count": len(header.metadata),
    }


async def weight_inspect(source: SourceLike, **options: Unpack[TransportOptions]) -> Identity:
    """weight-inspect's identity (:func:`weight_inspect_id`) of one file, from its header alone
    (ranged requests on remote sources), with ``source`` and weight-inspect's ``schema`` and
    ``format``. A sharded checkpoint's index is a :class:`~stream_st.UsageError`: weight-inspect
    identifies one file (name a shard)."""
    if isinstance(source, str | os.PathLike) and is_index(source):
        raise UsageError(
            "weight-inspect identifies one file, not a sharded checkpoint: name a shard"
        )
    (header,) = await headers_of(source, command_clock(options), unknown_dtypes="keep")
    return {
        "source": redact(str(source)),
        "schema": 1,
        "format": "safetensors",
        **weight_inspect_id(header),
    }
