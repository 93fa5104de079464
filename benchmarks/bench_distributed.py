"""N ranks, each in its own network namespace with its own shaped link to an object store, loading
one checkpoint: each rank reading it whole, against a process group sharing the read
(``stream_st.torch.load_file(url, process_group=pg)``), against runai-model-streamer's
distributed mode.

Run it from the repository root, as root (namespaces, veth pairs, ``tc``; torch with gloo, and
runai-model-streamer[s3] for its variant)::

    sudo python benchmarks/bench_distributed.py [--ranks 2,4] [--gib 1] [--rate 50e6]
        [--delay-ms 15] [--rounds 2] [--modes whole,group,runai] [--dir DIR]

Without root (or without ``ip``/``tc``/``nginx``) it prints ``skipped: <reason>`` and exits 0.

The network, made of real parts:

* the store: nginx serving ``DIR/bench/`` path-style as an S3 endpoint in a namespace of its own
  (``benchmarks/netns_store.py``), each answer logged with its client's address and the body
  bytes it sent;
* each rank in a namespace of its own, with its own link to the store: a veth pair into the
  store's namespace, limited to ``--rate`` bytes/s from the store to the rank (one HTB class for
  the whole link, whatever the connections on it), and a round trip of ``2 * --delay-ms`` per
  request (netem on the link where the kernel has it, else nginx waiting before each answer);
* a hub namespace, a bridge with one unshaped veth pair to each rank: the group's traffic
  (gloo) goes there, never over the store links.

A checkpoint of ``--gib`` GiB (16 F32 tensors) is written once into ``DIR/bench/`` (a temporary
folder unless ``--dir``). For each N and each round, one run per mode, each in N fresh rank
processes, the order rotated each round:

* ``whole``: every rank calls ``load_file("s3://bench/...")`` on its own (each reads every byte);
* ``group``: every rank calls ``load_file("s3://bench/...", process_group=pg)`` on a gloo group;
* ``runai``: every rank streams the file with runai-model-streamer's ``SafetensorsStreamer``,
  ``is_distributed=True``, on the same gloo group, ``RUNAI_STREAMER_DIST=1`` (its distributed
  mode takes gloo and the CPU only when told so), keeping every tensor.

Each run reports the time until every rank holds the model (rank 0, from a barrier before the
loads to one after them), the bytes the store sent to each rank and in all (from nginx's log,
by the rank's address), and each rank's peak RSS above its RSS right before loading (``VmHWM``
after the load minus ``VmRSS`` before: torch and the imports are left out). Every rank's
tensors are checked against the others' (an xxh3 digest of every tensor's bytes). Printed per
N: medians over rounds, each mode's time over ``whole``'s paired per round (median and range),
the bars (bytes from the store within 1.02x the file with a group; a group's time at most 0.6x
``whole``'s at N = 4), and the load average before and after.

What one machine does not show: the ranks share its cores and memory (here the exchange, gloo
over the hub's veth pairs, competes with the reading for the same CPU; on separate hosts each
rank's CPU and links are its own).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(Path(__file__).resolve())
KEY = "m.safetensors"
TENSORS = 16
MODES = ("whole", "group", "runai")
BAR_SERVED = 1.02  # bytes from the store with a group, x the file
BAR_TIME = 0.6  # a group's time over whole's at N = 4
GROUP_PORT = 29500


def _status(field: str) -> int:
    """A ``VmHWM``/``VmRSS`` figure of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def rank_main(mode: str, rank: int, world: int, master: str, port: int, out: str) -> None:
    """One rank, in its namespace: join the group, load, report (time, memory, digest)."""
    import torch
    import torch.distributed as dist
    import xxhash
    from bench_peers_remote import BUCKET

    import stream_st.torch

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{master}:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    url = f"s3://{BUCKET}/{KEY}"
    before = _status("VmRSS")
    dist.barrier()
    start = time.perf_counter()
    if mode == "group":
        tensors = stream_st.torch.load_file(url, process_group=dist.group.WORLD)
    elif mode == "whole":
        tensors = stream_st.torch.load_file(url)
    else:
        runai = importlib.import_module("runai_model_streamer")  # no type hints

        with runai.SafetensorsStreamer() as streamer:
            streamer.stream_file(url, device="cpu", is_distributed=True)
            tensors = dict(streamer.get_tensors())
    dist.barrier()
    elapsed = time.perf_counter() - start
    peak = _status("VmHWM") - before
    digest = xxhash.xxh3_128()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().reshape(-1).view(torch.uint8).numpy().data)
    figures = {"time": elapsed, "peak": peak, "digest": digest.hexdigest()}
    Path(out, f"{rank}.json").write_text(json.dumps(figures))
    dist.destroy_process_group()


