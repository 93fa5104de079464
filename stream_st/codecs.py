"""Moved to :mod:`stream_st.core.codecs`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .core.codecs import *  # noqa: F403
from .core.codecs import __all__ as __all__
