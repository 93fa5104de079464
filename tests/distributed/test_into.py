"""``open_stream(process_group=..., into=...)`` in a real gloo group of two ranks: ``into=``
names the header lacks are refused on every rank alike before any byte moves, as the
docstring says."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import save_file as reference_save  # noqa: E402

from ._group import Pool  # noqa: E402
from .test_failures import failed  # noqa: E402


@pytest.fixture
def three(tmp_path: Path) -> Path:
    path = tmp_path / "three.safetensors"
    every = {"a": torch.arange(8.0), "b": torch.arange(6.0), "c": torch.arange(8.0) + 100}
    reference_save(every, str(path))
    return path


def test_into_a_name_not_in_the_header_fails_every_rank(
    tmp_path: Path, three: Path, pool: Pool
) -> None:
    """Was: taken silently with a group, where without one it is a TensorNotFoundError."""
    reports = pool.run(tmp_path, 2, mode="stream", src=str(three), into={"zz": [0, 5]})
    for report in reports:
        assert "TensorNotFoundError: into= names tensors not in the header: ['zz']" in failed(
            report, "RankFailedError", 0
        )
