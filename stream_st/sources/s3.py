"""``s3://bucket/key`` sources on any S3-compatible store: signed ranged GETs.

Everything about ranges, retries, resumption and truncation is the HTTP source's; this module
adds the address and the SigV4 signature of each request (configuration: ``stream_st._s3``),
with credentials looked for (and refreshed) off the event loop before a request needs them.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from typing import Unpack

from .._http import HTTPClient, Response
from .._limits import LimitOptions
from .._s3 import S3Config, parse_s3_url
from .http import HttpSource

__all__ = ["S3Source"]


class S3Source(HttpSource):
    """An object in an S3-compatible store. ``config`` defaults to the AWS environment; the other
    options are :class:`~stream_st.HttpSource`'s (``headers``, signed with the rest,
    ``ssl_context``, ``concurrency``, ``part_size``, the limits)."""

    def __init__(
        self,
        url: str,
        *,
        config: S3Config | None = None,
        client: HTTPClient | None = None,
        headers: Mapping[str, str] | None = None,
        ssl_context: ssl.SSLContext | None = None,
        retries: int = 3,
        backoff: float = 0.25,
        concurrency: int = 1,
        part_size: int = 8 << 20,
        **limits: Unpack[LimitOptions],
    ) -> None:
        bucket, key = parse_s3_url(url)
        self.config = config or S3Config.resolve()
        super().__init__(
            self.config.object_url(bucket, key),
            client=client,
            headers=headers,
            ssl_context=ssl_context,
            retries=retries,
            backoff=backoff,
            concurrency=concurrency,
            part_size=part_size,
            name=url,
            **limits,
        )

    async def _get(self, start: int, end: int | None) -> Response | None:
        await self.config.ready(self.clock, self.name)
        return await super()._get(start, end)

    def prepare_headers(self, method: str, url: str, headers: dict[str, str]) -> dict[str, str]:
        return self.config.sign(method, url, headers)
