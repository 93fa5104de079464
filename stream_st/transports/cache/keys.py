"""What names a copy on disk: an address made safe to keep, and its key.

A key never holds a secret: user information (``user:password@``) is dropped, and so is each
query parameter that only signs or authorizes the request (:func:`signs_only`: a presigned S3
or Google URL's ``X-Amz-*`` and ``X-Goog-*``, CloudFront's ``Signature``, ``Expires``,
``Policy`` and ``Key-Pair-Id``, an Azure SAS's ``sig``, ``se``, ``sp``..., and any name that
:func:`~stream_st.errors.redact` masks: ``token``, ``access_token``, ``api_key``...): it changes
with every signing, and the same object signed twice is one copy. ``key`` and a name ending in
``key`` (``fileKey``) are dropped only from a signed URL: elsewhere they name the object as
often as they authorize. Every other parameter stays part of the object's identity
(``?file=a``, ``?version=2``, S3's ``versionId``), in a canonical order, and is kept on disk
only as a hash: two objects never share a copy. What is shown
(``cache ls``) is the address without user information and query.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from urllib.parse import parse_qsl, quote, urlencode

from ...core.shards import split_address
from ...errors import _key_parameter, _secret_parameter

__all__ = ["ObjectKey", "object_key", "signs_only", "version_key"]

SIGNED_PREFIXES = ("x-amz-", "x-goog-")
"""Query parameters (lower case) whose name starts so sign a request (SigV4, Google's V4)."""

SIGNED_QUERY = frozenset(
    {"signature", "expires", "policy", "key-pair-id", "awsaccesskeyid", "googleaccessid"}
)
"""Query parameters (lower case) of a URL signed by S3's SigV2, Google's V2 or CloudFront: only
the signature's, when a ``Signature`` is there."""

SAS_QUERY = frozenset(
    {"sig", "sv", "ss", "srt", "sp", "se", "st", "spr", "sr", "si", "sip", "sdd", "ses"}
    | {"skoid", "sktid", "skt", "ske", "sks", "skv", "saoid", "suoid", "scid", "sduoid"}
)
"""Query parameters (lower case) of an Azure shared access signature: only the signature's,
when a ``sig`` is there."""

VERSION_QUERY = frozenset({"versionid", "generation"})
"""Query parameters (lower case) that name one version of an object (S3's ``versionId``, Google
Cloud Storage's ``generation``): part of its key, signed or not."""

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
    """The key of the object at ``address`` (a URL); see the module. An ``s3://`` address has no
    query or fragment: its key is everything after the bucket (``?`` and ``#`` included)."""
    parts = split_address(address)
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
    names = {name.lower() for name, _ in pairs}
    kept = sorted((n, v) for n, v in pairs if not signs_only(n, names))
    query = "?" + urlencode(kept, quote_via=quote) if kept else ""
    digest = hashlib.sha256(f"{shown}{query}".encode()).hexdigest()[:40]
    return ObjectKey(digest, shown)


def signs_only(name: str, names: Collection[str] = ()) -> bool:
    """Whether the query parameter ``name`` only signs or authorizes a request (see the module),
    in a query of the parameters ``names`` (lower case)."""
    lowered = name.lower()
    if lowered in VERSION_QUERY:
        return False
    if lowered.startswith(SIGNED_PREFIXES):
        return True
    if _key_parameter(name) and not _signed(names):
        return False  # ?key=, ?fileKey=: as often the object's name as a credential
    if _secret_parameter(name):
        return True
    if lowered in SIGNED_QUERY and "signature" in names:
        return True
    return lowered in SAS_QUERY and "sig" in names


def _signed(names: Collection[str]) -> bool:
    """Whether a query of the parameters ``names`` (lower case) carries a signature."""
    return bool({"signature", "sig"} & set(names)) or any(
        name.startswith(SIGNED_PREFIXES) for name in names
    )


def version_key(etag: str, last_modified: str, size: int | None) -> str:
    """A short name for one version of an object: its validators and size, hashed."""
    text = f"{etag}\n{last_modified}\n{size}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]
