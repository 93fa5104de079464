"""The Llama decoder checks the numbers it is configured with, wherever they come from (the
constructor, a checkpoint's metadata, a GGUF file), before they size or compute anything: a
refusal is a ModelError, never NaN logits nor a memory blow-up."""

from __future__ import annotations

import json
import tracemalloc
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from stream_st import ArgumentTypeError
from stream_st.models.bert import Stage
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


@pytest.mark.parametrize(
    "theta", [float("nan"), float("inf"), 0.0, -10000.0, "1e4", True, 10**400, -(10**400)]
)
def test_a_rope_theta_that_is_no_base_is_refused(theta: Any) -> None:
    """NaN, inf, 0 and negative bases were taken: the model returned NaN logits; an integer
    past float's range raised a bare ``OverflowError``."""
    with pytest.raises(ModelError, match="not a Llama configuration"):
        LlamaConfig(**SIZES, num_layers=1, rope_theta=theta)
    assert LlamaConfig(**SIZES, num_layers=1, rope_theta=500000).rope_theta == 500000


async def test_a_configuration_of_numpy_numbers_holds_python_numbers(tmp_path: Path) -> None:
    """LlamaConfig took numpy's integers and floats as they were: a model of them ran, but
    write_checkpoint died with a bare TypeError (int64 is not JSON serializable)."""
    numbers: dict[str, Any] = {key: np.int64(value) for key, value in SIZES.items()}
    numbers.update(num_layers=np.int32(2), rope_theta=np.float32(5e5), rms_norm_eps=np.float32(0.5))
    config = LlamaConfig(**numbers)
    assert config == LlamaConfig(**SIZES, num_layers=2, rope_theta=5e5, rms_norm_eps=0.5)
    assert all(type(v) in (int, float) for v in vars(config).values()), vars(config)
    rng = np.random.default_rng(0)
    weights = {n: rng.standard_normal(config.shape(n), dtype=np.float32) for n in config.names()}
    path = tmp_path / "model.safetensors"
    await write_checkpoint(path, Llama(config, weights))
    assert (await read_checkpoint(path)).config == config


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


def _gguf(
    path: Path, model: Llama, blocks: int, freq_base: float = 10000.0, eos: int | None = None
) -> None:
    """``model`` as a llama GGUF file declaring ``blocks`` layers (its query and key rows left
    as they are: only the shapes matter here) and end of sequence token ``eos`` (default the
    model's)."""
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
    writer.add_eos_token_id(c.eos_token_id if eos is None else eos)
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


@pytest.mark.parametrize(
    "ids",
    [{"eos_token_id": -1}, {"eos_token_id": 64}, {"bos_token_id": -1}, {"eos_token_id": True}],
)
def test_a_token_id_out_of_the_vocabulary_is_refused(ids: dict[str, Any]) -> None:
    """eos_token_id=-1 was taken: generate never stopped at it."""
    with pytest.raises(ModelError, match=rf"{next(iter(ids))} .* is no id in \[0, 64\)"):
        LlamaConfig(**SIZES, num_layers=1, **ids)
    assert LlamaConfig(**SIZES, num_layers=1, bos_token_id=0, eos_token_id=63).eos_token_id == 63


def test_a_gguf_file_with_an_end_token_out_of_its_vocabulary_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    _gguf(path, small_model(1), 1, eos=64)
    with pytest.raises(ModelError, match=r"eos_token_id 64 is no id in \[0, 64\)"):
        read_gguf(path)


@pytest.mark.parametrize("layer", ["²", "\u0661", "01", "-1", "1" * 5000])
def test_a_weight_of_a_layer_numbered_oddly_is_no_weight_of_the_model(layer: str) -> None:
    """'²' passed str.isdigit and int() raised a bare ValueError; so did 5,000 digits (past
    what int() converts)."""
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


def test_generate_grows_its_cache_a_layer_at_a_time() -> None:
    """Every layer's grown keys and values were made while the whole cache before was still
    held: twice the cache at every step. Now the cache is held once, plus one layer."""
    model = small_model(layers=8)
    rng = np.random.default_rng(1)
    tracemalloc.start()
    try:
        shape = (1, 2, 16384, 8)  # 1 MiB each: 16 MiB in all
        cache = [
            (
                rng.standard_normal(shape, dtype=np.float32),
                rng.standard_normal(shape, dtype=np.float32),
            )
            for _ in range(8)
        ]
        tracemalloc.reset_peak()
        model.generate([1], cache, 2)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(cache) == 8 and cache[0][0].shape == (1, 2, 16386, 8)
    assert peak - current < 4 * 2**20, (peak, current)  # one layer is 2 MiB, the cache 16


