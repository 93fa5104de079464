"""A real gloo group of 2-3 processes on 127.0.0.1 loading one checkpoint together, from a file,
HTTP, S3 and a sharded index: every rank gets exactly what a single-process load gives (checked
against the reference ``safetensors``), or every rank raises naming the rank that failed."""

from __future__ import annotations

import json
from collections import Counter
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

from ._group import Pool  # noqa: E402


class Model(torch.nn.Module):  # type: ignore[misc,name-defined]
    """A small model for load_model (built the same in every rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.proj = torch.nn.Linear(16, 32)
        self.out = torch.nn.Linear(32, 8, bias=False)
        self.register_buffer("scale", torch.zeros(8, dtype=torch.float64))


def tensors() -> dict[str, Any]:
    """A checkpoint of every kind the exchange meets: dtypes, a scalar, an empty tensor, one
    tensor big enough to be cut across ranks, and two to slice."""
    gen = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(512, 96, generator=gen),
        "a": torch.randn(64, 32, generator=gen),
        "b": torch.randn(16, 8, generator=gen).to(torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
        "empty": torch.zeros(0, 3, dtype=torch.uint8),
        "scalar": torch.tensor(3.5, dtype=torch.float32),
        "w0": torch.randn(12, 10, generator=gen),
        "w1": torch.randn(6, 14, generator=gen).to(torch.float16),
        "w2": torch.randn(1, 9, 4, generator=gen),
    }


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    reference_save(tensors(), str(path))
    return path


def raw(tensor: Any) -> Any:
    """The tensor's bytes, compared bit for bit (NaNs and all)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape, name
        assert torch.equal(raw(got[name]), raw(tensor)), name


def ok(report: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in report and "died" not in report, report
    got: dict[str, Any] = report.get("tensors", {})
    return got


def test_every_rank_gets_the_file(tmp_path: Path, checkpoint: Path, pool: Pool) -> None:
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(checkpoint))
    expected = reference_load(str(checkpoint))
    for report in reports:
        assert_same(ok(report), expected)


def served(server: RangeHTTPServer, path: str) -> int:
    server.settle()
    return sum(
        sent for method, where, _, sent in server.requests if where == path and method == "GET"
    )


def test_http_each_byte_served_once(tmp_path: Path, pool: Pool) -> None:
    """Three ranks streaming from one HTTP server: the offset order of a single load, and the
    data bytes served about once (each rank's first request reads ahead of its header)."""
    gen = torch.Generator().manual_seed(1)
    big = {f"layer{i}": torch.randn(256, 256, generator=gen) for i in range(8)}
    path = tmp_path / "big.safetensors"
    reference_save(big, str(path))
    data = path.read_bytes()
    with RangeHTTPServer(objects={"/big.safetensors": data}) as server:
        reports = pool.run(tmp_path, 3, mode="stream", src=server.url("/big.safetensors"))
        total = served(server, "/big.safetensors")
    expected = reference_load(str(path))
    for report in reports:
        assert_same(ok(report), expected)
        assert report["names"] == list(expected)  # offset order, as written
    assert total < len(data) + 3 * (64 << 10), (total, len(data))


def test_include_differs_per_rank(tmp_path: Path, checkpoint: Path, pool: Pool) -> None:
    include = [["big", "a", "c"], ["a", "b", "empty", "scalar"], ["a"]]
    reports = pool.run(tmp_path, 3, mode="load_file", src=str(checkpoint), include=include)
    expected = reference_load(str(checkpoint))
    for report, names in zip(reports, include, strict=True):
        assert_same(ok(report), {name: expected[name] for name in names})


def test_slices_give_each_rank_its_part(tmp_path: Path, checkpoint: Path, pool: Pool) -> None:
    """dim 0 (contiguous: read alone), dim 1 (scattered by the reader), dim 1 after a leading 1
    (contiguous again); the other tensors whole."""
    data = checkpoint.read_bytes()
    slices = [
        {"w0": [0, rank, 2], "w1": [1, rank, 2], "w2": [1, rank, 2], "big": [-1, rank, 2]}
        for rank in range(2)
    ]
    with RangeHTTPServer(objects={"/m.safetensors": data}) as server:
        reports = pool.run(
            tmp_path, 2, mode="load_file", src=server.url("/m.safetensors"), slices=slices
        )
    expected = reference_load(str(checkpoint))
    for rank, report in enumerate(reports):
        wanted = dict(expected)
        for name, (dim, part, parts) in slices[rank].items():
            wanted[name] = torch.tensor_split(expected[name], parts, dim=dim)[part].contiguous()
        assert_same(ok(report), wanted)


def test_load_model_in_place(tmp_path: Path, pool: Pool) -> None:
    model = Model()
    torch.nn.init.normal_(model.scale)
    path = tmp_path / "model.safetensors"
    reference_save(model.state_dict(), str(path))
    reports = pool.run(tmp_path, 2, mode="load_model", src=str(path))
    for report in reports:
        assert_same(ok(report), reference_load(str(path)))
        assert report["missing"] == [] and report["unexpected"] == []
        assert report["in_place"] == sorted(model.state_dict())


