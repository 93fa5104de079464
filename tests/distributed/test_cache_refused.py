"""``cache=`` with a read split across ranks is refused, never silently ignored; ``include=``
without a group is an ordinary read of those tensors, and caches what it read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st

torch = pytest.importorskip("torch")
import stream_st.torch as st_torch  # noqa: E402


@pytest.fixture
def path(tmp_path: Path) -> Path:
    out = tmp_path / "m.safetensors"
    reference_numpy.save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3)}, str(out))
    return out


def test_load_model_refuses_cache_with_a_split_read(path: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    model = torch.nn.Linear(3, 2, bias=False)
    with pytest.raises(stream_st.UsageError, match="cache= does not go with"):
        st_torch.load_model(model, path, include=["a"], cache=cache, strict=False)
    assert not cache.exists()


def test_load_file_with_include_and_no_group_reads_those_tensors(path: Path) -> None:
    """Was: "slices= needs process_group=", for a call with neither."""
    loaded = st_torch.load_file(path, include=["a"])
    assert list(loaded) == ["a"] and loaded["a"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert st_torch.load_file(path, include=lambda name: name != "a") == {}


async def test_open_stream_refuses_cache_with_slices(path: Path, tmp_path: Path) -> None:
    """The refusal comes first, before slices='s own need of a group is checked."""
    with pytest.raises(stream_st.UsageError, match="cache= does not go with"):
        stream_st.open_stream(path, slices={"a": (0, 0, 2)}, cache=tmp_path / "cache")
