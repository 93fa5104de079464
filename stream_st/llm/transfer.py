"""Moved to :mod:`stream_st.models.llm.transfer`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from ..models.llm.transfer import *  # noqa: F403
from ..models.llm.transfer import __all__ as __all__
