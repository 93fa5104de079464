"""Failures in a real gloo group: a rank killed with SIGKILL, a source that stalls on one rank,
a rank given another file or a name the file lacks. Every surviving rank raises a
:class:`~stream_st.SafetensorsError` naming the rank and the cause; nothing hangs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import load_file as reference_load  # noqa: E402
from safetensors.torch import save_file as reference_save  # noqa: E402

from tests.servers.http_server import RangeHTTPServer  # noqa: E402

from ._group import Pool, run_group  # noqa: E402
from .test_load import assert_same, ok  # noqa: E402


@pytest.fixture
def layers(tmp_path: Path) -> Path:
    """Eight tensors of 256 KiB: many stripes, so a failure lands mid-load."""
    gen = torch.Generator().manual_seed(3)
    path = tmp_path / "layers.safetensors"
    reference_save({f"layer{i}": torch.randn(256, 256, generator=gen) for i in range(8)}, str(path))
    return path


def failed(report: dict[str, Any], kind: str, rank: int) -> str:
    """The message of ``report``'s error, checked to be ``kind`` naming ``rank``."""
    assert report.get("error") == kind, report
    assert report["distributed"] and report["safetensors_error"], report
    assert report["failed_rank"] == rank, report
    assert f"rank {rank}" in report["message"], report
    message: str = report["message"]
    return message


def test_a_killed_rank_is_named_by_the_others(tmp_path: Path, layers: Path) -> None:
    reports = run_group(tmp_path, 3, mode="stream", src=str(layers), kill=1, timeout=20)
    assert reports[1].get("died") == -9, reports[1]
    for survivor in (reports[0], reports[2]):
        assert "is gone" in failed(survivor, "RankLostError", 1)


def test_a_source_failing_on_one_rank_fails_every_rank(
    tmp_path: Path, layers: Path, pool: Pool
) -> None:
    data = layers.read_bytes()
    with (
        RangeHTTPServer(objects={"/m": data}) as good,
        RangeHTTPServer(objects={"/m": data}, stall_after=100_000, no_range=True) as stalled,
    ):
        srcs = [good.url("/m"), stalled.url("/m"), good.url("/m")]
        reports = pool.run(tmp_path, 3, mode="load_file", srcs=srcs, options={"timeout": 1.0})
        for report in reports:
            assert "ReadTimeoutError" in failed(report, "RankFailedError", 1)
            assert "tensors" not in report  # nobody handed out a partial model
        # The group is still in step: the next load works.
        again = pool.run(tmp_path, 3, mode="load_file", src=good.url("/m"))
    for report in again:
        assert_same(ok(report), reference_load(str(layers)))


def test_another_file_on_one_rank(tmp_path: Path, layers: Path, pool: Pool) -> None:
    other = tmp_path / "other.safetensors"
    reference_save({"layer0": torch.zeros(3)}, str(other))
    reports = pool.run(tmp_path, 2, mode="load_file", srcs=[str(layers), str(other)])
    for report in reports:
        assert "header differs" in failed(report, "RankFailedError", 1)


def test_a_name_the_file_lacks(tmp_path: Path, layers: Path, pool: Pool) -> None:
    include = [["layer0"], ["layer1", "nope"]]
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(layers), include=include)
    for report in reports:
        assert "nope" in failed(report, "RankFailedError", 1)


def test_a_missing_source_on_one_rank(tmp_path: Path, layers: Path, pool: Pool) -> None:
    srcs = [str(layers), str(tmp_path / "absent.safetensors")]
    reports = pool.run(tmp_path, 2, mode="stream", srcs=srcs)
    for report in reports:
        assert "SourceNotFoundError" in failed(report, "RankFailedError", 1)
