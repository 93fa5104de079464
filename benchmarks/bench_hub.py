"""Requests per read of a Hub checkpoint: ``hf://`` against ``huggingface_hub``, on a fake Hub.

The fake Hub (tests/servers/hub_server.py: the Hub on 127.0.0.1, its CDN on 127.0.0.2) holds a
single-file model and a sharded one (an index and ``--shards`` shards). Each row counts the
requests the Hub and the CDN received for one operation, by ``hf://`` and by the other way named
in the row (huggingface_hub, or the plain HTTP source on the resolve URL); ratio = ours / other.

    python benchmarks/bench_hub.py [--shards N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import safetensors.numpy as reference_numpy

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import stream_st
from stream_st.tools import inspect
from stream_st.transports.http.source import HttpSource
from stream_st.transports.hub import HubSource
from tests.servers.hub_server import CDN_HOST, FakeHub

INDEX_NAME = "model.safetensors.index.json"
PARALLEL_URL = "hf://org/single/model.safetensors"
PARALLEL: dict[str, Any] = {"concurrency": 4, "part_size": 256 << 10}


def checkpoint(shards: int) -> tuple[bytes, dict[str, bytes]]:
    """A single-file model and the files of a sharded one (~1 MB per shard)."""
    rng = np.random.default_rng(0)
    arrays = {
        f"layer{k}.{p}": rng.random((128, 256), np.float32) for k in range(shards) for p in "qkv"
    }
    single = reference_numpy.save(arrays)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for k in range(shards):
        name = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: a for n, a in arrays.items() if n.startswith(f"layer{k}.")}
        files[name] = reference_numpy.save(part)
        weight_map.update(dict.fromkeys(part, name))
    files[INDEX_NAME] = json.dumps({"weight_map": weight_map}).encode()
    return single, files


def counted(hub: FakeHub, run: Callable[[], Any]) -> tuple[int, int]:
    """(Hub requests, CDN requests) that ``run()`` made."""
    hub.log.clear()
    run()
    seen = hub.seen()
    cdn = sum(r.host == CDN_HOST for r in seen)
    return len(seen) - cdn, cdn


def ours(job: Callable[[], Awaitable[Any]]) -> Callable[[], Any]:
    return lambda: anyio.run(job)


async def read_everything(source: Any, **kwargs: Any) -> None:
    async for _ in stream_st.open_stream(source, **kwargs):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=4)
    args = parser.parse_args()
    single, files = checkpoint(args.shards)
    with FakeHub() as hub, tempfile.TemporaryDirectory() as cache:
        hub.push("org/single", {"model.safetensors": single})
        hub.push("org/sharded", files)
        os.environ.update(HF_ENDPOINT=hub.endpoint, HF_TOKEN=hub.token, HF_HUB_CACHE=cache)
        os.environ.update(HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
        import huggingface_hub  # reads its environment on import

        api = huggingface_hub.HfApi(endpoint=hub.endpoint, token=hub.token)
        index = "hf://org/sharded/model.safetensors.index.json"
        shards = sorted(name for name in files if name.endswith(".safetensors"))

        def download(*names: str) -> Callable[[], Any]:
            """huggingface_hub downloading ``names`` of the sharded repo into a fresh cache."""

            def run() -> None:
                with tempfile.TemporaryDirectory() as fresh:
                    for name in names:
                        api.hf_hub_download("org/sharded", name, cache_dir=fresh)

            return run

        def parallel(source: Callable[[], Any]) -> Callable[[], Any]:
            return ours(lambda: read_everything(source()))

        single_url = hub.url("org/single", "model.safetensors")
        rows = [
            (
                "header only, single file",
                counted(hub, ours(lambda: inspect("hf://org/single/model.safetensors"))),
                counted(hub, lambda: api.get_safetensors_metadata("org/single")),
                "get_safetensors_metadata",
            ),
            (
                f"header only, {len(shards)} shards",
                counted(hub, ours(lambda: inspect(index))),
                counted(hub, lambda: api.get_safetensors_metadata("org/sharded")),
                "get_safetensors_metadata",
            ),
            (
                f"full read, {len(shards)} shards",
                counted(hub, ours(lambda: read_everything(index))),
                counted(hub, download(INDEX_NAME, *shards)),
                "hf_hub_download x each file",
            ),
            (
                "include= one tensor",
                counted(hub, ours(lambda: read_everything(index, include=["layer0.q"]))),
                counted(hub, download(INDEX_NAME, shards[0])),
                "hf_hub_download index + shard",
            ),
            (
                "single file, concurrency=4",
                counted(hub, parallel(lambda: HubSource(PARALLEL_URL, **PARALLEL))),
                counted(hub, parallel(lambda: HttpSource(single_url, **PARALLEL))),
                "HttpSource(resolve URL)",
            ),
        ]
    print(f"{'operation':28} {'hf:// hub+cdn':>14} {'other hub+cdn':>14} {'ratio':>6}  other")
    for name, mine, theirs, what in rows:
        ratio = sum(mine) / sum(theirs)
        print(f"{name:28} {show(mine):>14} {show(theirs):>14} {ratio:6.2f}  {what}")


def show(counts: tuple[int, int]) -> str:
    return f"{counts[0]}+{counts[1]}={sum(counts)}"


if __name__ == "__main__":
    main()
