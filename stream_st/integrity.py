"""Moved to :mod:`stream_st.core.digests`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .core.digests import *  # noqa: F403
from .core.digests import __all__ as __all__
