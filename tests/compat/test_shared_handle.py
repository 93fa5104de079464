"""One ``safe_open`` of a sharded index shared by many threads opens each shard once."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st.numpy

from ..servers.http_server import RangeHTTPServer

SHARDS = 4
THREADS = 16


@pytest.fixture
def index_url() -> Iterator[tuple[RangeHTTPServer, str, dict[str, str]]]:
    with RangeHTTPServer() as server:
        weight_map: dict[str, str] = {}
        for shard in range(SHARDS):
            name = f"model-{shard + 1:05}-of-{SHARDS:05}.safetensors"
            arrays = {f"t{shard}_{k}": np.full(1000, k, np.float32) for k in range(4)}
            server.objects["/" + name] = reference_numpy.save(arrays)
            weight_map.update(dict.fromkeys(arrays, name))
        document = {"metadata": {}, "weight_map": weight_map}
        server.objects["/model.safetensors.index.json"] = json.dumps(document).encode()
        yield server, server.url("/model.safetensors.index.json"), weight_map


def test_threads_sharing_a_handle_open_each_shard_once(
    index_url: tuple[RangeHTTPServer, str, dict[str, str]],
) -> None:
    server, url, weight_map = index_url
    got: list[dict[str, float]] = []
    with stream_st.numpy.safe_open(url, "np") as handle:
        start = threading.Barrier(THREADS)

        def work() -> None:
            start.wait()
            got.append({name: float(handle.get_tensor(name)[0]) for name in sorted(weight_map)})

        threads = [threading.Thread(target=work) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(got) == THREADS and all(found == got[0] for found in got)
    server.settle()
    headers = Counter(
        path for _, path, range_, _ in server.requests if range_.startswith("bytes=0-")
    )
    shards = {f"/model-{shard + 1:05}-of-{SHARDS:05}.safetensors" for shard in range(SHARDS)}
    assert {path: headers[path] for path in shards} == dict.fromkeys(shards, 1)
