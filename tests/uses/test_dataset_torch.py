"""The torch IterableDataset over a safetensors dataset: every sample once per epoch across
DataLoader workers and distributed ranks, only the selected columns' bytes read, any source."""

from __future__ import annotations

import asyncio
import copy
import gc
import itertools
import os
import pickle
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import stream_st  # noqa: E402
from stream_st.integrations.torch_dataset import SafetensorsDataset  # noqa: E402
from stream_st.numpy import save_file  # noqa: E402

from ..servers.http_server import RangeHTTPServer  # noqa: E402

SHARD_ROWS = (10, 10, 7)


def write_dataset(directory: Path) -> None:
    """Three shards of 10, 10 and 7 samples: ``image`` (U8 [256, 256]) and ``label`` (its index)."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(directory, target_shard_size=1) as writer:
            start = 0
            for rows in SHARD_ROWS:
                labels = np.arange(start, start + rows, dtype=np.int64)
                images = np.repeat(labels.astype(np.uint8), 256 * 256).reshape(rows, 256, 256)
                await writer.write_batch({"image": images, "label": labels}, rows)
                start += rows

    anyio.run(main)


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    write_dataset(tmp_path)
    return tmp_path


def labels(samples: object) -> list[int]:
    return [int(sample["label"]) for sample in samples]  # type: ignore[attr-defined]


def test_single_process_reads_every_sample_once(dataset_dir: Path) -> None:
    data = SafetensorsDataset(dataset_dir / "dataset_manifest.json")
    samples = list(data)
    assert labels(samples) == list(range(27)) and data.num_samples == 27
    assert samples[13]["image"].shape == (256, 256) and samples[13]["image"].dtype == torch.uint8
    assert samples[13]["image"].eq(13).all()


def test_samples_are_writable_and_writes_never_reach_the_file(dataset_dir: Path) -> None:
    before = {p.name: p.read_bytes() for p in dataset_dir.glob("part-*.safetensors")}
    sample = next(iter(SafetensorsDataset(dataset_dir)))
    sample["image"].fill_(255)
    sample["label"] += 100
    assert sample["image"].eq(255).all() and int(sample["label"]) == 100
    assert {p.name: p.read_bytes() for p in dataset_dir.glob("part-*.safetensors")} == before
    assert labels(SafetensorsDataset(dataset_dir))[:2] == [0, 1]


def epoch_of(
    directory: Path, world: int, workers: int, *, epoch: int = 1, **options: Any
) -> list[list[int]]:
    """The labels each rank of ``world`` gets in ``epoch`` through a DataLoader."""
    out = []
    for rank in range(world):
        data = SafetensorsDataset(directory, rank=rank, world_size=world, seed=3, **options)
        data.set_epoch(epoch)
        loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=workers)
        out.append([int(label) for batch in loader for label in batch["label"]])
        assert len(out[-1]) == len(data)
    return out


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_rank_gets_as_many_samples_each_once(
    dataset_dir: Path, world: int, workers: int
) -> None:
    ranks = epoch_of(dataset_dir, world, workers, shuffle=True, shuffle_buffer=5)
    per_rank = -(-27 // world)
    assert [len(r) for r in ranks] == [per_rank] * world
    seen = Counter(label for labels in ranks for label in labels)
    assert sorted(seen) == list(range(27))  # every sample, once, but the padding
    padding = [label for label, count in seen.items() for _ in range(count - 1)]
    assert len(padding) == per_rank * world - 27
    assert ranks == epoch_of(dataset_dir, world, workers, shuffle=True, shuffle_buffer=5)
    dropped = epoch_of(dataset_dir, world, workers, shuffle=True, drop_last=True)
    labels = [label for labels in dropped for label in labels]
    assert [len(r) for r in dropped] == [27 // world] * world
    assert len(set(labels)) == len(labels) == 27 // world * world


def test_padding_repeats_the_first_samples_of_the_epoch(dataset_dir: Path) -> None:
    ranks = epoch_of(dataset_dir, 2, 0)  # in order: 0-26, then 0 again
    assert ranks == [list(range(14)), [*range(14, 27), 0]]
    four = epoch_of(dataset_dir, 4, 0, drop_last=True)
    assert four == [list(range(i, i + 6)) for i in range(0, 24, 6)]


def test_shuffling_is_per_sample_seeded_and_changes_with_the_epoch(dataset_dir: Path) -> None:
    (first,) = epoch_of(dataset_dir, 1, 0, shuffle=True, shuffle_buffer=8)
    (again,) = epoch_of(dataset_dir, 1, 0, shuffle=True, shuffle_buffer=8)
    (later,) = epoch_of(dataset_dir, 1, 0, epoch=2, shuffle=True, shuffle_buffer=8)
    assert first == again and first != later
    assert sorted(first) == sorted(later) == list(range(27))
    # samples move between pieces' rows, not only pieces between each other
    shards = [set(range(0, 10)), set(range(10, 20)), set(range(20, 27))]
    runs = [next(i for i, s in enumerate(shards) if label in s) for label in first]
    assert sum(a != b for a, b in itertools.pairwise(runs)) > len(shards) - 1
    # a buffer of one sample: each piece's (shard's) rows in order, back to back
    (unbuffered,) = epoch_of(dataset_dir, 1, 0, shuffle=True, shuffle_buffer=1)
    runs = [next(i for i, s in enumerate(shards) if label in s) for label in unbuffered]
    assert sum(a != b for a, b in itertools.pairwise(runs)) == len(shards) - 1
    assert all([x for x in unbuffered if x in s] == sorted(s) for s in shards)


def test_more_consumers_than_shards_cuts_shards_into_row_ranges(dataset_dir: Path) -> None:
    data = SafetensorsDataset(dataset_dir, world_size=4, rank=0, columns=["label"])
    parts = [data.pieces(worker, 2) for worker in range(2)]
    others = [
        SafetensorsDataset(dataset_dir, world_size=4, rank=r, drop_last=True).pieces(w, 2)
        for r, w in itertools.product(range(1, 4), range(2))
    ]
    assert all(parts) and all(others)  # 8 consumers, 3 shards: everyone gets work
    rows = sorted((p.address, r) for p in itertools.chain(*others) for r in range(p.start, p.stop))
    assert len(rows) == len(set(rows)) == 18
    assert all(p.names == ("label",) for p in parts[0])


def test_streams_from_http_reading_only_the_selected_columns(dataset_dir: Path) -> None:
    with RangeHTTPServer() as server:
        for path in dataset_dir.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        data = SafetensorsDataset(server.url("/data/dataset_manifest.json"), columns=["label"])
        server.requests.clear()
        samples = list(data)
        assert labels(samples) == list(range(27)) and samples[0].keys() == {"label"}
        sent = sum(request[3] for request in server.requests)
        assert (
            sent < 27 * 256 * 256 // 4
        )  # labels and headers (a 64 KiB first read each), no images


@pytest.mark.parametrize("columns", [[], (), set()])
def test_columns_naming_none_is_refused(dataset_dir: Path, columns: Any) -> None:
    """An empty ``columns=`` is a UsageError (None reads every column), where the dataset
    held no sample at all."""
    with pytest.raises(
        stream_st.UsageError, match=r"columns= selects no column.*\['image', 'label'\]"
    ):
        SafetensorsDataset(dataset_dir, columns=columns)


def test_columns_takes_a_predicate_on_the_name(tmp_path: Path) -> None:
    """``columns=`` takes a predicate, as ``include=`` does (the docstring says so): it was
    refused with an ArgumentTypeError naming ``include=`` and listing a predicate as taken. It
    selects among the dataset's columns, in their order; selecting none is refused as naming
    none is, and the dataset keeps the names, not the predicate (a lambda does not pickle)."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            z, a, m = np.arange(3), np.arange(3) * 10, np.ones(3, np.int8)
            await writer.write_batch({"z": z, "a": a, "m": m}, 3)

    anyio.run(main)
    data = SafetensorsDataset(tmp_path, columns=lambda name: name != "m")
    assert data.columns == ["z", "a"]
    samples = list(pickle.loads(pickle.dumps(data)))
    assert [{k: int(v) for k, v in s.items()} for s in samples] == [
        {"z": i, "a": 10 * i} for i in range(3)
    ]
    with pytest.raises(
        stream_st.UsageError, match=r"columns= selects no column.*\['z', 'a', 'm'\]"
    ):
        SafetensorsDataset(tmp_path, columns=lambda name: False)


