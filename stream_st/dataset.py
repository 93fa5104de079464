"""Moved to :mod:`stream_st.integrations.dataset`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .integrations.dataset import (
    MANIFEST_NAME,
    DatasetInfo,
    Piece,
    describe_dataset,
    plan_pieces,
    read_piece,
)

__all__ = ["MANIFEST_NAME", "DatasetInfo", "Piece", "describe_dataset", "plan_pieces", "read_piece"]
