"""From an address and a :class:`~.config.Cache` to what to read: the verified local copy, or
the remote object through a :class:`~.tee.TeeSource` that writes the copy.

``http(s)://`` and ``s3://``: under the entry's lock (:class:`~.store.EntryLock`; a second
reader of the same object reads the copy the first is writing as it grows, see :mod:`.follow`,
or waits while the lock's holder checks its copy), the first request of the read is also the
freshness check: it carries ``If-None-Match`` with the
copy's ETag. A ``304 Not Modified`` (or an answer of the same version, from a server that does
not do conditional requests) means the copy is used and the answer is dropped; any other answer
is the first of the read of the new version, which goes into a new copy. A server that cannot
be reached, or fails with a 5xx, leaves the copy in use.

``hf://``: a revision that is a full commit id, with its file in the cache, makes no request at
all. Otherwise one ``HEAD`` to the Hub's resolve URL (the token to the Hub only, as
:class:`~stream_st.HubSource` sends it) tells the commit and the file's ETag (an LFS file's
SHA-256): a blob of that ETag in the cache is used (the snapshot link and the ref made as
``huggingface_hub`` makes them); else the file is read at that commit, from the location the
Hub gave, into the blob, checked against its SHA-256 while it streams; an answer of the Hub
to the read naming another ETag than the ``HEAD`` is a :class:`~stream_st.SourceChangedError`,
nothing kept. A Hub that cannot be reached, or answers the ``HEAD`` with a 5xx or 429, leaves
the copy in use.

Offline (``cache="offline"``, ``HF_HUB_OFFLINE=1``): the copy is used without any request, and
a missing one is a :class:`~.config.CacheMissError`.

While the request that checks a copy is in flight, the copy may be read already (``on_copy`` of
:func:`resolve`): what was read of it is used only if the answer is that copy.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...errors import (
    CacheMissError,
    CacheWarning,
    HTTPStatusError,
    SafetensorsError,
    TransportError,
    redact,
)
from ..base import Source
from ..http.framing import sendable
from ..http.redirect import REDIRECTS, redirected
from ..http.status import ascii_number
from ..http.target import Target
from ..options import Clock, Transport
from ..registry import open_source, read_object, scheme_of
from .config import Cache
from .follow import FollowSource, follow
from .keys import object_key, version_key
from .layout import COMMIT, HubEntry, ObjectEntry, repo_folder
from .store import (
    EntryLock,
    RangeSet,
    Record,
    checked_copy,
    fingerprint,
    partial_ranges,
    remove_quietly,
    touch,
)
from .tee import CopyWriter, Destination, TeeSource

if TYPE_CHECKING:
    from ..hub import HubFile

__all__ = ["CACHED_SCHEMES", "Resolved", "is_cached_address", "read_cached", "resolve"]

CACHED_SCHEMES = frozenset({"http", "https", "s3", "hf"})
"""The addresses a cache applies to; any other source is read as it is."""

MAX_HUB_HOPS = 5

HUB_UNSURE = frozenset({429, *range(500, 600)})
"""The Hub's answers to the ``HEAD`` that leave a cached copy in use (``"stale"``), as where
the Hub cannot be reached: it failed (5xx) or asks to come back later (429), as
``huggingface_hub`` falls back to its cache."""

_ETAG_BYTES = 200
"""The most bytes of an ETag a Hub blob is named by: its longest file name, the temporary
``.<etag>.part.json.<pid>.tmp``, stays within the 255 bytes file systems allow."""


@dataclass
class Resolved:
    """What to read: ``target`` (a local path, a source, or the address itself) and how the
    cache served it, ``state``: ``"hit"`` (the copy, checked fresh), ``"offline"`` (the copy,
    no request), ``"stale"`` (the copy; the server could not say), ``"fetch"`` (the object,
    kept while read), ``"shared"`` (the copy another process is writing, read as it grows) or
    ``"uncached"`` (the object, as without a cache); :attr:`served` tells it as it stands."""

    target: str | Source
    state: str
    home: str | None = None  # where its neighbours are, when not at the address (hf://, pinned)
    files: tuple[Path, ...] = ()  # the copy's, where ``target`` is a copy that may be wrong

    @property
    def served(self) -> str:
        """``state`` as it stands now: a ``"shared"`` copy whose writer stopped first (the rest
        read from the server by the follower itself, nothing kept) is ``"uncached"`` from then
        on."""
        if isinstance(self.target, FollowSource) and self.target.by_itself:
            return "uncached"
        return self.state

    async def refuted(self) -> None:
        """Bytes read from ``target`` failed the file's own digests (a tensor's): the cache
        keeps nothing of them, so the next read fetches the object again (a copy checked
        against the origin's own digest, a Hub blob's SHA-256, is the origin's and stays)."""
        if isinstance(self.target, TeeSource):
            await self.target.writer.refuted()
        else:
            remove_quietly(*self.files)


OnCopy = Callable[[str], None]
"""Told the path of a local copy that a request is about to check (see :func:`resolve`)."""


async def resolve(
    address: str, cache: Cache, clock: Clock, *, read_all: bool, on_copy: OnCopy | None = None
) -> Resolved:
    """What to read for ``address`` under ``cache`` (see the module); ``read_all`` as for
    :meth:`~stream_st.transports.base.Source.start`. ``on_copy``, when given, is called with
    the path of the local copy just before the request that checks it goes out (at most once;
    never when no request is made): the caller may start reading the copy, and must use what it
    read only if the answer is that copy (``target`` is that path), and drop it otherwise."""
    scheme = scheme_of(address)
    try:
        if scheme == "hf":
            return await _hub(address, cache, clock, read_all, on_copy)
        if scheme in CACHED_SCHEMES:
            return await _object(address, cache, clock, read_all, on_copy)
    except OSError as exc:
        if isinstance(exc, SafetensorsError):  # the read's own failure (TransportError)
            raise
        # masked: a Hub file's snapshot link is named by its path, signed values and all
        problem = redact(f"{exc.strerror or exc}: {exc.filename}")
        warnings.warn(  # a cache folder that is a file, read-only, replaced...
            f"the cache cannot be used ({problem}): reading without it",
            CacheWarning,
            stacklevel=2,
        )
    return Resolved(address, "uncached")


async def read_cached(address: str, cache: Cache, clock: Clock, *, limit: int) -> tuple[bytes, str]:
    """The whole of a small object (an index) through the cache, at most ``limit`` bytes, and
    the address to find its neighbours (the shards) from: as
    :func:`~stream_st.transports.registry.read_object`, never the copy's path."""
    resolved = await resolve(address, cache, clock, read_all=True)
    target = resolved.target
    raw, home = await read_object(target, clock, limit=limit)
    if target != address:  # the copy, or a source keeping one: the shards are by the address
        pinned = target.home if isinstance(target, Source) else resolved.home
        home = pinned or address
    return raw, home


# -- http(s):// and s3://


def _validators(source: Source) -> tuple[str, str]:
    """The ETag and Last-Modified the source's first answer had (``HttpSource.validators``);
    one no request header can carry (a NUL in it) is none: the record keeps what
    ``If-None-Match`` can send back."""
    validators = getattr(source, "validators", None)  # an HttpSource's (S3 and Hub included)
    if isinstance(validators, tuple) and len(validators) == 2:
        etag, modified = (str(value) if sendable(str(value)) else "" for value in validators)
        return etag, modified
    return "", ""


async def _committed(entry: ObjectEntry) -> tuple[ObjectEntry, Record] | None:
    """The entry's complete copy, checked (see :func:`~.store.checked_copy`); None if none."""
    for version in list(entry.versions()):
        found = entry.at(version)
        record = Record.load(found.record)
        if await checked_copy(found.data, record, found.record):
            assert record is not None
            return found, record
    return None


def _fresh(record: Record, etag: str, modified: str, size: int | None) -> bool:
    """Whether an answer of this version is the recorded copy's (a version with no validator
    is never known to be the same)."""
    if not (etag or modified) or record.size != size:
        return False
    return (record.etag, record.last_modified) == (etag, modified)


async def _object(
    address: str, cache: Cache, clock: Clock, read_all: bool, on_copy: OnCopy | None
) -> Resolved:
    inner = await open_source(address, clock)
    url = getattr(inner, "url", address)
    key = object_key(url if isinstance(url, str) else address)
    shown = object_key(address).shown
    entry = ObjectEntry.of(cache, key.key)
    lock = EntryLock(entry.lock)
    handed = False
    try:
        if cache.offline:
            found = await _committed(entry)
            if found is None:
                raise CacheMissError(
                    f"{shown} is not in the cache, and the cache is offline", url=shown
                )
            touch(found[0].record)
            return _copy(found[0], "offline")
        follower: FollowSource | None = None

        async def followed() -> bool:  # the copy another reader is writing, read as it grows
            nonlocal follower
            follower = await follow(entry, inner, lock, shown)
            return follower is not None

        if not await lock.acquire(clock, inner.name, functools.partial(_files, entry), followed):
            if follower is None:
                return Resolved(address, "uncached")  # its writer made no progress for a while
            handed = True
            return Resolved(follower, "shared")
        entry.clean()
        found = await _committed(entry)
        if found is not None and found[1].etag:
            inner.add_transport(Transport((("If-None-Match", found[1].etag),)))
        partial = entry.partials()
        if found is not None and on_copy is not None:
            on_copy(str(found[0].data))
        try:
            await inner.start(read_all=read_all and next(partial, None) is None)
        except HTTPStatusError as exc:
            if found is None or not (exc.status == 304 or exc.status >= 500):
                raise
            touch(found[0].record)
            return _copy(found[0], "hit" if exc.status == 304 else "stale")
        except TransportError:
            if found is None:
                raise
            touch(found[0].record)
            return _copy(found[0], "stale")
        etag, modified = _validators(inner)
        if found is not None and _fresh(found[1], etag, modified, inner.size):
            touch(found[0].record)
            return _copy(found[0], "hit")
        version = entry.at(version_key(etag, modified, inner.size))
        strong = bool(modified) or (bool(etag) and not etag.startswith("W/"))
        resumable = inner.random_access and inner.size is not None and strong
        held = RangeSet()
        if resumable:
            held = partial_ranges(
                version.part, version.part_record, inner.size, etag=etag, last_modified=modified
            )
        record = Record(shown, -1 if inner.size is None else inner.size, "xxh3-128", "")
        record.etag, record.last_modified = etag, modified
        destination = Destination(
            part=version.part,
            part_record=version.part_record if resumable else None,
            record=record,
            commit=version.commit,
            kept=(version.data, version.record),
            on_committed=_pruner(cache, version.data),
            held=held,
            growing=entry.growing,
            version=version.version,
            reserve=read_all,
        )
        # the transport's digest of the whole object (an S3 checksum): the copy is checked
        # against it once complete, whatever reads made it up
        check = await inner.object_digest()
        writer = CopyWriter(destination, lock, inner.name, check)
        handed = True
        return Resolved(TeeSource(inner, writer), "fetch")
    finally:
        if not handed:
            lock.release()
            await inner.aclose()


def _copy(entry: ObjectEntry, state: str) -> Resolved:
    """The copy of ``entry`` to read."""
    return Resolved(str(entry.data), state, files=(entry.data, entry.record))


def _pruner(cache: Cache, keep: Path) -> Callable[[], None] | None:
    """What to run once a copy is committed: evict to the cap, ``keep`` aside."""
    if cache.max_size is None:
        return None
    from .manage import prune

    cap = cache.max_size

    def evict() -> None:
        prune(cache, cap, keep=(keep,))

    return evict


# -- hf://


def _etag(text: str) -> str | None:
    """``text``, an ETag as the Hugging Face cache names blobs (``hub.hub_etag``), when
    usable as a file name; None when empty or not (a ``/``, a leading ``.``, a NUL or other
    character that is not printable, more bytes than the blob's longest file name leaves room
    for, an ending ``.part``: its record would be named as another's partial copy's, see
    :mod:`.layout`)."""
    if not text or "/" in text or text.startswith(".") or not text.isprintable():
        return None
    if text.endswith(".part"):
        return None
    return text if len(text.encode()) <= _ETAG_BYTES else None


def _hub_algorithm(etag: str) -> tuple[str, str | None]:
    """How a Hub blob named ``etag`` is checked: an LFS file's SHA-256, a git blob id (SHA-1),
    or (any other name) only by the digest stream_st takes."""
    lowered = etag.lower()
    if len(lowered) == 64 and all(c in "0123456789abcdef" for c in lowered):
        return "sha256", lowered
    if COMMIT.fullmatch(lowered):
        return "git-sha1", lowered
    return "xxh3-128", None


def _hub_extra(file: HubFile, commit: str) -> dict[str, str]:
    """What a record of a Hub blob adds: which file of which repository, at what commit
    (``cache ls`` shows it, ``cache rm 'hf://org/model@*'`` finds it by it)."""
    return {
        "repo_type": file.repo_type,
        "repo_id": file.repo_id,
        "path": file.path,
        "commit": commit,
    }


async def _hub_blob(entry: HubEntry, etag: str, file: HubFile, commit: str) -> bool:
    """Whether the blob ``etag`` (of ``file`` at ``commit``) is in the cache and checks out; a
    blob that was put there by another program is hashed once against its name, and recorded
    as that file's."""
    blob = entry.blob(etag)
    record_path = entry.record(etag)
    record = Record.load(record_path)
    if record is None:
        algorithm, expected = _hub_algorithm(etag)
        try:
            size = blob.stat().st_size
        except OSError:
            return False
        record = Record(file.address(commit), size, algorithm, expected or "", etag=etag)
        record.extra = _hub_extra(file, commit)
        if expected is None:  # nothing to check it against: taken as it is
            return True
        record.fingerprint = [-1]
        with contextlib.suppress(OSError):
            record_path.parent.mkdir(parents=True, exist_ok=True)
    return await checked_copy(blob, record, record_path)


async def _hub_local(entry: HubEntry, file: HubFile, commit: str) -> str | None:
    """The name of the blob this file's snapshot at ``commit`` links to, when that blob is in
    the cache and checks out. The blob is what is read, never the link: a link re-pointed
    elsewhere (to a file of the blob's name) only names the blob."""
    etag = entry.blob_of(commit)
    if etag is None or _etag(etag) != etag:
        return None
    if await _hub_blob(entry, etag, file, commit):
        touch(entry.record(etag))
        return etag
    remove_quietly(entry.pointer(commit))
    return None


@dataclass
class _HubAnswer:
    commit: str | None
    etag: str | None
    size: int | None
    location: str | None


async def _hub_head(url: str, clock: Clock) -> _HubAnswer | int:
    """One ``HEAD`` of the Hub's resolve URL ``url`` (following redirects within the Hub: a
    renamed repository); the status of an error answer (or of the last of too many
    redirects) instead of an answer."""
    from ..hub import HubClient, hub_endpoint, hub_etag, hub_token

    client = HubClient(hub_endpoint(), hub_token())
    transport = clock.transport
    try:
        status = 0
        for _ in range(MAX_HUB_HOPS + 1):
            response = await client.request(
                "HEAD",
                url,
                dict(transport.headers),
                clock=clock,
                ssl_context=transport.ssl_context,
            )
            async with response:
                status, headers = response.status, dict(response.headers)
            location = headers.get("location")
            if status in REDIRECTS and location:
                location = redirected(Target.parse(url), location, {})[0].url
                if client.on_hub(location):
                    url = location
                    continue
            if status >= 400:
                return status
            etag = _etag(hub_etag(headers))
            size_text = headers.get("x-linked-size") or (
                headers.get("content-length") if status < 300 else None
            )
            size = ascii_number(size_text) if size_text else None
            commit = headers.get("x-repo-commit")
            commit = commit if commit and COMMIT.fullmatch(commit) else None
            far = location if status in REDIRECTS and location else None
            return _HubAnswer(commit, etag, size, far)
        return status
    finally:
        await client.aclose()


async def _hub(
    address: str, cache: Cache, clock: Clock, read_all: bool, on_copy: OnCopy | None
) -> Resolved:
    from ..hub import HubFile, HubSource, hub_endpoint

    file = HubFile.parse(address)
    entry = HubEntry(cache.hub_directory, repo_folder(file.repo_type, file.repo_id), file.path)
    known = entry.commit_of(file.revision)
    held_etag = None if known is None else await _hub_local(entry, file, known)
    local = None if held_etag is None else entry.blob(held_etag)
    if local is not None and (cache.offline or COMMIT.fullmatch(file.revision)):
        assert known is not None and held_etag is not None
        state = "offline" if cache.offline else "hit"
        files = _blob_files(entry, known, held_etag)
        return Resolved(str(local), state, file.address(known), files)
    if cache.offline:
        raise CacheMissError(
            f"{redact(address)} is not in the cache (HF_HUB_OFFLINE or cache='offline')",
            url=address,
        )
    if local is not None and on_copy is not None:
        on_copy(str(local))
    answer: _HubAnswer | int | None
    try:
        answer = await _hub_head(file.resolve_url(hub_endpoint()), clock)
    except TransportError as exc:
        if local is None or isinstance(exc, HTTPStatusError):
            exc.report_as(address)  # the address given, as a read without the cache names it
            raise
        answer = None  # the Hub cannot be reached
    unsure = answer is None or (isinstance(answer, int) and answer in HUB_UNSURE)
    if local is not None and unsure:
        assert known is not None and held_etag is not None
        files = _blob_files(entry, known, held_etag)
        return Resolved(str(local), "stale", file.address(known), files)
    if not isinstance(answer, _HubAnswer) or answer.commit is None or answer.etag is None:
        return Resolved(address, "uncached")  # the read reports what the Hub said
    commit, etag = answer.commit, answer.etag
    lock = EntryLock(entry.lock(etag))
    if not await lock.acquire(clock, address, functools.partial(_growth, entry.part(etag))):
        return Resolved(address, "uncached")  # its writer made no progress for a while
    handed = False
    inner: Source | None = None
    try:
        if await _hub_blob(entry, etag, file, commit):
            entry.link(commit, etag, file.revision)
            touch(entry.record(etag))
            files = _blob_files(entry, commit, etag)
            return Resolved(str(entry.blob(etag)), "hit", file.address(commit), files)
        inner = await open_source(file.address(commit), clock)
        if isinstance(inner, HubSource):  # its answers held to the HEAD's (else SourceChanged)
            inner.commit, inner.etag = commit, etag
            if answer.location is not None:  # the Hub's redirect: straight there
                inner.url = answer.location
        held = partial_ranges(entry.part(etag), entry.part_record(etag), answer.size)
        await inner.start(read_all=read_all and not held.ranges)
        algorithm, expected = _hub_algorithm(etag)
        size = inner.size
        shown = file.address(commit)
        record = Record(shown, -1 if size is None else size, algorithm, "", etag=etag)
        record.extra = _hub_extra(file, commit)
        resumable = inner.random_access and size is not None
        destination = Destination(
            part=entry.part(etag),
            part_record=entry.part_record(etag) if resumable else None,
            record=record,
            commit=functools.partial(_commit_blob, entry, etag),
            expected=expected,
            kept=_blob_files(entry, commit, etag),
            on_committed=_pruner(cache, entry.blob(etag)),
            held=held if resumable else RangeSet(),
            reserve=read_all,
            link=functools.partial(entry.link, commit, etag, file.revision),
        )
        writer = CopyWriter(destination, lock, address, None)
        handed = True
        return Resolved(TeeSource(inner, writer), "fetch")
    finally:
        if not handed:
            lock.release()
            if inner is not None:
                await inner.aclose()


def _blob_files(entry: HubEntry, commit: str, etag: str | None = None) -> tuple[Path, ...]:
    """The files of the blob of ``commit`` (named ``etag``, else as its snapshot links to it)
    that go if it is found wrong: none where its name is the Hub's digest of it (checked when
    written, so the Hub's own bytes)."""
    etag = etag or entry.blob_of(commit)
    if etag is None or _hub_algorithm(etag)[1] is not None:
        return ()
    return entry.blob(etag), entry.record(etag), entry.pointer(commit)


def _files(entry: ObjectEntry) -> list[tuple[str, int, int]]:
    """How far the copy being written into ``entry`` has come (its files' names, sizes and
    times of change): for an object of unknown size, no ``.growing`` file tells."""
    try:
        with os.scandir(entry.folder) as found:
            stats = [(each.name, each.stat()) for each in found]
    except OSError:  # the folder, or a file in it, removed meanwhile
        return []
    return sorted((name, info.st_size, info.st_mtime_ns) for name, info in stats)


def _growth(part: Path) -> tuple[int, int] | None:
    """How far the blob being written at ``part`` has come (its size and time of change)."""
    try:
        info = part.stat()
    except OSError:
        return None
    return info.st_size, info.st_mtime_ns


def _commit_blob(entry: HubEntry, etag: str, part: Path, record: Record) -> None:
    """Move the finished blob into place and record it (its snapshot link and ref are made
    next: ``Destination.link``)."""
    blob = entry.blob(etag)
    blob.parent.mkdir(parents=True, exist_ok=True)
    os.replace(part, blob)
    record.fingerprint = fingerprint(blob)
    record.save(entry.record(etag))


def is_cached_address(source: object) -> bool:
    """Whether ``source`` is an address a cache applies to."""
    return isinstance(source, str) and scheme_of(source) in CACHED_SCHEMES
