"""Whole-object operations on a directory or an ``s3://`` prefix: list, write, move, remove.

What a job that commits many files at once needs besides streaming them: list the files under
a prefix, write a small object atomically, move a staged file into place, remove what an aborted
job left. A plain path (or ``file://`` URL) uses the file system (a move is a rename); ``s3://``
uses the store's ListObjectsV2, CopyObject and DeleteObject over stream_st's own client and
signing (a move is a server-side copy, then a delete). Other schemes are refused with
:class:`~stream_st.UnsupportedSinkError`. Not public API.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from urllib.parse import quote

import anyio
import anyio.to_thread

from ..core.shards import scheme_of
from ..errors import TransportError, UnsupportedSinkError, UsageError, redact
from .http import HTTPNotFoundError, xml_field
from .options import UNLIMITED, Clock
from .registry import open_sink, path_from_url
from .s3.config import parse_s3_url
from .s3.sink import S3Sink

__all__ = [
    "any_exists",
    "join",
    "list_names",
    "listable",
    "make_directory",
    "move",
    "remove",
    "remove_tree",
    "write_object",
]


def _local(address: str) -> str | None:
    """The file system path ``address`` names; None for an ``s3://`` URL; refuses the rest."""
    scheme = scheme_of(address)
    if scheme == "s3":
        return None
    if scheme in (None, "file"):
        return address if scheme is None else path_from_url(address, UnsupportedSinkError)
    raise UnsupportedSinkError(f"{redact(address)}: a dataset is written to a path or an s3:// URL")


def listable(address: str) -> bool:
    """Whether :func:`list_names` can list ``address`` (a path or ``s3://``; not ``http(s)://``)."""
    return scheme_of(address) in (None, "file", "s3")


def join(directory: str, name: str) -> str:
    """``name`` inside ``directory`` (a path or URL)."""
    return directory.rstrip("/") + "/" + name


class _Bucket(S3Sink):
    """Requests about other objects of the bucket of ``url``, signed as the upload's are."""

    async def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, in the store's order (by name)."""
        found: list[str] = []
        token = ""
        while True:
            query = f"list-type=2&prefix={quote(prefix, safe='')}{token}"
            _, answer = await self._call("GET", query, key="")
            found += [key for key in (xml_field(m, "Key") for m in _contents(answer)) if key]
            following = xml_field(answer, "NextContinuationToken")
            if xml_field(answer, "IsTruncated") != "true" or not following:
                return found
            token = f"&continuation-token={quote(following, safe='')}"

    async def copy(self, source_key: str, key: str) -> None:
        headers = self._headers
        self._headers = {**headers, "x-amz-copy-source": quote(f"/{self.bucket}/{source_key}")}
        try:
            await self._call("PUT", "", key=key)
        finally:
            self._headers = headers

    async def delete(self, key: str) -> None:
        with contextlib.suppress(HTTPNotFoundError):  # already gone
            await self._call("DELETE", "", key=key)

    async def has(self, key: str) -> bool:
        """Whether an object is at ``key`` (a HEAD request)."""
        try:
            await self._call("HEAD", "", key=key)
        except HTTPNotFoundError:
            return False
        return True

    async def __aenter__(self) -> _Bucket:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close_client()


def _contents(answer: bytes) -> list[str]:
    text = answer.decode("utf-8", "replace")
    return [part.split("</Contents>", 1)[0] for part in text.split("<Contents>")[1:]]


async def list_names(directory: str) -> list[str]:
    """The names of the files directly in ``directory``, sorted; none if it does not exist; a
    :class:`~stream_st.UsageError` for a local file."""
    path = _local(directory)
    if path is not None:
        try:
            entries = await anyio.to_thread.run_sync(os.listdir, path)
        except FileNotFoundError:
            return []
        except NotADirectoryError:
            raise UsageError(f"{redact(directory)} is a file, not a directory") from None
        except OSError as exc:
            raise TransportError(f"listing failed: {exc.strerror}", url=directory) from exc
        return sorted(entries)
    prefix = join(directory, "")
    async with _Bucket(prefix + "_") as bucket:  # a key in the prefix, for its bucket
        bucket.name = redact(prefix)  # errors name the prefix listed
        keys = await bucket.keys(bucket.key[:-1])
    base = len(bucket.key) - 1
    return sorted(key[base:] for key in keys if "/" not in key[base:])


