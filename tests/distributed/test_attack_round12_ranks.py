"""Group loads found wrong by an attack (round 12), in real gloo groups: a model with tied
weights on one rank, ranks given different indexes (or an index and a file), a manifest whose
shards repeat names, ``device="meta"`` and a ``process_group=`` that is no process group."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import save_file as reference_save  # noqa: E402

import stream_st  # noqa: E402
import stream_st.torch  # noqa: E402

from ._group import Pool, free_port, spawn  # noqa: E402
from .test_failures import PROMPT, failed  # noqa: E402
from .test_load import ok, write_index  # noqa: E402

TIED = textwrap.dedent(
    """
    import datetime, json, sys
    import torch, torch.distributed as dist
    import stream_st.torch

    src, out, port, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), 2
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )

    class Model(torch.nn.Module):
        def __init__(self, tie):
            super().__init__()
            for i in range(6):
                self.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(64, 64)))
            if tie:
                self.w1 = self.w0  # one Parameter under two names

    model = Model(tie=rank == 1)
    stream_st.torch.load_model(model, src, process_group=dist.group.WORLD, strict=False)
    alone = Model(tie=rank == 1)
    stream_st.torch.load_model(alone, src, strict=False)
    got = {name: t.tolist() for name, t in model.state_dict().items()}
    single = {name: t.tolist() for name, t in alone.state_dict().items()}
    with open(f"{out}/rank{rank}.json", "w") as file:
        json.dump({"got": got, "single": single}, file)
    dist.destroy_process_group()
    """
)


def test_tied_weights_on_one_rank_corrupt_no_rank(tmp_path: Path) -> None:
    """Rank 1's model ties ``w1`` to ``w0``: every rank ends up with the file's bytes, as the
    single-process ``load_model`` gives them (rank 0's plain model: each its own tensor)."""
    gen = torch.Generator().manual_seed(12)
    src = tmp_path / "tied.safetensors"
    reference_save({f"w{i}": torch.randn(64, 64, generator=gen) for i in range(6)}, str(src))
    script = tmp_path / "tied.py"
    script.write_text(TIED)
    port = str(free_port())
    _, errors = spawn(
        [
            [sys.executable, str(script), str(src), str(tmp_path), port, str(rank)]
            for rank in range(2)
        ]
    )
    for rank in range(2):
        path = tmp_path / f"rank{rank}.json"
        assert path.exists(), errors[rank][-3000:]
        report = json.loads(path.read_text())
        assert report["got"] == report["single"], f"rank {rank}"
    plain = json.loads((tmp_path / "rank0.json").read_text())["got"]
    expected = stream_st.torch.load_file(str(src))
    for name, tensor in expected.items():
        assert torch.equal(torch.tensor(plain[name]), tensor), name


@pytest.fixture
def every() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(5)
    return {f"t{i}": torch.randn(32, 32, generator=gen) for i in range(4)}


def test_different_indexes_fail_every_rank(
    tmp_path: Path, every: dict[str, Any], pool: Pool
) -> None:
    full = write_index(tmp_path, every, 2)
    half = tmp_path / "half.safetensors.index.json"
    half.write_text(json.dumps({"weight_map": dict.fromkeys(["t0", "t1"], "m-1.safetensors")}))
    reports = pool.run(tmp_path, 2, mode="load_file", srcs=[str(full), str(half)])
    for report in reports:
        assert "index differs" in failed(report, "RankFailedError", 1)
        assert report["seconds"] < PROMPT
        assert "tensors" not in report  # nobody handed out a partial model
    again = pool.run(tmp_path, 2, mode="load_file", src=str(full))  # the group is in step
    for report in again:
        assert sorted(ok(report)) == sorted(every)


def test_an_index_and_a_file_fail_every_rank(
    tmp_path: Path, every: dict[str, Any], pool: Pool
) -> None:
    full = write_index(tmp_path, every, 2)
    shard = tmp_path / "m-1.safetensors"
    reports = pool.run(tmp_path, 2, mode="load_file", srcs=[str(full), str(shard)])
    for report in reports:
        assert "differs from rank 0's" in failed(report, "RankFailedError", 1)
        assert report["seconds"] < PROMPT
        assert "tensors" not in report


def test_a_manifest_repeating_names_is_refused(tmp_path: Path, pool: Pool) -> None:
    """As the single-process ``load_file`` refuses it: one dict cannot hold both ``x``."""
    shards = []
    for i in range(2):
        path = tmp_path / f"s{i}.safetensors"
        reference_save({"x": torch.full((4,), float(i)), "y": torch.zeros(2)}, str(path))
        shards.append({"shard_path": path.name, "bytes": path.stat().st_size})
    manifest = tmp_path / "dataset_manifest.json"
    manifest.write_text(json.dumps({"shards": shards}))
    with pytest.raises(stream_st.UsageError, match="in more than one shard"):
        stream_st.torch.load_file(str(manifest))
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(manifest))
    for report in reports:
        assert report.get("error") == "UsageError", report
        assert "'x' is in more than one shard" in report["message"]
    # A stream of it is still read, shard after shard.
    reports = pool.run(tmp_path, 2, mode="stream", src=str(manifest))
    for report in reports:
        assert sorted(ok(report)) == ["x", "y"]


def test_device_meta_is_refused_on_every_rank(
    tmp_path: Path, every: dict[str, Any], pool: Pool
) -> None:
    src = tmp_path / "plain.safetensors"
    reference_save(every, str(src))
    options: list[dict[str, Any]] = [{}, {"device": "meta"}]
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(src), options=options)
    for report in reports:
        message = failed(report, "RankFailedError", 1)
        assert "only the CPU and CUDA devices are supported" in message


@pytest.mark.parametrize("device", ["cpu:1", "xla"])
def test_a_refused_device_fails_every_rank_as_without_a_group(
    tmp_path: Path, every: dict[str, Any], pool: Pool, device: str
) -> None:
    """The group's own copy of the device check took ``"cpu:1"`` and refused ``"xla"`` with a
    UsageError alone, where the single-process load raises a DeviceError and an
    UnsupportedDeviceError: the group tells the same error to every rank."""
    src = tmp_path / "plain.safetensors"
    reference_save(every, str(src))
    with pytest.raises(stream_st.UsageError) as alone:
        stream_st.torch.load_file(str(src), device=device)
    told = f"{type(alone.value).__name__}: {alone.value}"
    options: list[dict[str, Any]] = [{}, {"device": device}]
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(src), options=options, timeout=20)
    for report in reports:
        assert told in failed(report, "RankFailedError", 1)


def test_process_group_that_is_no_group(tmp_path: Path, every: dict[str, Any]) -> None:
    src = tmp_path / "plain.safetensors"
    reference_save(every, str(src))
    with pytest.raises(stream_st.ArgumentTypeError, match="process_group="):
        stream_st.torch.load_file(str(src), process_group="world")
    with pytest.raises(stream_st.ArgumentTypeError, match="process_group="):
        stream_st.torch.load_model(torch.nn.Linear(2, 2), str(src), process_group="world")
