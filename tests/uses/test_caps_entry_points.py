"""The per-reader caps reach every entry point: the drop-ins' ``load_file`` and the command's
``--max-tensor-bytes`` / ``--max-total-bytes`` refuse a file declaring more, before any
allocation, and let one within them through."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
import stream_st.torch
from stream_st.cli import main
from stream_st.reader.caps import Caps, using_caps

ARRAYS: dict[str, np.ndarray[Any, Any]] = {
    "a": np.zeros(1000, np.float32),
    "b": np.ones(10, np.int64),
}  # 4,000 and 80 bytes


@pytest.fixture
def path(tmp_path: Path) -> Path:
    file = tmp_path / "m.safetensors"
    reference_numpy.save_file(ARRAYS, str(file))
    return file


@pytest.mark.parametrize("module", [stream_st.numpy, stream_st.torch])
def test_the_drop_ins_load_file_takes_the_caps(path: Path, module: object) -> None:
    load_file = module.load_file  # type: ignore[attr-defined]
    with pytest.raises(stream_st.AllocationError, match="'a' declares 4000 bytes"):
        load_file(str(path), max_tensor_bytes=3999)
    with pytest.raises(stream_st.AllocationError, match="4080 bytes"):
        load_file(str(path), max_total_bytes=4079)
    assert sorted(load_file(str(path), max_tensor_bytes=4000, max_total_bytes=4080)) == ["a", "b"]
    refused = pytest.raises(stream_st.AllocationError, match="'a' declares 4000 bytes")
    with using_caps(Caps.of(3999, None)), refused:  # set for the context, not given: taken too
        load_file(str(path))


def test_the_command_takes_the_caps(
    path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    copy = tmp_path / "copy.safetensors"
    assert main(["cp", "-q", "--max-tensor-bytes", "3999", str(path), str(copy)]) == 2
    assert "max_tensor_bytes=3999" in capsys.readouterr().err and not copy.exists()
    assert main(["validate", "-q", "--max-total-bytes", "4000", str(path)]) == 2
    assert "max_total_bytes=4000" in capsys.readouterr().err
    assert main(["cp", "-q", "--max-total-bytes", "1M", str(path), str(copy)]) == 0
    assert copy.read_bytes() == path.read_bytes()
    with pytest.raises(SystemExit):
        main(["cp", "--max-tensor-bytes", "lots", str(path), str(copy)])


async def test_a_cached_read_takes_the_caps(path: Path, tmp_path: Path) -> None:
    """``cache=`` reads through another stream; the caps go with it."""
    from ..servers.http_server import RangeHTTPServer

    with RangeHTTPServer() as server:
        server.objects["/m.safetensors"] = path.read_bytes()
        url = server.url("/m.safetensors")
        with pytest.raises(stream_st.AllocationError, match="max_tensor_bytes=3999"):
            await stream_st.load(url, cache=tmp_path / "cache", max_tensor_bytes=3999)
        got = await stream_st.load(url, cache=tmp_path / "cache", max_tensor_bytes=4000)
        assert sorted(got) == ["a", "b"]
