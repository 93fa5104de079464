"""``stream-st inspect``: what a file or checkpoint holds, from its headers alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Unpack

from ..core.header import Header
from ..errors import redact
from ..transports.options import TransportOptions
from ..transports.registry import SourceLike
from .common import command_clock, headers_of, result_repr, shard_metadata, tensors_of

__all__ = ["Inspection", "inspect"]


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

    def __repr__(self) -> str:
        """A bounded summary: the counts, and the first tensors and metadata."""
        return result_repr(self)

    def to_json(self) -> dict[str, Any]:
        """The result as JSON-ready values (every field): what ``stream-st inspect --json``
        prints."""
        return asdict(self)


async def inspect(source: SourceLike, **options: Unpack[TransportOptions]) -> Inspection:
    """Read only the header (ranged requests on remote sources) and describe it."""
    headers = await headers_of(source, command_clock(options), unknown_dtypes="keep")
    return described(source, headers)


def described(source: SourceLike, headers: Sequence[Header]) -> Inspection:
    """The :class:`Inspection` of ``source``, whose shards' ``headers`` (one for a file) were
    read already."""
    tensors = tensors_of(headers)
    return Inspection(
        source=redact(str(source)),
        tensors=[
            {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.nbytes}
            for t in tensors
        ],
        tensor_count=len(tensors),
        parameter_count=sum(t.nelements for t in tensors),
        data_bytes=sum(h.data_size for h in headers),
        header_bytes=sum(h.header_size for h in headers),
        metadata=shard_metadata(headers),
        shards=len(headers),
    )