class RankNetwork:
    """``ranks`` namespaces, each with a shaped link to ``store`` and an unshaped one to a hub
    (see the module); removed on exit, also after an error."""

    def __init__(self, store: Any, ranks: int, rate: int) -> None:
        self.store = store
        self.rate = rate
        self.pid = pid = os.getpid()
        self.hub = f"stst-hub-{pid}"
        self.namespaces = [f"stst-rank-{pid}-{rank}" for rank in range(ranks)]
        self._store_net = f"10.214.{pid % 250 + 1}"
        self._group_net = f"10.215.{pid % 250 + 1}"

    def address(self, rank: int) -> str:
        """The rank's address on its link to the store (the client nginx logs)."""
        return f"{self._store_net}.{4 * rank + 2}"

    def group_address(self, rank: int) -> str:
        """The rank's address on the hub."""
        return f"{self._group_net}.{rank + 1}"

    def group_device(self, rank: int) -> str:
        """The rank's interface to the hub (its ``GLOO_SOCKET_IFNAME``)."""
        return f"gr{self.pid}r{rank}"[:15]

    def __enter__(self) -> RankNetwork:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _build(self) -> None:
        from netns_store import rate_limit, run_tool

        store = self.store
        hub = ("ip", "netns", "exec", self.hub)
        run_tool("ip", "netns", "add", self.hub)
        run_tool(*hub, "ip", "link", "add", "hub", "type", "bridge")
        run_tool(*hub, "ip", "link", "set", "hub", "up")
        for rank, namespace in enumerate(self.namespaces):
            inside = ("ip", "netns", "exec", namespace)
            run_tool("ip", "netns", "add", namespace)
            run_tool(*inside, "ip", "link", "set", "lo", "up")
            # The store link: shaped on the store's side (what the rank downloads).
            near, far = f"sk{self.pid}r{rank}"[:15], f"sr{self.pid}r{rank}"[:15]
            gateway = f"{self._store_net}.{4 * rank + 1}"
            run_tool("ip", "link", "add", near, "type", "veth", "peer", "name", far)
            run_tool("ip", "link", "set", near, "netns", store.namespace)
            run_tool("ip", "link", "set", far, "netns", namespace)
            run_tool(*store.inside("ip", "addr", "add", f"{gateway}/30", "dev", near))
            run_tool(*store.inside("ip", "link", "set", near, "up"))
            run_tool(*store.inside("tc", "-batch", "-"), stdin=rate_limit(near, self.rate))
            run_tool(*inside, "ip", "addr", "add", f"{self.address(rank)}/30", "dev", far)
            run_tool(*inside, "ip", "link", "set", far, "up")
            run_tool(*inside, "ip", "route", "add", f"{store.store_address}/32", "via", gateway)
            if store.delay_on_link:  # else nginx waits before each answer
                delay = f"{2 * store.delay_ms:g}ms"
                run_tool(*inside, "tc", "qdisc", "add", "dev", far, "root", "netem", "delay", delay)
            # The group link: to the hub's bridge, not shaped.
            port, device = f"gh{self.pid}r{rank}"[:15], self.group_device(rank)
            run_tool("ip", "link", "add", port, "type", "veth", "peer", "name", device)
            run_tool("ip", "link", "set", port, "netns", self.hub)
            run_tool("ip", "link", "set", device, "netns", namespace)
            run_tool(*hub, "ip", "link", "set", port, "master", "hub", "up")
            run_tool(*inside, "ip", "addr", "add", f"{self.group_address(rank)}/24", "dev", device)
            run_tool(*inside, "ip", "link", "set", device, "up")

    def close(self) -> None:
        """Delete the namespaces (their veth pairs go with them)."""
        for namespace in [*self.namespaces, self.hub]:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)

    def run(self, mode: str, world: int, port: int) -> dict[str, Any]:
        """One run of ``world`` fresh rank processes in ``mode``; its figures."""
        from bench_peers_remote import CREDENTIALS

        logged = len(self.store.served())
        with tempfile.TemporaryDirectory() as out:
            processes = []
            for rank in range(world):
                env = dict(
                    os.environ,
                    **CREDENTIALS,
                    PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")]),
                    OMP_NUM_THREADS="1",
                    TORCH_CPP_LOG_LEVEL="ERROR",  # not c10d's reverse look-ups of the hub's
                    GLOO_SOCKET_IFNAME=self.group_device(rank),
                    AWS_ENDPOINT_URL=self.store.endpoint,
                    RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING="0",
                    RUNAI_STREAMER_DIST="1",
                )
                rank_of = (mode, rank, world, self.group_address(0), port, out)
                command = [sys.executable, SCRIPT, "--rank-of", *map(str, rank_of)]
                inside = ["ip", "netns", "exec", self.namespaces[rank]]
                processes.append(subprocess.Popen([*inside, *command], env=env))
            for process in processes:
                if process.wait(timeout=900) != 0:
                    raise SystemExit(f"a rank failed ({mode}, N={world})")
            reports = [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(world)]
        if len({report["digest"] for report in reports}) != 1:
            raise SystemExit(f"the ranks loaded different tensors ({mode}, N={world})")
        sent: dict[str, int] = defaultdict(int)
        for client, nbytes in self.store.served()[logged:]:
            sent[client] += nbytes
        return {
            "time": reports[0]["time"],
            "served": [sent[self.address(rank)] for rank in range(world)],
            "peak": [report["peak"] for report in reports],
        }


