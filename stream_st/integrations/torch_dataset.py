"""A torch ``IterableDataset`` over a safetensors dataset (a manifest, or a directory of shards).

Importing this module imports torch; ``import stream_st`` does not. The dataset is described
once, where it is made (the manifest and every shard's header); each ``DataLoader`` worker of each
distributed rank then takes every ``consumers``-th piece of the same plan (``consumers`` = ranks x
workers), so each sample is read exactly once per epoch across the whole job. Pieces are row
ranges of a shard, read with ranged requests from any source stream_st reads (paths, ``s3://``,
``http(s)://``, ``hf://``).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterable, Iterator

import anyio
import torch
import torch.distributed
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import UsageError
from .dataset import DatasetInfo, Piece, describe_dataset, plan_pieces, read_piece

__all__ = ["SafetensorsDataset"]


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The distributed rank and world size: as given, else torch.distributed's, else the
    ``RANK`` / ``WORLD_SIZE`` environment (torchrun's), else a single process."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class SafetensorsDataset(IterableDataset[dict[str, torch.Tensor]]):
    """Samples of a batch-mode dataset, each ``{column: tensor}`` (one row of every column).

    ``columns`` selects the tensors to read (only their bytes are fetched). ``shuffle`` shuffles
    the order of pieces each epoch (:meth:`set_epoch`, same ``seed`` on every rank);
    ``piece_bytes`` bounds what one read holds in memory. ``rank`` and ``world_size`` default to
    torch.distributed's (or ``RANK``/``WORLD_SIZE``).
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        columns: Iterable[str] | None = None,
        shuffle: bool = False,
        seed: int = 0,
        piece_bytes: int = 64 << 20,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        self.dataset: DatasetInfo = anyio.run(lambda: describe_dataset(source))
        if self.dataset.kv:
            raise UsageError(f"{os.fspath(source)} is a KV-mode dataset: it holds no samples")
        self.columns = None if columns is None else list(columns)
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.piece_bytes = piece_bytes
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is not in a world of {self.world_size}")

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (every rank and worker together)."""
        first = self.dataset.columns[0]
        return sum(header[first].shape[0] for header in self.dataset.headers)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently in ``epoch`` (call it on every rank before each epoch)."""
        self.epoch = epoch

    def pieces(self, worker: int = 0, workers: int = 1) -> list[Piece]:
        """The pieces ``worker`` (of ``workers``) of this rank reads this epoch."""
        consumers = self.world_size * workers
        plan = plan_pieces(
            self.dataset, self.columns, max_bytes=self.piece_bytes, at_least=consumers
        )
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(plan)
        return plan[self.rank * workers + worker :: consumers]

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for piece in self.pieces(worker, workers):
            arrays = {name: torch.from_numpy(a) for name, a in anyio.run(read_piece, piece).items()}
            for row in range(piece.stop - piece.start):
                yield {name: tensor[row] for name, tensor in arrays.items()}
