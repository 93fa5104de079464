"""The ``stream-st`` command.

``stream-st demo`` streams a TinyLlama-shaped KV cache over a loopback TCP connection: a sender
produces it layer by layer, the receiver reads it with :func:`stream_st.open_stream` as the bytes
arrive and checks every layer. Nothing to set up by hand.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import anyio
import numpy as np
from anyio.abc import SocketStream

from .errors import SafetensorsError
from .header import TensorSpec, build_header
from .reader import open_stream


def _kv_layer(layer: int, kind: int, shape: tuple[int, ...]) -> np.ndarray:
    """Deterministic synthetic K or V data for a layer, so the receiver can check it."""
    rng = np.random.default_rng(layer * 2 + kind)
    return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)


async def _demo(layers: int, seq: int) -> int:
    shape = (1, 4, seq, 64)
    plan = [
        TensorSpec(f"layer_{i}_{kind}", "F16", shape)
        for i in range(layers)
        for kind in ("key", "value")
    ]
    prefix, header = build_header(plan, {"compression": "none", "source": "stream-st demo"})
    start = time.perf_counter()
    sent: dict[str, float] = {}

    async def send(stream: SocketStream) -> None:
        async with stream:
            await stream.send(prefix)
            for i in range(layers):
                for kind_index, kind in enumerate(("key", "value")):
                    data = _kv_layer(i, kind_index, shape)
                    await stream.send(data.tobytes())
                    sent[f"layer_{i}_{kind}"] = time.perf_counter() - start

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    print(
        f"stream-st demo: {layers} layers x key/value {list(shape)} F16, "
        f"{header.file_size / 1e6:.1f} MB over tcp://127.0.0.1:{port}"
    )
    print(f"{'tensor':<18}{'sent ms':>10}{'received ms':>13}  check")
    received = 0
    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, send)
        connection = await anyio.connect_tcp("127.0.0.1", port)
        async with connection, open_stream(connection) as stream:
            async for name, array in stream:
                at = time.perf_counter() - start
                layer, kind = int(name.split("_")[1]), name.endswith("value")
                ok = np.array_equal(array, _kv_layer(layer, int(kind), shape))
                received += array.nbytes
                print(
                    f"{name:<18}{sent.get(name, float('nan')) * 1e3:>10.1f}{at * 1e3:>13.1f}"
                    f"  {'ok' if ok else 'MISMATCH'}"
                )
                if not ok:
                    raise SafetensorsError(f"{name} arrived corrupted")
        group.cancel_scope.cancel()
    total = time.perf_counter() - start
    print(
        f"received {received / 1e6:.1f} MB in {total * 1e3:.0f} ms "
        f"({received / total / 1e9:.2f} GB/s), every tensor verified"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stream-st", description="Read and write safetensors files as streams."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    demo = commands.add_parser(
        "demo",
        help="stream a KV cache over loopback TCP and check it (the default)",
        description="Stream a TinyLlama-shaped KV cache over loopback TCP, layer by layer.",
    )
    demo.add_argument("--layers", type=int, default=22, help="number of layers (default 22)")
    demo.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-st`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in (None, "demo"):
            return anyio.run(_demo, getattr(args, "layers", 22), getattr(args, "seq", 2048))
    except SafetensorsError as exc:
        print(f"stream-st: error: {exc}", file=sys.stderr)
        return 2
    return 0  # pragma: no cover - argparse rejects unknown commands


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