def test_include_given_as_an_iterator_is_checked_as_a_list(
    tmp_path: Path, checkpoint: Path, pool: Pool
) -> None:
    """``include=`` an iterator (a generator): a name not in the file fails every rank, as a
    list's does, and load_model loads the names it gives; the iterator was spent by a first
    look, so the missing name was skipped without a word."""
    once = {"once": ["a", "not-there"]}
    for mode in ("load_file", "stream"):
        reports = pool.run(tmp_path, 2, mode=mode, src=str(checkpoint), include=[None, once])
        for report in reports:
            assert report.get("error") == "RankFailedError", report
            assert "not in the source: ['not-there']" in report["message"], report
    model = Model()
    torch.nn.init.normal_(model.scale)
    path = tmp_path / "model.safetensors"
    reference_save(model.state_dict(), str(path))
    wanted = {"once": ["proj.weight", "scale"]}
    reports = pool.run(tmp_path, 2, mode="load_model", src=str(path), include=[wanted, wanted])
    expected = reference_load(str(path))
    for report in reports:
        assert report.get("missing") == [] and report["unexpected"] == [], report
        got = ok(report)
        for name in ("proj.weight", "scale"):
            assert torch.equal(got[name], expected[name]), name


class Tied(torch.nn.Module):  # type: ignore[misc,name-defined]
    """A model whose head shares the embedding's weight (save_model writes it once)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.norm = torch.nn.LayerNorm(4)


def test_include_of_a_model_with_tied_weights_counts_them_as_without(
    tmp_path: Path, pool: Pool
) -> None:
    """A tied name the file does not hold (save_model dropped it) is neither missing nor
    unexpected whatever include= leaves out, as without include=; it was reported unexpected
    (include= filtered the missing names before the tied ones were counted)."""
    from stream_st.torch import save_model

    path = tmp_path / "tied.safetensors"
    save_model(Tied(), str(path))
    for include in (["emb.weight"], ["norm.weight", "norm.bias"], None):
        reports = pool.run(
            tmp_path, 2, mode="load_model", model="Tied", src=str(path), include=[include] * 2
        )
        for report in reports:
            assert report.get("missing") == [] and report["unexpected"] == [], (include, report)


def write_index(folder: Path, every: dict[str, Any], cut: int) -> Path:
    """``every`` as a sharded checkpoint in ``folder``: its first ``cut`` tensors, then the rest;
    the index's path."""
    names = list(every)
    shards = {"m-1.safetensors": names[:cut], "m-2.safetensors": names[cut:]}
    weight_map = {}
    for shard, part in shards.items():
        reference_save({name: every[name] for name in part}, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    index = folder / "m.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_sharded_index(tmp_path: Path, pool: Pool) -> None:
    every = tensors()
    index = write_index(tmp_path, every, 4)
    second = ["a", "w1", "scalar"]
    reports = pool.run(tmp_path, 2, mode="load_file", src=str(index), include=[None, second])
    assert_same(ok(reports[0]), every)
    assert_same(ok(reports[1]), {name: every[name] for name in second})


def test_a_stream_opened_from_two_tasks_at_once_joins_the_group_once(
    tmp_path: Path, checkpoint: Path, pool: Pool
) -> None:
    """Each rank opens its stream from two tasks at once: the second waits for the first one's
    open (one gather with the group) and gets its header, where it returned at once, before
    the first had agreed with the group (over HTTP, before the header came: an empty one); the
    ranks then read it all, the index read once by each."""
    expected = reference_load(str(checkpoint))
    index = write_index(tmp_path, expected, 2)
    with RangeHTTPServer() as server:
        for path in (checkpoint, index, tmp_path / "m-1.safetensors", tmp_path / "m-2.safetensors"):
            server.objects[f"/{path.name}"] = path.read_bytes()
        for src, names in [(checkpoint, sorted(expected)), (index, [])]:
            reports = pool.run(tmp_path, 2, mode="stream", src=server.url(f"/{src.name}"), opens=2)
            for report in reports:
                assert_same(ok(report), expected)
                assert [sorted(each) for each in report["opened"]] == [names, names], report
        server.settle()
    gets = Counter(where for method, where, _, _ in server.requests if method == "GET")
    assert gets[f"/{index.name}"] == 2


def test_s3(tmp_path: Path, checkpoint: Path, moto_s3: Any, pool: Pool) -> None:
    client = moto_s3.client()
    client.create_bucket(Bucket="dist")
    client.put_object(Bucket="dist", Key="m.safetensors", Body=checkpoint.read_bytes())
    env = {
        "AWS_ENDPOINT_URL": moto_s3.endpoint_url,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    reports = pool.run(tmp_path, 2, mode="load_file", src="s3://dist/m.safetensors", env=env)
    expected = reference_load(str(checkpoint))
    for report in reports:
        assert_same(ok(report), expected)
