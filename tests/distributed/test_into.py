"""``open_stream(process_group=..., into=...)`` in a real gloo group of two ranks: ``into=``
names the header lacks, and memory given for several names, are refused on every rank alike
before any byte moves, as the docstring and docs/torch.md say."""

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
from .test_load import ok  # noqa: E402


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


def test_into_one_buffer_for_several_names_is_refused_with_a_group(
    tmp_path: Path, three: Path, pool: Pool
) -> None:
    """Was: the group received both tensors into the one buffer together and handed out mixed
    bytes for each; memory of its own for each name is received into and handed out whole."""
    shared = {"a": [0, 8], "c": [0, 8]}
    reports = pool.run(tmp_path, 2, mode="stream", src=str(three), into=shared)
    for report in reports:
        assert "into= gives 'a' and 'c' overlapping memory" in failed(report, "RankFailedError", 0)
    apart = {"a": [0, 8], "c": [1, 8]}
    for report in pool.run(tmp_path, 2, mode="stream", src=str(three), into=apart):
        got = ok(report)
        assert got["a"].tolist() == list(range(8))
        assert got["c"].tolist() == [100.0 + i for i in range(8)]
