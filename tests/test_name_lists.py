"""Messages naming tensors stay bounded whatever the number and length of the names: the
dataset writer's column errors, a BERT model's incomplete forward pass, a writer closed with
tensors unwritten and the model checks list names through :func:`stream_st.errors.some_names`
(the first few, each cut past 100 characters, and how many more), and show one tensor name cut
at 80 characters. Each showed names whole (a 10 MB name made a 10 MB message), or a list in a
way of its own (four names and ``...``, how many more unsaid; names unquoted)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
from stream_st import TensorInfo, TensorSpec
from stream_st.errors import NAMES_SHOWN, some_names
from stream_st.models.bert import BertConfig, ModelError, StreamingBert
from stream_st.sharded.writer import open_dataset_writer
from stream_st.tools.model_checks import ModelConfig, validate_dtype_consistency

BOUND = 2000
"""The most characters a message naming tensors may take."""

MANY = 10**5

HUGE = "head" + "x" * (10 << 20) + "tail"
"""A name of 10 MiB."""

CONFIG = ModelConfig(
    hidden_size=16,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=40,
    vocab_size=50,
)
"""A small Llama model, whose tensors a file's are checked against."""


def many(prefix: str) -> list[str]:
    """:data:`MANY` names, in the order ``sorted`` gives them."""
    return sorted(f"{prefix}{i}" for i in range(MANY))


def bounded(text: str) -> str:
    """``text``, after checking it is under :data:`BOUND` characters."""
    assert len(text) < BOUND, (len(text), text[:300])
    return text


def infos(names: list[str]) -> dict[str, TensorInfo]:
    """A file's tensors ``names``, each one F32 value."""
    return {name: TensorInfo(name, "F32", (1,), 0, 4) for name in names}


@pytest.mark.parametrize("names", [many("c"), ["b", HUGE]], ids=["many", "huge"])
async def test_a_batch_of_other_columns_than_the_datasets_lists_them_bounded(
    tmp_path: Path, names: list[str]
) -> None:
    """Each side's columns were shown by a repr of four names cut at 40 characters and ``...``,
    how many more unsaid."""
    batch = {name: np.zeros(3, np.uint8) for name in names}
    async with open_dataset_writer(tmp_path / "kv") as writer:
        await writer.write_batch({"a": np.arange(3)}, samples=1)
        await writer.write_batch({"b": np.arange(3)}, samples=1)  # KV rows
        with pytest.raises(stream_st.UsageError, match="after KV-mode rows") as caught:
            await writer.write_batch(batch, samples=3)
    text = bounded(str(caught.value))
    assert f"samples of {len(names)} columns ({some_names(names)}) after" in text, text
    async with open_dataset_writer(tmp_path / "batches") as writer:
        await writer.write_batch(batch, samples=3)
        with pytest.raises(stream_st.UsageError, match="are not the dataset's") as caught:
            await writer.write_batch({"other": np.zeros(3, np.uint8)}, samples=3)
    text = bounded(str(caught.value))
    assert "the batch's 1 columns (['other']) are not the dataset's" in text, text
    assert f"{len(names)} columns ({some_names(names)}): every batch" in text, text


async def test_a_dataset_writers_column_of_a_huge_name_is_cut(tmp_path: Path) -> None:
    """A column's errors showed its name whole."""
    async with open_dataset_writer(tmp_path) as writer:
        with pytest.raises(stream_st.UsageError, match="is 0-d") as caught:
            await writer.write_batch({HUGE: np.float32(3)}, samples=2)
    assert bounded(str(caught.value)).startswith(f"write_batch: column {HUGE!r:.80} is 0-d")


