"""The Llama decoder checks the numbers it is configured with, wherever they come from (the
constructor, a checkpoint's metadata, a GGUF file), before they size or compute anything: a
refusal is a ModelError, never NaN logits nor a memory blow-up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream_st.models.llm import (
    Llama,
    LlamaConfig,
    ModelError,
    StreamingPrefill,
    perplexity,
    read_checkpoint,
    read_gguf,
    write_checkpoint,
)
from stream_st.models.llm.transfer import send_prefill

SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 4,
    "num_kv_heads": 2,
}


def small_model(layers: int = 2) -> Llama:
    config = LlamaConfig(**SIZES, num_layers=layers)
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(config.shape(n), dtype=np.float32) for n in config.names()}
    return Llama(config, weights)


@pytest.mark.parametrize("theta", [float("nan"), float("inf"), 0.0, -10000.0, "1e4", True])
def test_a_rope_theta_that_is_no_base_is_refused(theta: Any) -> None:
    """NaN, inf, 0 and negative bases were taken: the model returned NaN logits."""
    with pytest.raises(ModelError, match="not a Llama configuration"):
        LlamaConfig(**SIZES, num_layers=1, rope_theta=theta)
    assert LlamaConfig(**SIZES, num_layers=1, rope_theta=500000).rope_theta == 500000


async def test_a_checkpoint_with_a_negative_rope_theta_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    await write_checkpoint(path, small_model())
    raw = path.read_bytes()
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    config = json.loads(header["__metadata__"]["llama_config"])
    header["__metadata__"]["llama_config"] = json.dumps({**config, "rope_theta": -1})
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + size :])
    with pytest.raises(ModelError, match="not a Llama configuration"):
        await read_checkpoint(path)


def _gguf(path: Path, model: Llama, blocks: int, freq_base: float = 10000.0) -> None:
    """``model`` as a llama GGUF file declaring ``blocks`` layers (its query and key rows left
    as they are: only the shapes matter here)."""
    gguf = pytest.importorskip("gguf", reason="the llm extra (gguf) is not installed")
    c = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(blocks)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_heads)
    writer.add_head_count_kv(c.num_kv_heads)
    writer.add_rope_freq_base(freq_base)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(c.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(c.vocab_size)])
    writer.add_bos_token_id(c.bos_token_id)
    writer.add_eos_token_id(c.eos_token_id)
    names = {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}
    parts = {
        "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    }  # fmt: skip
    for name, array in model.weights.items():
        stem = name.removesuffix(".weight")
        if stem not in names:
            _, _, layer, part = stem.split(".", 3)
            names[stem] = f"blk.{layer}.{parts[part]}"
        writer.add_tensor(f"{names[stem]}.weight", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_file_declaring_more_layers_than_it_holds_is_refused(tmp_path: Path) -> None:
    """A one-layer file declaring a billion built a list of 9e9 names (MemoryError)."""
    path = tmp_path / "model.gguf"
    _gguf(path, small_model(1), 10**9)
    with pytest.raises(ModelError, match="1000000000 layers, the file holds 11 tensors"):
        read_gguf(path)
    _gguf(path, small_model(1), 1)
    assert read_gguf(path).config.num_layers == 1


def test_a_gguf_file_with_a_nan_rope_base_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _gguf(path, small_model(1), 1, freq_base=float("nan"))
    with pytest.raises(ModelError, match="not a Llama configuration"):
        read_gguf(path)


@pytest.mark.parametrize("layer", ["²", "\u0661", "01", "-1"])
def test_a_weight_of_a_layer_numbered_oddly_is_no_weight_of_the_model(layer: str) -> None:
    """'²' passed str.isdigit and int() raised a bare ValueError."""
    with pytest.raises(ModelError, match="is not a weight of this Llama model"):
        small_model().config.shape(f"model.layers.{layer}.input_layernorm.weight")


async def test_a_batch_of_token_ids_is_refused_not_run_as_one_sequence(tmp_path: Path) -> None:
    """[[1, 2, 3], [4, 5, 6]] ran as the one sequence 1..6: six rows of logits, the second
    row's tokens attending to the first's."""
    model = small_model()
    batch = np.array([[1, 2, 3], [4, 5, 6]])
    calls = {
        "forward": lambda: model.forward(batch),
        "score": lambda: model.score(batch),
        "cache": lambda: model.cache(batch),
        "prefill": lambda: next(model.prefill(batch)),
        "generate": lambda: model.generate(batch, None, 0),
        "StreamingPrefill": lambda: StreamingPrefill(model.config, batch),
        "perplexity": lambda: perplexity(np.zeros((6, 64)), batch),
    }
    for what, call in calls.items():
        with pytest.raises(ModelError, match=r"must be one sequence of ids, not .* \[2, 3\]"):
            call()
            pytest.fail(what)
    with pytest.raises(ModelError, match="one sequence"):
        await send_prefill(tmp_path / "kv.st", model, batch, model.config.kv_layout(6))
    assert not (tmp_path / "kv.st").exists()
    assert model.score(np.array(5)).shape == (1, 64)  # one id, 0-d: one token, as before
    np.testing.assert_array_equal(model.score(batch[1]), model.score([4, 5, 6]))