@pytest.mark.parametrize("columns", [5, [1], b"label", [["label"]]])
def test_columns_of_the_wrong_type_are_refused_naming_columns(
    dataset_dir: Path, columns: Any
) -> None:
    """A ``columns=`` that is no name, names or predicate is an ArgumentTypeError naming
    ``columns=``, where it named ``include=``, which the caller never gave."""
    with pytest.raises(stream_st.ArgumentTypeError, match=r"^columns= takes") as caught:
        SafetensorsDataset(dataset_dir, columns=columns)
    assert "include=" not in str(caught.value)


@pytest.mark.parametrize(
    ("worker", "workers", "epoch", "error", "message"),
    [
        (0, 0, None, stream_st.UsageError, "workers must be an integer >= 1"),
        ("0", 2, None, stream_st.ArgumentTypeError, "worker must be an integer >= 0"),
        (-1, 2, None, stream_st.UsageError, "worker must be an integer >= 0"),
        (2, 2, None, stream_st.UsageError, "worker 2 is not one of 2 workers"),
        (0, 1, -1, stream_st.UsageError, "epoch must be an integer >= 0"),
        (0, 1, "1", stream_st.ArgumentTypeError, "epoch must be an integer >= 0"),
    ],
)
def test_pieces_refuses_bad_arguments_naming_them(
    dataset_dir: Path, worker: Any, workers: Any, epoch: Any, error: type, message: str
) -> None:
    """``pieces()`` raised a bare ZeroDivisionError for no workers, a bare TypeError for a
    worker that is no integer, and planned rows outside this rank's share for a worker past
    the last (or before the first), an epoch of the wrong type or sign taken as a seed."""
    data = SafetensorsDataset(dataset_dir)
    with pytest.raises(error, match=message):
        data.pieces(worker, workers, epoch=epoch)


