"""Moved to :mod:`stream_st.models.bert`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from .models.bert import (
    BertConfig,
    Stage,
    StageRunner,
    StreamingBert,
    mean_pool,
    minilm_dir,
    run_loaded,
    run_streaming,
    tokenize,
)

__all__ = [
    "BertConfig",
    "Stage",
    "StageRunner",
    "StreamingBert",
    "mean_pool",
    "minilm_dir",
    "run_loaded",
    "run_streaming",
    "tokenize",
]
