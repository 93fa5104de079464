"""Moved to :mod:`stream_st.models.llm`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from ..models.llm import *  # noqa: F403
from ..models.llm import __all__ as __all__
