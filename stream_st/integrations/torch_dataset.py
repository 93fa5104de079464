"""A torch ``IterableDataset`` over a safetensors dataset (a manifest, or a directory of shards).

Importing this module imports torch; ``import stream_st`` does not. The dataset is described
once, where it is made (the manifest and every shard's header). Each epoch every rank sees the
same sequence of samples (the shards' pieces in order, or shuffled with the epoch's seed), made
a multiple of the world size as torch's ``DistributedSampler`` makes it: padded by repeating its
first samples, or (``drop_last=True``) cut. Each rank reads its own contiguous part of that
sequence, split again between its ``DataLoader`` workers, so each sample is read once per epoch
across the whole job (padding aside) and only its bytes are fetched: ranged requests from any
source stream_st reads (paths, ``s3://``, ``http(s)://``, ``hf://``). With ``shuffle``, samples
are also shuffled within a bounded buffer (``shuffle_buffer`` samples) in each worker. The epoch
(:meth:`SafetensorsDataset.set_epoch`) is kept in shared memory, so that ``DataLoader`` workers
that outlive an epoch (``persistent_workers=True``), each holding its own copy of the dataset,
still see the one the main process sets.
"""

from __future__ import annotations

import bisect
import copy
import math
import os
import random
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Self

import numpy as np
import torch
import torch.distributed
from anyio.from_thread import start_blocking_portal
from torch.utils.data import IterableDataset, get_worker_info

from .._api import open_stream
from ..compat._sync import run
from ..core.arrays import to_torch
from ..core.shards import scheme_of
from ..errors import UsageError, boolean, integer_at_least, redact, some_names
from ..reader.stream import include_names
from .dataset import (
    DatasetInfo,
    Piece,
    changed,
    check_alike,
    describe_dataset,
    plan_pieces,
    read_piece,
    verify_rows,
)

__all__ = ["SafetensorsDataset"]

Sample = dict[str, torch.Tensor]

Columns = Iterable[str] | str | Callable[[str], bool] | None
"""What ``columns=`` takes: one name, several, a predicate on the name, or None (all of them)."""

SHUFFLE_DRAWS = 4096
"""Random slots of the shuffle buffer drawn at once (one numpy call, not one per sample)."""


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """The distributed rank and world size: as given, else torch.distributed's, else the
    ``RANK`` / ``WORLD_SIZE`` environment (torchrun's), else a single process."""
    if rank is not None:
        rank = integer_at_least("rank", rank, 0)
    if world_size is not None:
        world_size = integer_at_least("world_size", world_size, 1)
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        found = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        found = _from_environment("RANK", 0), _from_environment("WORLD_SIZE", 1)
    return (found[0] if rank is None else rank), (found[1] if world_size is None else world_size)


def _from_environment(name: str, default: int) -> int:
    """The whole number the environment variable ``name`` holds (``default`` if unset)."""
    text = os.environ.get(name)
    if text is None:
        return default
    digits = text.strip()
    if not digits.isascii() or not digits.isdigit():
        raise UsageError(f"{name}={text!r} in the environment is not a whole number")
    return int(text)


def _selected_columns(dataset: DatasetInfo, columns: Columns) -> list[str] | None:
    """The columns ``columns`` selects: None for every one; a predicate's among the dataset's
    columns, in their order; names as ``include=`` takes them, sorted (one the dataset lacks is
    refused when the pieces are planned). :class:`~stream_st.ArgumentTypeError` naming
    ``columns=`` for anything else, :class:`~stream_st.UsageError` where none is selected."""
    if columns is None:
        return None
    if callable(columns):  # first, as include= takes it: a callable may be iterable too
        selected = [name for name in dataset.columns if columns(name)]
    else:
        selected = sorted(include_names(columns, "columns="))
    if not selected:  # a dataset of samples with nothing in them
        raise UsageError(
            "columns= selects no column: give None (the default) to read every one (the "
            f"dataset has {len(dataset.columns)} columns: {some_names(dataset.columns)})"
        )
    return selected


