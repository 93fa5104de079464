"""Moved to :mod:`stream_st.core.digests`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .core.digests import (
    ALGORITHM_KEY,
    ALGORITHMS,
    DEFAULT_ALGORITHM,
    DIGEST_KEY_PREFIX,
    Algorithm,
    Digests,
    Hasher,
    ObjectDigest,
    OrderedHash,
    algorithm_named,
)

__all__ = [
    "ALGORITHMS",
    "ALGORITHM_KEY",
    "DEFAULT_ALGORITHM",
    "DIGEST_KEY_PREFIX",
    "Algorithm",
    "Digests",
    "Hasher",
    "ObjectDigest",
    "OrderedHash",
    "algorithm_named",
]
