"""Write throughput and peak memory of every stream_st writer, from the arrays users hand over.

Run it from the repository root (~2.1 GiB of disk, ~6 GiB RAM; with `--tensors 32` about ten
minutes on a loaded 2-core machine)::

    python benchmarks/bench_write.py [--repeat 7] [--tensors 64] [--source numpy|torch]
                                     [--dir DIR] [--variants A,B,...]
    python benchmarks/bench_write.py --small [--repeat 5] [--plans 100x4,...] [--variants ...]
                                     [--base DIR] [--cpu]

The plan is ``--tensors`` tensors of 32 MiB F32 (64: 2 GiB of data), named ``t00``, ``t01``...
Each variant runs in a fresh process that first builds the tensors as a user's program does:
distinct arrays, just allocated and filled (``--source numpy``: ``np.empty`` then filled, which
numpy backs with huge pages from 4 MiB; ``--source torch``: ``torch.empty`` then filled), tensor
``i`` holding ``arange(8 Mi) + i``. The torch variants take ``torch.from_numpy`` of the numpy
arrays, the numpy ones ``.numpy()`` of the torch tensors (both share the memory). The file goes
to a temporary directory in ``--dir`` (by default the system's, which the output names with its
file system): the disk users write to, not ``/dev/shm``.

Variants, interleaved (A B C ... A B C ...), the timer running from opening the destination to
the file complete and closed (no fsync anywhere, as the reference does none). Before the timer
each process pays, for every variant alike, what a program pays once and not per write: it
imports the modules the variant calls (stream_st imports its parts on first use) and, where the
variant runs an event loop, anyio's asyncio backend (imported on anyio's first run); a model's
module is built from the tensors. That cost is reported apart, as "first call" (on a quiet
machine 0.1-0.3 s for stream_st's writers: timed with the write, it cost 1 GiB of them about a
third of their speed against the bar).

* ``pwrite``: the bar. The file preallocated (``posix_fallocate``), the header written, then the
  data by 2 threads issuing 8 MiB ``os.pwrite`` calls from the arrays' memory.
* ``open_writer``: ``open_writer(path, plan)`` and ``await writer.write(name, array)`` per tensor.
* ``write_many`` (``--small`` only): ``open_writer(path, plan)`` and one
  ``await writer.write_many(arrays)``.
* ``save``: ``await stream_st.save(path, arrays)``.
* ``np_save_file`` / ``torch_save_file``: the drop-ins ``stream_st.numpy.save_file`` and
  ``stream_st.torch.save_file``.
* ``torch_save_model``: ``stream_st.torch.save_model`` of a module whose parameters are the
  tensors (its ``state_dict()``).
* ``ref_np`` / ``ref_torch``: the reference, ``safetensors.numpy.save_file`` and
  ``safetensors.torch.save_file`` of the same dict.
* ``sharded``: ``open_sharded_writer`` with shards of half the data (two shards and an index).
* ``dataset``: ``open_dataset_writer``, two batches of half the tensors (two shards, a manifest).
* ``cp``: ``stream_st.tools.cp.cp`` of a file of the same bytes, written (and so in the page
  cache) before the first round, to a new file.

Every single-file variant writes the same bytes (the reference's layout); the first round checks
each file's CRC-32. The sharded and dataset variants write the same data in two shards. After
each run the files are deleted and the dirty pages flushed (``os.sync``), outside the timer.

Reported: GB/s per round and per variant, each variant's ratio to ``pwrite`` of the same round
(median, min and max: the requirement is every round), the same against the reference's
``save_file``, the peak RSS above the process's RSS once the tensors exist (``VmHWM``), and the
first-call cost.
The load average (other processes skew the figures) is printed at the start and end.

``--small``: many small tensors, where the writers' work per tensor counts rather than the
copy (about two minutes, ~1 GiB of RAM and disk). ``--plans`` lists ``COUNTxKIB`` plans (by
default 100, 1,000 and 10,000 tensors of 4 KiB and of 64 KiB, F32, each filled with its index).
Each variant (by default the reference's two ``save_file``, the drop-ins' ``save_file``,
``save_model``, ``save``, ``open_writer`` and ``write_many``) runs in a fresh process per round,
interleaved, and writes every plan there in turn: 9 calls for a plan under 16 MiB, 3 under
256 MiB, else 1, the file removed after each call outside the timer, the imports made before
(``save``, ``open_writer`` and ``write_many`` awaited in one running event loop, as an async
program calls them; the others called from plain code, outside any loop). Reported per plan:
each variant's median time per call, and its paired ratio to ``ref_np`` and ``ref_torch`` of
the same round (their median call / the variant's; median, min and max over the rounds), and
the same for the first call of the process alone. The first call's file is checked against
the reference's bytes. ``--base DIR`` also runs each stream_st variant with the stream_st of the
checkout ``DIR`` (the code before a change), as ``VARIANT@base`` in the same rounds, and prints
each variant's paired ratio to it (the base's median call / the variant's). ``--cpu`` times each
call by the CPU time of its process (``time.process_time``: every thread, user and system)
instead of the wall clock: on a machine other processes load, a call's wall-clock time counts
the time they take the cores from it, and varies 2-3 fold from one call to the next.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MiB = 1 << 20
GiB = 1 << 30
TENSOR_BYTES = 32 * MiB
ELEMENTS = TENSOR_BYTES // 4
PIECE = 8 * MiB
DEFAULT_VARIANTS = (
    "pwrite",
    "open_writer",
    "save",
    "np_save_file",
    "ref_np",
    "torch_save_file",
    "torch_save_model",
    "ref_torch",
    "sharded",
    "dataset",
    "cp",
)
MULTI_FILE = ("sharded", "dataset")
SMALL_VARIANTS = (
    "ref_np",
    "np_save_file",
    "ref_torch",
    "torch_save_file",
    "torch_save_model",
    "save",
    "open_writer",
    "write_many",
)
VARIANTS = (*DEFAULT_VARIANTS, "write_many")
"""Every variant's name: the default ones and those of ``--small`` alone."""
BASE = "@base"
"""The suffix of a variant run with the stream_st of ``--base``."""
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
"""The checkout this script is in, whose stream_st the variants run (not the one the
interpreter may have installed elsewhere)."""
SMALL_PLANS = "100x4,1000x4,10000x4,100x64,1000x64,10000x64"


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")  # pragma: no cover