def test_generate_from_a_cache_continues_the_sequence() -> None:
    """The tokens and the cache generate leaves are those of the sequence run from its start."""
    model = small_model()
    cache = model.cache([1, 2, 3])
    out = model.generate([4], cache, 3)
    assert out == model.generate([1, 2, 3, 4], None, 3)
    for (key, value), (key_all, value_all) in zip(
        cache, model.cache([1, 2, 3, 4, *out[:-1]]), strict=True
    ):
        np.testing.assert_allclose(key, key_all, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(value, value_all, rtol=1e-5, atol=1e-5)


def test_generate_of_no_tokens_checks_the_tokens() -> None:
    """generate([-1], None, 0) returned [], where generate([-1], None, 1) refused -1."""
    model = small_model()
    for bad in ([-1], [64], []):
        with pytest.raises(ModelError, match="tokens must be"):
            model.generate(bad, None, 0)
    with pytest.raises(ModelError, match="the cache holds 1 layers"):
        model.generate([1], model.cache([1])[:1], 0)
    assert model.generate([1], None, 0) == []


def test_a_forward_pass_from_a_later_position_without_a_past_is_causal() -> None:
    """forward(tokens, start) with start > 0 and no past masked key j against position
    start + i: a token attended to the tokens after it (the first token's logits changed with
    the last token); a start past int64 was a bare OverflowError."""
    model = small_model()

    def logits(tokens: list[int], start: int) -> Any:
        run = model.forward(tokens, start)
        keys = [run.step()[0] for _ in range(2)]
        return run.logits(), keys

    first, _ = logits([3, 7, 1, 9], 5)
    np.testing.assert_array_equal(first[:3], logits([3, 7, 1, 30], 5)[0][:3])
    np.testing.assert_allclose(first, logits([3, 7, 1, 9], 0)[0], rtol=1e-4, atol=1e-4)
    _, keys = logits([3, 7], 5)  # rotated at their own positions, 5 and 6
    whole = model.cache([1, 2, 4, 5, 6, 3, 7])[0][0]
    np.testing.assert_allclose(keys[0], whole[:, :, 5:], rtol=1e-5, atol=1e-5)
    for start in (2**53 - 1, 2**70):
        with pytest.raises(ModelError, match=r"positions must be below 2\*\*53"):
            model.forward([1, 2], start)
    assert model.forward([1], 2**53 - 1).step()[0].shape == (1, 2, 1, 8)


async def test_a_partial_model_is_refused_before_its_checkpoint_is_written(
    tmp_path: Path,
) -> None:
    """write_checkpoint of Llama(config, weights, partial=True) with weights missing raised a
    bare KeyError."""
    full = small_model()
    weights = {n: w for n, w in full.weights.items() if "layers.1." not in n}
    partial = Llama(full.config, weights, partial=True)
    with pytest.raises(ModelError, match=r"lacks 9 weights: \['model\.layers\.1\.input_layernorm"):
        await write_checkpoint(tmp_path / "model.safetensors", partial)
    assert list(tmp_path.iterdir()) == []


def lacking(part: str) -> Llama:
    """The small model made with ``partial=True``, lacking the weights whose names hold
    ``part``."""
    full = small_model()
    kept = {n: w for n, w in full.weights.items() if part not in n}
    return Llama(full.config, kept, partial=True)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        ("layers.1.", r"layer 1: \['model\.layers\.1\.input_layernorm\.weight', .*\] and 1 more"),
        ("model.", r"the embeddings: \['model\.embed_tokens\.weight'\]$"),  # no weight at all
        ("model.norm.", r"the logits: \['model\.norm\.weight'\]$"),
    ],
)
def test_a_partial_model_run_names_the_weights_it_lacks(part: str, message: str) -> None:
    """A model made with partial=True and run lacking weights raised a bare KeyError ('model.
    layers.1.input_layernorm.weight', 'model.embed_tokens.weight')."""
    model = lacking(part)
    with pytest.raises(ModelError, match=f"the model lacks weights for {message}"):
        model.score([1, 2])
    with pytest.raises(ModelError, match="the model lacks weights for generate: "):
        model.generate([1], None, 0)  # checked before anything runs, as the tokens are
    if part == "model.norm.":
        assert len(model.cache([1, 2])) == 2  # no logits: it runs
    else:
        with pytest.raises(ModelError, match=f"the model lacks weights for {message}"):
            model.cache([1, 2])


def test_generate_of_a_partial_model_leaves_its_cache_as_it_was() -> None:
    """generate grew the first layers of the cache it was given, then raised a bare KeyError
    at the first weight missing: the cache was left unusable."""
    cache = small_model().cache([1, 2])
    with pytest.raises(ModelError, match=r"the model lacks weights for generate: .* and 1 more"):
        lacking("layers.1.").generate([3], cache, 1)
    assert [key.shape[2] for key, _ in cache] == [2, 2]  # no layer grown


