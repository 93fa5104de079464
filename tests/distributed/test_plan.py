"""The plan every rank computes alike: each shared byte read by exactly one rank, the ranks'
shares balanced by bytes, slices read alone when contiguous and scattered otherwise."""

from __future__ import annotations

import itertools

import pytest

from stream_st.core.header import TensorInfo
from stream_st.errors import UsageError
from stream_st.sharded.ranks import (
    check_slice,
    contiguous_span,
    plan_exchange,
    slice_bounds,
)


def table(*sizes: tuple[int, ...]) -> list[TensorInfo]:
    """F32 tensors of these shapes, back to back."""
    infos, at = [], 0
    for number, shape in enumerate(sizes):
        nbytes = 4
        for each in shape:
            nbytes *= each
        infos.append(TensorInfo(f"t{number}", "F32", shape, at, at + nbytes))
        at += nbytes
    return infos


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_shared_byte_is_read_once_and_shares_balance(world: int) -> None:
    tensors = table((1000, 10), (3,), (7, 7), (4096,), (1,), (250, 4))
    plan = plan_exchange(tensors, [dict.fromkeys(range(len(tensors))) for _ in range(world)])
    covered = {index: [] for index in range(len(tensors))}  # type: dict[int, list[tuple[int, int]]]
    for stripe in plan.stripes:
        for piece in stripe.pieces:
            assert not piece.targets  # everyone wants everything: broadcast
            covered[piece.index].append((piece.lo, piece.hi))
    for index, spans in covered.items():
        assert sorted(spans)[0][0] == 0
        ends = sorted(spans)
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ends))
        assert ends[-1][1] == tensors[index].nbytes
    shares = [plan.owned_bytes(rank) for rank in range(world)]
    total = sum(t.nbytes for t in tensors)
    assert sum(shares) == total
    assert max(shares) - min(shares) <= total // (world * 4) + 1  # one stripe at most
    assert all(not direct for direct in plan.direct)
    for rank in range(world):  # every rank gets every tensor, each once, in offset order
        got = [index for step in plan.done[rank] for index, _ in step]
        assert got == list(range(len(tensors)))


def test_wanted_by_one_rank_is_read_by_it_alone() -> None:
    tensors = table((10,), (20,), (30,))
    plan = plan_exchange(tensors, [{0: None, 1: None}, {1: None}, {2: None}])
    assert plan.direct == [[(0, None)], [], [(2, None)]]
    pieces = [piece for stripe in plan.stripes for piece in stripe.pieces]
    assert [(p.index, p.targets) for p in pieces] == [(1, ((0, None), (1, None)))]


def test_slices_contiguous_alone_others_scattered() -> None:
    tensors = table((8, 6), (8, 6), (1, 8, 6))
    wants = [{0: (0, r, 2), 1: (1, r, 2), 2: (1, r, 2)} for r in range(2)]
    plan = plan_exchange(tensors, wants)
    assert plan.direct == [[(0, (0, 0, 2)), (2, (1, 0, 2))], [(0, (0, 1, 2)), (2, (1, 1, 2))]]
    pieces = [piece for stripe in plan.stripes for piece in stripe.pieces]
    assert [(p.index, p.targets) for p in pieces] == [(1, ((0, (1, 0, 2)), (1, (1, 1, 2))))]
    assert contiguous_span(tensors[0], (0, 1, 2)) == (4 * 6 * 4, 8 * 6 * 4)
    assert contiguous_span(tensors[1], (1, 1, 2)) is None


def test_slice_bounds_and_checks() -> None:
    assert [slice_bounds(10, part, 3) for part in range(3)] == [(0, 4), (4, 7), (7, 10)]
    info = table((4, 6))[0]
    assert check_slice(info, (-1, 0, 2)) == (1, 0, 2)
    for bad in [(2, 0, 2), (0, 2, 2), (0, 0, 0), [0, 0, 2], (0, 0)]:
        with pytest.raises(UsageError):
            check_slice(info, bad)


def test_slices_of_a_rank_that_checks_digests_are_cut_by_an_owner() -> None:
    """A part has no digest: a rank that checks digests gets even a contiguous slice cut from
    the whole tensor by its owner (who checks it first); a rank that does not reads it alone
    (unless it owns the tensor: see :func:`test_an_owner_cuts_its_own_slice_too`)."""
    tensors = table((8, 6))
    wants = [{0: (0, 0, 2)}, {0: (0, 1, 2)}]
    plan = plan_exchange(tensors, wants, stripe=96, checked=[False, True])  # rank 1 owns it
    assert plan.direct == [[(0, (0, 0, 2))], []]
    [stripe] = plan.stripes
    assert [(p.lo, p.hi, p.targets) for p in stripe.pieces] == [(0, 192, ((1, (0, 1, 2)),))]
    assert plan_exchange(tensors, wants).stripes == []


def test_an_owner_cuts_its_own_slice_too() -> None:
    """The owner of a tensor it reads whole to cut another rank's slice cuts its own
    contiguous slice from it too, rather than reading those bytes a second time."""
    tensors = table((8, 6))
    wants = [{0: (0, 0, 2)}, {0: (0, 1, 2)}]
    plan = plan_exchange(tensors, wants, stripe=192, checked=[False, True])  # rank 0 owns it
    assert plan.direct == [[], []]
    [stripe] = plan.stripes
    assert stripe.owner == 0
    assert [(p.lo, p.hi, p.targets) for p in stripe.pieces] == [
        (0, 192, ((0, (0, 0, 2)), (1, (0, 1, 2))))
    ]
    assert plan.done == [[[(0, (0, 0, 2))]], [[(0, (0, 1, 2))]]]
