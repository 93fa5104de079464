"""StreamingBert and BertConfig check what they are given as the Llama decoder does: ids, mask
and sequence length against the weights, the configuration's numbers; every refusal a
ModelError (or an ArgumentTypeError), never a bare numpy error nor a silent wrong answer."""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

import stream_st
from stream_st.models.bert import BertConfig, ModelError, Stage, StreamingBert, run_loaded
from stream_st.models.llm import ModelError as LlamaModelError

Array = np.ndarray[Any, Any]
CONFIG = BertConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1)
LAYER = {
    "attention.self.query": (8, 8),
    "attention.self.key": (8, 8),
    "attention.self.value": (8, 8),
    "attention.output.dense": (8, 8),
    "attention.output.LayerNorm": (8,),
    "intermediate.dense": (16, 8),
    "output.dense": (8, 16),
    "output.LayerNorm": (8,),
}


def weights() -> dict[str, Array]:
    """A one-layer BERT of hidden size 8: a vocabulary of 10, 4 positions, 2 token types."""
    rng = np.random.default_rng(0)
    found = {
        "embeddings.word_embeddings.weight": rng.standard_normal((10, 8), dtype=np.float32),
        "embeddings.position_embeddings.weight": rng.standard_normal((4, 8), dtype=np.float32),
        "embeddings.token_type_embeddings.weight": rng.standard_normal((2, 8), dtype=np.float32),
        "embeddings.LayerNorm.weight": np.ones(8, np.float32),
        "embeddings.LayerNorm.bias": np.zeros(8, np.float32),
    }
    for part, shape in LAYER.items():
        found[f"encoder.layer.0.{part}.weight"] = rng.standard_normal(shape, dtype=np.float32)
        found[f"encoder.layer.0.{part}.bias"] = np.zeros(shape[0], np.float32)
    return found


def run(ids: Any, mask: Any, types: Any = None, config: BertConfig = CONFIG) -> Array:
    return run_loaded(StreamingBert(config, ids, mask, types), weights())


def bert(config: BertConfig = CONFIG) -> StreamingBert:
    """An encoder of ``config`` for two tokens."""
    return StreamingBert(config, np.array([[1, 2]]), np.array([[1, 1]]))


def test_good_inputs_still_run() -> None:
    out = run([[1, 9, 0]], [[1, 1, 0]], [[0, 1, 1]])
    assert out.shape == (1, 3, 8) and np.isfinite(out).all()
    assert run(np.array([[1, 2]], np.uint8), np.array([[True, True]])).shape == (1, 2, 8)


@pytest.mark.parametrize(
    ("ids", "mask", "types", "message"),
    [
        ([[1, -1]], [[1, 1]], None, r"input_ids must be ids in \[0, 10\), got -1"),
        ([[1, 10]], [[1, 1]], None, r"input_ids must be ids in \[0, 10\), got 10"),
        ([[1, 2]], [[1, 1]], [[0, 2]], r"token_type_ids must be ids in \[0, 2\), got 2"),
        ([[1, 2, 3, 4, 5]], [[1] * 5], None, "5 tokens, the model has 4 positions"),
        ([[1, 2]], [[1, 1, 1]], None, r"attention_mask has shape \(1, 3\), input_ids \(1, 2\)"),
        ([[1, 2]], [[1, 1]], [[0]], r"token_type_ids has shape \(1, 1\)"),
        ([1, 2], [1, 1], None, r"input_ids must be \[batch, seq\]"),
        ([[]], [[]], None, "1 or more tokens"),
        ([[1, 2]], [[1, 2]], None, "attention_mask must hold 0"),
        ([[1, 2]], [[1, np.nan]], None, "attention_mask must hold 0"),
    ],
)
def test_inputs_that_do_not_fit_the_weights_are_a_model_error(
    ids: Any, mask: Any, types: Any, message: str
) -> None:
    """-1 silently embedded the last word of the vocabulary; the others were a bare IndexError
    or ValueError from numpy."""
    with pytest.raises(ModelError, match=message) as raised:
        run(ids, mask, types)
    assert isinstance(raised.value, stream_st.SafetensorsError | ValueError)


@pytest.mark.parametrize(
    ("ids", "mask"),
    [([[1.0, 2.0]], [[1, 1]]), ([["a", "b"]], [[1, 1]]), ([[1, 2]], [["1", "1"]])],
)
def test_inputs_that_are_not_integers_or_numbers_are_an_argument_type_error(
    ids: Any, mask: Any
) -> None:
    with pytest.raises(stream_st.ArgumentTypeError):
        run(ids, mask)


def test_embeddings_of_another_width_than_the_configuration_are_a_model_error() -> None:
    config = BertConfig(hidden_size=4, num_attention_heads=2, num_hidden_layers=1)
    needs = "has shape [10, 8], the configuration needs [n, 4]"
    with pytest.raises(ModelError, match=re.escape(f"word_embeddings.weight' {needs}")):
        run([[1, 2]], [[1, 1]], config=config)


