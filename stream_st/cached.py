"""A :class:`~stream_st.TensorStream` whose remote object is served through the cache
(``open_stream(url, cache=...)``): :class:`CachedStream`.

When the stream opens, the cache decides (:func:`~stream_st.transports.cache.resolve.resolve`)
whether the verified local copy is read, as any local file is (mapped with ``copy=False``, read
ahead by worker threads), or the remote object, through a source that also writes the copy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from .core.header import Header
from .reader import TensorStream
from .transports.cache import Cache

__all__ = ["CachedStream", "cached_stream", "current_cache", "using_cache", "with_cache"]

T = TypeVar("T")


class CachedStream(TensorStream):
    """:class:`~stream_st.TensorStream` over ``address`` (an ``http(s)://``, ``s3://`` or
    ``hf://`` address) and ``cache``. After it opens, ``cache_state`` says how the cache served
    it: ``"hit"`` (the local copy, checked fresh), ``"offline"`` (the copy, no request),
    ``"stale"`` (the copy; the server could not be asked), ``"fetch"`` (the remote object,
    kept while read) or ``"uncached"``."""

    def __init__(self, address: str, *, cache: Cache, **options: Any) -> None:
        super().__init__(address, **options)
        self._address = address
        self._cache = cache
        self.cache_state: str | None = None

    async def open(self, *, read_all: bool = False) -> Header:
        if self.cache_state is None and self._header is None and not self._closed:
            from .transports.cache.resolve import resolve

            self._clock.start()
            resolved = await resolve(self._address, self._cache, self._clock, read_all=read_all)
            self._source_like = resolved.target
            self.cache_state = resolved.state
        return await super().open(read_all=read_all)


def cached_stream(source: object, cache: object, **options: Any) -> CachedStream | None:
    """A :class:`CachedStream` over ``source`` when ``cache`` (any ``cache=`` value, see
    :meth:`~stream_st.Cache.of`) names a cache and ``source`` is an address it applies to;
    None otherwise (the source is read as it is)."""
    settings = Cache.of(cache) if cache is not None else current_cache()
    if settings is None:
        return None
    from .transports.cache.resolve import is_cached_address

    if not is_cached_address(source):
        return None
    assert isinstance(source, str)
    return CachedStream(source, cache=settings, **options)


_AMBIENT: ContextVar[Cache | None] = ContextVar("stream_st_cache", default=None)


def current_cache() -> Cache | None:
    """The cache set by :func:`using_cache` for the reads in this context, if any."""
    return _AMBIENT.get()


@contextmanager
def using_cache(cache: object) -> Iterator[Cache | None]:
    """Every read in the ``with`` block (in this task and those it starts) that is given no
    ``cache=`` of its own uses ``cache`` (any ``cache=`` value; None or False: none): how the
    command's ``--cache`` reaches its subcommands, and the drop-in functions their reads."""
    settings = Cache.of(cache)
    token = _AMBIENT.set(settings)
    try:
        yield settings
    finally:
        _AMBIENT.reset(token)


async def with_cache(cache: object, function: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``await function(*args)`` under :func:`using_cache` (for calls run on another loop)."""
    with using_cache(cache):
        return await function(*args)