def _checked_epoch(epoch: object) -> int:
    """``epoch`` as an ``int`` an ``int64`` holds, else a :class:`~stream_st.UsageError`."""
    checked = integer_at_least("epoch", epoch, 0)
    if checked >= 1 << 63:
        raise UsageError(f"epoch must be below 2**63, got {checked}")
    return checked


class _EpochSlots:
    """The epochs of this process's datasets, in shared memory: blocks of :data:`BLOCK`
    ``int64`` places, a dataset taking one and giving it back when it goes. One shared block
    (one file descriptor, as torch shares memory) serves many datasets, where a block each held
    a descriptor per dataset (a thousand datasets exhausted the default limit of open files)."""

    BLOCK = 1024

    def __init__(self) -> None:
        self._blocks: list[torch.Tensor] = []
        self._free: list[tuple[int, int]] = []  # (block, place) given back
        self._lock = threading.Lock()

    def take(self, owner: object) -> tuple[torch.Tensor, int]:
        """A place (its block and index) set to 0, given back when ``owner`` goes."""
        with self._lock:
            if not self._free:
                block = torch.zeros(self.BLOCK, dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
                self._free = [(len(self._blocks), place) for place in range(self.BLOCK)][::-1]
                self._blocks.append(block)
            number, place = self._free.pop()
        tensor = self._blocks[number]
        tensor[place] = 0
        weakref.finalize(owner, self._give_back, number, place)
        return tensor, place

    def _give_back(self, number: int, place: int) -> None:
        with self._lock:
            self._free.append((number, place))


_EPOCH_SLOTS = _EpochSlots()


class SafetensorsDataset(IterableDataset[Sample]):
    """Samples of a batch-mode dataset, each ``{column: tensor}`` (one row of every column).

    ``columns`` selects the tensors to read (only their bytes are fetched): one name, several or
    a predicate on the name (tried on each of the dataset's columns), as ``include=`` takes them
    (none selected is a :class:`~stream_st.UsageError`); None, all of them.
    ``shuffle`` shuffles the order of pieces each epoch (:meth:`set_epoch`; the same ``seed`` on
    every rank) and the samples within a buffer of
    ``shuffle_buffer`` samples in each worker: the order is the same for the same seed, epoch,
    world size and number of workers.
    ``drop_last`` as for torch's ``DistributedSampler``: every rank gets ``len(self)`` samples,
    the sequence padded with its first samples (False) or cut (True). ``piece_bytes`` bounds what
    one read holds in memory (two reads are held at most: the next piece is read while the
    rows of the one before are handed out). A local shard's samples are writable views of a
    private mapping of it, as the reference's ``safe_open`` gives them (a write never reaches
    the file; a sample kept beyond its batch keeps its shard mapped: ``clone()`` it to keep it
    alone). Digests a checksummed shard records are checked before any of its samples is given:
    a shard split into pieces has its selected columns read whole once per process that reads
    part of it (a digest covers a whole tensor).
    ``rank`` and ``world_size`` default to torch.distributed's (or
    ``RANK``/``WORLD_SIZE``).
    The epoch lies in shared memory (one ``int64`` place in a block the process's datasets share):
    :meth:`set_epoch` in the main process
    reaches the copies of the dataset that ``DataLoader`` workers hold, persistent ones
    (``persistent_workers=True``) included, however they were started (fork, spawn,
    forkserver). A dataset pickled otherwise (``pickle.dumps``) takes its epoch's value along, no
    longer shared; a copy (``copy.copy``, ``copy.deepcopy``) has an epoch of its own in shared
    memory, set to this one's.
    """

    def __init__(
        self,
        source: str | os.PathLike[str],
        *,
        columns: Columns = None,
        shuffle: bool = False,
        seed: int = 0,
        shuffle_buffer: int = 1024,
        drop_last: bool = False,
        piece_bytes: int = 64 << 20,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        super().__init__()
        shuffle, drop_last = boolean("shuffle", shuffle), boolean("drop_last", drop_last)
        seed = integer_at_least("seed", seed, -(1 << 63))  # an int (1.5 and None were taken)
        shuffle_buffer = integer_at_least("shuffle_buffer", shuffle_buffer, 1)
        piece_bytes = integer_at_least("piece_bytes", piece_bytes, 1)
        self.dataset: DatasetInfo = run(describe_dataset, source)  # a caller's loop running too
        if self.dataset.kv:
            why = self.dataset.not_batch()  # the reason it was found to be KV-mode
            raise UsageError(
                f"{redact(os.fspath(source))} is not a batch-mode dataset ({why}), so it reads "
                "as a KV-mode dataset: it holds no samples"
            )
        self.columns = _selected_columns(self.dataset, columns)
        check_alike(self.dataset, self.columns)
        self.shuffle, self.seed = shuffle, seed
        # shared: a persistent DataLoader worker's copy of the dataset reads what set_epoch wrote
        self._epochs, self._slot = _EPOCH_SLOTS.take(self)
        self.shuffle_buffer = shuffle_buffer
        self.drop_last = drop_last
        self.piece_bytes = piece_bytes
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        if not 0 <= self.rank < self.world_size:
            raise UsageError(f"rank {self.rank} is not in a world of {self.world_size}")
        self._plan = plan_pieces(self.dataset, self.columns, max_bytes=piece_bytes)
        first = self.dataset.columns[0] if self.dataset.columns else None
        self._described = dict(zip(self.dataset.shards, self.dataset.headers, strict=True))
        self._rows = {
            address: header[first].shape[0] if first and len(header) else 0
            for address, header in self._described.items()
        }

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (every rank and worker together)."""
        return sum(piece.stop - piece.start for piece in self._plan)

    def __len__(self) -> int:
        """Samples this rank yields per epoch (all its workers together)."""
        if self.drop_last:
            return self.num_samples // self.world_size
        return math.ceil(self.num_samples / self.world_size)

    @property
    def epoch(self) -> int:
        """The epoch :meth:`set_epoch` set last (0 at first), as every worker sees it."""
        return int(self._epochs[self._slot])

    @epoch.setter
    def epoch(self, epoch: int) -> None:  # written here, not through an overridable set_epoch
        self._epochs[self._slot] = _checked_epoch(epoch)

    def set_epoch(self, epoch: int) -> None:
        """Shuffle differently in ``epoch`` (call it on every rank before each epoch, before
        iterating the ``DataLoader``): written into shared memory, so that the ``DataLoader``'s
        workers, persistent ones included, read it when they begin the epoch."""
        self._epochs[self._slot] = _checked_epoch(epoch)

    def __copy__(self) -> Self:
        """A dataset alike with an epoch place of its own, set to this one's epoch: a place
        shared with this dataset would be given back when this one goes, and another dataset
        would take it."""
        return self._copied(self._state())

    def __deepcopy__(self, memo: dict[int, object]) -> Self:
        """As :meth:`__copy__`, the rest copied deeply: the epoch stays in shared memory, so
        :meth:`set_epoch` on the copy still reaches its ``DataLoader`` workers."""
        clone = self._copied({})
        memo[id(self)] = clone
        clone.__dict__.update(copy.deepcopy(self._state(), memo))
        return clone

    def _state(self) -> dict[str, object]:
        """The dataset's attributes but its epoch place."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_epochs", "_slot")}

    def _copied(self, state: dict[str, object]) -> Self:
        """A dataset of ``state``, with a place of its own holding this one's epoch."""
        clone = type(self).__new__(type(self))
        clone.__dict__.update(state)
        clone._epochs, clone._slot = _EPOCH_SLOTS.take(clone)
        clone._epochs[clone._slot] = self.epoch
        return clone

    def _sequence(self, epoch: int) -> list[Piece]:
        plan = list(self._plan)
        if self.shuffle:
            random.Random(f"{self.seed}/{epoch}").shuffle(plan)
        return plan

    def pieces(self, worker: int = 0, workers: int = 1, *, epoch: int | None = None) -> list[Piece]:
        """The row ranges ``worker`` (of ``workers``) of this rank reads in ``epoch`` (None: the
        current one), in order. A worker outside ``range(workers)`` is a
        :class:`~stream_st.UsageError` (its rows would be another rank's)."""
        worker = integer_at_least("worker", worker, 0)
        workers = integer_at_least("workers", workers, 1)
        if worker >= workers:
            raise UsageError(f"worker {worker} is not one of {workers} workers")
        sequence = self._sequence(self.epoch if epoch is None else _checked_epoch(epoch))
        ends = [0]
        for piece in sequence:
            ends.append(ends[-1] + piece.stop - piece.start)
        total = ends[-1]
        share = len(self)
        first = self.rank * share
        begin = first + share * worker // workers
        end = first + share * (worker + 1) // workers
        out: list[Piece] = []
        position = begin
        while position < end and total:
            wrapped = position % total  # padding repeats the sequence from its start
            k = bisect.bisect_right(ends, wrapped) - 1
            piece = sequence[k]
            offset = piece.start + wrapped - ends[k]
            take = min(end - position, ends[k + 1] - wrapped)
            out.append(Piece(piece.address, piece.names, offset, offset + take))
            position += take
        return out

    async def _read(self, piece: Piece) -> dict[str, torch.Tensor]:
        """The rows of ``piece``. A local shard is mapped privately, as the reference's
        ``safe_open`` maps it: its rows are writable views whose writes never reach the file;
        other sources are read with ranged requests (tensors of any dtype made as
        ``framework="pt"`` makes them). Digests a shard records are checked: as the piece is read
        when it is the whole shard, else on the shard's tensors read whole once per process
        (:func:`~stream_st.integrations.dataset.verify_rows`) before any row of them is given."""
        described = self._described[piece.address]
        whole = (piece.start, piece.stop) == (0, self._rows[piece.address])
        version = ("", "") if whole else await verify_rows(piece.address, piece.names, described)
        if scheme_of(piece.address) not in (None, "file"):
            read = await read_piece(piece, described, version)
            rows = piece.stop - piece.start
            return {
                name: to_torch(array, described[name].dtype, (rows, *described[name].shape[1:]))
                for name, array in read.items()
            }
        names = list(piece.names)
        async with open_stream(
            piece.address, include=names, framework="pt", copy=False, verify=whole
        ) as stream:
            if stream.header != described:  # rewritten since: rows that were not planned
                raise changed(piece.address)
            views = {name: tensor async for name, tensor in stream}
        return {name: views[name][piece.start : piece.stop] for name in names}

    def _samples(self, pieces: list[Piece]) -> Iterator[Sample]:
        """The samples of ``pieces``, in order: each piece read on the epoch's event loop while
        the rows of the one before are handed out (two reads held at most)."""
        if not pieces:
            return
        with start_blocking_portal() as portal:  # one event loop for the epoch's reads
            coming = portal.start_task_soon(self._read, pieces[0])
            for following in [*pieces[1:], None]:
                tensors = coming.result()
                if following is not None:
                    coming = portal.start_task_soon(self._read, following)
                names = list(tensors)
                for row in zip(*(tensors[name].unbind(0) for name in names), strict=True):
                    yield dict(zip(names, row, strict=True))

    def __iter__(self) -> Iterator[Sample]:
        """The samples of the current epoch that this rank's worker reads: the epoch read once,
        from shared memory, when the iteration begins (a worker's copy of the dataset sees the
        :meth:`set_epoch` of the main process)."""
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        epoch = self.epoch
        samples = self._samples(self.pieces(worker, workers, epoch=epoch))
        if not self.shuffle:
            yield from samples
            return
        seed = random.Random(f"{self.seed}/{epoch}/{self.rank}/{worker}/{workers}")
        rng = np.random.default_rng(seed.getrandbits(128))
        size = self.shuffle_buffer
        buffer: list[Sample] = []
        draws: Iterator[int] = iter(())
        for sample in samples:
            if len(buffer) < size:
                buffer.append(sample)
                continue
            i = next(draws, None)
            if i is None:  # the buffer's slots drawn SHUFFLE_DRAWS at a time
                draws = iter(rng.integers(0, size, SHUFFLE_DRAWS).tolist())
                i = next(draws)
            yield buffer[i]
            buffer[i] = sample
        for i in rng.permutation(len(buffer)).tolist():
            yield buffer[i]
