"""``stream-st diff``: what differs between two files or checkpoints, header and data."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Unpack

from .._util import task_group
from ..core.header import Header
from ..reader import TensorStream
from ..transports.options import TransportOptions
from ..transports.registry import SourceLike
from .common import (
    Progress,
    command_clock,
    expect_totals,
    merged_metadata,
    naming,
    opened,
    tensors_of,
)
from .hash import digest_stream

__all__ = ["Diff", "diff"]


@dataclass
class Diff:
    """Differences between two files; ``equal`` when there are none."""

    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: dict[str, dict[str, Any]] = field(default_factory=dict)
    metadata_added: list[str] = field(default_factory=list)
    metadata_removed: list[str] = field(default_factory=list)
    metadata_changed: dict[str, list[str]] = field(default_factory=dict)
    metadata_values: dict[str, str] = field(default_factory=dict)
    """The values of the keys added (B's) and removed (A's)."""
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
    clock = command_clock(options)
    compared: set[str] = set()  # filled once both headers are known, before any data is read
    async with (
        opened(a, clock, include=compared.__contains__) as (stream_a, headers_a),
        opened(b, clock, include=compared.__contains__) as (stream_b, headers_b),
    ):
        result, common = _compare(headers_a, headers_b)
        if content:
            compared.update(common)
            expect_totals(
                progress, [t for t in tensors_of([*headers_a, *headers_b]) if t.name in compared]
            )
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
                with naming((a, b)[side]):
                    digests[side] = await digest_stream(stream, report(side))

            async with task_group() as group:
                group.start_soon(run, 0, stream_a)
                group.start_soon(run, 1, stream_b)
            result.content_compared = True
            result.content_differs = [n for n in common if digests[0][n] != digests[1][n]]
    return result


def _compare(headers_a: Sequence[Header], headers_b: Sequence[Header]) -> tuple[Diff, list[str]]:
    """What differs between two files' headers, tensors (names, dtypes, shapes, byte lengths)
    and metadata; and the names of the tensors both hold alike, whose bytes may be compared."""
    tensors_a = {t.name: t for t in tensors_of(headers_a)}
    tensors_b = {t.name: t for t in tensors_of(headers_b)}
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
    meta_a, meta_b = merged_metadata(headers_a), merged_metadata(headers_b)
    result.metadata_added = sorted(meta_b.keys() - meta_a.keys())
    result.metadata_removed = sorted(meta_a.keys() - meta_b.keys())
    result.metadata_values = {
        **{k: meta_a[k] for k in result.metadata_removed},
        **{k: meta_b[k] for k in result.metadata_added},
    }
    result.metadata_changed = {
        k: [meta_a[k], meta_b[k]]
        for k in sorted(meta_a.keys() & meta_b.keys())
        if meta_a[k] != meta_b[k]
    }
    same = [n for n in sorted(tensors_a.keys() & tensors_b.keys()) if n not in result.changed]
    return result, same
