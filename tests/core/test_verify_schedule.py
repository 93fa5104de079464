"""Every digest of a checksummed local file is checked whichever way it is read: a file of at
least ``READ_AHEAD_FROM`` bytes, a smaller one, or mapped (``copy=False``); tensors over one
hashed piece (:data:`FEED_PIECE`) are hashed piece by piece by worker threads. A flipped byte in
any chunk of any tensor, or a damaged digest of any tensor (a zero-size one included), raises
:class:`~stream_st.IntegrityError` before that tensor is handed out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import stream_st
from stream_st import IntegrityError
from stream_st.core.digests import DIGEST_KEY_PREFIX
from stream_st.reader.ahead import READ_AHEAD_FROM
from stream_st.transports.file.readahead import FEED_PIECE

Arrays = dict[str, np.ndarray[Any, Any]]


def arrays(big: bool) -> Arrays:
    """Tensors of several sizes: chunks of :data:`FEED_PIECE` cut each big one, at points in
    the file that are not chunk boundaries too; a tensor smaller than a chunk; zero-size ones
    first, between and last. ``big``: at least ``READ_AHEAD_FROM`` bytes in all."""
    rng = np.random.default_rng(7)
    scale = 4 if big else 1

    def some(nbytes: int) -> np.ndarray[Any, Any]:
        return rng.integers(0, 256, nbytes, dtype=np.uint8)

    return {
        "empty_first": some(0),
        "odd": some(scale * FEED_PIECE + 12_345),
        "small": some(1000),
        "empty_middle": some(0).reshape(0, 4),
        "round": some(scale * FEED_PIECE),
        "last": some(FEED_PIECE // 2 + 3),
        "empty_last": some(0),
    }


def flipped(data: bytes, offset: int) -> bytes:
    raw = bytearray(data)
    raw[offset] ^= 0x10
    return bytes(raw)


async def read(path: Path, **options: Any) -> list[str]:
    """The names handed out; an :class:`IntegrityError` carries those handed out before it as
    its last note (JSON)."""
    names: list[str] = []
    try:
        async with stream_st.open_stream(path, **options) as stream:
            async for name, _ in stream:
                names.append(name)
    except IntegrityError as exc:
        exc.add_note(json.dumps(names))
        raise
    return names


def offsets(data: bytes) -> tuple[int, dict[str, tuple[int, int]]]:
    """The data's start and each tensor's ``data_offsets``."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return 8 + size, {
        name: tuple(entry["data_offsets"]) for name, entry in header.items() if name[0] != "_"
    }


MODES = {
    "big file": (True, {}),
    "small file": (False, {}),
    "mapped": (False, {"copy": False}),
}


@pytest.fixture(params=list(MODES))
def saved(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, bytes, dict[str, Any]]:
    big, options = MODES[request.param]
    path = tmp_path / "checked.safetensors"
    anyio.run(lambda: stream_st.save(path, arrays(big), checksums=True))
    data = path.read_bytes()
    spans = offsets(data)[1]
    assert (sum(end - begin for begin, end in spans.values()) >= READ_AHEAD_FROM) == big
    return path, data, options


def where(tensor_size: int) -> list[int]:
    """Bytes of a tensor to damage: its first, its last, and the last and first bytes around
    each cut into chunks of :data:`FEED_PIECE`."""
    spots = {0, tensor_size - 1}
    for cut in range(FEED_PIECE, tensor_size, FEED_PIECE):
        spots |= {cut - 1, cut}
    return sorted(spots)


def test_a_flipped_byte_anywhere_is_caught_at_its_tensor(
    saved: tuple[Path, bytes, dict[str, Any]], tmp_path: Path
) -> None:
    path, data, options = saved
    start, spans = offsets(data)
    order = list(spans)
    assert anyio.run(lambda: read(path, **options)) == order
    damaged = tmp_path / "damaged.safetensors"
    checked = 0
    for name, (begin, end) in spans.items():
        for spot in where(end - begin) if end > begin else []:
            damaged.write_bytes(flipped(data, start + begin + spot))
            with pytest.raises(IntegrityError, match=repr(name)) as caught:
                anyio.run(lambda: read(damaged, **options))
            assert caught.value.name == name
            assert json.loads(caught.value.__notes__[-1]) == order[: order.index(name)]
            checked += 1
    assert checked >= 10


def test_a_damaged_digest_of_any_tensor_is_caught(
    saved: tuple[Path, bytes, dict[str, Any]], tmp_path: Path
) -> None:
    _, data, options = saved
    order = list(offsets(data)[1])
    damaged = tmp_path / "damaged.safetensors"
    for name in order:
        key = json.dumps(DIGEST_KEY_PREFIX + name).encode() + b':"'
        at = data.index(key) + len(key)
        digit = b"0" if data[at : at + 1] != b"0" else b"1"  # still a hex digit
        damaged.write_bytes(data[:at] + digit + data[at + 1 :])
        with pytest.raises(IntegrityError, match=repr(name)) as caught:
            anyio.run(lambda: read(damaged, **options))
        assert caught.value.name == name
        assert json.loads(caught.value.__notes__[-1]) == order[: order.index(name)]


def test_verify_false_hands_out_the_damaged_bytes(tmp_path: Path) -> None:
    path = tmp_path / "checked.safetensors"
    anyio.run(lambda: stream_st.save(path, arrays(True), checksums=True))
    data = path.read_bytes()
    start, spans = offsets(data)
    path.write_bytes(flipped(data, start + spans["round"][0] + FEED_PIECE))
    assert anyio.run(lambda: read(path, verify=False)) == list(spans)
