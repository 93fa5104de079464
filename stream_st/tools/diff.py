"""``stream-st diff``: what differs between two files or checkpoints, header and data."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar, Unpack

from .._util import task_group
from ..core.header import Header, TensorInfo, UnknownDtypes
from ..reader import TensorStream
from ..transports.options import TransportOptions
from ..transports.registry import SourceLike
from .common import (
    Progress,
    checked_progress,
    command_clock,
    expect_totals,
    naming,
    opened,
    result_repr,
    shard_labels,
    tensors_of,
    varied_metadata,
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
        """True when no tensor or metadata key was added, removed or changed, and no content
        compared differs."""
        return not (
            self.added
            or self.removed
            or self.changed
            or self.metadata_added
            or self.metadata_removed
            or self.metadata_changed
            or self.content_differs
        )

    def __repr__(self) -> str:
        """A bounded summary: whether equal, then the first differences of each kind."""
        return result_repr(self, equal=self.equal)

    def to_json(self) -> dict[str, Any]:
        """The result as JSON-ready values (every field, and ``equal``): what ``stream-st diff
        --json`` prints."""
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
    the bytes of tensors the two have in common, both streamed at once (each side holding about
    one tensor at a time, plus its read-ahead).

    A name a dataset repeats in every shard (``dataset_manifest.json``) is compared shard by
    shard: each of its tensors is reported as ``name (shard N)``, N counted from 0 in the
    manifest's order, so that a shard more or less, or one whose tensor differs, is a
    difference. A name each side holds once (a file, a sharded checkpoint) is compared by name
    alone, whichever shard holds it. So is a metadata key, unless its value differs between the
    shards of either side: then each shard's value is compared, as ``key (shard N)`` (see
    :func:`~stream_st.tools.common.shard_labels` for a key spelled so already).
    (``content`` reads the sources as
    :func:`~stream_st.tools.common.opened` does, which refuses, with a
    :class:`~stream_st.UsageError`, a dataset whose shards repeat a name: the bytes compared
    are those of names held once, by name.)"""
    progress = checked_progress(progress)
    clock = command_clock(options)
    compared: set[str] = set()  # filled once both headers are known, before any data is read
    # the headers alone take a dtype stream_st cannot read (I4), as inspect does
    unknown: UnknownDtypes = "refuse" if content else "keep"

    def side(source: SourceLike) -> AbstractAsyncContextManager[tuple[TensorStream, list[Header]]]:
        return opened(source, clock, include=compared.__contains__, unknown_dtypes=unknown)

    async with side(a) as (stream_a, headers_a), side(b) as (stream_b, headers_b):
        result, common = _compare(headers_a, headers_b)
        if content:
            compared.update(name for name, _ in common)
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
            result.content_differs = [  # names held once: a repeated one was refused
                _label(key) for key in common if digests[0][key[0]] != digests[1][key[0]]
            ]
    return result


Key = tuple[str, int]
"""A tensor or metadata key as compared: its name, and for a name repeated across shards (a
metadata key whose value differs between shards) the shard holding it (-1 for a name each side
holds once, or a key of one value)."""
_V = TypeVar("_V")


def _label(key: Key) -> str:
    """The tensor or metadata key ``key`` names, as the report gives it: ``name``, or
    ``name (shard N)``."""
    name, shard = key
    return name if shard < 0 else f"{name} (shard {shard})"


def _keyed(headers_a: Sequence[Header], headers_b: Sequence[Header]) -> list[dict[Key, TensorInfo]]:
    """The tensors of each side's headers by :data:`Key`: a name either side repeats (a
    dataset's columns, one per shard) keyed by its shard, any other by its name alone."""
    repeated: set[str] = set()
    for headers in (headers_a, headers_b):
        seen: set[str] = set()
        for header in headers:
            for info in header:
                if info.name in seen:
                    repeated.add(info.name)
                seen.add(info.name)
    return _by_shard((headers_a, headers_b), repeated, lambda h: ((i.name, i) for i in h))


def _metadata_keyed(
    headers_a: Sequence[Header], headers_b: Sequence[Header]
) -> list[dict[Key, str]]:
    """The ``__metadata__`` of each side's headers by :data:`Key`: a key whose value differs
    between the shards of either side keyed by the shard holding each value, any other (its
    value the same in every shard holding it) by the key alone."""
    varied = varied_metadata(headers_a) | varied_metadata(headers_b)
    return _by_shard((headers_a, headers_b), varied, lambda h: h.metadata.items())


def _by_shard(
    sides: Iterable[Sequence[Header]],
    split: set[str],
    items: Callable[[Header], Iterable[tuple[str, _V]]],
) -> list[dict[Key, _V]]:
    """For each side, the ``items`` (name, value) of its headers by :data:`Key`: a name in
    ``split`` with the shard holding it, any other with -1."""
    return [
        {
            (name, shard if name in split else -1): value
            for shard, header in enumerate(headers)
            for name, value in items(header)
        }
        for headers in sides
    ]


def _compare(headers_a: Sequence[Header], headers_b: Sequence[Header]) -> tuple[Diff, list[Key]]:
    """What differs between two files' headers, tensors (names, dtypes, shapes, byte lengths)
    and metadata; and the keys of the tensors both hold alike, whose bytes may be compared."""
    tensors_a, tensors_b = _keyed(headers_a, headers_b)
    result = Diff(
        added=[_label(k) for k in sorted(tensors_b.keys() - tensors_a.keys())],
        removed=[_label(k) for k in sorted(tensors_a.keys() - tensors_b.keys())],
    )
    same: list[Key] = []
    for key in sorted(tensors_a.keys() & tensors_b.keys()):
        ta, tb = tensors_a[key], tensors_b[key]
        changes = {
            what: [va, vb]
            for what, va, vb in (
                ("dtype", ta.dtype, tb.dtype),
                ("shape", list(ta.shape), list(tb.shape)),
                ("byte_length", ta.nbytes, tb.nbytes),
            )
            if va != vb
        }
        if changes:
            result.changed[_label(key)] = changes
        else:
            same.append(key)
    meta_a, meta_b = _metadata_keyed(headers_a, headers_b)
    label = shard_labels(sorted(meta_a.keys() | meta_b.keys()))  # one for both sides
    added, removed = sorted(meta_b.keys() - meta_a.keys()), sorted(meta_a.keys() - meta_b.keys())
    result.metadata_added = [label[k] for k in added]
    result.metadata_removed = [label[k] for k in removed]
    result.metadata_values = {
        **{label[k]: meta_a[k] for k in removed},
        **{label[k]: meta_b[k] for k in added},
    }
    result.metadata_changed = {
        label[k]: [meta_a[k], meta_b[k]]
        for k in sorted(meta_a.keys() & meta_b.keys())
        if meta_a[k] != meta_b[k]
    }
    return result, same
