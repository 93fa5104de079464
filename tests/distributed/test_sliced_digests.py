"""Slices of a file whose header records digests, in real gloo groups of two ranks (found by an
attack): a part has no digest of its own, so a tensor a checking rank wants a slice of is read
whole by its owner and checked before it is cut or sent. A damaged tensor made every rank raise
:class:`~stream_st.RankFailedError` when read whole, but its parts were handed out unchecked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

import stream_st.torch  # noqa: E402

from ._group import Pool  # noqa: E402
from .test_failures import PROMPT, failed  # noqa: E402
from .test_load import ok  # noqa: E402

SLICES = {  # per rank: halves along dim 0 (contiguous, read alone unchecked) or dim 1
    "dim0": [{"w": [0, 0, 2]}, {"w": [0, 1, 2]}],
    "dim1": [{"w": [1, 0, 2]}, {"w": [1, 1, 2]}],
    "mixed": [None, {"w": [0, 1, 2]}],  # rank 0 wants w whole
}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    """A checksummed file, and a copy with the last byte of ``w`` changed (in rank 1's part)."""
    good = tmp_path / "sums.safetensors"
    w = torch.randn(16, 6, generator=torch.Generator().manual_seed(3))
    stream_st.torch.save_file({"b": torch.arange(4.0), "w": w}, str(good), checksums=True)
    data = bytearray(good.read_bytes())
    size = int.from_bytes(data[:8], "little")
    end = json.loads(data[8 : 8 + size])["w"]["data_offsets"][1]
    data[8 + size + end - 1] ^= 0x80
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(data)
    return good, bad


@pytest.mark.parametrize("mode", ["stream", "load_file"])
@pytest.mark.parametrize("split", sorted(SLICES))
def test_a_damaged_tensor_fails_every_rank_however_it_is_sliced(
    tmp_path: Path, pool: Pool, files: tuple[Path, Path], mode: str, split: str
) -> None:
    """Every rank raises RankFailedError naming the rank that read ``w`` (its owner, which
    checks it before cutting it), none hands out a part; the good file gives each rank its
    part, bit for bit."""
    good, bad = files
    reports = pool.run(tmp_path, 2, mode=mode, src=str(bad), slices=SLICES[split])
    for report in reports:
        message = failed(report, "RankFailedError", report["failed_rank"])
        assert "IntegrityError: tensor 'w'" in message, report
        assert report["seconds"] < PROMPT, report
    assert reports[0]["failed_rank"] == reports[1]["failed_rank"]
    reports = pool.run(
        tmp_path, 2, mode=mode, src=str(good), slices=SLICES[split], reference=str(good)
    )
    for report in reports:
        ok(report)
        assert report["names"] == ["b", "w"] and report["unequal"] == [], report


@pytest.mark.parametrize("verify", [[False, True], [True, False]])
def test_a_rank_that_checks_is_given_a_checked_part_by_one_that_does_not(
    tmp_path: Path, pool: Pool, files: tuple[Path, Path], verify: list[bool]
) -> None:
    """Whichever rank owns ``w``, the rank that checks digests gets no damaged part: the owner
    checks what it cuts for it, even with ``verify=False`` itself."""
    _, bad = files
    options = [{"verify": each} for each in verify]
    reports = pool.run(
        tmp_path, 2, mode="stream", src=str(bad), slices=SLICES["dim0"], options=options
    )
    for report in reports:
        assert "IntegrityError: tensor 'w'" in failed(report, "RankFailedError", 0), report


def test_parts_read_without_checking_are_read_alone(
    tmp_path: Path, pool: Pool, files: tuple[Path, Path]
) -> None:
    """With ``verify=False`` on every rank, contiguous parts are still read alone, only their
    bytes: the damaged one is handed out as it is, the other is intact."""
    good, bad = files
    reports = pool.run(
        tmp_path,
        2,
        mode="stream",
        src=str(bad),
        slices=SLICES["dim0"],
        options={"verify": False},
        reference=str(good),
    )
    for rank, unequal in enumerate([[], ["w"]]):
        ok(reports[rank])
        assert reports[rank]["unequal"] == unequal, reports[rank]