@pytest.mark.parametrize(
    ("name", "shape", "needed"),
    [
        ("encoder.layer.0.output.LayerNorm.weight", (1,), "[8]"),
        ("encoder.layer.0.attention.self.query.bias", (1,), "[8]"),
        ("encoder.layer.0.attention.self.key.weight", (8,), "[8, 8]"),
        ("embeddings.LayerNorm.bias", (), "[8]"),
        ("encoder.layer.0.intermediate.dense.weight", (12, 8), "[16, 8]"),
        ("encoder.layer.0.output.dense.weight", (8, 12), "[8, 16]"),
    ],
)
def test_a_weight_of_another_shape_than_the_configuration_is_a_model_error(
    name: str, shape: tuple[int, ...], needed: str
) -> None:
    """A [1] LayerNorm weight or bias was broadcast silently (off by up to 6.6 on MiniLM), a
    dense weight of another shape a bare numpy ValueError."""
    bad = {**weights(), name: np.ones(shape, np.float32)}
    message = f"{name!r} has shape {list(shape)}, the configuration needs {needed}"
    with pytest.raises(ModelError, match=re.escape(message)):
        run_loaded(bert(replace(CONFIG, intermediate_size=16)), bad)


def test_the_intermediate_size_is_the_configuration_s_or_the_first_weight_s() -> None:
    """intermediate_size from config.json wins; without it the first weight that has it sets it."""
    assert run_loaded(bert(), weights()).shape == (1, 2, 8)
    with pytest.raises(ModelError, match=r"needs \[12, 8\]"):
        run_loaded(bert(replace(CONFIG, intermediate_size=12)), weights())
    backwards = dict(reversed(weights().items()))  # output.dense (8, 16) comes first
    assert run_loaded(bert(), backwards).shape == (1, 2, 8)
    narrow = {**weights(), "encoder.layer.0.intermediate.dense.weight": np.ones((12, 8))}
    with pytest.raises(ModelError, match=r"dense\.bias' has shape \[16\], .* needs \[12\]"):
        run_loaded(bert(), narrow)


@pytest.mark.parametrize(
    "dtype", [np.int32, np.bool_, np.complex64, "V4", [("x", "<f4")], ml_dtypes.int4]
)
def test_weights_that_are_not_floating_point_are_a_model_error(dtype: Any) -> None:
    """A void, a record or an ml_dtypes integer (numpy's kind "V", as ml_dtypes' floats) was
    taken: the layer then died with numpy's UFuncTypeError."""
    bad = {**weights(), "encoder.layer.0.attention.self.value.weight": np.ones((8, 8), dtype)}
    with pytest.raises(ModelError, match=r"value\.weight' holds .*, the model needs floating"):
        run_loaded(bert(), bad)


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, np.float16])
def test_weights_of_ml_dtypes_floats_are_taken(dtype: Any) -> None:
    name = "encoder.layer.0.attention.self.value.weight"
    given = weights()
    out = run_loaded(bert(), {**given, name: given[name].astype(dtype)})
    np.testing.assert_allclose(out, run_loaded(bert(), given), atol=0.2)


def test_a_weight_that_is_no_array_is_an_argument_type_error() -> None:
    """A list was a bare AttributeError ('list' object has no attribute 'T') as its layer ran."""
    listed = {**weights(), "encoder.layer.0.output.dense.bias": [0.0] * 8}
    with pytest.raises(stream_st.ArgumentTypeError, match=r"dense\.bias' is a list, not a numpy"):
        run_loaded(bert(), listed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("encoder.layer.1.output.dense.bias", "the configuration has 1 layers"),
        ("encoder.layer.01.output.dense.bias", "is no weight of a BERT layer"),
        ("encoder.layer.0.output.gate.bias", "is no weight of a BERT layer"),
        ("encoder.layer.\u0661.output.dense.bias", "is no weight of a BERT layer"),
        (f"encoder.layer.{'1' * 5000}.output.dense.bias", "is no weight of a BERT layer"),
    ],
)
def test_a_layer_the_configuration_has_not_is_a_model_error(name: str, message: str) -> None:
    """A checkpoint of more layers than config.json says was run on its first ones, silently.
    The name shows quoted, cut at 80 characters."""
    shown = f"{name!r:.80}"
    with pytest.raises(ModelError, match=f"^{re.escape(shown)}:? {message}$"):
        run_loaded(bert(), {**weights(), name: np.ones(8)})


def test_the_bert_prefix_is_found_past_tensors_of_a_head() -> None:
    """A checkpoint whose first tensor was cls.* took no prefix: every bert.* weight was
    reported missing."""
    ids, mask = np.array([[1, 9, 3]]), np.array([[1, 1, 0]])
    expected = run(ids, mask)
    head = {"cls.predictions.bias": np.zeros(10, np.float32)}
    prefixed = {**head, **{f"bert.{k}": v for k, v in weights().items()}}
    prefixed["bert.pooler.dense.weight"] = np.zeros((8, 8), np.float32)
    prefixed["bert.embeddings.position_ids"] = np.arange(4)  # integers, but no weight: let go
    model = StreamingBert(CONFIG, ids, mask)
    np.testing.assert_array_equal(run_loaded(model, prefixed), expected)
    assert model.prefix == "bert."


