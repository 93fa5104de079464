"""Moved to :mod:`stream_st.models.bert`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .models.bert import *  # noqa: F403
from .models.bert import __all__ as __all__
