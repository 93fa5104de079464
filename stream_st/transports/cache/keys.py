"""What names a copy on disk: an address made safe to keep, and its key.

A key never holds a secret: user information (``user:password@``) is dropped, and a query that
carries a signature or a credential (a presigned S3 URL's ``X-Amz-Signature``, a CDN's ``sig``,
a ``token``) is dropped, as it changes with every signing, but for what names a version of the
object (S3's ``versionId``, :data:`VERSION_QUERY`): two versions are two objects. Any
other query stays part of the object's identity (``?version=2``) but is kept on disk only as a
hash. What is shown (``cache ls``) is the address without user information and query.
"""

from __future__ import annotations

import hashlib
from urllib.parse import parse_qsl, urlsplit

__all__ = ["ObjectKey", "object_key", "version_key"]

SIGNED_QUERY = frozenset(
    {
        "x-amz-signature",
        "x-amz-credential",
        "x-amz-security-token",
        "x-goog-signature",
        "x-goog-credential",
        "signature",
        "sig",
        "token",
        "access_token",
        "awsaccesskeyid",
        "key-pair-id",
        "policy",
        "expires",
        "se",
        "sv",
        "sp",
    }
)
"""Query parameters (lower case) that mark a signed or credentialed URL."""

VERSION_QUERY = frozenset({"versionid", "generation"})
"""Query parameters (lower case) of a signed URL that name one version of the object (S3's
``versionId``, Google Cloud Storage's ``generation``): kept in its key."""

_DEFAULT_PORTS = {"http": 80, "https": 443}


class ObjectKey:
    """An address as the cache knows it: ``key`` (hex, a folder name) and ``shown`` (no user
    information, no query)."""

    def __init__(self, key: str, shown: str) -> None:
        self.key = key
        self.shown = shown

    def __repr__(self) -> str:
        return f"ObjectKey({self.key!r}, {self.shown!r})"


def object_key(address: str) -> ObjectKey:
    """The key of the object at ``address`` (a URL); see the module."""
    parts = urlsplit(address)
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:
        port = None
    netloc = host if port is None or port == _DEFAULT_PORTS.get(scheme) else f"{host}:{port}"
    path = parts.path or "/"
    shown = f"{scheme}://{netloc}{path}"
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    signed = any(name.lower() in SIGNED_QUERY for name, _ in pairs)
    if signed:  # of the signed query, only what names a version of the object stays
        kept = sorted((n, v) for n, v in pairs if n.lower() in VERSION_QUERY)
        query = "".join(f"&{n}={v}" for n, v in kept).replace("&", "?", 1)
    else:
        query = "?" + parts.query if parts.query else ""
    digest = hashlib.sha256(f"{shown}{query}".encode()).hexdigest()[:40]
    return ObjectKey(digest, shown)


def version_key(etag: str, last_modified: str, size: int | None) -> str:
    """A short name for one version of an object: its validators and size, hashed."""
    text = f"{etag}\n{last_modified}\n{size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
