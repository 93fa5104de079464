"""Moved to :mod:`stream_st.core.digests`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .core.digests import *  # noqa: F403
from .core.digests import __all__ as _digests
from .reader import READ_CHUNK, read_hashing

__all__ = [*_digests, "READ_CHUNK", "read_hashing"]
