"""A server that ignores Range is said so once (a warning the caller can silence, a line of the
command and its progress line), never read whole in silence."""

from __future__ import annotations

import contextlib
import os
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest

import stream_st
from stream_st import RangeIgnoredWarning, StreamStWarning

from ..servers.http_server import RangeHTTPServer
from ._cli import COMMAND, run, write_model


@pytest.fixture
def data(tmp_path: Path) -> bytes:
    tensors = {f"t{i}": np.full(1 << 16, i, np.float32) for i in range(8)}  # 2 MiB
    return write_model(tmp_path / "m.safetensors", tensors).read_bytes()


async def test_the_library_warns_once_and_can_be_silenced(data: bytes) -> None:
    with RangeHTTPServer(objects={"/m": data}, no_range=True) as server:
        url = server.url("/m")
        with pytest.warns(RangeIgnoredWarning, match="ignores Range") as caught:
            async with stream_st.open_stream(url, include=["t6"]) as stream:
                async for _name, array in stream:
                    assert array[0] == 6
        assert len(caught) == 1 and issubclass(caught[0].category, StreamStWarning)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # any warning fails the test
            warnings.simplefilter("ignore", RangeIgnoredWarning)
            assert len(await stream_st.read_header(url)) == 8
    with RangeHTTPServer(objects={"/m": data}) as server, warnings.catch_warnings():
        warnings.simplefilter("error")  # a server with ranges: no warning
        assert len(await stream_st.read_header(server.url("/m"))) == 8
        async with stream_st.open_stream(server.url("/m")) as stream:  # a whole read asks none
            assert len([n async for n, _ in stream]) == 8


def test_the_command_says_so_in_one_line_and_in_its_progress(data: bytes, tmp_path: Path) -> None:
    with RangeHTTPServer(objects={"/m": data}, no_range=True) as server:
        url = server.url("/m")
        result = run("inspect", url)
        assert result.returncode == 0, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("stream-st: warning: ") and url in lines[0]
        assert "Traceback" not in result.stderr and "warnings.warn" not in result.stderr
        server.rate = 1 << 20  # long enough for the progress bar to be drawn
        reader, writer = os.openpty()
        try:
            done = subprocess.run(
                [COMMAND, "cp", "--include", "t7", url, str(tmp_path / "t7.safetensors")],
                stdout=subprocess.PIPE,
                stderr=writer,
                timeout=120,
                env={**os.environ, "COLUMNS": "200"},
            )
            os.close(writer)
            writer = -1
            shown = b""
            with contextlib.suppress(OSError):
                while chunk := os.read(reader, 1 << 16):
                    shown += chunk
        finally:
            if writer >= 0:
                os.close(writer)
            os.close(reader)
        assert done.returncode == 0, shown
        assert b"server ignores ranges" in shown, shown
        assert shown.count(b"stream-st: warning:") == 1, shown