def _load() -> str:
    """The 1, 5 and 15 minute load averages."""
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def _names(count: int) -> list[str]:
    return [f"t{i:02d}" for i in range(count)]


def _file_system(path: str) -> str:
    """The type of the file system ``path`` is on (from ``/proc/mounts``)."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            inside = real == point or real.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(best):
                best, kind = point, fields[2]
    return kind


def _crc_of_files(paths: list[str]) -> int:
    crc = 0
    buffer = bytearray(16 * MiB)
    view = memoryview(buffer)
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while got := file.readinto(buffer):
                crc = zlib.crc32(view[:got], crc)
    return crc


def _expected(count: int) -> tuple[bytes, int]:
    """The reference's file for the plan: its header prefix, and the CRC-32 of the whole file."""
    import numpy as np

    from stream_st.core.layout import TensorSpec, build_header

    prefix, _ = build_header([TensorSpec(name, "F32", (ELEMENTS,)) for name in _names(count)])
    base = np.arange(ELEMENTS, dtype=np.float32)
    crc = zlib.crc32(prefix)
    for i in range(count):
        crc = zlib.crc32((base + i).data, crc)
    return prefix, crc


# ---------------------------------------------------------------------------------- the children


def _arrays(count: int, source: str) -> dict[str, Any]:
    """Fresh tensors, as a program makes them: ``{name: numpy array}`` and torch tensors over
    the same memory, under ``"torch"``."""
    import numpy as np

    names = _names(count)
    if source == "numpy":
        base = np.arange(ELEMENTS, dtype=np.float32)
        arrays = {}
        for i, name in enumerate(names):
            array = np.empty(ELEMENTS, dtype=np.float32)
            np.add(base, i, out=array)
            arrays[name] = array
        return arrays
    import torch

    base_t = torch.arange(ELEMENTS, dtype=torch.float32)
    arrays = {}
    for i, name in enumerate(names):
        tensor = torch.empty(ELEMENTS, dtype=torch.float32)
        torch.add(base_t, i, out=tensor)
        arrays[name] = tensor.numpy()
    return arrays


