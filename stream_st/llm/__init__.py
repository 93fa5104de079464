"""Moved to :mod:`stream_st.models.llm`; this path re-exports it for the 0.1 series."""

from __future__ import annotations

from ..models.llm import (
    Forward,
    KVCache,
    Llama,
    LlamaConfig,
    ModelError,
    StreamingPrefill,
    load_tokenizer,
    perplexity,
    read_checkpoint,
    read_gguf,
    smollm2_path,
    write_checkpoint,
)

__all__ = [
    "Forward",
    "KVCache",
    "Llama",
    "LlamaConfig",
    "ModelError",
    "StreamingPrefill",
    "load_tokenizer",
    "perplexity",
    "read_checkpoint",
    "read_gguf",
    "smollm2_path",
    "write_checkpoint",
]
