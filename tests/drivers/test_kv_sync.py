"""``send_kv`` takes a plain (sync) iterable of layers as it takes an async one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stream_st import SafetensorsError
from stream_st.kv import KVLayout, receive_kv, send_kv

SHAPE = (1, 2, 16, 8)


def layers(count: int) -> Iterator[tuple[int, Any, Any]]:
    for layer in range(count):
        yield layer, np.full(SHAPE, layer, np.float16), np.full(SHAPE, -layer, np.float16)


async def test_a_plain_generator_and_a_list_of_layers(tmp_path: Path) -> None:
    """A sync generator raised "'async for' requires an object with __aiter__"."""
    layout = KVLayout(num_layers=3, shape=SHAPE)
    for name, given in [("gen", layers(3)), ("list", list(layers(3)))]:
        path = tmp_path / f"{name}.safetensors"
        report = await send_kv(path, layout, given)
        assert len(report.sent_at) == 3
        got = []
        async with receive_kv(path) as kv_in:
            async for layer, key, value in kv_in:
                assert np.all(key == layer) and np.all(value == -layer)
                got.append(layer)
        assert got == [0, 1, 2]


async def test_neither_iterable_is_a_usage_error(tmp_path: Path) -> None:
    layout = KVLayout(num_layers=1, shape=SHAPE)
    with pytest.raises(SafetensorsError, match="iterable"):
        await send_kv(tmp_path / "x.safetensors", layout, 42)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())
