"""Moved to :mod:`stream_st.transports.hub`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .transports.hub import *  # noqa: F403
from .transports.hub import __all__ as __all__