def _pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _bar(path: str, prefix: bytes, arrays: dict[str, Any]) -> None:
    """The raw-I/O bar: a preallocated file, 2 threads of 8 MiB ``pwrite``."""
    size = len(prefix) + sum(a.nbytes for a in arrays.values())
    pieces = []
    offset = len(prefix)
    for array in arrays.values():
        view = memoryview(array).cast("B")
        for start in range(0, len(view), PIECE):
            pieces.append((view[start : start + PIECE], offset + start))
        offset += len(view)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.posix_fallocate(fd, 0, size)
        _pwrite_all(fd, memoryview(prefix), 0)
        with ThreadPoolExecutor(2) as pool:
            for _ in pool.map(lambda piece: _pwrite_all(fd, *piece), pieces):
                pass
    finally:
        os.close(fd)


def _prepare(
    variant: str, workdir: str, arrays: dict[str, Any], tensors: dict[str, Any], src: str
) -> Any:
    """Import what ``variant`` calls and build what it is handed (a model's module); returns the
    call to time. Everything here is a once-per-process cost, kept out of the timer for every
    variant alike: the modules (stream_st's are imported lazily, on first use), and for the
    variants that run an event loop anyio's asyncio backend, which anyio imports on its first
    run."""
    import anyio

    path = os.path.join(workdir, "out.safetensors")
    if variant == "pwrite":
        from stream_st.core.layout import TensorSpec, build_header

        prefix, _ = build_header([TensorSpec(name, "F32", a.shape) for name, a in arrays.items()])
        return lambda: _bar(path, prefix, arrays)
    if variant == "ref_np":
        import safetensors.numpy

        return lambda: safetensors.numpy.save_file(arrays, path)
    if variant == "ref_torch":
        import safetensors.torch

        return lambda: safetensors.torch.save_file(tensors, path)
    anyio.run(anyio.lowlevel.checkpoint)  # imports anyio's asyncio backend
    if variant == "np_save_file":
        import stream_st.numpy

        return lambda: stream_st.numpy.save_file(arrays, path)
    if variant in ("torch_save_file", "torch_save_model"):
        import torch

        import stream_st.torch

        if variant == "torch_save_file":
            return lambda: stream_st.torch.save_file(tensors, path)
        module = torch.nn.Module()
        for name, tensor in tensors.items():
            module.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
        return lambda: stream_st.torch.save_model(module, path)
    if variant == "cp":
        from stream_st.tools.cp import cp

        return lambda: anyio.run(cp, src, path)
    run = _coroutine(variant, workdir, arrays)
    return lambda: anyio.run(run)


ASYNC_VARIANTS = ("open_writer", "write_many", "save", "sharded", "dataset")


def _coroutine(variant: str, workdir: str, arrays: dict[str, Any]) -> Any:
    """The coroutine function of an async variant (one of :data:`ASYNC_VARIANTS`)."""
    from stream_st import TensorSpec, open_dataset_writer, open_sharded_writer, open_writer, save

    names = list(arrays)
    path = os.path.join(workdir, "out.safetensors")

    async def by_tensor() -> None:
        plan = [TensorSpec(name, "F32", array.shape) for name, array in arrays.items()]
        async with open_writer(path, plan) as writer:
            for name in names:
                await writer.write(name, arrays[name])

    async def sharded() -> None:
        half = sum(array.nbytes for array in arrays.values()) // 2
        async with open_sharded_writer(workdir, max_shard_size=half) as writer:
            for name in names:
                await writer.write(name, arrays[name])

    async def dataset() -> None:
        half = len(names) // 2
        async with open_dataset_writer(workdir) as writer:
            for rows in (range(half), range(half, len(names))):
                await writer.write_batch(
                    {f"c{j:02d}": arrays[names[i]] for j, i in enumerate(rows)}, 1
                )

    async def many() -> None:
        plan = [TensorSpec(name, "F32", array.shape) for name, array in arrays.items()]
        async with open_writer(path, plan) as writer:
            await writer.write_many(arrays)

    async def saved() -> None:
        await save(path, arrays)

    coroutines = {"open_writer": by_tensor, "write_many": many, "save": saved}
    return {**coroutines, "sharded": sharded, "dataset": dataset}[variant]


