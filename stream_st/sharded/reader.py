"""Sharded files read as one stream: a Hugging Face ``model.safetensors.index.json`` or a
``dataset_manifest.json`` (the safetensors-spark dataset layout).

An index maps every tensor to its shard::

    {"metadata": {"total_size": 123},
     "weight_map": {"embed.weight": "model-00001-of-00002.safetensors", ...}}

A manifest lists its shards with their sizes (and sample counts, and a schema)::

    {"format_version": "1.0", "total_samples": 2000, "total_bytes": 8192000,
     "shards": [{"shard_path": "part-00000-0000-<uuid>.safetensors", "samples_count": 1000,
                 "bytes": 4096000}, ...],
     "schema": {"image": {"dtype": "F32", "shape": [1000, 3, 224, 224]}}}

:func:`~stream_st.open_stream` on either (a path, ``file://``, ``http(s)://`` or ``s3://``
address) yields every tensor of every shard, shard after shard (index shards in name order,
manifest shards in its order; tensors in offset order within each). ``include=`` applies across
shards; with an index, a shard holding nothing selected is never opened.
``open_stream(index, concurrency=K)`` (or ``ShardedStream(index, concurrency=K)``) reads each
remote shard through K ranged requests at once and opens the next shard (its header read, its
first K parts requested) while the current one streams, so a remote checkpoint is read neither
one connection nor one round trip per shard at a time; tensors still come in the index's order.
Memory: the tensor being handed out, plus up to K part buffers for the shard being read and K
for the next one. Without it, shards are opened one after the other, each as its source reads.
Each
shard's header must hold exactly the tensors the index assigns to it, or describe exactly the
bytes the manifest gives for it.

An index may come from anywhere. Its shard names must be relative paths that stay next to it
however they are decoded (``stream_st.core.shards``): every name is checked before any shard is
opened or requested. A shard that turns out not to be a safetensors file, or not the one the
index describes, is reported by its address and the kind of problem only, never with values read
from its bytes: the index may name a file the user never meant to show.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Callable
from typing import Any

from .._util import task_group
from ..core.header import DEFAULT_MAX_HEADER_SIZE, Header, UnknownDtypes
from ..core.shards import (
    MANIFEST_NAME,
    address_path,
    holds_safetensors,
    shard_address,
    shard_name,
)
from ..core.strict_json import decode_json
from ..errors import (
    DtypeError,
    HeaderError,
    HeaderTooLargeError,
    SafetensorsError,
    TensorNotFoundError,
    TrailingDataError,
    TransportError,
    TruncatedStreamError,
    UsageError,
    rebuilt,
    redact,
    some_names,
)
from ..memory.delivery import Delivery
from ..reader import Include, TensorStream
from ..reader.stream import ObjectOnly, TensorT, include_names
from ..transports.options import Clock
from ..transports.registry import read_object

__all__ = ["ShardIndex", "ShardedStream", "repeated_name", "shard_address", "shard_headers"]

MAX_INDEX_SIZE = 64 << 20


_PROBLEMS: dict[type[SafetensorsError], str] = {
    HeaderTooLargeError: "its header is larger than max_header_size allows",
    TruncatedStreamError: "it ends before the bytes its header describes",
    TrailingDataError: "bytes follow its last tensor",
    DtypeError: "its header names a dtype that cannot be read",
    HeaderError: "it is not a safetensors file (its header is malformed)",
}
"""What a shard's error says instead of its own message (most specific class first)."""


def _without_contents(exc: SafetensorsError, address: str) -> SafetensorsError:
    """``exc``, raised opening the shard at ``address``, with a message naming only the shard
    and the kind of problem: its own may quote the shard's bytes (a header length, an excerpt),
    and an index may name any file it can reach. The class and attributes are kept."""
    problem = next(
        (text for kind, text in _PROBLEMS.items() if isinstance(exc, kind)),
        f"it cannot be read as a shard ({type(exc).__name__})",
    )
    return rebuilt(exc, f"{redact(address)}: {problem}")  # rebuilt() masks nothing itself


async def _open_shard(stream: TensorStream[Any], address: str, *, read_all: bool = False) -> Header:
    """Open the shard ``stream`` reads (at ``address``); its header, or an error that quotes none
    of its bytes. Failed I/O is reported as is: it names the address and a position only."""
    try:
        return await stream.open(read_all=read_all)
    except TransportError:
        raise
    except SafetensorsError as exc:
        failure = _without_contents(exc, address)
    try:
        raise failure  # outside the handler: the original is not chained for a traceback to show
    finally:
        del failure  # else this frame, in its traceback, holds it: a cycle only gc.collect() frees


