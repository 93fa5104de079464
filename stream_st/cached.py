"""A :class:`~stream_st.TensorStream` whose remote object is served through the cache
(``open_stream(url, cache=...)``): :class:`CachedStream`.

When the stream opens, the cache decides (:func:`~stream_st.transports.cache.resolve.resolve`)
whether the verified local copy is read, as any local file is (mapped with ``copy=False``, read
ahead by worker threads), or the remote object, through a source that also writes the copy.
"""

from __future__ import annotations

from typing import Any

from .core.header import Header
from .reader import TensorStream
from .transports.cache import Cache

__all__ = ["CachedStream"]


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
    from .transports.cache.resolve import is_cached_address

    settings = Cache.of(cache)
    if settings is None or not is_cached_address(source):
        return None
    assert isinstance(source, str)
    return CachedStream(source, cache=settings, **options)
