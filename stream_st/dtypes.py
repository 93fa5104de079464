"""Moved to :mod:`stream_st.core.dtypes`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .core.dtypes import *  # noqa: F403
from .core.dtypes import __all__ as __all__
