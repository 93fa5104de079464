"""Group loads found wrong by an attack (round 28), in real gloo groups of two ranks: copies
whose headers differ only in their metadata (the digests recorded there among it) were taken
for the same file, so a rank checking digests could get bytes its own digest does not match,
with no error; now every rank raises :class:`~stream_st.RankFailedError` naming the rank whose
header differs, before any byte moves."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("torch.distributed with gloo is needed", allow_module_level=True)

from safetensors.torch import load_file as reference_load  # noqa: E402

import stream_st.torch  # noqa: E402

from ._group import Pool  # noqa: E402
from .test_failures import failed  # noqa: E402
from .test_load import assert_same, ok  # noqa: E402

M = torch.arange(4000, dtype=torch.float32).reshape(4, 1000)


def _digest_changed(path: Path, into: Path) -> None:
    """``path``'s bytes with one hex digit of the digest it records for ``m`` changed."""
    data = bytearray(path.read_bytes())
    at = data.index(b'"stream_st.digest:m":"') + len(b'"stream_st.digest:m":"')
    data[at] = ord("0") if data[at] != ord("0") else ord("1")
    into.write_bytes(data)


@pytest.mark.parametrize(
    ("other", "part"), [("data", [0, 0, 2]), ("digest", None), ("metadata", [0, 0, 2])]
)
def test_copies_whose_metadata_differs_fail_every_rank(
    tmp_path: Path, pool: Pool, other: str, part: list[int] | None
) -> None:
    """Rank 1 reads a copy of rank 0's file laid out alike that differs in its data and its
    digests (``data``), in one recorded digest only (``digest``), or in other metadata
    (``metadata``); it checks digests and wants ``part`` of ``m`` (None: all of it). Every rank
    raises naming rank 1, whose header differs, before any byte moves (rank 1 got a slice
    rank 0 had checked against rank 0's digest only, or the group took both copies' intact
    bytes for damaged ones once they had moved), and the group goes on."""
    path = tmp_path / "m.safetensors"
    stream_st.torch.save_file({"m": M}, str(path), {"note": "a"}, checksums=True)
    copy = tmp_path / "copy.safetensors"
    if other == "data":
        stream_st.torch.save_file({"m": M + 1}, str(copy), {"note": "a"}, checksums=True)
    elif other == "digest":
        _digest_changed(path, copy)
    else:
        stream_st.torch.save_file({"m": M}, str(copy), {"note": "b"}, checksums=True)
    reports = pool.run(
        tmp_path,
        2,
        mode="load_file",
        srcs=[str(path), str(copy)],
        slices=[None, None if part is None else {"m": part}],
        options={"verify": True},
    )
    for report in reports:
        assert "its header differs from rank 0's" in failed(report, "RankFailedError", 1)
        assert "tensors" not in report
    for report in pool.run(tmp_path, 2, mode="load_file", srcs=[str(path), str(path)]):
        assert_same(ok(report), reference_load(str(path)))
