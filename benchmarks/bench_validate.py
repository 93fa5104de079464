"""``stream_st.tools.validate`` against a plain streaming read of the same warm file.

Run it from the repository root (about half a minute on 2 cores; needs ~0.6 GB of disk)::

    python benchmarks/bench_validate.py [--rounds 5] [--dtype F32|BF16|F16]
                                        [--dir DIR] [--code DIR]

It writes one safetensors file of SmolLM2-135M's shapes (random normal weights: 272 tensors, an
embedding of 49152 x 576 tied to the head, 30 layers of hidden size 576; 538 MB in F32, 269 MB
in BF16) and its ``config.json``, reads the file once so the page cache is warm, then runs the
variants, each in a fresh process, interleaved round by round (the order rotating: read,
validate, before; validate, before, read; ...):

* ``read``: ``async for name, array in stream_st.open_stream(path)``, each array dropped at once;
* ``validate``: ``stream_st.tools.validate(path, config=config_json)``: every statistic of every
  tensor, every check, the config's included;
* with ``--code DIR`` (a checkout of another version, e.g. a ``git worktree`` of an older commit),
  also ``before``: the same validate with the ``stream_st`` package found in ``DIR``, so that both
  versions are measured in the same rounds against the same read.

The peer is ``read``; the bar: validate at :data:`BAR` (0.5) of the read's speed or more. Each
child times itself from just before opening the file to the end (imports excluded: what a
variant imports on its first call, :data:`FIRST_USE`, is imported before the clock starts) and
prints its wall and CPU seconds. Per round the script prints both, the paired ratio (read
seconds over validate seconds: validate's speed as a fraction of the plain read's; 1.0 is as
fast) and the 1-minute load average; then the median ratio and its range over the rounds against
the bar (and, given ``--code``, the before side's, and the paired speed-up of validate over it),
and the load average (1, 5, 15 minutes) at the start and the end. On busy cores the ratio falls
toward the ratio of the CPU times; where a second CPU is free, the read copies on both.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

MiB = 1 << 20

BAR = 0.5
"""validate's speed as a fraction of the plain read's, at least (the median of the rounds)."""


CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "num_hidden_layers": 30,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}
"""SmolLM2-135M's numbers (its config.json, abridged): a real Llama-family model's shapes."""


def write_model(path: Path, dtype: str) -> int:
    """Write random normal weights of :data:`CONFIG`'s shapes with the streaming writer, and the
    config beside them (``config.json``); returns the file's size."""
    import anyio

    import stream_st
    from stream_st.core.dtypes import dtype_from_code
    from stream_st.tools.validate import ModelConfig

    rng = np.random.default_rng(0)
    shapes = ModelConfig.from_json(CONFIG).shapes()
    np_dtype = dtype_from_code(dtype).numpy

    async def write() -> None:
        specs = [stream_st.TensorSpec(name, dtype, s) for name, s in shapes.items()]
        async with stream_st.open_writer(str(path), specs, order="plan") as writer:
            for name, shape in shapes.items():
                values = rng.standard_normal(shape, dtype=np.float32) * 0.02
                await writer.write(name, values.astype(np_dtype))

    anyio.run(write)
    (path.parent / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return path.stat().st_size


FIRST_USE = {
    "read": (),
    "validate": ("stream_st.models.llm.model",),
    "before": ("stream_st.models.llm.model",),
}
"""Modules each variant imports on its first call (validate: the model code behind ``config``, with
the packages above it: 45 ms of CPU where Python writes no bytecode cache)."""


def child(variant: str, path: str, code: str | None) -> None:
    """Run one variant once and print its seconds (imports and file warm-up excluded); ``code``:
    where ``before`` finds its ``stream_st``."""
    import anyio

    if variant == "before":
        sys.path.insert(0, str(code))
    for module in FIRST_USE[variant]:
        importlib.import_module(module)

    import stream_st
    from stream_st import tools

    async def read() -> None:
        async with stream_st.open_stream(path) as stream:
            async for _name, array in stream:
                del array

    async def validate() -> None:
        config = os.path.join(os.path.dirname(path), "config.json")
        takes_config = "config" in inspect.signature(tools.validate).parameters  # not before 0.2
        result = await (
            tools.validate(path, config=config) if takes_config else tools.validate(path)
        )
        if not result.ok:
            raise SystemExit(f"validation failed: {result.errors[:3]}")

    run = {"read": read, "validate": validate, "before": validate}[variant]
    start, cpu = time.perf_counter(), time.process_time()
    anyio.run(run)
    print(f"{time.perf_counter() - start:.6f} {time.process_time() - cpu:.6f}")


def timed(variant: str, path: Path, code: str | None) -> tuple[float, float]:
    """Wall and CPU seconds of ``variant`` run once in a fresh process."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", variant, str(path), *([code] if code else [])],
        check=True,
        capture_output=True,
        text=True,
    )
    wall, cpu = out.stdout.strip().splitlines()[-1].split()
    return float(wall), float(cpu)


def compiled_sums() -> str:
    """How this checkout's validate sums F16, BF16 and F32 values: the compiled module's path on
    this CPU, or numpy where the module was not built."""
    try:
        from stream_st.core import _sums
    except ImportError:
        return "numpy (stream_st.core._sums not built)"
    return f"compiled, {_sums.path()} path"


def load() -> str:
    """The load average over 1, 5 and 15 minutes."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="F32", choices=("F32", "BF16", "F16"))
    parser.add_argument("--dir", help="keep the file here (reused when present)")
    parser.add_argument("--code", help="also time validate with the stream_st package in CODE")
    parser.add_argument("--child", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        variant, path, *code = args.child
        child(variant, path, code[0] if code else None)
        return
    code = os.path.abspath(args.code) if args.code else None
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(args.dir or tmp)
        home.mkdir(parents=True, exist_ok=True)
        home = home / args.dtype.lower()
        home.mkdir(exist_ok=True)
        path = home / "model.safetensors"
        size = path.stat().st_size if path.exists() else write_model(path, args.dtype)
        with open(path, "rb") as f:  # warm the page cache
            while f.read(64 * MiB):
                pass
        print(
            f"{path.name}: {args.dtype}, {size / MiB:.0f} MiB, {os.cpu_count()} CPUs; "
            f"load average at start: {load()}"
        )
        print(f"peer: read (open_stream, each array dropped); bar: validate at >= {BAR}x its speed")
        print(f"sums of F16, BF16 and F32 values: {compiled_sums()}")
        if code:
            print(f"before: validate with the stream_st of {code}")
        sides = ["validate", *(["before"] if code else [])]
        variants = ["read", *sides]
        print(
            f"{'round':>5} {'read s':>7} {'cpu s':>6} "
            + " ".join(f"{side[:6] + ' s':>8} {'cpu s':>6} {'ratio':>6}" for side in sides)
            + f" {'read GB/s':>9} {'load':>5}"
        )
        ratios: dict[str, list[float]] = {side: [] for side in sides}
        speedups = []
        for round_ in range(args.rounds):
            order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
            seconds = {variant: timed(variant, path, code) for variant in order}
            read, read_cpu = seconds["read"]
            cells = []
            for side in sides:
                wall, cpu = seconds[side]
                ratios[side].append(read / wall)
                cells.append(f"{wall:>8.3f} {cpu:>6.3f} {ratios[side][-1]:>6.2f}")
            if code:
                speedups.append(seconds["before"][0] / seconds["validate"][0])
            print(
                f"{round_:>5} {read:>7.3f} {read_cpu:>6.3f} {' '.join(cells)} "
                f"{size / read / 1e9:>9.2f} {os.getloadavg()[0]:>5.2f}"
            )
        for side in sides:
            median = statistics.median(ratios[side])
            print(
                f"{side}: paired ratio (its speed / the read's): median {median:.2f}, "
                f"range {min(ratios[side]):.2f}-{max(ratios[side]):.2f} over {args.rounds} "
                f"rounds; bar {BAR}: {'met' if median >= BAR else 'NOT met'}"
            )
        if speedups:
            print(
                f"validate's speed-up over before, paired: median {statistics.median(speedups):.2f}"
                f", range {min(speedups):.2f}-{max(speedups):.2f}"
            )
        print(f"load average at end: {load()}")


if __name__ == "__main__":
    main()
