"""Remote media side by side: stream_st against its peers on an object-store endpoint of real parts.

Run it from the repository root, as root (the endpoint is a network namespace; about 5 minutes
on 2 cores with the defaults; ~600 MiB of disk)::

    sudo python benchmarks/bench_peers_remote.py [--repeat 5] [--size-mib 512]
        [--concurrency 1,8,16] [--part-mib 8] [--files big,kv,shards] [--variants st-s3,...]
        [--dir DIR]

Without root (or without ``ip``/``tc``/``nginx``) it prints ``skipped: <reason>`` and exits 0.
``main(argv)`` is what another benchmark calls to include these tables.

The endpoint (``benchmarks/netns_store.py``): nginx serving a folder path-style as an S3
endpoint inside a network namespace, 30 ms round trip, 200 MB/s per connection. Files, written
once into ``DIR/bench/`` (a temporary folder unless ``--dir``): ``big``, ``--size-mib`` of
32 MiB F32 tensors (512 MiB), ``kv``, a TinyLlama KV cache (44 x 1 MiB F16, 44 MiB), and
``shards``, the big file's tensors in 4 shards with a ``model.safetensors.index.json``.

Variants, each run in a fresh subprocess (``--child``) so every figure is a first run in a
fresh process (imports and client set-up are not timed; the read is, from the first request
to the last tensor touched). Each touches every 4 KiB page of every tensor (checked against
the file, names in offset order for the streaming ones) and reports its peak RSS (VmHWM) above
the RSS it had before the read:

* ``st-s3-K``: ``open_stream(S3Source("s3://bench/FILE", concurrency=K, part_size=M))``;
* ``st-http-K``: ``open_stream(HttpSource(URL, concurrency=K, part_size=M))``;
* ``runai-K``: runai-model-streamer's ``SafetensorsStreamer`` on ``s3://bench/FILE`` with
  ``AWS_ENDPOINT_URL`` set, ``RUNAI_STREAMER_CONCURRENCY=K``, path-style addressing;
* ``boto3``: one ``get_object``, ``Body.readinto`` straight into each tensor's array;
* ``boto3-K``: ``get_object`` ranged parts of M bytes on K threads into one buffer for the whole
  file, tensors as views of it;
* ``http``: plain HTTP, ``http.client`` with ``readinto`` into each array (one GET).

On ``shards`` the variants are stream_st's own: ``st-index-K``, ``open_stream`` of the index
with ``concurrency=K`` (each shard through a window of K parts of 8 MiB, the default; the next
shard opened while one streams), against ``st-seq-K``, the shards opened one after another, each
through K parts (what a caller without index support does): the ratio says what reading shards
ahead gains.

Rounds are interleaved (every variant once per round, the order rotated each round); the tables
give medians, GB/s of file bytes, peak RSS, and paired ratios (per round, the peer's time over
stream_st's, then the median), with the targets: S3Source >= 1.2x runai at equal concurrency,
and >= 3x a single stream (``st-s3-1``) on the KV file.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from bench_read import KV, NUMPY_DTYPES, BenchFile, big_file, ensure_file, touch
from netns_store import NetnsStore, StoreUnavailable, check_available

SCRIPT = str(Path(__file__).resolve())
MiB = 1 << 20
BUCKET = "bench"
PEERS = ("st-s3", "st-http", "runai", "boto3", "boto3-K", "http")
SHARDED = ("st-index", "st-seq")
SHARDS = "shards"
SHARD_COUNT = 4
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_REGION": "us-east-1",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}

# --------------------------------------------------------------------------- in the child

Layout = list[tuple[str, np.dtype[Any], tuple[int, ...], int, int]]


def parse_layout(raw: bytes | bytearray | memoryview) -> Layout:
    """The tensors of a JSON header in offset order: (name, dtype, shape, start, end)."""
    header: dict[str, Any] = json.loads(bytes(raw))
    header.pop("__metadata__", None)
    items = [
        (name, NUMPY_DTYPES[v["dtype"]], tuple(v["shape"]), *v["data_offsets"])
        for name, v in header.items()
    ]
    return sorted(items, key=lambda item: item[3])


def digest(touches: Sequence[tuple[str, int]]) -> str:
    """What a variant delivered: names in the order received, and each one's page touches."""
    return hashlib.sha256(json.dumps(list(touches)).encode()).hexdigest()[:16]


