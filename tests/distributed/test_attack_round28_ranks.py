"""Group loads found wrong by an attack (round 28), in real gloo groups: copies whose headers
differ only in their metadata (the digests recorded there among it) were taken for the same
file, so a rank checking digests could get bytes its own digest does not match, with no error;
now every rank raises :class:`~stream_st.RankFailedError` naming the rank whose header differs,
before any byte moves. A rank reading a tensor alone between two it shares got the later one
first; now every rank gets its tensors in the file's offset order."""

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


def test_a_tensor_read_alone_is_handed_out_in_offset_order(tmp_path: Path, pool: Pool) -> None:
    """Rank 0 reads ``b`` alone (rank 1 leaves it out), between ``a`` and ``c`` it shares: it
    got ``c`` before ``b`` (one stripe held the end of ``a`` and all of ``c``); every rank now
    gets its tensors in the file's offset order, as without a group."""
    path = tmp_path / "abc.safetensors"
    tensors = {"a": torch.arange(1000.0), "b": torch.arange(25.0), "c": torch.arange(2.0)}
    stream_st.torch.save_file(tensors, str(path))
    include = [None, ["a", "c"]]
    reports = pool.run(
        tmp_path, 2, mode="stream", src=str(path), include=include, reference=str(path)
    )
    assert [report.get("names") for report in reports] == [["a", "b", "c"], ["a", "c"]], reports
    for report in reports:
        assert report["unequal"] == [], report


def test_tensors_read_alone_and_slices_come_in_offset_order(tmp_path: Path, pool: Pool) -> None:
    """Three ranks wanting different tensors of a file of tensors of many sizes (some read
    alone whole, some parts read alone, others cut by an owner, some shared): each gets what
    it wants, in the file's offset order."""
    gen = torch.Generator().manual_seed(28)
    sizes = [4000, 8, 300, 0, 5000, 64, 2, 1200, 16, 900, 3, 7000]
    tensors = {f"t{i:02}": torch.randn(size, 4, generator=gen) for i, size in enumerate(sizes)}
    path = tmp_path / "many.safetensors"
    stream_st.torch.save_file(tensors, str(path), checksums=True)
    names = list(tensors)
    include = [None, names[::2], [name for i, name in enumerate(names) if i % 3]]
    slices = [None, {name: [0, 1, 3] for name in names[2::4]}, {n: [1, 1, 2] for n in names[1::4]}]
    options = [{}, {"verify": False}, {}]
    reports = pool.run(
        tmp_path,
        3,
        mode="stream",
        src=str(path),
        include=include,
        slices=slices,
        options=options,
        reference=str(path),
    )
    for report, wanted in zip(reports, include, strict=True):
        assert report.get("names") == (names if wanted is None else wanted), report
        assert report["unequal"] == [], report
