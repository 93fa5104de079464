"""A zero-copy read of a local file keeps a bounded part of it in the process's memory.

``open_stream(path, copy=False)`` hands out views of one shared, read-only mapping, populated a
window ahead of the consumer; the pages it populated stayed mapped, so the process's resident
memory (file-backed) grew to the whole file while streaming, each view dropped or not (a 768 MiB
file: 768 MiB). ``serve`` computing digests at start (``checksums=``) read the whole file through
such a mapping too, and hashed it with every view held. Each window passed is now let go of
(``MADV_DONTNEED``: the pages stay in the page cache; a view still held reads them again when
touched). Each case runs in a fresh process whose peak resident memory (``VmHWM``) is reset
just before the read.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from stream_st.transports.file import mmap as file_mmap

TENSOR = 16 << 20
"""Bytes of each tensor."""

COUNT = 16
"""Tensors in the file (256 MiB in all)."""

BOUND = (file_mmap.WINDOW + 2 * TENSOR) >> 20
"""The most MiB the read may add to the process's peak: a window populated ahead, the tensor
in hand and one being let go of (the whole file is 256 MiB)."""

CHILD = textwrap.dedent(
    """
    import asyncio, sys
    import stream_st
    from stream_st.server.served import served_object
    from stream_st.transports.file import mmap as file_mmap

    path, mode = sys.argv[1], sys.argv[2]
    if mode in ("ctypes", "mmap"):  # the ways a file is mapped without the compiled module
        file_mmap._COMPILED = None
        file_mmap._LIBC = file_mmap._LibcMapping() if mode == "ctypes" else None

    def mib(key):
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) >> 10

    async def main():
        await stream_st.read_header(path)  # what the read imports, before the baseline
        base = mib("VmRSS")
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # the peak (VmHWM) starts again from now
        if mode == "serve":
            await served_object(path, checksums="sha256")
            print(mib("VmHWM") - base)
            return
        first = None
        async with stream_st.open_stream(path, copy=False) as stream:
            async for name, array in stream:
                first = array if first is None else first
                del array
        print(mib("VmHWM") - base, int((first == 1).sum()))  # the held view, read again

    asyncio.run(main())
    """
)

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="needs /proc/self/clear_refs (Linux)"
)


@pytest.fixture
def path(tmp_path: Path) -> Iterator[Path]:
    """A file of :data:`COUNT` F32 tensors of :data:`TENSOR` bytes, tensor ``i`` all ``i + 1``
    (real bytes, written here: in the page cache)."""
    path = tmp_path / "big.safetensors"
    items = TENSOR // 4
    header = {
        f"t{i:02d}": {
            "dtype": "F32",
            "shape": [items],
            "data_offsets": [i * TENSOR, (i + 1) * TENSOR],
        }
        for i in range(COUNT)
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(text)) + text)
        for i in range(COUNT):
            np.full(items, i + 1, np.float32).tofile(file)
    yield path
    path.unlink()


def child(path: Path, mode: str) -> list[str]:
    """What the fresh process reading ``path`` prints: streamed (``mode``: how it is mapped,
    ``compiled``, ``ctypes`` or ``mmap``), or planned for ``serve``."""
    result = subprocess.run(
        [sys.executable, "-B", "-c", CHILD, str(path), mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize("mapping", ["compiled", "ctypes", "mmap"])
def test_a_zero_copy_stream_lets_each_window_passed_go(path: Path, mapping: str) -> None:
    if mapping == "compiled" and file_mmap._COMPILED is None:
        pytest.skip("the compiled module was not built")
    peak, first = child(path, mapping)
    assert int(peak) <= BOUND, f"peak {peak} MiB over baseline streaming a 256 MiB file"
    # The first tensor's view, held to the end, still reads its bytes (from the page cache).
    assert int(first) == TENSOR // 4


def test_serve_computing_digests_keeps_a_bounded_part_of_the_file(path: Path) -> None:
    (peak,) = child(path, "serve")
    assert int(peak) <= BOUND, f"peak {peak} MiB over baseline serving a 256 MiB file"