def _fill(readinto: Callable[[memoryview], int], view: memoryview) -> None:
    filled = 0
    while filled < len(view):
        got = readinto(view[filled:])
        if not got:
            raise RuntimeError("the body ended early")
        filled += got


def _read_body(readinto: Callable[[memoryview], int]) -> list[tuple[str, int]]:
    """A safetensors body read front to back with ``readinto``, into a fresh array per tensor."""
    prefix = bytearray(8)
    _fill(readinto, memoryview(prefix))
    raw = bytearray(int.from_bytes(prefix, "little"))
    _fill(readinto, memoryview(raw))
    touches = []
    for name, dtype, shape, start, end in parse_layout(raw):
        flat = np.empty(end - start, np.uint8)
        _fill(readinto, flat.data)
        touches.append((name, touch(flat.view(dtype).reshape(shape))))
        del flat
    return touches


def _whole_buffer(data: np.ndarray[Any, Any]) -> list[tuple[str, int]]:
    """Tensors as views of a buffer holding the whole file."""
    n = int.from_bytes(data[:8].tobytes(), "little")
    base = 8 + n
    return [
        (name, touch(data[base + start : base + end].view(dtype).reshape(shape)))
        for name, dtype, shape, start, end in parse_layout(data[8:base].tobytes())
    ]


def _shard_names(endpoint: str, key: str) -> list[str]:
    """The shard files an index on the endpoint names, in the order of their first tensor."""
    parts = urlsplit(f"{endpoint}/{BUCKET}/{key}")
    connection = http.client.HTTPConnection(parts.netloc)
    try:
        connection.request("GET", parts.path)
        weight_map: dict[str, str] = json.loads(connection.getresponse().read())["weight_map"]
    finally:
        connection.close()
    return list(dict.fromkeys(weight_map.values()))


