"""Moved to :mod:`stream_st.integrations.dataset`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .integrations.dataset import *  # noqa: F403
from .integrations.dataset import __all__ as __all__
