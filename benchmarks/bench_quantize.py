"""INT8 and INT4 coding speed, per core: ``Int8Codec.encode`` / ``Int4Codec.encode`` of one big
tensor per dtype, in CPU seconds of the calling thread (coding runs on one core; CPU time is
what a loaded machine leaves least disturbed).

Run it from the repository root (about a minute on 2 cores, ~1.5 GB of memory)::

    python benchmarks/bench_quantize.py [--rounds 5] [--mib 256]

For each of F32, F16 and BF16 it makes a tensor of ``--mib`` MiB of random normal values, then,
round by round, codes it with each variant in turn (the order rotating each round):

* ``int8``: what ``stream-st cp --quantize int8`` and the KV exchange call;
* ``int8 via float32`` (F16 and BF16): the same codes, the tensor first widened to float32 by
  numpy's (F16) or ml_dtypes' (BF16) cast, as a caller would without ``int8``'s own widening
  (F16 by moving its bits into float32's, BF16 in the multiply by the scale);
* ``int4``.

It prints, per variant, the input's GB per CPU-second (median and range of the rounds) and per
wall-second, the paired ratio of ``int8`` to ``int8 via float32`` for 16-bit inputs, and the
1-minute load average before and after. The target (issue: INT8 quantization) is >= 1 GB of
input per CPU-second.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from stream_st.core.codecs import Int4Codec, Int8Codec, _int8_codes, _max_abs_bits

Array = np.ndarray[Any, Any]
DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


def _via_float32(values: Array) -> None:
    """INT8 codes of the values widened to float32 first (the library's cast)."""
    flat = values.reshape(-1)
    scale = Int8Codec.scale_for("x", _max_abs_bits(flat))
    _int8_codes(flat.astype(np.float32), np.float32(scale))


def _variants(dtype: str) -> dict[str, Callable[[Array], object]]:
    out: dict[str, Callable[[Array], object]] = {"int8": lambda a: Int8Codec().encode("x", a)}
    if DTYPES[dtype].itemsize == 2:
        out["int8 via float32"] = _via_float32
    out["int4"] = lambda a: Int4Codec().encode("x", a)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    for dtype, numpy_dtype in DTYPES.items():
        count = (args.mib << 20) // numpy_dtype.itemsize
        values = np.random.default_rng(0).standard_normal(count, dtype=np.float32)
        values = values.astype(numpy_dtype)
        variants = _variants(dtype)
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        wall: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for round_ in range(args.rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                began, began_cpu = time.perf_counter(), time.thread_time()
                variants[name](values)
                cpu[name].append(time.thread_time() - began_cpu)
                wall[name].append(time.perf_counter() - began)
        size = values.nbytes / 1e9
        for name in names:
            rates = [size / s for s in cpu[name]]
            print(
                f"{dtype:>4} {name:<15} {statistics.median(rates):5.2f} GB/CPU-s "
                f"[{min(rates):.2f}-{max(rates):.2f}]  "
                f"{size / statistics.median(wall[name]):5.2f} GB/s wall"
            )
        if "int8 via float32" in cpu:
            ratios = [b / a for a, b in zip(cpu["int8"], cpu["int8 via float32"], strict=True)]
            print(
                f"{dtype:>4} int8 speed / via float32: {statistics.median(ratios):.2f}x "
                f"[{min(ratios):.2f}-{max(ratios):.2f}] (paired by round, CPU time)"
            )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