async def shard_headers(
    index_address: str | os.PathLike[str],
    clock: Clock,
    *,
    unknown_dtypes: UnknownDtypes = "refuse",
) -> list[Header]:
    """The header of every shard of the index or manifest at ``index_address``, in reading
    order, each checked against what the index says of it; ``clock`` bounds every wait.
    ``unknown_dtypes`` as in :func:`~stream_st.read_header`."""
    address = os.fspath(index_address)
    index = await ShardIndex.read(address, clock)
    headers = []
    for shard in index.shards:
        where = shard_address(index.home, shard)
        stream = TensorStream(where, clock=clock, unknown_dtypes=unknown_dtypes)
        header = await _open_shard(stream, where)
        await stream.aclose()
        index.check(shard, where, header)
        headers.append(header)
    return headers


class ShardIndex:
    """A validated index of shards: a Hugging Face ``*.index.json`` or a ``dataset_manifest.json``.

    ``shards`` lists the shard files in reading order, found next to ``home`` (the address it was
    read at: for ``hf://``, pinned to the commit the index came from). For an index,
    ``weight_map`` maps each tensor to its shard; for a manifest, ``shard_bytes`` gives each
    shard's size and ``manifest`` the whole document (``total_samples``, ``schema``, ...).
    """

    def __init__(self, raw: bytes, name: str, home: str | None = None) -> None:
        self.home = name if home is None else home
        shown = redact(name)  # what messages begin with: an address, masked alone
        if holds_safetensors(raw, len(raw)):  # a length prefix and a JSON object: not an index
            raise UsageError(
                f"{shown} is a safetensors file, not an index of shards: read or copy it as a "
                "file (a remote one named *.index.json or dataset_manifest.json is taken for an "
                "index: read it from a local copy)"
            )
        obj = decode_json(raw, f"{shown}: the index", strict=True)  # a key once, no NaN
        if not isinstance(obj, dict):
            raise HeaderError(f"{shown}: the index must be a JSON object")
        self.weight_map: dict[str, str] | None = None
        self.shard_bytes: dict[str, int] = {}
        self._names: dict[str, set[str]] = {}
        self.manifest: dict[str, Any] = {}
        if address_path(name).endswith(MANIFEST_NAME):
            self._read_manifest(obj, shown)
        else:
            self._read_index(obj, shown)

    @classmethod
    async def read(cls, address: str, clock: Clock) -> ShardIndex:
        """The index or manifest at ``address`` (a path or URL), read whole and validated."""
        raw, home = await read_object(address, clock, limit=MAX_INDEX_SIZE)
        return cls(raw, address, home)

    def _read_index(self, obj: dict[str, Any], shown: str) -> None:
        weight_map = obj.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise HeaderError(f"{shown}: the index needs a 'weight_map' of tensor name -> shard")
        metadata = obj.get("metadata", {})
        self.metadata: dict[str, Any] = metadata if isinstance(metadata, dict) else {}
        self.weight_map = weight_map
        for tensor, shard in weight_map.items():  # one pass: names_in() is a look-up
            self._names.setdefault(shard, set()).add(tensor)
        self.shards = sorted(shard_name(shard, shown) for shard in self._names)

    def _read_manifest(self, obj: dict[str, Any], shown: str) -> None:
        shards = obj.get("shards")
        if not isinstance(shards, list):
            raise HeaderError(f"{shown}: the manifest needs a 'shards' list")
        self.shards = []
        for entry in shards:
            size = entry.get("bytes") if isinstance(entry, dict) else None
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise HeaderError(
                    f"{shown}: each shard needs a 'shard_path' and its size in 'bytes' (an "
                    "integer >= 0)"
                )
            shard = shard_name(entry.get("shard_path"), shown)
            if shard in self.shard_bytes:  # every reader would read its samples twice
                raise HeaderError(f"{shown}: the manifest lists shard {shard!r} twice")
            self.shards.append(shard)
            self.shard_bytes[shard] = size
        self.metadata = {k: v for k, v in obj.items() if k not in ("shards", "schema")}
        self.manifest = obj

    def selector(self, include: Include) -> Callable[[str], bool]:
        """Whether ``include=`` (names, a name, a predicate or None) selects a tensor, by name;
        :class:`~stream_st.TensorNotFoundError` for a name the index does not list."""
        if include is None:
            return lambda name: True
        if callable(include):
            return include
        names = include_names(include)
        if self.weight_map is not None:
            missing = sorted(names - self.weight_map.keys())
            if missing:
                raise TensorNotFoundError(
                    f"include= names tensors not in the index: {some_names(missing)}"
                )
        return names.__contains__

    def names_in(self, shard: str) -> set[str] | None:
        """The tensors an index assigns to ``shard`` (the index's own set: do not modify it);
        None for a manifest (it does not say)."""
        if self.weight_map is None:
            return None
        return self._names.get(shard, set())

    def check(self, shard: str, address: str, header: Header) -> None:
        """:class:`HeaderError` unless ``header`` (of ``shard``, read at ``address``) holds exactly
        the tensors the index assigns it, or describes exactly the bytes the manifest gives it.
        The message quotes only the index: the shard may be a file the user never named."""
        expected = self.names_in(shard)
        if expected is not None and set(header.names()) != expected:
            lacking = sorted(expected.difference(header.names()))
            detail = f"it lacks {lacking[:5]}" if lacking else "it holds tensors not assigned it"
            raise HeaderError(
                f"{redact(address)}: the shard's tensors differ from those the index assigns it "
                f"({detail})"
            )
        size = self.shard_bytes.get(shard)
        if size is not None and size != header.file_size:
            raise HeaderError(
                f"{redact(address)}: the manifest says {size} bytes, the shard's header describes "
                "a different size"
            )


