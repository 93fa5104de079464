"""Jobs of a :class:`~stream_st.transports.file.readahead.ReadAhead` fed as they land
(``feed=``): every byte fed once, in file order, whatever order the threads read the pieces in;
a job complete only once fed; a file that ends inside a job, or a feed that fails, never leaves a
wait hanging."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

from stream_st import TransportError
from stream_st.transports.file.readahead import _BUFFERED, _COLD, FEED_PIECE, InOrder, ReadAhead
from stream_st.transports.file.source import FileSource


def test_pieces_finished_out_of_order_are_fed_in_order() -> None:
    """The thread that finishes the next piece in order feeds it and the run after it; nobody
    waits. Each piece is counted (``fed``) once fed."""
    fed: list[bytes] = []
    counted: list[int] = []
    order = InOrder(lambda piece: fed.append(bytes(piece)), 100, counted.append)
    pieces = {100 + 3 * n: memoryview(bytes([n]) * 3) for n in range(6)}
    for n in (1, 3, 0, 5, 2, 4):  # 0 feeds 0 and 1; 2 feeds 2 and 3; 4 feeds 4 and 5
        order.done(100 + 3 * n, pieces[100 + 3 * n], 3)
    assert fed == [bytes(piece) for piece in pieces.values()]
    assert counted == [3] * 6

    fed.clear()
    crowd = InOrder(lambda piece: fed.append(bytes(piece)), 0, counted.append)
    many = [memoryview(n.to_bytes(2, "little")) for n in range(2000)]

    def work(first: int) -> None:
        for n in range(first, len(many), 2):
            crowd.done(2 * n, many[n], 2)

    threads = [threading.Thread(target=work, args=(first,)) for first in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert fed == [bytes(piece) for piece in many]


def test_a_short_piece_ends_the_feeding_but_not_the_counting() -> None:
    fed: list[bytes] = []
    counted: list[int] = []
    order = InOrder(lambda piece: fed.append(bytes(piece)), 0, counted.append)
    order.done(4, memoryview(b"zzzz"), 0)  # after the end: counted, never fed
    order.done(0, memoryview(b"abcd"), 2)  # the file ended inside this piece
    assert fed == [b"ab"] and counted == [2, 0]


def test_a_failed_feed_stops_feeding_later_pieces() -> None:
    fed: list[int] = []

    def feed(piece: memoryview) -> None:
        if piece[0] == 1:
            raise ValueError("hash failed")
        fed.append(piece[0])

    order = InOrder(feed, 0, lambda count: None)
    order.done(2, memoryview(b"\x02"), 1)
    order.done(0, memoryview(b"\x00"), 1)
    with pytest.raises(ValueError, match="hash failed"):
        order.done(1, memoryview(b"\x01"), 1)  # 2 is left unfed
    order.done(3, memoryview(b"\x03"), 1)
    assert fed == [0]


def file_of(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = bytes((n * 7 + n // 251) % 256 for n in range(size))
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


async def test_fed_and_plain_jobs_mixed_get_every_byte_in_order(tmp_path: Path) -> None:
    """Fed jobs of several sizes (a piece's size, one byte more, many pieces from an odd
    offset) between plain ones: each fed exactly its bytes, in order, and all read."""
    path, data = file_of(tmp_path, 9 * FEED_PIECE)
    spans = [(0, FEED_PIECE), (FEED_PIECE, 4096), (FEED_PIECE + 4096, FEED_PIECE + 1)]
    spans += [(2 * FEED_PIECE + 4097, 5 * FEED_PIECE + 12_345), (8 * FEED_PIECE + 12_345, 10)]
    source = FileSource(path)
    try:
        async with source.reading() as ahead:
            results = []
            for number, (offset, size) in enumerate(spans):
                buffer = bytearray(size)
                fed = bytearray()
                feed = fed.extend if number != 1 else None
                job = ahead.add(offset, memoryview(buffer), feed=feed)
                results.append((job, offset, size, buffer, fed, feed))
            for job, offset, size, buffer, fed, feed in results:
                assert await ahead.wait(job) == size
                assert buffer == data[offset : offset + size]
                assert fed == (b"" if feed is None else buffer)
    finally:
        await source.aclose()


async def test_a_fed_job_past_the_end_of_the_file_completes_short(tmp_path: Path) -> None:
    path, data = file_of(tmp_path, 3 * FEED_PIECE + 100)
    source = FileSource(path)
    buffer, fed = bytearray(6 * FEED_PIECE), bytearray()
    try:
        with anyio.fail_after(10):
            got = await source.read_feeding(FEED_PIECE // 2, memoryview(buffer), fed.extend)
    finally:
        await source.aclose()
    assert got == len(data) - FEED_PIECE // 2
    assert fed == data[FEED_PIECE // 2 :]


async def test_a_feed_that_fails_fails_the_wait(tmp_path: Path) -> None:
    path, _ = file_of(tmp_path, 4 * FEED_PIECE)
    source = FileSource(path)

    def feed(piece: memoryview) -> None:
        raise ValueError("no room for the hash")

    try:
        async with source.reading() as ahead:
            job = ahead.add(0, memoryview(bytearray(4 * FEED_PIECE)), feed=feed)
            with anyio.fail_after(10), pytest.raises(TransportError, match="no room"):
                await ahead.wait(job)
    finally:
        await source.aclose()


async def test_a_fed_job_goes_to_one_thread_while_a_later_job_waits(tmp_path: Path) -> None:
    """While a later job waits behind a fed job, the thread that takes the fed job's first
    piece takes all of them (it reads and feeds them in order, each hashed while in its
    cache); the last job queued is shared piece by piece, until one comes after it."""
    path, _ = file_of(tmp_path, 12 * FEED_PIECE)
    with path.open("rb") as file:
        ahead = ReadAhead(file.fileno(), str(path))  # no thread started: the test takes
        buffers = [bytearray(4 * FEED_PIECE) for _ in range(3)]
        first = ahead.add(0, memoryview(buffers[0]), feed=bytearray().extend)
        second = ahead.add(4 * FEED_PIECE, memoryview(buffers[1]), feed=bytearray().extend)

        def taken() -> list[tuple[int, int]]:
            batch, how = ahead._take()
            assert how == _BUFFERED
            return [(job, offset) for job, offset, _, _ in batch]

        assert taken() == [(first, n * FEED_PIECE) for n in range(4)]
        assert taken() == [(second, 4 * FEED_PIECE)]  # the last job: one piece
        ahead.add(8 * FEED_PIECE, memoryview(buffers[2]))  # a plain job after it
        assert taken() == [(second, n * FEED_PIECE) for n in range(5, 8)]
        ahead.stop()


class _Lacking:
    """A page cache that lacks the file from ``cold_from`` on (what ``Residency`` says)."""

    def __init__(self, cold_from: int) -> None:
        self.cold_from = cold_from

    def uncached(self, offset: int, length: int) -> bool:
        return offset + length > self.cold_from


async def test_a_fed_job_s_run_ends_where_the_page_cache_lacks_the_rest(tmp_path: Path) -> None:
    """A thread's run of a fed job takes the pieces the page cache holds as it holds the first:
    the pieces it lacks are left in line, to be taken for a cold read (one thread at a time),
    as each piece was before runs; a cold run takes the pieces the cache lacks."""
    path, data = file_of(tmp_path, 8 * FEED_PIECE)
    with path.open("rb") as file:
        residency: Any = _Lacking(2 * FEED_PIECE)
        ahead = ReadAhead(file.fileno(), str(path), None, residency)  # the test takes
        buffer = bytearray(4 * FEED_PIECE)
        fed = bytearray()
        job = ahead.add(0, memoryview(buffer), feed=fed.extend)
        ahead.add(4 * FEED_PIECE, memoryview(bytearray(FEED_PIECE)))  # a later job waits
        batch, how = ahead._take()
        assert (how, [offset for _, offset, _, _ in batch]) == (_BUFFERED, [0, FEED_PIECE])
        ahead._serve(batch, how, None)
        batch, how = ahead._take()
        assert how == _COLD
        assert [offset for _, offset, _, _ in batch] == [2 * FEED_PIECE, 3 * FEED_PIECE]
        ahead._serve(batch, how, None)
        assert await ahead.wait(job) == len(buffer)
        assert fed == buffer == data[: len(buffer)]
        ahead.stop()


async def test_pieces_taken_before_a_stop_are_not_read(tmp_path: Path) -> None:
    """A stop between a thread's taking of a fed job's pieces and their reading (the job's
    feed forgotten by then) leaves them unread: they were read as one plain batch, any length,
    past the stop (over 1,024 pieces, a failed read)."""
    path, _ = file_of(tmp_path, 8 * FEED_PIECE)
    with path.open("rb") as file:
        ahead = ReadAhead(file.fileno(), str(path))
        buffer = bytearray(4 * FEED_PIECE)
        job = ahead.add(0, memoryview(buffer), feed=bytearray().extend)
        ahead.add(4 * FEED_PIECE, memoryview(bytearray(FEED_PIECE)))
        batch, how = ahead._take()
        assert len(batch) == 4
        ahead.stop()
        ahead._serve(batch, how, None)
        assert buffer == bytearray(len(buffer))
        with pytest.raises(TransportError, match="read stopped"):
            await ahead.wait(job)
