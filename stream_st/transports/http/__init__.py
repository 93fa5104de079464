"""A small HTTP/1.1 client built for throughput: bodies are received straight into the caller's
buffers (``recv_into`` on plain sockets), so a tensor's bytes are copied once, by the kernel.

It does what the transports need and no more: keep-alive connections, ``Content-Length`` and
chunked bodies, chunked uploads, redirects for GET, timeouts, and TLS (through anyio's TLS stream,
which copies: decryption costs more than the copy). Not public API.

One concern per module:

* ``target``: addresses (an ``http(s)://`` URL split for a request);
* ``wire``: connections, plain or TLS, and the bytes on them;
* ``framing``: request and response heads, bodies, uploads;
* ``redirect``: which redirects are followed and which headers (credentials) follow them;
* ``status``: what an answer means (one-line errors, lost answers, Retry-After, encodings);
* ``client``: the pool of keep-alive connections and the requests made on them.
"""

from __future__ import annotations

from ...errors import HTTPNotFoundError, HTTPProtocolError, HTTPStatusError
from .client import ClientUser, HTTPClient
from .framing import Response, Upload, content_range
from .status import outcome_unknown, raise_for_status, retry_after, summary, xml_field
from .target import Target

__all__ = [
    "ClientUser",
    "HTTPClient",
    "HTTPNotFoundError",
    "HTTPProtocolError",
    "HTTPStatusError",
    "Response",
    "Target",
    "Upload",
    "content_range",
    "outcome_unknown",
    "raise_for_status",
    "retry_after",
    "summary",
    "xml_field",
]