@pytest.mark.parametrize(("prefix", "layers"), [("", MANY // 16), (HUGE, 1)], ids=["many", "huge"])
def test_an_incomplete_bert_forward_pass_lists_the_weights_missing_bounded(
    prefix: str, layers: int
) -> None:
    """It showed five names whole (a prefix of 10 MB, 50 MB), and how many more."""
    config = BertConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=layers)
    model = StreamingBert(config, np.array([[1, 2]]), np.array([[1, 1]]), prefix=prefix)
    with pytest.raises(ModelError) as caught:
        model.output()
    text = bounded(str(caught.value))
    first = some_names([f"{prefix}embeddings.word_embeddings.weight"])[:-1]
    assert text.startswith(f"the forward pass is incomplete: missing {first}, "), text
    assert text.endswith(f" and {5 + 16 * layers - NAMES_SHOWN} more"), text


def test_a_bert_weight_of_a_huge_name_is_cut() -> None:
    """A weight's errors showed its name whole, unquoted."""
    model = StreamingBert(
        BertConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1),
        np.array([[1, 2]]),
        np.array([[1, 1]]),
    )
    name = f"encoder.layer.0.{HUGE}.bias"
    with pytest.raises(ModelError) as caught:
        model.add(name, np.ones(8, np.float32))
    assert bounded(str(caught.value)) == f"{name!r:.80} is no weight of a BERT layer"


@pytest.mark.parametrize("names", [many("t"), [HUGE]], ids=["many", "huge"])
async def test_a_writer_closed_with_tensors_unwritten_lists_them_bounded(
    tmp_path: Path, names: list[str]
) -> None:
    """It showed eight names whole, each with its bytes written, and how many more."""
    plan = [TensorSpec(name, "F32", [1]) for name in names]
    with pytest.raises(stream_st.WriterError, match="not completely written") as caught:
        async with stream_st.open_writer(tmp_path / "out.safetensors", plan):
            pass
    text = bounded(str(caught.value))
    shown = min(len(names), NAMES_SHOWN)
    assert text == (
        f"{len(names)} tensor(s) not completely written when the writer closed: "
        f"{some_names(names)} (written: {', '.join(['0 of 4'] * shown)} bytes)"
    )


@pytest.mark.parametrize(
    ("name", "array", "message"),
    [
        (HUGE, np.zeros(1, np.float64), f"tensor {HUGE!r:.80}: planned F32 [1] takes an array"),
        (HUGE + "!", np.zeros(1, np.float32), f"no tensor named {HUGE + '!'!r:.80} in the plan"),
    ],
    ids=["wrong dtype", "unplanned"],
)
async def test_a_writers_tensor_of_a_huge_name_is_cut(
    tmp_path: Path, name: str, array: Any, message: str
) -> None:
    """A tensor's errors showed its name whole."""
    plan = [TensorSpec(HUGE, "F32", [1])]
    with pytest.raises(stream_st.WriterError) as caught:
        async with stream_st.open_writer(tmp_path / "out.safetensors", plan) as writer:
            await writer.write(name, array)
    assert bounded(str(caught.value)).startswith(message), str(caught.value)[:300]


@pytest.mark.parametrize("names", [many("n"), [HUGE]], ids=["many", "huge"])
def test_tensors_of_another_dtype_are_listed_bounded(names: list[str]) -> None:
    """They were shown unquoted, whole, three and ``, ... N more``."""
    [problem] = validate_dtype_consistency(dict.fromkeys(names, "F32"), "BF16")
    assert bounded(problem) == (
        "floating-point tensors not in the expected BF16: "
        f"F32 ({len(names)}: {some_names(names, 3)})"
    )


@pytest.mark.parametrize("names", [many("n"), [HUGE]], ids=["many", "huge"])
def test_a_file_no_tensor_of_which_the_config_names_lists_them_bounded(names: list[str]) -> None:
    """Both sides were shown unquoted, whole, three and ``, ... N more``; the config's side now
    shows its first names (its count said), not made past them."""
    errors, warnings = CONFIG.check(infos(names))
    assert warnings == []
    [error] = errors
    config = list(CONFIG.names())[:NAMES_SHOWN]
    assert bounded(error) == (
        "no tensor of the file is one the config names (a config for another model?): the "
        f"config expects 30 tensors, the first {some_names(config)}; the file holds "
        f"{len(names)} tensor{'s' if len(names) > 1 else ''}: {some_names(names)}"
    )


@pytest.mark.parametrize("names", [many("n"), [HUGE]], ids=["many", "huge"])
def test_tensors_the_config_does_not_describe_are_listed_bounded(names: list[str]) -> None:
    """They were shown unquoted, whole, three and ``, ... N more``."""
    held = infos(names)
    held["model.norm.weight"] = TensorInfo("model.norm.weight", "F32", (16,), 0, 64)
    _, warnings = CONFIG.check(held)
    described = [bounded(w) for w in warnings if "the config does not describe" in w]
    tensors = f"{len(names)} tensor{'s' if len(names) > 1 else ''}"
    assert described == [f"{tensors} the config does not describe: {some_names(names)}"]
