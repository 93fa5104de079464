"""Forward proxies: which one a request goes through, chosen from the environment as curl and
requests choose it, and ``CONNECT`` tunnels for https.

* ``http://`` URLs use ``http_proxy``, ``https://`` URLs ``https_proxy``, either falls back to
  ``all_proxy``. Each name is read in lower case first, then in upper case: a lower-case one
  that is set wins, even empty (which means no proxy). ``HTTP_PROXY`` in upper case is ignored
  when ``REQUEST_METHOD`` is set: under CGI a client's ``Proxy:`` request header arrives as
  ``HTTP_PROXY`` (the "httpoxy" problem; requests and urllib do the same, curl never reads it).
* ``no_proxy`` (or ``NO_PROXY``) lists hosts reached directly, as curl reads it: entries
  separated by commas or spaces; ``*`` alone matches every host; a name matches itself and every
  host under it (a leading dot is ignored: ``.example.com`` and ``example.com`` both match
  ``example.com`` and ``a.example.com``); an IP address matches itself, an address with a
  prefix length (``10.0.0.0/8``) its network; ``host:port`` (``[v6]:port``) matches only that
  port. Names are compared without case and without a final dot.
* A proxy is an ``http://`` URL (a bare ``host:port`` reads as one; the port defaults to 1080,
  as in curl); ``user:password@`` in it is sent as ``Proxy-Authorization: Basic``. ``https://``
  and ``socks*://`` proxies are refused with :class:`~stream_st.UsageError`: never a silent
  direct connection.

A plain http request through a proxy is sent to it in absolute form (``GET http://host/path``);
an https one goes through ``CONNECT host:port``, then TLS inside the tunnel. A proxy that refuses
(407, any answer but 2xx to ``CONNECT``) raises a one-line :class:`~stream_st.HTTPProtocolError`
naming the proxy, never its password: not retried, as the same request gets the same answer
(a status worth retrying, a 503 say, raises a :class:`~stream_st.TransportError`, retried as the
origin's would be). A proxy that closes the connection before answering ``CONNECT`` is named so.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

import anyio
import anyio.abc

from ...errors import HTTPProtocolError, TransportError, UsageError
from .redirect import basic_authorization
from .status import RETRYABLE, ascii_number
from .target import Target, unreadable

__all__ = ["Proxy", "proxy_for", "tunnel"]

_DEFAULT_PORT = 1080  # curl's, for a proxy URL without one
_HEAD_LIMIT = 64 << 10


@dataclass(frozen=True, slots=True)
class Proxy:
    """A forward proxy: where it listens, the ``Proxy-Authorization`` value for it (if any), and
    ``name``, its URL without the password, for messages."""

    host: str
    port: int
    authorization: str | None = field(repr=False)  # a secret: never shown
    name: str

    @classmethod
    def parse(cls, url: str, variable: str) -> Proxy:
        """The proxy at ``url``, found in environment variable ``variable``."""
        text = url.strip()
        if "://" not in text:
            text = "http://" + text
        try:
            parts = urlsplit(text)
            scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
        except ValueError as exc:
            raise UsageError(f"{variable}: invalid proxy URL: {unreadable(text, exc)}") from None
        if scheme != "http":
            raise UsageError(
                f"{variable}: {scheme}:// proxies are not supported (only http:// proxies)"
            )
        if not host:
            raise UsageError(f"{variable}: the proxy URL names no host")
        port = port or _DEFAULT_PORT
        shown = f"[{host}]" if ":" in host else host
        authorization = None
        if parts.username is not None:
            user, password = unquote(parts.username), unquote(parts.password or "")
            authorization = basic_authorization(user, password)
            shown = f"{parts.username}@{shown}"
        return cls(host, port, authorization, f"http://{shown}:{port}")

    def headers(self) -> list[str]:
        """The header lines every request to the proxy carries."""
        return [] if self.authorization is None else [f"Proxy-Authorization: {self.authorization}"]

    def refused(self, what: str, status: int, reason: str, url: str) -> TransportError:
        """The error for the proxy answering ``what`` with ``status``: a
        :class:`HTTPProtocolError`, which is not retried, unless the status is worth retrying."""
        hint = (
            " (it asks for credentials: user:password@ in the proxy URL)" if status == 407 else ""
        )
        answer = f"HTTP {status} {reason}".rstrip()
        kind = TransportError if status in RETRYABLE else HTTPProtocolError
        return kind(f"the proxy {self.name} refused {what}: {answer}{hint}", url=url)


def _setting(name: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """The value of ``name`` (lower case first, then upper case) and the variable it came from;
    None when unset or empty."""
    lower, upper = name.lower(), name.upper()
    if lower in environ:
        found = lower
    elif upper in environ and not (upper == "HTTP_PROXY" and "REQUEST_METHOD" in environ):
        found = upper
    else:
        return None
    value = environ[found].strip()
    return (value, found) if value else None


def _host_port(entry: str) -> tuple[str, int | None]:
    """An entry of ``no_proxy`` split into host and port (None: any port)."""
    if entry.startswith("["):  # [v6] or [v6]:port
        host, _, rest = entry[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif entry.count(":") == 1:
        host, _, port = entry.partition(":")
    else:  # a name, an IPv4 address or a bare IPv6 one
        host, port = entry, ""
    return host, ascii_number(port)


def _bypassed(target: Target, no_proxy: str) -> bool:
    """Whether ``no_proxy`` (see the module) sends ``target`` direct."""
    host = target.host.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in no_proxy.replace(",", " ").split():
        if entry == "*":
            return True
        pattern, port = _host_port(entry.lower())
        if port is not None and port != target.port:
            continue
        if address is not None and "/" in pattern:
            try:
                if address in ipaddress.ip_network(pattern, strict=False):
                    return True
            except ValueError:
                pass
            continue
        pattern = pattern.lstrip(".").rstrip(".")
        if pattern and (host == pattern or host.endswith("." + pattern)):
            return True
    return False


def proxy_for(target: Target, environ: Mapping[str, str] | None = None) -> Proxy | None:
    """The proxy a request to ``target`` goes through (see the module), None for a direct
    connection; ``environ`` defaults to ``os.environ``, read at every call."""
    env = os.environ if environ is None else environ
    found = _setting(f"{target.scheme}_proxy", env) or _setting("all_proxy", env)
    if found is None:
        return None
    no_proxy = _setting("no_proxy", env)
    if no_proxy is not None and _bypassed(target, no_proxy[0]):
        return None
    return Proxy.parse(*found)


async def tunnel(stream: anyio.abc.ByteStream, proxy: Proxy, target: Target) -> None:
    """Ask ``proxy``, on ``stream``, for a tunnel to ``target``'s host and port (``CONNECT``);
    :class:`TransportError` unless it answers 2xx (see :meth:`Proxy.refused`), or when the
    connection ends before its answer does. Reads exactly the answer: what follows is the
    origin's. The caller bounds the wait."""
    host = f"[{target.host}]" if ":" in target.host else target.host
    authority = f"{host}:{target.port}"
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}", *proxy.headers()]
    head = bytearray()
    try:
        await stream.send(("\r\n".join(lines) + "\r\n\r\n").encode("ascii"))
        while not head.endswith((b"\n\n", b"\n\r\n")):  # CRLF or a bare LF ends a line
            if len(head) > _HEAD_LIMIT:
                raise TransportError(
                    f"the proxy {proxy.name} sent an overlong answer", url=target.url
                )
            head += await stream.receive(1)  # byte by byte: TLS starts right after the answer
    except (anyio.EndOfStream, anyio.BrokenResourceError) as exc:
        raise TransportError(
            f"the proxy {proxy.name} closed the connection before answering CONNECT {authority}",
            url=target.url,
        ) from exc
    status_line = head.split(b"\n", 1)[0].removesuffix(b"\r").decode("latin-1")
    _, status, reason = [*status_line.split(" ", 2), "", ""][:3]
    code = ascii_number(status) or 0
    if not 200 <= code < 300:
        raise proxy.refused(f"CONNECT {authority}", code, reason, target.url)
