"""N ranks loading one checkpoint over HTTP: each rank reading it whole, against a process group
sharing the read (``stream_st.torch.load_file(url, process_group=pg)``).

Run it from the repository root (torch with gloo installed)::

    python benchmarks/bench_distributed.py [--ranks 2,4] [--mib 64] [--rate 40e6] [--rounds 3]

A checkpoint of ``--mib`` MiB (16 F32 tensors) is served from memory by the tests' HTTP server
(``tests/servers/http_server.py``) on 127.0.0.1, each connection paced to ``--rate`` bytes/s so
that the link, not the loopback or the CPU, is the bottleneck (a per-connection limit stands for a
per-host link: every rank is its own host here). For each N and each round, two runs in fresh
processes, paired and in alternating order:

* ``whole``: every rank calls ``load_file(url)`` on its own (each reads every byte);
* ``group``: every rank calls ``load_file(url, process_group=pg)`` on a gloo group.

Each run reports the time to a loaded group (from a barrier before the loads to a barrier after
them, on rank 0), the bytes the server sent (body bytes of every answer, counted in the server),
and each rank's peak RSS above its RSS right before loading (``VmHWM`` after the load minus
``VmRSS`` before: torch and the imports are left out). Every rank's tensors are checked against
rank 0's digest. The load average is printed before and after. Medians over rounds.

What one machine cannot show: N hosts with N links. Here the ranks share the machine's cores
and its loopback, so the exchange (gloo over loopback TCP) competes with the reading for the same
CPU; on separate hosts each rank's link and CPU are its own, and the exchange runs over the
cluster network, which this does not model.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    """A ``VmHWM``/``VmRSS`` figure of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rank_main(url: str, mode: str, rank: int, world: int, port: int, out: str) -> None:
    """One rank: join the group, load, report (time, memory, digest) to ``out``."""
    import torch
    import torch.distributed as dist

    import stream_st.torch

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=120),
    )
    before = _status("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    if mode == "group":
        tensors = stream_st.torch.load_file(url, process_group=dist.group.WORLD)
    else:
        tensors = stream_st.torch.load_file(url)
    dist.barrier()
    elapsed = time.perf_counter() - start
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].reshape(-1).view(torch.uint8).numpy().tobytes())
    report = {"time": elapsed, "peak": _status("VmHWM") - before, "digest": digest.hexdigest()}
    Path(out, f"{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run(server: Any, url: str, mode: str, world: int) -> dict[str, Any]:
    """One run of ``world`` fresh rank processes in ``mode``; its figures."""
    server.settle()
    server.requests.clear()
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out:
        processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--rank-of",
                    url,
                    mode,
                    *map(str, (rank, world, port)),
                    out,
                ],
                env=env,
            )
            for rank in range(world)
        ]
        for process in processes:
            if process.wait(timeout=600) != 0:
                raise SystemExit(f"a rank failed ({mode}, N={world})")
        reports = [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(world)]
    server.settle()
    if len({report["digest"] for report in reports}) != 1:
        raise SystemExit(f"the ranks loaded different tensors ({mode}, N={world})")
    return {
        "time": reports[0]["time"],
        "served": sum(sent for method, _, _, sent in server.requests if method == "GET"),
        "peak": max(report["peak"] for report in reports),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4", help="group sizes, comma-separated")
    parser.add_argument("--mib", type=int, default=64, help="checkpoint size in MiB")
    parser.add_argument("--rate", type=float, default=40e6, help="bytes/s per connection")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank-of", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        url, mode, rank, world, port, out = args.rank_of
        rank_main(url, mode, int(rank), int(world), int(port), out)
        return
    sys.path.insert(0, str(ROOT))
    import torch
    from safetensors.torch import save

    from tests.servers.http_server import RangeHTTPServer

    per = args.mib * (1 << 20) // 16 // 4
    gen = torch.Generator().manual_seed(0)
    data = save({f"layer{i:02d}": torch.randn(per, generator=gen) for i in range(16)})
    print(
        f"checkpoint: {len(data) / 1e6:.1f} MB, 16 tensors; rate {args.rate / 1e6:.0f} MB/s "
        f"per connection; load average {os.getloadavg()}"
    )
    with RangeHTTPServer(objects={"/m.safetensors": data}, rate=args.rate) as server:
        url = server.url("/m.safetensors")
        for world in (int(each) for each in args.ranks.split(",")):
            results: dict[str, list[dict[str, Any]]] = {"whole": [], "group": []}
            ratios = []
            for round_ in range(args.rounds):
                order = ["whole", "group"] if round_ % 2 == 0 else ["group", "whole"]
                got = {mode: run(server, url, mode, world) for mode in order}
                for mode in order:
                    results[mode].append(got[mode])
                ratios.append(got["whole"]["time"] / got["group"]["time"])
            print(f"\nN={world} ranks, {args.rounds} rounds (medians):")
            heads = f"{'time s':>8} {'served MB':>10} {'x file':>7} {'peak RSS MB/rank':>17}"
            print(f"  {'mode':<6} {heads}")
            for mode, runs in results.items():
                seconds = statistics.median(r["time"] for r in runs)
                served = statistics.median(r["served"] for r in runs)
                peak = statistics.median(r["peak"] for r in runs)
                print(
                    f"  {mode:<6} {seconds:8.2f} {served / 1e6:10.1f} {served / len(data):7.2f} "
                    f"{peak / 1e6:17.0f}"
                )
            print(f"  whole/group time, paired median: {statistics.median(ratios):.2f}x")
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