def test_kv_dataset_and_bad_rank_are_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            await writer.write_batch({"a__x": np.zeros(3), "b__x": np.zeros((2, 2))}, 1)

    anyio.run(main)
    with pytest.raises(stream_st.UsageError, match="KV-mode"):
        SafetensorsDataset(tmp_path)
    write_dataset(tmp_path / "batch")
    with pytest.raises(stream_st.UsageError, match="rank 2 is not in a world of 2"):
        SafetensorsDataset(tmp_path / "batch", rank=2, world_size=2)


def test_a_presigned_kv_manifest_is_refused_with_its_reason(tmp_path: Path) -> None:
    """A KV-mode dataset given as a presigned manifest URL was refused with the address masked
    and its reason masked with it (read as the signature's value); the reason now shows after
    the masked address."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            await writer.write_batch({"a__x": np.zeros(3), "b__x": np.zeros((2, 2))}, 1)

    anyio.run(main)
    with RangeHTTPServer() as server:  # the query is ignored
        for path in tmp_path.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        url = server.url("/data/dataset_manifest.json?X-Amz-Signature=5ec2e7de0fa1")
        with pytest.raises(stream_st.UsageError) as info:
            SafetensorsDataset(url)
    text = str(info.value)
    assert "5ec2e7de0fa1" not in text and "X-Amz-Signature=***" in text, text
    assert "is not a batch-mode dataset (" in text and "KV-mode dataset" in text, text


def test_selecting_no_column_of_many_names_a_few(tmp_path: Path) -> None:
    """``columns=`` selecting none of a dataset of many columns listed every one (hundreds of
    kilobytes); the error now counts them and shows the first few."""
    many = 20_000

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            await writer.write_batch({f"c{i}": np.zeros(2, np.uint8) for i in range(many)}, 2)

    anyio.run(main)
    with pytest.raises(stream_st.UsageError, match="columns= selects no column") as info:
        SafetensorsDataset(tmp_path, columns=lambda name: False)
    text = str(info.value)
    assert len(text) < 500 and f"{many} columns" in text and "'c0'" in text, text[:500]


def test_a_damaged_checksummed_shard_is_refused(tmp_path: Path) -> None:
    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path, checksums=True) as writer:
            await writer.write_batch({"label": np.arange(4, dtype=np.int64)}, 4)

    anyio.run(main)
    assert labels(list(SafetensorsDataset(tmp_path))) == [0, 1, 2, 3]
    (shard,) = tmp_path.glob("part-*.safetensors")
    header = anyio.run(stream_st.read_header, str(shard))
    damaged = bytearray(shard.read_bytes())
    damaged[header.data_start + header["label"].start] ^= 1
    shard.write_bytes(bytes(damaged))
    with pytest.raises(stream_st.IntegrityError, match="'label'"):
        list(SafetensorsDataset(tmp_path))


@pytest.mark.parametrize("where", ["local", "http"])
def test_a_damaged_checksummed_shard_read_in_row_ranges_is_refused(
    tmp_path: Path, where: str
) -> None:
    """A shard split into pieces (``piece_bytes``, ranks, workers) was read unchecked, a digest
    covering a whole tensor: row 5 came back as 4 from a flipped bit. Its tensors are now read
    whole once per process, and checked, before any row of them is given."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path, checksums=True) as writer:
            await writer.write_batch({"label": np.arange(8, dtype=np.int64)}, 8)

    anyio.run(main)
    (shard,) = tmp_path.glob("part-*.safetensors")
    header = anyio.run(stream_st.read_header, str(shard))
    damaged = bytearray(shard.read_bytes())
    damaged[header.data_start + header["label"].start + 5 * 8] ^= 1
    shard.write_bytes(bytes(damaged))
    with RangeHTTPServer() as server:
        for path in tmp_path.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        source = server.url("/data/dataset_manifest.json") if where == "http" else str(tmp_path)
        splits: list[dict[str, Any]] = [{"piece_bytes": 16}, {"rank": 1, "world_size": 2}]
        for options in splits:
            with pytest.raises(stream_st.IntegrityError, match="'label'"):
                list(SafetensorsDataset(source, **options))


