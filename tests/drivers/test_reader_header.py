"""``read_header`` of a local file: the header read and parsed at once when it is in the page
cache and short (:func:`stream_st.reader.header._cached_header`), through a source otherwise;
both give the same header and the same errors."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import stream_st
import stream_st.numpy
from stream_st.reader.header import CACHED_FIRST_READ, PARSE_AT_ONCE_UP_TO, _cached_header

from ..servers.http_server import RangeHTTPServer


def write(path: Path, tensors: int, *, tail: bytes = b"", cut: int = 0) -> Path:
    """A file of ``tensors`` one-byte tensors (``tail`` appended, its last ``cut`` bytes cut)."""
    header = {
        f"t{i}": {"dtype": "U8", "shape": [1], "data_offsets": [i, i + 1]} for i in range(tensors)
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    data = struct.pack("<Q", len(text)) + text + bytes(tensors) + tail
    path.write_bytes(data[: len(data) - cut])
    return path


async def through_a_source(path: Path) -> stream_st.Header:
    async with stream_st.open_stream(path) as stream:
        return stream.header


@pytest.mark.parametrize("tensors", [0, 3, 2000])  # 2000: a header past the first read
async def test_a_cached_header_is_the_sources(tmp_path: Path, tensors: int) -> None:
    path = write(tmp_path / "f.safetensors", tensors)
    assert (os.path.getsize(path) > CACHED_FIRST_READ) == (tensors == 2000)
    found = _cached_header(str(path), 10**8, "refuse")
    assert found is not None and found == await through_a_source(path)
    assert await stream_st.read_header(path) == found and len(found) == tensors


async def test_a_header_of_several_pieces_is_read_through_a_source(tmp_path: Path) -> None:
    path = write(tmp_path / "f.safetensors", PARSE_AT_ONCE_UP_TO // 40)
    assert _cached_header(str(path), 10**8, "refuse") is None
    assert len(await stream_st.read_header(path)) == PARSE_AT_ONCE_UP_TO // 40


async def test_a_fifo_is_left_to_its_source(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    assert _cached_header(str(fifo), 10**8, "refuse") is None  # and nothing opened it


@pytest.mark.parametrize(
    ("tail", "cut", "error", "message"),
    [
        (b"x", 0, stream_st.TrailingDataError, "1 bytes follow the last tensor"),
        (b"", 1, stream_st.TruncatedStreamError, "tensor 't2'"),
    ],
)
async def test_the_size_is_checked_as_a_source_checks_it(
    tmp_path: Path, tail: bytes, cut: int, error: type[Exception], message: str
) -> None:
    path = write(tmp_path / "f.safetensors", 3, tail=tail, cut=cut)
    with pytest.raises(error, match=message) as direct:
        await stream_st.read_header(path)
    with pytest.raises(error) as streamed:
        await through_a_source(path)
    assert str(direct.value) == str(streamed.value)


async def test_a_short_or_oversized_header_is_refused_as_before(tmp_path: Path) -> None:
    path = tmp_path / "short.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(stream_st.HeaderError, match="got only 2 bytes"):
        await stream_st.read_header(path)
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(stream_st.TruncatedStreamError, match="the header"):
        await stream_st.read_header(path)
    write(path, 3)
    with pytest.raises(stream_st.HeaderTooLargeError):
        await stream_st.read_header(path, max_header_size=16)


async def test_what_cannot_be_read_says_why(tmp_path: Path) -> None:
    with pytest.raises(stream_st.SourceNotFoundError):
        await stream_st.read_header(tmp_path / "missing.safetensors")
    with pytest.raises(stream_st.TransportError, match="directory"):
        await stream_st.read_header(tmp_path)
    with pytest.raises(stream_st.UsageError, match="invalid path"):
        await stream_st.read_header("a\0b")


async def test_limits_and_metadata_take_the_same_path(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    stream_st.numpy.save_file({"a": np.zeros(4, np.float32)}, path, metadata={"k": "v"})
    found = await stream_st.read_header(path, timeout=5)  # a limit: read through a source
    assert found == await stream_st.read_header(path) and found.metadata == {"k": "v"}


@pytest.mark.filterwarnings("ignore::stream_st.RangeIgnoredWarning")  # nothing to resume from
@pytest.mark.parametrize("cut", [0, 4, 7])
async def test_a_body_cut_within_the_length_prefix_is_a_truncation(cut: int) -> None:
    """A source that said how long it is (an answer's Content-Length) and ends within the 8
    bytes of the header's length is cut off (``TruncatedStreamError``, an ``EOFError``), as it
    is anywhere later: not a file that is not safetensors."""
    data = stream_st.numpy.save({"x": np.arange(4.0)})
    objects = {"/f.safetensors": data}
    with (
        RangeHTTPServer(objects=objects, no_range=True, close_after=cut) as server,
        pytest.raises(stream_st.TruncatedStreamError) as info,
    ):
        await stream_st.read_header(server.url("/f.safetensors"))
    assert (info.value.offset, info.value.expected) == (cut, 8)


async def test_a_header_error_names_its_source_though_the_name_is_in_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file named ``a`` holding a bad tensor ``'a'``: the message starts with the file's name,
    as any other's does, where the name found in it (the tensor's) was taken for the source's
    and the message said nothing of the file; read at once or through a source alike."""
    monkeypatch.chdir(tmp_path)
    text = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,1]}}'
    path = Path("a")
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"x")
    for read in (stream_st.read_header, through_a_source):
        with pytest.raises(stream_st.HeaderError) as info:
            await read(path)
        assert str(info.value).startswith("a: tensor 'a': shape [2]")