def _child(variant: str, workdir: str, count: int, source: str, src: str) -> dict[str, Any]:
    """Run one variant once in this (fresh) process; return its timing, its once-per-process
    cost (imports, outside the timer) and its memory."""
    arrays = {} if variant == "cp" else _arrays(count, source)
    tensors = {}
    if "torch" in variant:  # the program that made the tensors has torch
        import torch

        tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
    start = time.perf_counter()
    run = _prepare(variant, workdir, arrays, tensors, src)
    setup = time.perf_counter() - start
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # VmHWM restarts from the RSS now: the tensors exist, imports are done
    baseline = _status_bytes("VmRSS")
    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    peak = _status_bytes("VmHWM")
    return {"seconds": seconds, "setup": setup, "baseline": baseline, "peak": peak}


def _run_child(variant: str, workdir: str, count: int, source: str, src: str) -> dict[str, Any]:
    command = [sys.executable, os.path.abspath(__file__), "--child", variant]
    command += ["--workdir", workdir, "--tensors", str(count), "--source", source, "--src", src]
    result: dict[str, Any] = _child_output(variant, command, CHECKOUT)
    return result


def _child_output(variant: str, command: list[str], checkout: str) -> Any:
    """The JSON a child process running ``command`` (with the stream_st of ``checkout``) prints
    last; its error output if it fails."""
    done = subprocess.run(command, capture_output=True, text=True, env=_code(checkout))
    if done.returncode:
        raise SystemExit(f"{variant} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _code(checkout: str) -> dict[str, str]:
    """The environment of a child that runs the stream_st of ``checkout``."""
    return {**os.environ, "PYTHONPATH": checkout}


def _calls(count: int, kib: int) -> int:
    """Calls of a variant per plan and process: more for the quicker plans."""
    size = count * kib << 10
    return 9 if size < 16 * MiB else 3 if size < 256 * MiB else 1


def _small_child(
    variant: str, workdir: str, plans: list[tuple[int, int]], cpu: bool
) -> list[dict[str, Any]]:
    """Write every plan with ``variant`` in this (fresh) process: each call's time (``cpu``: the
    process's CPU time), and the CRC-32 of the first call's file. An async variant's calls are
    timed in one running event loop, as a program using the async API makes them."""
    import anyio
    import numpy as np

    path = os.path.join(workdir, "out.safetensors")
    clock = time.process_time if cpu else time.perf_counter

    def done(record: dict[str, Any], call: int, start: float) -> None:
        record["times"].append(clock() - start)
        if not call:
            record["crc"] = _crc_of_files([path])
        os.unlink(path)

    async def awaited(run: Any, calls: int) -> dict[str, Any]:
        record: dict[str, Any] = {"times": [], "crc": 0}
        for call in range(calls):
            start = clock()
            await run()
            done(record, call, start)
        return record

    results = []
    for count, kib in plans:
        arrays = {f"t{i:05d}": np.full(kib << 8, i, dtype=np.float32) for i in range(count)}
        tensors = {}
        if "torch" in variant:
            import torch

            tensors = {name: torch.from_numpy(array) for name, array in arrays.items()}
        calls = _calls(count, kib)
        if variant in ASYNC_VARIANTS:
            results.append(anyio.run(awaited, _coroutine(variant, workdir, arrays), calls))
            continue
        run = _prepare(variant, workdir, arrays, tensors, "")
        record: dict[str, Any] = {"times": [], "crc": 0}
        for call in range(calls):
            start = clock()
            run()
            done(record, call, start)
        results.append(record)
    return results


def _small_expected(plans: list[tuple[int, int]]) -> list[int]:
    """The CRC-32 of the reference's file of each plan."""
    import numpy as np
    import safetensors.numpy

    return [
        zlib.crc32(
            safetensors.numpy.save(
                {f"t{i:05d}": np.full(kib << 8, i, dtype=np.float32) for i in range(count)}
            )
        )
        for count, kib in plans
    ]


def _small_main(
    repeat: int,
    directory: str | None,
    variants: list[str],
    plans: list[tuple[int, int]],
    base: str | None,
    cpu: bool,
) -> None:
    if base is not None:  # each stream_st variant also run with the code of ``base``
        variants = [
            name for v in variants for name in ((v,) if v.startswith("ref_") else (v, v + BASE))
        ]
    workdir = tempfile.mkdtemp(prefix="bench_write_small_", dir=directory)
    print(
        f"plans (count x KiB of F32): {' '.join(f'{c}x{k}' for c, k in plans)}, to a file on "
        f"{_file_system(workdir)}; {repeat} rounds of {' '.join(variants)}, each in a fresh "
        f"process writing every plan; timed by {'CPU time' if cpu else 'the wall clock'}"
    )
    print(f"load average at start: {_load()}")
    expected = _small_expected(plans)
    runs: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    try:
        for rep in range(repeat):
            for variant in variants:
                name, on_base, _ = variant.partition(BASE)
                command = [sys.executable, os.path.abspath(__file__), "--child", name]
                command += ["--workdir", workdir, "--small", "--plans", _plan_text(plans)]
                command += ["--cpu"] if cpu else []
                result = _child_output(variant, command, base if on_base and base else CHECKOUT)
                for (count, kib), got, crc in zip(plans, result, expected, strict=True):
                    if got["crc"] != crc:
                        raise SystemExit(f"{variant}: {count}x{kib}: the file's bytes differ")
                runs[variant].append(result)
                os.sync()
            print(f"round {rep + 1} done (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average at end: {_load()}")
    print("every variant's file matched the reference's bytes (CRC-32, first call of each)\n")
    print(
        "per plan: the median call in ms; the paired ratio to the reference's save_file of the "
        "same input (numpy arrays: ref_np, torch tensors: ref_torch), its median call / the "
        "variant's, median [min-max] over the rounds; the same for the first call alone"
    )
    for index, (count, kib) in enumerate(plans):
        median = {v: [statistics.median(r[index]["times"]) for r in runs[v]] for v in variants}
        first = {v: [r[index]["times"][0] for r in runs[v]] for v in variants}
        print(f"{count} x {kib} KiB ({_calls(count, kib)} calls a process):")
        for variant in variants:
            line = f"  {variant:<17} {statistics.median(median[variant]) * 1e3:>9.2f} ms"
            bar = "ref_torch" if "torch" in variant else "ref_np"
            if bar != variant and bar in variants:
                line += f"  vs {bar} {_span(median[variant], median[bar])}"
                line += f"  first call {_span(first[variant], first[bar])}"
            if variant + BASE in variants:
                line += f"  vs base {_span(median[variant], median[variant + BASE])}"
            print(line)


def _span(times: list[float], bars: list[float]) -> str:
    """The paired ratios ``bar / time``, as median [min-max]."""
    ratios = [bar / time for time, bar in zip(times, bars, strict=True)]
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def _plan_text(plans: list[tuple[int, int]]) -> str:
    return ",".join(f"{count}x{kib}" for count, kib in plans)


def _parse_plans(text: str) -> list[tuple[int, int]]:
    plans = []
    for item in text.split(","):
        count, _, kib = item.strip().partition("x")
        plans.append((int(count), int(kib)))
    return plans


# ---------------------------------------------------------------------------------- the parent


def _written(workdir: str, variant: str) -> list[str]:
    """The safetensors files ``variant`` left in ``workdir``, in name order."""
    names = sorted(n for n in os.listdir(workdir) if n.endswith(".safetensors"))
    if variant not in MULTI_FILE and names != ["out.safetensors"]:
        raise SystemExit(f"{variant}: expected out.safetensors, found {names}")
    return [os.path.join(workdir, name) for name in names]


def _ratios(rounds: list[float]) -> str:
    return (
        f"median {statistics.median(rounds):.2f}x, min {min(rounds):.2f}x, max {max(rounds):.2f}x"
    )


def _main(repeat: int, directory: str | None, variants: list[str], count: int, source: str) -> None:
    import numpy as np
    import safetensors
    import torch

    import stream_st

    data = count * TENSOR_BYTES
    workdir = tempfile.mkdtemp(prefix="bench_write_", dir=directory)
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
        f"safetensors {safetensors.__version__}, stream_st {stream_st.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    print(
        f"plan: {count} x {TENSOR_BYTES // MiB} MiB F32 = {data / GiB:.2f} GiB from fresh "
        f"{source} arrays, to a file on {_file_system(workdir)}; {repeat} rounds of "
        f"{' '.join(variants)}, each in a fresh process"
    )
    print(f"load average at start: {_load()}")
    prefix, expected_crc = _expected(count)
    src = os.path.join(workdir, "source.safetensors.in")
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    above: dict[str, list[int]] = {v: [] for v in variants}
    setup: dict[str, list[float]] = {v: [] for v in variants}
    try:
        if "cp" in variants:
            arrays = _arrays(count, "numpy")
            _bar(src, prefix, arrays)
            del arrays
        for rep in range(repeat):
            for variant in variants:
                result = _run_child(variant, workdir, count, source, src)
                paths = _written(workdir, variant)
                if variant not in MULTI_FILE:
                    size = os.path.getsize(paths[0])
                    if size != len(prefix) + data:
                        raise SystemExit(f"{variant}: wrote {size} bytes")
                    if rep == 0 and _crc_of_files(paths) != expected_crc:
                        raise SystemExit(f"{variant}: the file's bytes differ from the expected")
                elif len(paths) != 2 or sum(map(os.path.getsize, paths)) < data:
                    raise SystemExit(f"{variant}: wrote {paths}")
                for name in os.listdir(workdir):
                    if name != os.path.basename(src):
                        target = os.path.join(workdir, name)
                        if os.path.isdir(target):
                            shutil.rmtree(target)
                        else:
                            os.unlink(target)
                os.sync()
                seconds[variant].append(result["seconds"])
                above[variant].append(result["peak"] - result["baseline"])
                setup[variant].append(result["setup"])
            line = " ".join(f"{v}={data / seconds[v][-1] / 1e9:.2f}" for v in variants)
            print(f"round {rep + 1} GB/s: {line}  (load {os.getloadavg()[0]:.2f})", flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"load average at end: {_load()}")
    print("every single-file variant's bytes matched the reference layout (CRC-32, round 1)\n")

    header = (
        f"{'variant':<17} {'median GB/s':>11} {'min':>6} {'max':>6} {'peak RSS above':>15} "
        f"{'first call':>11}"
    )
    print(header)
    print("-" * len(header))
    for variant in variants:
        rates = [data / s / 1e9 for s in seconds[variant]]
        print(
            f"{variant:<17} {statistics.median(rates):>11.2f} {min(rates):>6.2f} "
            f"{max(rates):>6.2f} {max(above[variant]) / MiB:>11.0f} MiB "
            f"{statistics.median(setup[variant]) * 1e3:>8.0f} ms"
        )
    print(
        "first call: the median once-per-process cost outside the timer (imports, and anyio's "
        "event-loop backend where an event loop runs)"
    )
    for bar, label in (("pwrite", "the 2-thread pwrite bar"), ("ref_np", "ref_np")):
        if bar not in variants:
            continue
        print(f"\npaired ratio to {label} (its time / the variant's, per round):")
        for variant in variants:
            if variant != bar:
                rounds = [b / a for a, b in zip(seconds[variant], seconds[bar], strict=True)]
                print(f"  {variant:<17} {_ratios(rounds)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=None, help="rounds (default 7, 5 --small)")
    parser.add_argument("--tensors", type=int, default=64, help="32 MiB tensors (default 64)")
    parser.add_argument("--source", choices=("numpy", "torch"), default="numpy")
    parser.add_argument("--dir", default=None, help="where to create the temporary directory")
    parser.add_argument(
        "--variants",
        default=None,
        help=f"comma-separated, from {', '.join(DEFAULT_VARIANTS)}",
    )
    parser.add_argument("--small", action="store_true", help="many small tensors (see above)")
    parser.add_argument("--plans", default=SMALL_PLANS, help=f"--small: default {SMALL_PLANS}")
    parser.add_argument(
        "--base", default=None, help="--small: also run stream_st's variants from checkout BASE"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="--small: time calls by CPU time, not the wall clock"
    )
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--src", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tensors < 2 or args.tensors % 2:
        parser.error("--tensors must be even and at least 2")
    try:
        plans = _parse_plans(args.plans)
    except ValueError:
        parser.error(f"--plans takes COUNTxKIB items, got {args.plans!r}")
    if args.child:
        if args.small:
            print(json.dumps(_small_child(args.child, args.workdir, plans, args.cpu)))
            return
        result = _child(args.child, args.workdir, args.tensors, args.source, args.src)
        print(json.dumps(result))
        return
    default = SMALL_VARIANTS if args.small else DEFAULT_VARIANTS
    chosen = args.variants or ",".join(default)
    variants = [v.strip() for v in chosen.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS if args.small else DEFAULT_VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}")
    if args.small:
        repeat = 5 if args.repeat is None else args.repeat
        base = None if args.base is None else os.path.abspath(args.base)
        _small_main(repeat, args.dir, variants, plans, base, args.cpu)
        return
    _main(7 if args.repeat is None else args.repeat, args.dir, variants, args.tensors, args.source)


if __name__ == "__main__":
    main()
