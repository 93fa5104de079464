"""Moved to :mod:`stream_st.models.llm.transfer`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from ..models.llm.transfer import continue_received, one_blas_thread, send_prefill

__all__ = ["continue_received", "one_blas_thread", "send_prefill"]