def write_checkpoint(path: Path, gib: float) -> int:
    """``path``: ``gib`` GiB in :data:`TENSORS` F32 tensors (kept if already there); its size."""
    if not path.exists():
        import numpy as np
        from safetensors.numpy import save_file

        per = int(gib * (1 << 30)) // TENSORS // 4
        rng = np.random.default_rng(0)
        tensors = {
            f"layer{i:02d}": rng.standard_normal(per, dtype=np.float32) for i in range(TENSORS)
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path) + ".part")
        os.replace(str(path) + ".part", path)
    return path.stat().st_size


def spread(values: Sequence[float]) -> str:
    """``median [low-high]``."""
    return f"{statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def report(world: int, size: int, results: dict[str, list[dict[str, Any]]]) -> None:
    """Print one group size's table, paired ratios and bars."""
    rounds = len(next(iter(results.values())))
    print(f"\nN={world} ranks, {rounds} rounds (medians; per rank: rank 0 first)")
    print(
        f"  {'mode':<6} {'time s':>7} {'served MB':>10} {'x file':>7}  "
        f"{'served per rank MB':<28} peak RSS per rank MB"
    )
    for mode, runs in results.items():
        seconds = statistics.median(run["time"] for run in runs)
        total = statistics.median(sum(run["served"]) for run in runs)
        per_rank = [statistics.median(run["served"][r] for run in runs) for r in range(world)]
        peaks = [statistics.median(run["peak"][r] for run in runs) for r in range(world)]
        print(
            f"  {mode:<6} {seconds:7.2f} {total / 1e6:10.1f} {total / size:7.3f}  "
            f"{' '.join(f'{each / 1e6:.0f}' for each in per_rank):<28} "
            f"{' '.join(f'{each / 1e6:.0f}' for each in peaks)}"
        )
    base = results.get("whole")
    for mode, runs in results.items():
        if mode == "whole" or base is None:
            continue
        ratios = [run["time"] / whole["time"] for run, whole in zip(runs, base, strict=True)]
        line = f"  {mode}/whole time, paired per round: {' '.join(f'{r:.2f}' for r in ratios)}"
        line += f"; median {spread(ratios)}"
        if mode == "group" and world == 4:
            met = "met" if statistics.median(ratios) <= BAR_TIME else "not met"
            line += f" (bar <= {BAR_TIME}x at N=4: {met})"
        print(line)
    if "group" in results:
        worst = max(sum(run["served"]) for run in results["group"]) / size
        met = "met" if worst <= BAR_SERVED else "not met"
        print(
            f"  group: bytes from the store, most of any round {worst:.3f}x the file "
            f"(bar <= {BAR_SERVED}x: {met})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4", help="group sizes, comma-separated")
    parser.add_argument("--gib", type=float, default=1.0, help="checkpoint size in GiB")
    parser.add_argument("--rate", type=float, default=50e6, help="bytes/s of each rank's link")
    parser.add_argument("--delay-ms", type=float, default=15.0, help="added each way")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dir", type=Path, help="where the checkpoint is written (kept)")
    parser.add_argument("--rank-of", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    if args.rank_of:
        mode, rank, world, master, port, out = args.rank_of
        rank_main(mode, int(rank), int(world), master, int(port), out)
        return
    from bench_peers_remote import BUCKET
    from netns_store import NetnsStore, StoreUnavailable, check_available

    modes = [mode for mode in args.modes.split(",") if mode]
    if "runai" in modes and importlib.util.find_spec("runai_model_streamer") is None:
        modes.remove("runai")
        print("runai-model-streamer is not installed: its mode is left out")
    worlds = [int(each) for each in args.ranks.split(",")]
    try:
        check_available()
    except StoreUnavailable as exc:
        print(f"skipped: {exc}")
        return
    folder = args.dir or Path(tempfile.mkdtemp(prefix="bench-distributed-"))
    try:
        size = write_checkpoint(folder / BUCKET / KEY, args.gib)
        with (
            NetnsStore(folder, delay_ms=args.delay_ms, access_log=True) as store,
            RankNetwork(store, max(worlds), int(args.rate)) as network,
        ):
            where = "netem on each link" if store.delay_on_link else "nginx echo_sleep"
            print(
                f"checkpoint: {size / 1e6:.1f} MB, {TENSORS} F32 tensors; each rank's link "
                f"{args.rate / 1e6:g} MB/s, round trip {2 * args.delay_ms:g} ms per request "
                f"({where}); group over an unshaped bridge"
            )
            port = GROUP_PORT
            for world in worlds:
                print(f"\nload average before N={world}: {os.getloadavg()}")
                results: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
                for round_ in range(args.rounds):
                    turn = round_ % len(modes)
                    for mode in modes[turn:] + modes[:turn]:
                        port += 1
                        results[mode].append(network.run(mode, world, port))
                report(world, size, results)
    except StoreUnavailable as exc:
        print(f"skipped: {exc}")
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"\nload average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