async def make_directory(directory: str) -> None:
    """Create ``directory`` and its parents (an object store needs none)."""
    path = _local(directory)
    if path is not None:
        try:
            await anyio.to_thread.run_sync(lambda: os.makedirs(path, exist_ok=True))
        except OSError as exc:
            raise TransportError(f"creating failed: {exc.strerror}", url=directory) from exc


async def write_object(address: str, data: bytes) -> None:
    """``data`` as the object at ``address``, atomically (complete or absent)."""
    _local(address)
    sink = await open_sink(address)
    try:
        await sink.allocate(len(data))
        await sink.send(memoryview(data))
    except BaseException:
        await sink.abort()
        raise
    await sink.aclose()


async def move(source: str, destination: str) -> None:
    """Move the object at ``source`` to ``destination`` (in the same store)."""
    path = _local(source)
    if path is not None:
        target = _local(destination)
        assert target is not None
        try:
            await anyio.to_thread.run_sync(os.replace, path, target)
        except OSError as exc:
            raise TransportError(f"moving into place failed: {exc.strerror}", url=source) from exc
        return
    async with _Bucket(destination) as bucket:
        _, source_key = parse_s3_url(source)
        await bucket.copy(source_key, bucket.key)
        await bucket.delete(source_key)


HEADS_AT_ONCE = 8
"""The most requests :func:`any_exists` has in flight at once."""


def _bucket(address: str, clock: Clock) -> _Bucket:
    """A :class:`_Bucket` for ``address`` whose requests go under ``clock``: its limits, its
    headers and TLS context (as :func:`~stream_st.transports.registry.open_sink` gives a sink)."""
    bucket = _Bucket(address)
    bucket.clock = clock
    bucket.add_transport(clock.transport)
    return bucket


async def any_exists(addresses: Sequence[str], clock: Clock = UNLIMITED) -> bool:
    """Whether a file or an object is at any of ``addresses`` (a dangling symlink is one), asked
    :data:`HEADS_AT_ONCE` at a time; the first found stops the rest. ``clock`` (the operation's)
    bounds an object store's requests: a client per bucket, a HEAD request per object. A request
    that fails stops none of the others (credentials without s3:ListBucket get a 403 for a
    missing key, a 200 for one there): unless one was found, the first failure is raised as it
    is."""
    found = False
    failure: list[Exception] = []
    at_once = anyio.Semaphore(HEADS_AT_ONCE)
    buckets: dict[str, _Bucket] = {}
    async with contextlib.AsyncExitStack() as stack:
        asks: list[Callable[[], Awaitable[bool]]] = []
        for address in addresses:  # every address checked before any request
            path = _local(address)
            if path is not None:
                asks.append(partial(anyio.to_thread.run_sync, os.path.lexists, path))
                continue
            bucket_name, key = parse_s3_url(address)
            if bucket_name not in buckets:
                buckets[bucket_name] = await stack.enter_async_context(_bucket(address, clock))
            asks.append(partial(buckets[bucket_name].has, key))

        async def ask(exists: Callable[[], Awaitable[bool]]) -> None:
            nonlocal found
            try:
                async with at_once:
                    if await exists():
                        found = True
                        group.cancel_scope.cancel()
            except Exception as exc:  # raised once the others are done, not in a group
                failure.append(exc)

        async with anyio.create_task_group() as group:
            for exists in asks:
                group.start_soon(ask, exists)
    if failure and not found:
        raise failure[0]
    return found


async def remove(address: str, clock: Clock = UNLIMITED) -> None:
    """Remove the object at ``address``, if there is one; ``clock`` (the operation's) bounds an
    object store's request."""
    path = _local(address)
    if path is not None:
        try:
            await anyio.to_thread.run_sync(os.remove, path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise TransportError(f"removing failed: {exc.strerror}", url=address) from exc
        return
    async with _bucket(address, clock) as bucket:
        await bucket.delete(bucket.key)


async def remove_tree(directory: str) -> bool:
    """Remove ``directory`` and everything under it, if it exists; whether it is gone (a local
    directory is not when a file appeared in it meanwhile)."""
    path = _local(directory)
    if path is not None:

        def remove() -> bool:
            shutil.rmtree(path, ignore_errors=True)
            return not os.path.lexists(path)

        return await anyio.to_thread.run_sync(remove)
    async with _Bucket(join(directory, "_")) as bucket:
        for key in await bucket.keys(bucket.key[:-1]):
            await bucket.delete(key)
    return True
