"""benchmarks/bench_kv.py's concurrent round: what it reports of the receivers."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st

pytestmark = pytest.mark.anyio


@pytest.fixture
def bench_kv(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The benchmark's module, imported as the benchmarks import one another."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    return importlib.import_module("bench_kv")


async def test_layers_ahead_counts_the_layers_verified_so_far(bench_kv: Any) -> None:
    """The most layers a receiver held verified past the one handed out counts those verified
    (``verified_at`` holds NaN for a layer not yet verified), where it took the list's length,
    always one for every layer, and reported the most there can be whatever happened."""
    layout = bench_kv.kv_layout(8, layers=12)
    rng = np.random.default_rng(0)
    base = [
        tuple(rng.standard_normal(layout.shape).astype(np.float16) for _ in range(2))
        for _ in range(layout.num_layers)
    ]
    async with stream_st.listen("127.0.0.1", 0, timeout=10) as listener:
        pair = await bench_kv.open_pair(listener)
        try:
            run = await bench_kv._concurrent_round([pair], base, layout, queue=2)
        finally:
            await pair.aclose()
    assert run["verified_transfers"] == 1
    assert 0 <= run["max_ahead"] < layout.num_layers - 1  # receive_kv's max_ahead=2 bounds it
