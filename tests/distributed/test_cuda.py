"""The group load on a CUDA device: skipped without one. With one device, an NCCL group of one
rank (its collectives on the device) and a gloo group of two ranks handing tensors out on the
device; with two or more, an NCCL group of two ranks, one device each (NCCL takes one device per
rank). Every tensor is compared bit for bit with the reference's on the device it was handed
out on. Run on a CUDA machine with ``pytest tests/distributed -k cuda`` (well under a minute)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not torch.cuda.is_available() or not dist.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from safetensors.torch import load_file as reference_load  # noqa: E402
from safetensors.torch import save_file as reference_save  # noqa: E402

from ._group import run_group  # noqa: E402
from .test_load import assert_same, ok, tensors  # noqa: E402


@pytest.mark.parametrize(("backend", "world"), [("nccl", 1), ("gloo", 2), ("nccl", 2)])
def test_cuda_load_is_bit_exact_on_the_device(tmp_path: Path, backend: str, world: int) -> None:
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip("NCCL takes one device per rank: two ranks on one device run with gloo")
    path = tmp_path / "model.safetensors"
    reference_save(tensors(), str(path))
    # Two ranks: one tensor cut across them, slices read alone and slices sent point to point.
    slices = [{"w0": [0, rank, 2], "w1": [1, rank, 2], "big": [-1, rank, 2]} for rank in range(2)]
    reports = run_group(
        tmp_path,
        world,
        mode="load_file",
        backend=backend,
        src=str(path),
        options={"device": "cuda"},
        slices=slices[:world] if world > 1 else [None],
        reference=str(path),
    )
    expected = reference_load(str(path))
    for rank, report in enumerate(reports):
        got = ok(report)
        device = rank % torch.cuda.device_count() if backend == "nccl" else 0
        assert report["devices"] == [f"cuda:{device}"], report
        assert report["unequal"] == [], report
        wanted = dict(expected)
        for name, (dim, part, parts) in (slices[rank] if world > 1 else {}).items():
            wanted[name] = torch.tensor_split(expected[name], parts, dim=dim)[part].contiguous()
        assert_same(got, wanted)
