"""Addresses: an ``http(s)://`` URL split into what a request needs."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from ...errors import SafetensorsError, UnsupportedSourceError, UsageError, unreadable

__all__ = ["Target", "unreadable"]

_URL_SAFE = "!#$%&'()*+,/:;=?@[]~"  # kept as is in a request target; the rest is percent-encoded


@dataclass(frozen=True, slots=True)
class Target:
    """A parsed ``http(s)://`` address."""

    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent on the request line

    @classmethod
    def parse(
        cls, url: str, unsupported: type[SafetensorsError] = UnsupportedSourceError
    ) -> Target:
        """Split ``url``; characters not allowed on a request line (spaces, non-ASCII) in its path
        and query are percent-encoded (UTF-8), a non-ASCII host name is IDNA-encoded.
        ``unsupported`` is raised for a URL that is not ``http(s)://`` with a host
        (:class:`~stream_st.UnsupportedSinkError` for a destination)."""
        try:
            parts = urlsplit(url)
            scheme = parts.scheme.lower()
            if scheme not in ("http", "https") or not parts.hostname:
                raise unsupported(f"expected an http:// or https:// URL, got {url!r}")
            port = parts.port
            host = parts.hostname
            if not host.isascii():
                host = host.encode("idna").decode("ascii")
            path = quote(parts.path or "/", safe=_URL_SAFE)
            if parts.query:
                path += "?" + quote(parts.query, safe=_URL_SAFE)
        except ValueError as exc:  # a bad port, bracket, host name or lone surrogate
            raise UsageError(f"invalid URL {url!r}: {unreadable(url, exc)}") from None
        if port is None:
            port = 443 if scheme == "https" else 80
        return cls(scheme, host, port, path)

    @property
    def origin(self) -> tuple[str, str, int]:
        """Scheme, host and port: what a connection is to."""
        return (self.scheme, self.host, self.port)

    @property
    def authority(self) -> str:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == default else f"{host}:{self.port}"

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.authority}{self.path}"
