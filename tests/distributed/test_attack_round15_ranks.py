"""Group streams found wrong by an attack (round 15), in real gloo groups of two ranks: a rank
that leaves its stream before iterating it, digests one rank cannot check, and ``include=`` or
``slices=`` names in no shard of a manifest (or of an index that lists no tensor). Each left
the other rank waiting until the group's timeout, or went unnoticed; now every rank raises
:class:`~stream_st.RankFailedError` naming the rank at fault, at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import load_file as reference_load  # noqa: E402
from safetensors.torch import save_file as reference_save  # noqa: E402

from ._group import Pool, run_group  # noqa: E402
from .test_failures import PROMPT, failed  # noqa: E402
from .test_load import assert_same, ok  # noqa: E402


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    path = tmp_path / "plain.safetensors"
    reference_save({"x": torch.arange(4.0), "y": torch.ones(2, 2)}, str(path))
    return path


def test_a_rank_leaving_before_iterating_fails_the_other_at_once(
    tmp_path: Path, plain: Path, pool: Pool
) -> None:
    """Rank 1 raises in its ``async with`` before its loop: it gets its own error back, rank 0
    learns at its first gather (it waited for the group's timeout), and the group goes on."""
    reports = pool.run(tmp_path, 2, mode="stream", src=str(plain), stop={"1": "leave"})
    assert reports[1]["error"] == "Stopped", reports[1]
    assert "left its stream" in failed(reports[0], "RankFailedError", 1)
    for report in reports:
        assert report["seconds"] < PROMPT, report
    for report in pool.run(tmp_path, 2, mode="load_file", src=str(plain)):
        assert_same(ok(report), reference_load(str(plain)))


def test_a_rank_closing_an_unopened_stream_on_a_broken_group_still_closes_it(
    tmp_path: Path, plain: Path
) -> None:
    """Rank 0 dies once open; rank 1 leaves before iterating: its gather (telling the group it
    left) fails with :class:`~stream_st.RankLostError`, raised once its source is closed (it
    was left open)."""
    stop = {"0": "die", "1": "close"}
    reports = run_group(tmp_path, 2, mode="stream", src=str(plain), stop=stop, timeout=5)
    assert reports[0].get("died") == -9, reports[0]
    assert "is gone" in failed(reports[1], "RankLostError", 0)
    assert reports[1]["closed"], reports[1]


def test_a_rank_closing_an_empty_index_before_iterating_returns_at_once(
    tmp_path: Path, pool: Pool
) -> None:
    """An index that lists no shard: rank 0 reads it to its end, rank 1 leaves before
    iterating. The others gather nothing after opening it, so rank 1 owes no gather (it waited
    for one until the group's timeout), and the group goes on."""
    index = str(_empty_index(tmp_path))
    reports = pool.run(tmp_path, 2, mode="stream", src=index, stop={"1": "close"})
    for report in reports:
        assert "error" not in report and report["names"] == [], report
        assert report["closed"] and report["seconds"] < PROMPT, report
    plain = tmp_path / "again.safetensors"
    reference_save({"x": torch.arange(4.0)}, str(plain))
    for report in pool.run(tmp_path, 2, mode="load_file", src=str(plain)):
        assert_same(ok(report), reference_load(str(plain)))


@pytest.mark.parametrize(
    ("verify", "more"), [([True, False], ""), ([True, True], " (and ranks [1])")]
)
def test_digests_a_rank_cannot_check_fail_every_rank(
    tmp_path: Path, pool: Pool, verify: list[bool], more: str
) -> None:
    """An unknown digest algorithm, checked on rank 0 (and rank 1): every rank raises
    :class:`~stream_st.RankFailedError` naming rank 0, where rank 0 raised a bare
    ``IntegrityError`` alone and rank 1 waited until the group's timeout."""
    src = tmp_path / "unknown.safetensors"
    reference_save({"w": torch.arange(8.0)}, str(src), metadata={"stream_st.digest": "nosuch"})
    options = [{"verify": each} for each in verify]
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(src), options=options)
    for report in reports:
        message = failed(report, "RankFailedError", 0)
        assert f"rank 0 failed{more}: IntegrityError" in message
        assert "'nosuch'" in message
        assert report["seconds"] < PROMPT, report


def _manifest(tmp_path: Path) -> Path:
    shards = []
    for i, tensors in enumerate([{"x": torch.arange(4.0)}, {"y": torch.ones(2, 2)}]):
        path = tmp_path / f"p{i}.safetensors"
        reference_save(tensors, str(path))
        shards.append({"shard_path": path.name, "bytes": path.stat().st_size})
    manifest = tmp_path / "dataset_manifest.json"
    manifest.write_text(json.dumps({"shards": shards}))
    return manifest


def _empty_index(tmp_path: Path) -> Path:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {}}))
    return index


@pytest.mark.parametrize(
    ("make", "params"),
    [
        (_manifest, {"include": [["x"], ["x", "typo"]]}),
        (_manifest, {"slices": [None, {"typo": [0, 1, 2]}]}),
        (_empty_index, {"include": [None, ["typo"]]}),
    ],
)
def test_names_in_no_shard_fail_every_rank(
    tmp_path: Path, pool: Pool, make: Any, params: dict[str, Any]
) -> None:
    """As a name a file lacks does (and as ``TensorNotFoundError`` is raised without a group):
    the names were ignored where the index did not list them up front."""
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(make(tmp_path)), **params)
    for report in reports:
        message = failed(report, "RankFailedError", 1)
        assert "TensorNotFoundError" in message and "'typo'" in message, report
        assert "tensors" not in report