class ShardedStream(TensorStream[TensorT]):
    """Every tensor of every shard of an index; used like any :class:`~stream_st.TensorStream`.

    ``index`` (the :class:`ShardIndex`) is available once open. ``header`` is the header of the
    shard being read; ``headers`` maps each shard reached so far to its header.
    ``concurrency``: ranged requests at once per remote shard, the next shard opened ahead (see
    the module); None takes the operation's (``open_stream(index, concurrency=K)``).
    ``unique_names`` refuses shards that repeat a tensor name (see
    :func:`~stream_st._api.stream_for`). ``max_tensor_bytes`` caps each tensor read,
    ``max_total_bytes`` the tensors of every shard together, each shard checked as it is
    reached, before any of its tensors is allocated (:class:`~stream_st.AllocationError`).
    """

    def __init__(
        self,
        index: str | os.PathLike[str],
        *,
        include: Include = None,
        max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
        verify: bool | ObjectOnly = True,
        clock: Clock | None = None,
        delivery: Delivery | None = None,
        copy: bool = True,
        concurrency: int | None = None,
        unique_names: bool = False,
        max_tensor_bytes: int | None = None,
        max_total_bytes: int | None = None,
    ) -> None:
        super().__init__(
            index,
            include=include,
            max_header_size=max_header_size,
            verify=verify,
            clock=clock,
            delivery=delivery,
            copy=copy,
            max_tensor_bytes=max_tensor_bytes,
            max_total_bytes=max_total_bytes,
        )
        self._counted = 0  # bytes the shards reached so far declare, for max_total_bytes
        self._clock.transport = self._clock.transport.reading(concurrency)
        # The next shard, opened while one streams (or the error opening it raised).
        self._ahead: TensorStream[TensorT] | SafetensorsError | None = None
        self._address = os.fspath(index)
        self._index: ShardIndex | None = None
        self._current: TensorStream[TensorT] | None = None
        self.headers: dict[str, Header] = {}
        self._unique_names = unique_names
        self._shard_of: dict[str, str] = {}  # with unique_names: each name read, its shard

    @property
    def index(self) -> ShardIndex:
        """The index read as the stream opened (its shards, which tensor each holds); a
        :class:`~stream_st.UsageError` before that."""
        if self._index is None:
            raise UsageError("the index is read when the stream opens: use 'async with' first")
        return self._index

    @property
    def header(self) -> Header:
        """The header of the shard being read."""
        if self._current is None or self._current._header is None:
            raise UsageError("a sharded stream has one header per shard: see .headers, .index")
        return self._current._header

    def _opened(self) -> bool:
        return self._index is not None

    async def _open(self, *, read_all: bool) -> Header:
        """Read and validate the index, once (shards are opened as iteration reaches them); the
        header is empty, each shard has its own. :meth:`open` runs it one task at a time."""
        if self._index is None:
            self._clock.start()  # one clock for the index and every shard
            self.stats.begin()
            self._index = await self._load_index()
        return Header.from_tensors((), {}, 0)

    async def _load_index(self) -> ShardIndex:
        """The index, read whole (a cached read reads it through the cache)."""
        return await ShardIndex.read(self._address, self._clock)

    def _shard_stream(self, address: str, **options: Any) -> TensorStream[TensorT]:
        """The stream of one shard (a cached read reads it through the cache)."""
        return TensorStream(address, **options)

    async def _iterate(self) -> AsyncGenerator[tuple[str, TensorT]]:
        self.stats.asked(first=True)
        await self.open()
        index = self.index
        selected = index.selector(self._include)
        if index.weight_map is not None:
            self._delivery.check(list(index.weight_map))
        shards = [
            shard
            for shard in index.shards  # a shard with nothing wanted is never opened
            if (expected := index.names_in(shard)) is None or any(map(selected, expected))
        ]
        ahead = (self._clock.transport.concurrency or 1) > 1
        try:
            for position, shard in enumerate(shards):
                self._check_open(index.home)  # by another task, while the shard before was read
                following = shards[position + 1] if ahead and position + 1 < len(shards) else None
                stream = None
                try:
                    async with task_group() as group:
                        if following is not None:  # its header and first parts: while this starts
                            group.start_soon(self._open_ahead, index, following, selected)
                        stream = self._current = await self._next_stream(index, shard, selected)
                        self._check_open(index.home)  # meanwhile: aclose() found no shard to close
                        self.headers[shard] = stream.header
                        if self._unique_names:
                            self._claim_names(shard, stream.header, selected)
                        wanted = (t for t in stream.header.tensors if selected(t.name))
                        self._counted = self._caps.check(wanted, stream.source.name, self._counted)
                        items = aiter(stream)
                        first = await anext(items, None)
                    if first is not None:
                        self._check_open(index.home)  # closed while the shard ahead opened
                        yield first
                        del first
                    async for item in items:  # closed later, the shard is closed with it
                        yield item
                        del item
                finally:
                    self._current = None
                    if stream is not None:
                        await stream.aclose()
        finally:  # a shard opened ahead that iteration never reached: close it now
            unread, self._ahead = self._ahead, None
            if isinstance(unread, TensorStream):
                await unread.aclose()
        self._check_all_found(index)

    def _claim_names(self, shard: str, header: Header, selected: Callable[[str], bool]) -> None:
        """With ``unique_names``: :class:`UsageError` if a tensor of ``shard`` to be read was
        read from an earlier shard already (a batch-mode dataset repeats its columns in every
        shard), before any of this shard's tensors is: one dict of names cannot hold them."""
        for name in header.names():
            if not selected(name):
                continue
            first = self._shard_of.setdefault(name, shard)
            if first != shard:
                raise repeated_name(self._address, name, first, shard)

    async def _open_checked(
        self, index: ShardIndex, shard: str, selected: Callable[[str], bool]
    ) -> TensorStream[TensorT]:
        """The open stream of ``shard``'s selected tensors, its header checked against the
        index."""
        address = shard_address(index.home, shard)
        stream = self._shard_stream(
            address,
            include=selected,
            max_header_size=self._max_header_size,
            verify=self._verify,
            clock=self._clock,
            copy=self._copy,
            max_tensor_bytes=self._caps.tensor,
        )
        stream.stats = self.stats  # every shard counts into the sharded stream's one object
        header = await _open_shard(stream, address, read_all=self._include is None)
        stream._delivery = self._delivery.only(header.names())
        try:
            index.check(shard, address, header)
        except BaseException:
            await stream.aclose()
            raise
        return stream

    async def _next_stream(
        self, index: ShardIndex, shard: str, selected: Callable[[str], bool]
    ) -> TensorStream[TensorT]:
        """``shard``'s open stream: the one opened ahead (or its failure, raised only now that
        the shards before it have been read), else opened now."""
        ahead, self._ahead = self._ahead, None
        if isinstance(ahead, Exception):
            raise ahead
        return ahead or await self._open_checked(index, shard, selected)

    async def _open_ahead(
        self, index: ShardIndex, shard: str, selected: Callable[[str], bool]
    ) -> None:
        try:
            self._ahead = await self._open_checked(index, shard, selected)
        except SafetensorsError as exc:
            self._ahead = exc

    def _check_all_found(self, index: ShardIndex) -> None:
        """A manifest does not list names up front: check ``include=`` and ``into=`` names at the
        end."""
        if index.weight_map is None:
            self._delivery.check([name for h in self.headers.values() for name in h.names()])
        include = self._include
        if index.weight_map is not None or include is None or callable(include):
            return
        found = {name for header in self.headers.values() for name in header.names()}
        missing = sorted(include - found)
        if missing:
            raise TensorNotFoundError(f"include= names tensors in no shard: {some_names(missing)}")

    async def aclose(self) -> None:
        self._closed = True  # an iteration running in another task opens no further shard
        await self._close_iteration()
        for stream in (self._current, self._ahead):
            if isinstance(stream, TensorStream):
                await stream.aclose()
        self._current = self._ahead = None


def repeated_name(index: str, name: str, first: str, shard: str) -> UsageError:
    """The refusal of a call that returns one dict of names when ``index``'s shards ``first`` and
    ``shard`` both hold tensor ``name`` (a batch-mode dataset repeats its columns in every shard):
    it names the ways to read such a checkpoint."""
    return UsageError(
        f"{redact(index)}: tensor {name!r} is in more than one shard ({first} and {shard}), so "
        "one dict of names cannot hold them all: read it as a stream (async for name, array in "
        "stream_st.open_stream(...)), shard after shard, or, for a dataset, by rows "
        "(stream_st.integrations.dataset.plan_pieces and read_piece, or SafetensorsDataset)"
    )
