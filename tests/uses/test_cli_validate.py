"""``stream-st validate``: what it says of NaN and Inf, digests, and its counts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import anyio
import numpy as np

import stream_st

from ._cli import run, write_model


def test_nan_and_inf_are_reported_never_as_constant(tmp_path: Path) -> None:
    """[1, NaN, Inf, -Inf] was warned about as "constant 1": its only finite value."""
    path = write_model(
        tmp_path / "odd.safetensors",
        {"odd": np.array([1.0, np.nan, np.inf, -np.inf], dtype=np.float32)},
    )
    result = run("validate", "--json", str(path))
    assert result.returncode == 1, result.stderr
    found = json.loads(result.stdout)
    assert not any("constant" in w for w in found["warnings"]), found["warnings"]
    assert any("NaN" in e for e in found["errors"]) and any("Inf" in e for e in found["errors"])
    text = run("validate", str(path)).stdout
    assert "constant" not in text
    assert "finite values" in text  # the statistics say what they cover
    constant = write_model(tmp_path / "c.safetensors", {"c": np.full(3, 2.0, np.float32)})
    assert "c: constant 2" in run("validate", str(constant)).stdout


def test_values_near_float64s_limit_give_a_mean_and_strict_json(tmp_path: Path) -> None:
    """F64 values whose sums overflow float64: the mean was NaN and ``--json`` printed ``NaN``,
    which JSON has not. The mean is now right, and so is the standard deviation (summed
    scaled by a power of two: numpy's is infinite here)."""
    big = np.finfo(np.float64).max
    values = np.array([big, 0.99 * big] * 300, dtype=np.float64)
    path = write_model(tmp_path / "big.safetensors", {"big": values})
    result = run("validate", "--json", str(path))

    def refuse(token: str) -> None:
        raise AssertionError(f"not JSON: {token}")

    found = json.loads(result.stdout, parse_constant=refuse)
    (stats,) = found["tensors"]
    assert math.isclose(stats["mean"], (values / 2.0**1000).mean() * 2.0**1000, rel_tol=1e-12)
    assert math.isclose(stats["std"], 0.005 * big, rel_tol=1e-9) and stats["max"] == big


def test_a_dataset_manifest_is_validated_shard_by_shard(tmp_path: Path) -> None:
    """``stream-st validate dataset_manifest.json`` of a dataset repeating its column in every
    shard exited 2 ("in more than one shard"); each shard's tensor is now reported apart."""
    manifest = anyio.run(_dataset, tmp_path / "d")
    result = run("validate", str(manifest))
    assert result.returncode == 0, result.stderr
    assert "x (shard 0)" in result.stdout and "x (shard 1)" in result.stdout
    assert "digests: xxh3-128: 2 tensors verified" in result.stdout


async def _dataset(path: Path) -> Path:
    """A checksummed dataset of one column ``x``, in two shards."""
    async with stream_st.open_dataset_writer(path, target_shard_size=1, checksums=True) as writer:
        for shard in range(2):
            await writer.write_batch({"x": np.full(4, shard, np.float32)}, samples=4)
    return path / "dataset_manifest.json"


def _recorded_anew(path: Path, change: dict[str, str | None]) -> None:
    """Rewrite the checksummed file ``path`` with the ``__metadata__`` keys ``change`` names
    set (a None value: removed), its tensors' bytes as they were."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    for key, value in change.items():
        if value is None:
            del header["__metadata__"][key]
        else:
            header["__metadata__"][key] = value
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data[8 + size :])


def test_a_damaged_digest_record_names_its_tensor_as_the_other_findings(tmp_path: Path) -> None:
    """A digest record lacking a tensor's digest, or holding one for no tensor, named the tensor
    quoted as ``repr`` quotes it, then escaped as validate's findings are: the name a\\b showed
    as 'a\\\\\\\\b', a repr of a repr. It is named as the table and the other findings name it,
    unquoted, once escaped."""
    names = ["a\\b", "q'\"x"]
    path = tmp_path / "sums.safetensors"
    anyio.run(lambda: stream_st.save(path, dict.fromkeys(names, np.ones(4)), checksums=True))
    recorded = anyio.run(stream_st.read_header, path).metadata["stream_st.digest:a\\b"]
    damages: list[tuple[dict[str, str | None], str]] = [
        ({"stream_st.digest:a\\b": None}, "tensor a\\b has no digest in the header"),
        ({"stream_st.digest:z\\y": recorded}, "the header has a digest for no tensor: z\\y"),
    ]
    for change, said in damages:
        copy = tmp_path / "damaged.safetensors"
        copy.write_bytes(path.read_bytes())
        _recorded_anew(copy, change)
        lines = run("validate", str(copy)).stdout.splitlines()
        shown = said.replace("\\", "\\\\")  # as the table shows the name a\\b: a\\\\b
        assert [line for line in lines if line.startswith("error: ")] == [f"error: {shown}"]
        assert "a\\\\b  " in lines[2], lines
        found = json.loads(run("validate", "--json", str(copy)).stdout)["errors"]
        assert found == [said]


def test_digests_recorded_without_their_algorithm_are_failed_not_none(tmp_path: Path) -> None:
    """A header with tensor digests but no (or an empty) ``stream_st.digest`` key was said to
    have "digests: none" (``--json``: "none"), under the error saying it has digests."""
    path = tmp_path / "sums.safetensors"
    anyio.run(lambda: stream_st.save(path, {"a": np.ones(4, np.float32)}, checksums=True))
    for algorithm in (None, ""):
        copy = tmp_path / "damaged.safetensors"
        copy.write_bytes(path.read_bytes())
        _recorded_anew(copy, {"stream_st.digest": algorithm})
        result = run("validate", "-q", str(copy))
        assert result.returncode == 1, result.stderr
        assert "\ndigests: FAILED (see the errors)\n" in result.stdout, result.stdout
        found = json.loads(run("validate", "--json", str(copy)).stdout)
        assert found["digests"] == "FAILED (see the errors)" and len(found["errors"]) == 1