def test_a_checksummed_shard_in_row_ranges_is_read_whole_once_per_process(
    tmp_path: Path,
) -> None:
    """The check of a split shard costs one more read of its selected tensors, once: the
    next epochs (and other pieces of it) take it as checked."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path, checksums=True) as writer:
            await writer.write_batch({"label": np.arange(8, dtype=np.int64)}, 8)

    anyio.run(main)
    with RangeHTTPServer() as server:
        for path in tmp_path.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        data = SafetensorsDataset(server.url("/data/dataset_manifest.json"), piece_bytes=16)
        server.requests.clear()
        assert labels(data) == list(range(8))
        first = len(server.requests)
        server.requests.clear()
        assert labels(data) == list(range(8))
        assert len(server.requests) < first


def test_a_shard_rewritten_after_the_dataset_was_described_is_refused(dataset_dir: Path) -> None:
    """Its rows were read as the new file holds them: samples that were never planned, and
    ranks yielding different counts."""
    dataset = SafetensorsDataset(dataset_dir)
    shard = sorted(dataset_dir.glob("part-*.safetensors"))[1]
    rows: dict[str, np.ndarray[Any, Any]] = {
        "image": np.zeros((3, 256, 256), np.uint8),
        "label": np.arange(100, 103),
    }
    save_file(rows, shard)
    with pytest.raises(stream_st.SourceChangedError, match="changed since the dataset"):
        list(dataset)


@pytest.mark.parametrize("rows", [7, 12])
def test_a_shard_rewritten_on_a_server_is_refused(dataset_dir: Path, rows: int) -> None:
    """Over HTTP the rows were read as the new file held them, past its tensors' ends where it
    had fewer (three zeros read from the next tensor's bytes)."""
    with RangeHTTPServer() as server:
        for path in dataset_dir.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        dataset = SafetensorsDataset(server.url("/data/dataset_manifest.json"), columns=["label"])
        shard = sorted(dataset_dir.glob("part-*.safetensors"))[1]
        new: dict[str, np.ndarray[Any, Any]] = {
            "image": np.zeros((rows, 256, 256), np.uint8),
            "label": np.arange(100, 100 + rows),
        }
        save_file(new, shard)
        server.objects[f"/data/{shard.name}"] = shard.read_bytes()
        with pytest.raises(stream_st.SourceChangedError, match="changed since the dataset"):
            list(dataset)


def test_a_bf16_column_over_http_is_a_torch_bfloat16_tensor(tmp_path: Path) -> None:
    """Read from a local shard it was; over HTTP (and S3) torch.from_numpy of the ml_dtypes
    array raised a bare TypeError."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path) as writer:
            x = torch.arange(6, dtype=torch.bfloat16).reshape(3, 2)
            await writer.write_batch({"x": x}, 3)

    anyio.run(main)
    with RangeHTTPServer() as server:
        for path in tmp_path.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        for piece_bytes in (64 << 20, 4):
            url = server.url("/data/dataset_manifest.json")
            samples = list(SafetensorsDataset(url, piece_bytes=piece_bytes))
            assert [s["x"].dtype for s in samples] == [torch.bfloat16] * 3
            assert [s["x"].tolist() for s in samples] == [[0, 1], [2, 3], [4, 5]]


def test_shards_whose_columns_differ_are_refused_up_front(tmp_path: Path) -> None:
    """Was accepted; the DataLoader then failed in torch's collate with a bare RuntimeError.
    (The dataset writer refuses such a batch: the shards are written one by one.)"""
    for name, x in (
        ("part-00000-0000-a", np.zeros((4, 3), np.float32)),
        ("part-00000-0001-a", np.zeros((4, 5), np.float64)),
    ):
        save_file({"x": x}, tmp_path / f"{name}.safetensors")
    with pytest.raises(stream_st.UsageError, match=r"column 'x' differs between shards: F32"):
        SafetensorsDataset(tmp_path)


def test_a_dataset_written_with_no_batch_holds_no_sample(tmp_path: Path) -> None:
    """Was refused as a KV-mode dataset."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path):
            pass

    anyio.run(main)
    dataset = SafetensorsDataset(tmp_path)
    assert len(dataset) == 0 and list(dataset) == []


def test_empty_shards_among_others_hold_no_sample(tmp_path: Path) -> None:
    """A task that wrote no batch leaves a shard of no tensor: first, it made the dataset's
    columns empty (nothing yielded); last, a TensorNotFoundError."""
    rows: dict[str, np.ndarray[Any, Any]] = {
        "x": np.zeros((4, 3), np.float32),
        "label": np.arange(4),
    }
    for name in ("part-00000-0000-a", "part-00001-0000-b", "part-00002-0000-c"):
        save_file(rows if name.endswith("b") else {}, tmp_path / f"{name}.safetensors")
    dataset = SafetensorsDataset(tmp_path)
    assert len(dataset) == 4 and labels(dataset) == [0, 1, 2, 3]


def test_flags_and_the_environment_are_checked(
    dataset_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """shuffle="no" shuffled, drop_last="no" dropped, seed=1.5 was taken; RANK=x raised a bare
    ValueError."""
    for wrong in ({"shuffle": "no"}, {"drop_last": "no"}, {"seed": 1.5}, {"seed": None}):
        with pytest.raises(stream_st.SafetensorsError, match=next(iter(wrong))):
            SafetensorsDataset(dataset_dir, **wrong)
    numpy_true: Any = np.bool_(True)
    assert len(SafetensorsDataset(dataset_dir, shuffle=numpy_true, seed=-1)) > 0
    with pytest.raises(stream_st.SafetensorsError, match="epoch"):
        SafetensorsDataset(dataset_dir).set_epoch("1")  # type: ignore[arg-type]
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(stream_st.UsageError, match="RANK='x' in the environment"):
        SafetensorsDataset(dataset_dir)


@pytest.mark.parametrize("source", [b"/data", None, 3])
def test_a_source_that_names_no_path_is_an_argument_type_error(source: Any) -> None:
    """A bytes path, None or a number let a bare TypeError escape (os.fspath)."""
    with pytest.raises(stream_st.ArgumentTypeError, match=type(source).__name__):
        SafetensorsDataset(source)


def test_a_dataset_is_built_where_an_event_loop_runs(dataset_dir: Path) -> None:
    """A notebook cell, async code calling sync code: anyio.run raised a bare RuntimeError
    ('Already running asyncio in this thread')."""

    async def cell() -> int:
        return len(SafetensorsDataset(dataset_dir))

    assert asyncio.run(cell()) == len(SafetensorsDataset(dataset_dir)) == 27


@pytest.mark.parametrize("how", [copy.copy, copy.deepcopy])
def test_a_copy_has_an_epoch_of_its_own(dataset_dir: Path, how: Any) -> None:
    """A shallow copy shared the original's epoch place without owning it: once the original
    went, another dataset took the place and reset it. A deep copy's epoch was cloned out of
    shared memory: set_epoch never reached its persistent, forked DataLoader workers."""
    data = SafetensorsDataset(dataset_dir, shuffle=True, seed=3)
    data.set_epoch(5)
    copied = how(data)
    assert copied.epoch == 5
    copied.set_epoch(6)
    assert data.epoch == 5
    del data
    gc.collect()
    SafetensorsDataset(dataset_dir).set_epoch(9)  # may take the place the original gave back
    assert copied.epoch == 6
    loader = torch.utils.data.DataLoader(
        copied,
        batch_size=None,
        num_workers=1,
        persistent_workers=True,
        multiprocessing_context="fork",
    )
    orders = []
    for epoch in (1, 2):
        copied.set_epoch(epoch)
        orders.append(labels(loader))
        expected = SafetensorsDataset(dataset_dir, shuffle=True, seed=3)
        expected.set_epoch(epoch)
        assert orders[-1] == labels(expected)
    assert orders[0] != orders[1]


def test_a_file_given_as_the_dataset_is_a_usage_error(dataset_dir: Path) -> None:
    """A shard or any file named as the dataset said 'listing failed: Not a directory', a
    TransportError, as if the disk had failed."""
    shard = next(dataset_dir.glob("part-*.safetensors"))
    with pytest.raises(stream_st.UsageError, match="is a file, not a directory"):
        SafetensorsDataset(shard)


@pytest.mark.parametrize("damage", ["truncated", "garbled"])
def test_a_damaged_shard_read_by_workers_raises_our_error(dataset_dir: Path, damage: str) -> None:
    """torch's DataLoader re-raises a worker's error as ``type(error)(message)``: a class that
    refused a message alone (TruncatedStreamError, HeaderTooLargeError, HTTPStatusError...)
    came back a bare RuntimeError."""
    shard = sorted(dataset_dir.glob("part-*.safetensors"))[1]
    dataset = SafetensorsDataset(dataset_dir)
    with shard.open("r+b") as file:
        if damage == "truncated":
            file.truncate(shard.stat().st_size - 10)
        else:
            file.write(b"\xff" * 8)  # a header length no file has
    expected = stream_st.TruncatedStreamError if damage == "truncated" else stream_st.HeaderError
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)
    with pytest.raises(expected, match="in DataLoader worker process 0"):
        list(loader)


def test_every_error_class_takes_a_message_alone() -> None:
    """What the DataLoader's re-raise (above) needs of every class."""
    classes = [
        kind
        for kind in vars(stream_st.errors).values()
        if isinstance(kind, type) and issubclass(kind, stream_st.SafetensorsError)
    ]
    assert len(classes) > 30
    for kind in classes:
        assert "a message" in str(kind("a message")), kind


def test_a_split_shard_rewritten_after_its_check_is_checked_again(tmp_path: Path) -> None:
    """The check was remembered by address, tensor and recorded digest alone: a shard rewritten
    in place with a damaged column, its header (so its record) the same, gave its rows unchecked
    in the same process (row 5 read as 4). The check is remembered for that file (its device,
    inode, size and time) and that whole header only."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path, checksums=True) as writer:
            await writer.write_batch({"label": np.arange(8, dtype=np.int64)}, 8)

    anyio.run(main)
    assert labels(SafetensorsDataset(tmp_path, piece_bytes=16)) == list(range(8))
    (shard,) = tmp_path.glob("part-*.safetensors")
    header = anyio.run(stream_st.read_header, str(shard))
    damaged = bytearray(shard.read_bytes())
    damaged[header.data_start + header["label"].start + 5 * 8] ^= 1
    (tmp_path / "new").write_bytes(bytes(damaged))
    os.replace(tmp_path / "new", shard)
    with pytest.raises(stream_st.IntegrityError, match="'label'"):
        list(SafetensorsDataset(tmp_path, piece_bytes=16))


def test_a_split_remote_shard_that_changes_after_its_check_is_refused(tmp_path: Path) -> None:
    """Each piece of a split shard is read by requests of its own, which never compared the
    version the check of the shard had read: bytes served with a new ETag after the check gave
    a wrong row (7 read as another). A piece whose answer names another version than the
    check's is refused."""

    async def main() -> None:
        async with stream_st.open_dataset_writer(tmp_path, checksums=True) as writer:
            await writer.write_batch({"label": np.arange(8, dtype=np.int64)}, 8)

    anyio.run(main)
    (shard,) = tmp_path.glob("part-*.safetensors")
    damaged = bytearray(shard.read_bytes())
    damaged[-3] ^= 0xFF
    with RangeHTTPServer(etag="strong") as server:
        for path in tmp_path.iterdir():
            server.objects[f"/data/{path.name}"] = path.read_bytes()
        data = SafetensorsDataset(server.url("/data/dataset_manifest.json"), piece_bytes=16)
        server.replace_after[f"/data/{shard.name}"] = (3, bytes(damaged))  # after the check
        with pytest.raises(stream_st.SourceChangedError, match="since its digests were checked"):
            list(data)