def test_weights_that_are_not_floating_point_numbers_are_refused() -> None:
    """A string array was a bare ValueError, integers were taken, a list a bare AttributeError."""
    model = small_model()
    name = "model.norm.weight"
    for bad in (
        np.array(["x"] * 32),
        np.ones(32, dtype=np.int64),
        np.ones(32, dtype=np.complex64),
        np.zeros(32, dtype="V4"),  # numpy's kind "V", as bfloat16's: a bare ValueError later
        np.zeros(32, dtype=[("a", "f4")]),  # a record: cast silently
    ):
        with pytest.raises(ModelError, match=f"{name} holds .*, the model needs floating point"):
            Llama(model.config, {**model.weights, name: bad})
    model.add(name, np.ones(32, dtype=ml_dtypes.bfloat16))  # ml_dtypes' floats are taken
    with pytest.raises(ModelError, match="has shape \\[3\\]"):
        model.add(name, [1.0, 2.0, 3.0])  # type: ignore[arg-type]
    model.add(name, [0.5] * 32)  # type: ignore[arg-type]
    assert model.weights[name].dtype == np.float32
    model.add(name, np.ones(32, dtype=np.float16))


def test_a_cache_of_keys_or_values_that_are_not_floats_is_refused() -> None:
    """Keys of strings were a bare ValueError in score, complex ones silently cast to float32;
    complex logits silently lost their imaginary parts in perplexity."""
    model = small_model()
    cache = model.cache([1, 2, 3])
    key, value = cache[1]
    for bad in (key.astype(str), key + 1j, key.astype(np.int32)):
        with pytest.raises(ModelError, match="layer 1's keys in the cache holds"):
            model.score([4], [cache[0], (bad, value)])
        with pytest.raises(ModelError, match="layer 1's values in the cache holds"):
            model.generate([4], [cache[0], (key, bad)], 1)
    with pytest.raises(ModelError, match=r"layer 1: the cache holds keys \[1, 2, 2, 8\]"):
        model.generate([4], [cache[0], (key[:, :, :2], value[:, :, :2])], 1)
    assert np.shape(cache[0][0]) == (1, 2, 3, 8)  # refused before any layer grew
    half = [(k.astype(np.float16), v.astype(np.float16)) for k, v in cache]
    np.testing.assert_allclose(model.score([4], half), model.score([4], cache), atol=0.05)
    with pytest.raises(ArgumentTypeError, match="real numbers, not complex128"):
        perplexity(np.zeros((1, 3), dtype=complex), [0])


def test_a_prefill_and_a_forward_pass_have_short_reprs() -> None:
    """asyncio.run formats a task's result, and run_streaming returns its model: a prefill
    printed its whole cache (1,274,674 characters for a tiny 32-layer Llama), its tokens and
    stages, a forward pass its tokens and hidden states."""
    model = small_model()
    key = np.zeros((1, 2, 500, 8), np.float32)
    prefill = StreamingPrefill(
        model.config,
        [1] * 100_000,
        [Stage("layer 0", 0.0, 1.0)] * 1000,
        [(key, key)] * 1000,
    )
    run = model.forward(np.ones(999, np.int64))
    run.hidden = np.zeros(999, np.float32)
    for shown in (repr(prefill), str(prefill), repr(run), str(run)):
        assert len(shown) < 2000, len(shown)
    assert repr(prefill) == (
        f"StreamingPrefill(config={model.config!r}, tokens=<list of 100000>, "
        "stages=<list of 1000>, cache=<list of 1000>, tied=None)"
    )
    assert repr(run) == (
        f"Forward(model={model!r}, tokens=<array [999] int64>, start=0, "
        "hidden=<array [999] float32>, layers_done=0)"
    )


def test_perplexity_of_logits_that_are_records_or_voids_is_refused() -> None:
    """A record of one float was cast silently (a perplexity of 4.0), a void refused by numpy's
    own message; ml_dtypes' floats (numpy's kind "V" too) are taken."""
    for bad in (np.zeros((2, 4), dtype=[("a", "f8")]), np.zeros((2, 4), dtype="V4")):
        with pytest.raises(ArgumentTypeError, match="real numbers, not"):
            perplexity(bad, [0, 1])
    assert perplexity(np.zeros((2, 4), dtype=ml_dtypes.bfloat16), [0, 1]) == pytest.approx(4.0)


@pytest.mark.parametrize("row", [[0, 0, np.nan, 0], [0, 0, np.inf, 0], [-np.inf] * 4])
def test_perplexity_of_logits_that_make_no_probabilities_is_refused(row: list[float]) -> None:
    """A NaN logit gave a NaN perplexity, +inf a RuntimeWarning and NaN."""
    logits = np.zeros((2, 4), dtype=np.float32)
    logits[1] = row
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModelError, match="finite maximum in each row"):
            perplexity(logits, [0, 1])


def test_perplexity_takes_minus_infinity_as_a_masked_token() -> None:
    """-inf is a token masked out (probability 0): the others share the row, and a target of
    -inf is certain to be missed (an infinite perplexity), without a warning."""
    logits = np.zeros((2, 4), dtype=np.float32)
    logits[:, 3] = -np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert perplexity(logits, [0, 1]) == pytest.approx(3.0)
        assert perplexity(logits, [0, 3]) == np.inf
    assert perplexity(np.zeros((2, 4), dtype=np.float32), [0, 1]) == pytest.approx(4.0)