def _s3_client(endpoint: str) -> Any:
    import boto3
    from botocore.config import Config

    config = Config(
        s3={"addressing_style": "path"},
        max_pool_connections=64,
        retries={"max_attempts": 1},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    return boto3.client("s3", endpoint_url=endpoint, config=config)


def prepare(variant: str, key: str, endpoint: str, k: int, part: int) -> Callable[[], Any]:
    """Set up ``variant`` (imports, clients: untimed); the returned call does the timed read."""
    url = f"{endpoint}/{BUCKET}/{key}"
    if variant in ("st-s3", "st-http"):
        import anyio

        import stream_st
        from stream_st.transports.http.source import HttpSource
        from stream_st.transports.s3.config import S3Config
        from stream_st.transports.s3.source import S3Source

        config = S3Config.resolve()  # credentials looked up untimed, as boto3's client is made
        anyio.run(config.ready)

        async def stream() -> list[tuple[str, int]]:
            if variant == "st-s3":
                address = f"s3://{BUCKET}/{key}"
                source: HttpSource = S3Source(address, config=config, concurrency=k, part_size=part)
            else:
                source = HttpSource(url, concurrency=k, part_size=part)
            return [(name, touch(array)) async for name, array in stream_st.open_stream(source)]

        return lambda: anyio.run(stream)
    if variant in ("st-index", "st-seq"):
        import anyio

        import stream_st

        index = f"s3://{BUCKET}/{key}"
        shards = [f"s3://{BUCKET}/{SHARDS}/{name}" for name in _shard_names(endpoint, key)]

        async def sharded() -> list[tuple[str, int]]:
            if variant == "st-index":  # the index: shards opened ahead, each through K parts
                stream = stream_st.open_stream(index, concurrency=k)
                return [(name, touch(array)) async for name, array in stream]
            touches = []  # one shard after another, each through K parts
            for shard in shards:
                stream = stream_st.open_stream(shard, concurrency=k)
                touches += [(name, touch(array)) async for name, array in stream]
            return touches

        return lambda: anyio.run(sharded)
    if variant == "runai":
        runai_streamer = importlib.import_module("runai_model_streamer")  # no type hints

        def runai() -> list[tuple[str, int]]:
            with runai_streamer.SafetensorsStreamer() as streamer:
                streamer.stream_file(f"s3://{BUCKET}/{key}")
                return sorted((name, touch(t.numpy())) for name, t in streamer.get_tensors())

        return runai
    if variant == "boto3":
        client = _s3_client(endpoint)
        return lambda: _read_body(client.get_object(Bucket=BUCKET, Key=key)["Body"].readinto)
    if variant == "boto3-K":
        client = _s3_client(endpoint)

        def ranged() -> list[tuple[str, int]]:
            size = client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
            data = np.empty(size, np.uint8)

            def get(start: int) -> None:
                end = min(size, start + part)
                answer = client.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{end - 1}")
                _fill(answer["Body"].readinto, data[start:end].data)

            with ThreadPoolExecutor(k) as pool:
                list(pool.map(get, range(0, size, part)))
            return sorted(_whole_buffer(data))

        return ranged
    if variant == "http":

        def plain() -> list[tuple[str, int]]:
            parts = urlsplit(url)
            connection = http.client.HTTPConnection(parts.netloc)
            connection.request("GET", parts.path)
            answer = connection.getresponse()
            try:
                return _read_body(answer.readinto)
            finally:
                connection.close()

        return plain
    raise SystemExit(f"unknown variant {variant!r}")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def child(args: argparse.Namespace) -> None:
    """``--child``: one timed read in this fresh process; prints one JSON line."""
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=args.endpoint)
    os.environ.update(RUNAI_STREAMER_CONCURRENCY=str(args.k))
    os.environ.update(RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0")
    read = prepare(args.child, args.key, args.endpoint, args.k, args.part)
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    touches = read()
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM") - before
    print(json.dumps({"seconds": seconds, "digest": digest(touches), "peak_mib": peak / 1024}))


# --------------------------------------------------------------------------- in the parent


def expected_digests(*paths: Path) -> tuple[str, str]:
    """The digest of ``paths`` one after another, each in offset order (streaming variants), and
    by name (the others)."""
    touches = []
    for path in paths:
        touches += _whole_buffer(np.asarray(np.memmap(path, dtype=np.uint8, mode="r")))
    return digest(touches), digest(sorted(touches))


def write_shards(folder: Path, big: Path) -> Path:
    """The big file's tensors in :data:`SHARD_COUNT` shards with a Hugging Face index, under
    ``folder``/:data:`SHARDS` (written once per size of the big file); the index's path."""
    import safetensors.numpy

    target = folder / SHARDS
    index = target / "model.safetensors.index.json"
    data = np.asarray(np.memmap(big, dtype=np.uint8, mode="r"))
    n = int.from_bytes(data[:8].tobytes(), "little")
    layout = parse_layout(data[8 : 8 + n].tobytes())
    total = sum(end - start for *_, start, end in layout)
    if index.exists() and json.loads(index.read_text())["metadata"]["total_size"] == total:
        return index  # written before, from a big file of this size
    target.mkdir(exist_ok=True)
    per_shard = -(-len(layout) // SHARD_COUNT)
    weight_map = {}
    for number in range(SHARD_COUNT):
        name = f"model-{number + 1:05d}-of-{SHARD_COUNT:05d}.safetensors"
        chosen = layout[number * per_shard : (number + 1) * per_shard]
        tensors = {
            tensor: data[8 + n + start : 8 + n + end].view(dtype).reshape(shape)
            for tensor, dtype, shape, start, end in chosen
        }
        safetensors.numpy.save_file(tensors, str(target / name))
        weight_map.update(dict.fromkeys(tensors, name))
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return index


def shard_paths(index: Path) -> list[Path]:
    """The shards of ``index`` in the order a stream reads them."""
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    return [index.parent / name for name in dict.fromkeys(weight_map.values())]


def run_child(variant: str, k: int, key: str, store: NetnsStore, part: int) -> dict[str, Any]:
    done = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--child",
            variant,
            "--key",
            key,
            "--endpoint",
            store.endpoint,
            "--k",
            str(k),
            "--part",
            str(part),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    return child_result(done)


def child_result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    """A child run's JSON record (its last line of output), or ``{"error": ...}`` saying how it
    failed."""
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exit {done.returncode}: {tail}"}
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def variant_names(args: argparse.Namespace, label: str) -> list[tuple[str, str, int]]:
    """(label, variant, K) for every variant asked for, on the file ``label``: the sharded
    checkpoint has variants of its own."""
    if label == SHARDS:
        return [(f"{variant}-{k}", variant, k) for variant in SHARDED for k in args.concurrency]
    names = []
    for variant in args.variants:
        if variant in ("boto3", "http"):
            names.append((variant, variant, 1))
            continue
        for k in args.concurrency:
            if variant == "boto3-K":
                names.append((f"boto3-{k}", variant, k))
            else:
                names.append((f"{variant}-{k}", variant, k))
    return names


def measure(
    args: argparse.Namespace, spec: BenchFile, path: Path, store: NetnsStore
) -> dict[str, list[dict[str, Any]]]:
    """Every variant once per round, in an order rotated each round; each result checked."""
    sharded = spec.label == SHARDS
    in_order, by_name = expected_digests(*(shard_paths(path) if sharded else [path]))
    key = f"{SHARDS}/{path.name}" if sharded else f"{spec.label}.safetensors"
    variants = variant_names(args, spec.label)
    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in variants}
    for round_index in range(args.repeat):
        shift = round_index % len(variants)
        for label, variant, k in variants[shift:] + variants[:shift]:
            result = run_child(variant, k, key, store, args.part)
            wanted = by_name if variant in ("runai", "boto3-K") else in_order
            if "error" not in result and result["digest"] != wanted:
                result = {"error": "delivered other bytes or another order than the file"}
            results[label].append(result)
        print(f"  round {round_index + 1}/{args.repeat} done", flush=True)
    return results


def paired(results: dict[str, list[dict[str, Any]]], ours: str, peer: str) -> float | None:
    """Median over rounds of the peer's time over ours (> 1: ours is faster)."""
    pairs = [
        b["seconds"] / a["seconds"]
        for a, b in zip(results.get(ours, []), results.get(peer, []), strict=False)
        if "seconds" in a and "seconds" in b
    ]
    return statistics.median(pairs) if pairs else None


def report(
    args: argparse.Namespace,
    spec: BenchFile,
    path: Path,
    results: dict[str, list[dict[str, Any]]],
) -> list[str]:
    """Print the table of one file; return its target lines."""
    files = shard_paths(path) if spec.label == SHARDS else [path]
    size = sum(file.stat().st_size for file in files)
    print(f"\n== {spec.label}: {spec.description} ({size / MiB:.0f} MiB), {args.repeat} rounds")
    print(f"  {'variant':<14} {'median s':>9} {'GB/s':>6} {'peak MiB':>9}  failures")
    for label, rounds in results.items():
        ok = [r for r in rounds if "seconds" in r]
        errors = {r["error"] for r in rounds if "error" in r}
        if not ok:
            print(f"  {label:<14} {'-':>9} {'-':>6} {'-':>9}  {'; '.join(sorted(errors))[:90]}")
            continue
        seconds = statistics.median(r["seconds"] for r in ok)
        peak = statistics.median(r["peak_mib"] for r in ok)
        note = f"{len(rounds) - len(ok)}: {'; '.join(sorted(errors))[:70]}" if errors else ""
        print(f"  {label:<14} {seconds:9.3f} {size / seconds / 1e9:6.2f} {peak:9.0f}  {note}")
    targets = []
    print("  paired ratios (peer time / stream_st time; > 1: stream_st faster):")
    if spec.label == SHARDS:
        for k in args.concurrency:
            for peer in (f"st-seq-{k}", "st-index-1"):
                ratio = paired(results, f"st-index-{k}", peer)
                if ratio is not None and peer != f"st-index-{k}":
                    line = f"st-index-{k} vs {peer}: {ratio:.2f}"
                    print(f"    {line}")
                    targets.append(f"{spec.label}: {line}")
        return targets
    for k in args.concurrency:
        ours = f"st-s3-{k}"
        for peer, target in ((f"runai-{k}", 1.2), (f"boto3-{k}", None), (f"st-http-{k}", None)):
            ratio = paired(results, ours, peer)
            if ratio is None:
                continue
            verdict = "" if target is None else (" PASS" if ratio >= target else " MISS")
            line = f"{ours} vs {peer}: {ratio:.2f}" + (f" (>= {target}){verdict}" if target else "")
            print(f"    {line}")
            if target:
                targets.append(f"{spec.label}: {line}")
        ratio = paired(results, ours, "boto3")
        if ratio is not None:
            print(f"    {ours} vs boto3 (one get_object): {ratio:.2f}")
        if k > 1 and spec.label == "kv":
            ratio = paired(results, ours, "st-s3-1")
            if ratio is not None:
                verdict = "PASS" if ratio >= 3 else "MISS"
                line = f"{ours} vs st-s3-1 (one stream): {ratio:.2f} (>= 3) {verdict}"
                print(f"    {line}")
                targets.append(f"{spec.label}: {line}")
    return targets


@contextlib.contextmanager
def folder(given: Path | None) -> Iterator[Path]:
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    made = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="stream_st against its peers on remote media")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=512)
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--part-mib", type=float, default=8)
    parser.add_argument("--files", default="big,kv,shards")
    parser.add_argument("--variants", default=",".join(PEERS))
    parser.add_argument("--dir", type=Path, default=None, help="keep the files here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--key", default="", help=argparse.SUPPRESS)
    parser.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--part", type=int, default=8 * MiB, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.concurrency = [int(k) for k in args.concurrency.split(",")]
    args.variants = [v for v in args.variants.split(",") if v]
    args.files = [f for f in args.files.split(",") if f]
    if args.child is None:
        args.part = int(args.part_mib * MiB)
    return args


