"""``cache=`` on a sharded checkpoint read by its ``*.index.json`` address: the index and every
shard are kept as single files are, and a second read, or an offline one, fetches no byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy as reference_numpy

import stream_st
from stream_st.transports.cache import Cache

from .._util import assert_same_arrays
from ..servers.http_server import RangeHTTPServer
from ..servers.hub_server import FakeHub

Arrays = dict[str, np.ndarray[Any, Any]]
SHARDS: dict[str, Arrays] = {
    "model-00001-of-00002.safetensors": {"a": np.arange(3000, dtype=np.float32)},
    "model-00002-of-00002.safetensors": {"b": np.ones((40, 50)), "c": np.arange(7)},
}
EVERY: Arrays = {name: array for arrays in SHARDS.values() for name, array in arrays.items()}
INDEX = json.dumps(
    {
        "metadata": {},
        "weight_map": {name: shard for shard, arrays in SHARDS.items() for name in arrays},
    }
).encode()
FILES = {"model.safetensors.index.json": INDEX} | {
    shard: reference_numpy.save(arrays) for shard, arrays in SHARDS.items()
}


async def read(source: str, **options: Any) -> Arrays:
    return {name: array async for name, array in stream_st.open_stream(source, **options)}


def body_bytes(server: RangeHTTPServer) -> int:
    server.settle()
    return sum(sent for _, _, _, sent in server.requests)


async def test_an_index_and_its_shards_are_kept_and_read_again_from_the_copies(
    tmp_path: Path,
) -> None:
    objects = {f"/ckpt/{name}": data for name, data in FILES.items()}
    with RangeHTTPServer(objects=objects, etag="strong") as running:
        url = running.url("/ckpt/model.safetensors.index.json")
        assert_same_arrays(await read(url, cache=tmp_path), EVERY)
        copies = sorted(p.read_bytes() for p in (tmp_path / "objects").rglob("*.safetensors"))
        assert copies == sorted(FILES.values())  # the index too
        running.requests.clear()
        assert_same_arrays(await read(url, cache=tmp_path), EVERY)
        assert body_bytes(running) == 0  # three conditional requests, each a 304
        assert len(running.requests) == 3
    # the server is gone: offline, everything comes from the copies
    offline = Cache(tmp_path, tmp_path / "hub", offline=True)
    assert_same_arrays(await read(url, cache=offline, include=["c"]), {"c": EVERY["c"]})


async def test_a_hub_checkpoint_goes_into_the_hugging_face_layout_at_one_commit(
    hub: FakeHub, tmp_path: Path
) -> None:
    commit = hub.push("org/model", FILES)
    address = "hf://org/model/model.safetensors.index.json"
    assert_same_arrays(await read(address, cache=True), EVERY)
    snapshot = tmp_path / "hub-cache" / "models--org--model" / "snapshots" / commit
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == FILES
    hub.push("org/model", {"model-00001-of-00002.safetensors": b"not this commit's"})
    hub.log.clear()
    # offline: the index's commit, and every shard from that same commit
    assert_same_arrays(await read(address, cache="offline"), EVERY)
    assert hub.log == []
