"""A request aiohttp cannot parse, a credential in it: the server's 400 and its log line say the
status and the kind of failure, never the request's bytes (``docs/serve.md``: the token is
never logged, echoed or shown). aiohttp's own reason quotes them: the first 100 characters of
an ``Authorization`` line over its 8190-byte limit, say, a client's credential or the server's
own token."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

import stream_st

from .test_serve import exchange

pytest.importorskip("aiohttp")

MARKER = "M4rker-Secret-9f3c"
"""A client's credential, in every request below."""

TOKEN = "s3rver-T0ken-5d21"
"""The server's own bearer token, sent back to it in an ``Authorization`` line too long."""

PADDING = "A" * 9000
"""More than aiohttp's 8190 bytes to a line."""

OVER_LONG = (
    f"GET /m.safetensors HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {MARKER}{PADDING}\r\n\r\n",
    f"GET /m.safetensors HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN} {PADDING}\r\n\r\n",
    f"GET /{MARKER}{PADDING} HTTP/1.1\r\nHost: x\r\n\r\n",
    f"GET /m.safetensors?key={MARKER}{PADDING} HTTP/1.1\r\nHost: x\r\n\r\n",
)
"""An ``Authorization`` line and a request line over the limit: aiohttp's ``LineTooLong``."""

OTHER = (
    f"GET /m.safetensors HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {MARKER}\x01\r\n\r\n",
    f"GET /m.safetensors HTTP/1.1\r\nAuthorization {MARKER}\r\n\r\n",
    f"{MARKER}\x01 /m.safetensors HTTP/1.1\r\n\r\n",
)
"""Other requests aiohttp answers 400, its reason quoting them (the kind of failure differs
between its C and Python parsers): a control character in a header, a header line without a
colon, a method that is not a token (logged at DEBUG, a first request not HTTP)."""


async def test_a_malformed_request_is_neither_logged_nor_echoed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each request gets a 400 whose body names the kind of failure and one log line (INFO, or
    DEBUG for a first request that is not HTTP) naming the status and that kind; neither holds
    a byte of the request, where aiohttp's reason, in both, began with the over-long line."""
    for name in ("aiohttp", "stream_st"):
        caplog.set_level(logging.DEBUG, logger=name)
    tensors = {"w": np.arange(6, dtype=np.float32)}
    async with stream_st.serving(tensors, name="m", token=TOKEN) as server:
        for request in OVER_LONG + OTHER:
            caplog.clear()
            answer = await exchange(server.port, request.encode("latin-1"))
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.0 400 Bad Request\r\n"), answer[:200]
            for secret in (MARKER, TOKEN):
                assert secret.encode() not in answer, (secret, answer[:300])
                assert secret not in caplog.text, (secret, caplog.text[:300])
                assert not any(secret in r.getMessage() for r in caplog.records), secret
            said = re.fullmatch(rb"malformed request \((\w+)\)\n", body)
            assert said is not None, body[:200]
            kind = said[1].decode()
            assert kind == "LineTooLong" or request in OTHER, (kind, request[:60])
            logged = [r for r in caplog.records if r.name == "aiohttp.server"]
            assert len(logged) == 1, [r.getMessage()[:200] for r in logged]
            line = logged[0].getMessage()
            assert line.endswith(f": answered 400 to a malformed request ({kind})"), line[:200]
            assert logged[0].exc_info is None, line
