"""Moved to :mod:`stream_st.integrations.torch_dataset`; re-exported here for the 0.1 series."""

from __future__ import annotations

from .integrations.torch_dataset import *  # noqa: F403
from .integrations.torch_dataset import __all__ as __all__