def main(argv: Sequence[str] | None = None) -> list[str]:
    """Run the remote tables (or one child read); return the target lines (empty if skipped)."""
    args = parse_args(argv)
    if args.child is not None:
        child(args)
        return []
    try:
        check_available()
    except StoreUnavailable as exc:
        print(f"remote media skipped: {exc}")
        return []
    big = big_file("big", args.size_mib)
    shards = BenchFile(SHARDS, f"the big file in {SHARD_COUNT} shards with an index", big.tensors)
    specs = {"big": big, "kv": KV, SHARDS: shards}
    targets: list[str] = []
    with folder(args.dir) as root:
        (root / BUCKET).mkdir(exist_ok=True)
        paths = {}
        for name in args.files:
            spec = big if name == SHARDS else specs[name]
            written = ensure_file(root / BUCKET, spec)
            paths[name] = root / BUCKET / f"{spec.label}.safetensors"
            if written != paths[name]:
                paths[name].unlink(missing_ok=True)
                os.link(written, paths[name])
            if name == SHARDS:
                paths[name] = write_shards(root / BUCKET, paths[name])
        with NetnsStore(root) as store:
            print(f"endpoint: {store.describe()}; part size {args.part / MiB:g} MiB")
            print(f"load before: {os.getloadavg()[0]:.2f} (2 cores; other work may share them)")
            for name in args.files:
                results = measure(args, specs[name], paths[name], store)
                targets += report(args, specs[name], paths[name], results)
    print("\nTargets:")
    for line in targets:
        print(f"  {line}")
    return targets


if __name__ == "__main__":
    main()
