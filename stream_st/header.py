"""Moved to :mod:`stream_st.core.header` and :mod:`stream_st.core.layout`; this path re-exports
them for the 0.1 series."""

from __future__ import annotations

from .core.header import *  # noqa: F403
from .core.header import __all__ as _header
from .core.layout import *  # noqa: F403
from .core.layout import __all__ as _layout

__all__ = [*_header, *_layout]