def test_an_encoder_has_a_short_repr() -> None:
    """asyncio.run formats a task's result, and run_streaming returns its model: an encoder
    printed every weight, key, value and stage it held (327,541 characters for all-MiniLM-L6-v2
    after a run)."""
    ids = np.ones((8, 4), np.int64)
    ran = StreamingBert(CONFIG, ids, ids)
    run_loaded(ran, weights())
    many = StreamingBert(
        CONFIG,
        np.ones((100, 100), np.int64),
        np.ones((100, 100), np.int64),
        weights={f"w{i}": np.zeros(900, np.float32) for i in range(1000)},
        stages=[Stage("layer 0", 0.0, 1.0)] * 1000,
        keys=[np.zeros(900, np.float32)] * 1000,
        values=[np.zeros(900, np.float32)] * 1000,
        hidden=np.zeros(999, np.float32),
    )
    for shown in (repr(ran), str(ran), repr(many), str(many)):
        assert len(shown) < 2000, len(shown)
    assert repr(ran) == (
        f"StreamingBert(config={CONFIG!r}, input_ids=<array [8, 4] int64>, "
        "attention_mask=<array [8, 4] int64>, token_type_ids=None, prefix='', "
        "weights=<dict of 0>, stages=<list of 2>, keys=<list of 1>, values=<list of 1>, "
        "hidden=<array [8, 4, 8] float32>, layers_done=0)"
    )


def test_one_model_error_for_both_models() -> None:
    assert ModelError is LlamaModelError


@pytest.mark.parametrize(
    "numbers",
    [
        {"num_attention_heads": 3},  # heads not dividing the hidden size
        {"num_attention_heads": 0},
        {"hidden_size": -32},
        {"num_hidden_layers": 0},
        {"hidden_size": True},
        {"hidden_size": 8.0},
        {"layer_norm_eps": float("nan")},
        {"layer_norm_eps": -1.0},
        {"layer_norm_eps": "1e-12"},
    ],
)
def test_a_bad_configuration_is_a_model_error(numbers: dict[str, Any]) -> None:
    """0 heads was a ZeroDivisionError, 3 heads of hidden 8 a bare ValueError at layer 0."""
    with pytest.raises(ModelError, match="not a BERT configuration"):
        BertConfig(**{**vars(CONFIG), **numbers})


@pytest.mark.parametrize(
    "text",
    [
        '{"hidden_size": -32, "num_attention_heads": 2, "num_hidden_layers": 1}',
        '{"hidden_size": true, "num_attention_heads": 1, "num_hidden_layers": 1}',
        '{"hidden_size": 8, "num_attention_heads": 0, "num_hidden_layers": 1}',
        '{"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1.0}',
        '{"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,'
        ' "layer_norm_eps": "nan"}',
        '{"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1,'
        ' "layer_norm_eps": 1e999}',
        '{"hidden_size": 8, "num_attention_heads": 2}',
        "[8, 2, 1]",
        "{",
    ],
)
def test_a_bad_config_json_is_a_model_error(tmp_path: Path, text: str) -> None:
    """They were taken (-32, true as 1, 'nan' as NaN) or raised ZeroDivisionError later."""
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ModelError, match="not a BERT configuration"):
        BertConfig.from_json(path)


def test_a_config_json_read_as_before(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        '{"hidden_size": 384, "num_attention_heads": 12, "num_hidden_layers": 6,'
        ' "layer_norm_eps": 1e-12, "hidden_act": "gelu", "vocab_size": 30522}'
    )
    assert BertConfig.from_json(path) == BertConfig(384, 12, 6, 1e-12)
    path.write_text('{"hidden_size": 8, "num_attention_heads": 2, "num_hidden_layers": 1}')
    assert BertConfig.from_json(path).layer_norm_eps == 1e-12


def test_a_config_json_that_cannot_be_read_is_a_model_error(tmp_path: Path) -> None:
    """A missing file was a bare FileNotFoundError."""
    with pytest.raises(ModelError, match=r"cannot read BERT configuration .*missing\.json"):
        BertConfig.from_json(tmp_path / "missing.json")
    with pytest.raises(ModelError, match="cannot read BERT configuration"):
        BertConfig.from_json(tmp_path)  # a directory


def test_importing_the_encoder_leaves_ml_dtypes_to_a_void_weight() -> None:
    """``stream_st.models.bert`` imported ``ml_dtypes`` (milliseconds) once the float check
    was shared with the decoder; it is imported where a void weight is checked."""
    code = (
        "import sys, numpy as np, stream_st.models.bert\n"
        "from stream_st.models._checks import floating\n"
        "assert 'ml_dtypes' not in sys.modules\n"
        "assert floating(np.dtype(np.float32)) and 'ml_dtypes' not in sys.modules\n"
        "assert not floating(np.dtype('V4')) and 'ml_dtypes' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
