"""A header over the limit: the drop-ins, whose limit is fixed (the reference's 100 MB) and which
take no ``max_header_size=``, say only that it is over the limit; ``stream_st``'s own readers,
which take ``max_header_size=``, still advise raising it."""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

import stream_st
import stream_st.compat
import stream_st.numpy
from stream_st.errors import HeaderTooLargeError

from ..servers.http_server import RangeHTTPServer

DECLARED = 100_000_001
"""One byte over the default limit: the prefix claims it, the file holds two bytes after it."""

OVER = f"header length {DECLARED} bytes exceeds the limit of 100000000 bytes"


@pytest.fixture
def big_header(tmp_path: Path) -> Path:
    """A file whose 8-byte prefix declares a header of :data:`DECLARED` bytes."""
    path = tmp_path / "big_header.safetensors"
    path.write_bytes(struct.pack("<Q", DECLARED) + b"{}")
    return path


def _torch_load_file(path: Path) -> object:
    """``stream_st.torch.load_file`` of ``path`` (skipped without torch)."""
    torch_api = pytest.importorskip("stream_st.torch")
    return torch_api.load_file(path)


def _torch_load(path: Path) -> object:
    """``stream_st.torch.load`` of the bytes of ``path`` (skipped without torch)."""
    torch_api = pytest.importorskip("stream_st.torch")
    return torch_api.load(path.read_bytes())


def _safe_open(path: Path) -> object:
    """``safe_open`` of ``path``, entered."""
    with stream_st.compat.safe_open(str(path), "np") as handle:
        return handle.keys()


DROP_INS: dict[str, Callable[[Path], Any]] = {
    "compat.deserialize": lambda path: stream_st.compat.deserialize(path.read_bytes()),
    "numpy.load": lambda path: stream_st.numpy.load(path.read_bytes()),
    "numpy.load_file": lambda path: stream_st.numpy.load_file(path),
    "torch.load": _torch_load,
    "torch.load_file": _torch_load_file,
    "safe_open": _safe_open,
}


@pytest.mark.parametrize("call", DROP_INS.values(), ids=DROP_INS.keys())
def test_a_drop_in_says_the_header_is_over_its_fixed_limit_without_advice(
    big_header: Path, call: Callable[[Path], Any]
) -> None:
    with pytest.raises(HeaderTooLargeError) as info:
        call(big_header)
    assert isinstance(info.value, stream_st.compat.SafetensorError)
    assert str(info.value).endswith(OVER)
    assert "max_header_size" not in str(info.value)
    assert (info.value.declared, info.value.limit) == (DECLARED, 100_000_000)


def test_a_reader_taking_max_header_size_still_advises_raising_it(big_header: Path) -> None:
    with pytest.raises(HeaderTooLargeError, match="raise max_header_size") as info:
        anyio.run(stream_st.read_header, str(big_header))
    assert OVER in str(info.value)


def test_a_drop_in_still_calls_a_non_header_prefix_no_safetensors_file(tmp_path: Path) -> None:
    path = tmp_path / "text.safetensors"
    path.write_bytes(b"not a safetensors file at all")
    with pytest.raises(HeaderTooLargeError, match="not a safetensors file"):
        stream_st.numpy.load_file(path)


@pytest.mark.parametrize("call", [_torch_load_file, _safe_open], ids=["load_file", "safe_open"])
def test_a_drop_in_reading_a_url_says_so_without_advice_too(
    big_header: Path, call: Callable[[Any], Any]
) -> None:
    """Read over HTTP (the streaming reader, where the limit's message is made with the advice),
    the drop-ins still said "raise max_header_size", which they refuse."""
    with RangeHTTPServer(objects={"/big.safetensors": big_header.read_bytes()}) as server:
        url = server.url("/big.safetensors")
        with pytest.raises(HeaderTooLargeError) as info:
            call(url)
    assert str(info.value) == f"{url}: {OVER}"
    assert (info.value.declared, info.value.limit) == (DECLARED, 100_000_000)
