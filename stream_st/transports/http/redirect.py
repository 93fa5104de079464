"""Redirects and credentials: which answers are followed, where to, and what a request carries.

The one policy for every redirect the client follows:

* only ``GET`` and ``HEAD`` requests follow 301, 302, 303, 307 and 308 answers with a
  ``Location``, at most ``max_redirects`` in a row;
* a ``Location`` that is not an ``http(s)://`` URL naming a host (``http://`` and ``http:x``
  are none: a scheme makes a URL absolute), or is no URL at all, and a redirect from https to
  http (a downgrade would send the request, and what it answers, in clear text), are refused;
* on a redirect to another origin (scheme, host or port), the credentials do not follow:
  ``Authorization``, ``Cookie``, ``Proxy-Authorization``, the API keys and tokens a message
  masks (``X-Api-Key``, ``Api-Key``, ``Private-Token``, ``X-Auth-Token``,
  ``X-Goog-Security-Token``) and every ``x-amz-*`` header (an S3 signature, its session token,
  customer keys) are dropped, as requests and httpx drop ``Authorization``. A signed
  request is not signed again for the other host: the signature was meant for the first one. A
  same-origin redirect keeps them; once dropped, they stay dropped for the rest of the chain.

Credentials in a URL (``https://user:password@host/...``) are used as curl and requests use them:
the first request carries them as ``Authorization: Basic`` (unless the caller gave its own
``Authorization``), so they go to that URL's origin only and follow a redirect only within it. A
``Location`` naming credentials of its own is followed without them.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from urllib.parse import unquote, urljoin, urlsplit

from ...errors import SECRET_HEADERS, HTTPProtocolError, SafetensorsError, redact
from .target import Target

__all__ = [
    "REDIRECTS",
    "basic_authorization",
    "credential_header",
    "redirected",
    "url_credentials",
]

REDIRECTS = frozenset({301, 302, 303, 307, 308})
"""The statuses a GET or HEAD follows (when the answer names a ``Location``)."""

_CREDENTIALS = frozenset({"authorization", *SECRET_HEADERS})
_SIGNED_PREFIX = "x-amz-"


def credential_header(name: str) -> bool:
    """Whether a request header named ``name`` proves who asks (never sent to another origin)."""
    key = name.lower()
    return key in _CREDENTIALS or key.startswith(_SIGNED_PREFIX)


def basic_authorization(user: str, password: str) -> str:
    """The value of an HTTP Basic ``Authorization`` (or ``Proxy-Authorization``) header for
    ``user`` and ``password`` (UTF-8, as RFC 7617 allows)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def url_credentials(url: str, headers: Mapping[str, str]) -> dict[str, str]:
    """``headers`` for the first request to ``url``: with ``Authorization: Basic`` made of the
    URL's ``user:password@`` (percent-decoded), unless there is none or ``headers`` already hold
    an ``Authorization``. ``url`` is one :meth:`Target.parse` accepted."""
    out = dict(headers)
    parts = urlsplit(url)
    if not (parts.username or parts.password):
        return out
    if any(name.lower() == "authorization" for name in out):
        return out
    user, password = unquote(parts.username or ""), unquote(parts.password or "")
    out["Authorization"] = basic_authorization(user, password)
    return out


def redirected(
    target: Target, location: str, headers: Mapping[str, str]
) -> tuple[Target, dict[str, str]]:
    """Where the request to ``target`` goes on an answer redirecting it to ``location``, and the
    headers it carries there. Raises :class:`HTTPProtocolError` for a refused redirect."""
    try:
        # A Location naming a scheme is taken as it is (RFC 3986's strict reading): urljoin
        # would read "http://" and "http:x" as relative to the URL redirected from.
        url = location if urlsplit(location).scheme else urljoin(target.url, location)
        new = Target.parse(url)
    except (SafetensorsError, ValueError) as exc:  # ValueError: an IPv6 bracket left open
        # Masked before it is cut: a password cut from its '@' would no longer be seen as one.
        raise HTTPProtocolError(
            f"redirect to an unusable address {redact(location)[:200]!r}", url=target.url
        ) from exc
    if target.scheme == "https" and new.scheme == "http":
        raise HTTPProtocolError(
            f"redirect from https to plain http refused (to http://{new.authority})", url=target.url
        )
    if new.origin == target.origin:
        return new, dict(headers)
    return new, {name: value for name, value in headers.items() if not credential_header(name)}
