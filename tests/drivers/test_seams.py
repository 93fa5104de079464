"""Where merged features meet: sharded reads opened ahead, checksums through ``cp`` and the
drop-in ``safe_open``, torch tensors over a mapped file. Real files, real subprocesses."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

import stream_st
import stream_st.numpy as stream_numpy
from stream_st import IntegrityError, tools

CLI = [sys.executable, "-m", "stream_st.cli"]

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _open_paths() -> list[str]:
    """The files this process has open (``/proc/self/fd``)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            found.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return found


async def _checksummed_shards(tmp_path: Path, count: int = 3) -> Path:
    weight_map = {}
    for i in range(count):
        tensors = {f"t{i}a": np.arange(10, dtype=np.float32) + i, f"t{i}b": np.ones(4, np.int64)}
        await stream_st.save(tmp_path / f"s{i}.safetensors", tensors, checksums=True)
        weight_map.update(dict.fromkeys(tensors, f"s{i}.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@linux_only
async def test_sharded_shard_opened_ahead_is_closed_when_the_read_fails(tmp_path: Path) -> None:
    # With concurrency=K the next shard is opened while one streams; a failure later in the
    # current shard (here its last tensor fails its digest) must not leave that one open.
    index = await _checksummed_shards(tmp_path)
    _flip_last_byte(tmp_path / "s0.safetensors")
    with pytest.raises(IntegrityError):
        async for _ in stream_st.open_stream(index, concurrency=2):
            pass
    leaked = [p for p in _open_paths() if p.startswith(str(tmp_path))]
    assert leaked == []


@linux_only
async def test_sharded_shard_opened_ahead_is_closed_when_the_consumer_stops(
    tmp_path: Path,
) -> None:
    index = await _checksummed_shards(tmp_path)
    stream = stream_st.open_stream(index, concurrency=2)
    items = aiter(stream)
    await anext(items)
    await items.aclose()  # type: ignore[attr-defined]
    leaked = [p for p in _open_paths() if p.startswith(str(tmp_path))]
    assert leaked == []


def test_cp_converting_a_checksummed_source_to_a_stream(tmp_path: Path) -> None:
    # The source's digests are inherited by default (checksums=None); converting means computing
    # new ones, which a destination written front to back cannot take at the end. That default
    # must not make `cp --dtype` of a checksummed file to stdout, tcp:// or an HTTP upload fail
    # (the command's own help shows such copies); the copy goes out without digests there.
    src = tmp_path / "src.safetensors"
    tensors = {"w": np.linspace(-1, 1, 64, dtype=np.float32)}
    anyio.run(functools.partial(stream_st.save, src, tensors, checksums=True))
    out = tmp_path / "out.safetensors"
    with out.open("wb") as sink:
        done = subprocess.run(
            [*CLI, "cp", "-q", "--dtype", "f16", str(src), "-"],
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    loaded = stream_numpy.load_file(str(out))
    assert loaded["w"].dtype == np.float16
    # Asked for explicitly, digests to compute are still refused there, before any byte.
    with (tmp_path / "out2.safetensors").open("wb") as sink:
        refused = subprocess.run(
            [*CLI, "cp", "-q", "--checksums", "--dtype", "f16", str(src), "-"],
            stdout=sink,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
            check=False,
        )
    assert refused.returncode == 2
    assert (tmp_path / "out2.safetensors").stat().st_size == 0


async def test_cp_api_converting_a_checksummed_source_into_a_fifo(tmp_path: Path) -> None:
    src = tmp_path / "src.safetensors"
    await stream_st.save(src, {"w": np.ones((4, 8), np.float32)}, checksums=True)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    received = bytearray()

    def drain() -> None:
        with fifo.open("rb") as pipe:
            while chunk := pipe.read(1 << 16):
                received.extend(chunk)

    async with anyio.create_task_group() as group:
        group.start_soon(anyio.to_thread.run_sync, drain)
        copy = await tools.cp(src, str(fifo), dtype="bf16")
    assert copy.converted == 1
    assert (await stream_st.load(bytes(received)))["w"].shape == (4, 8)


async def test_safe_open_checks_digests_before_handing_a_tensor_out(tmp_path: Path) -> None:
    # load_file (through open_stream) refuses a tensor that fails its digest; the drop-in's
    # safe_open must not hand the same damaged tensor out.
    path = tmp_path / "bad.safetensors"
    await stream_st.save(
        path, {"a": np.arange(8, dtype=np.float32), "b": np.ones(3, np.float16)}, checksums=True
    )
    _flip_last_byte(path)  # the last tensor in the file
    with pytest.raises(IntegrityError):
        stream_numpy.load_file(str(path))
    with stream_numpy.safe_open(str(path), "np") as f, pytest.raises(IntegrityError):
        f.get_tensors()
    with stream_numpy.safe_open(str(path), "np") as f:
        damaged = f.offset_keys()[-1]
        with pytest.raises(IntegrityError):
            f.get_tensor(damaged)


def test_torch_tensors_over_a_mapped_file_survive_a_write(tmp_path: Path) -> None:
    # framework="pt" with copy=False: torch has no read-only tensors, so a tensor over a
    # PROT_READ mapping is one in-place op away from a SIGSEGV. The tensors handed out must be
    # safe to write (copy-on-write, as the reference's torch mmap, or a copy) and the file must
    # not change.
    pytest.importorskip("torch")
    path = tmp_path / "a.safetensors"
    original: dict[str, Any] = {"a": np.arange(10, dtype=np.float32)}
    stream_numpy.save_file(original, str(path))
    before = path.read_bytes()
    script = textwrap.dedent(
        f"""
        import asyncio
        import stream_st
        async def main():
            got = {{n: t async for n, t in stream_st.open_stream({str(path)!r}, copy=False,
                                                                 framework="pt")}}
            got["a"].add_(1)
            print(float(got["a"][0]))
        asyncio.run(main())
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "not writable" not in done.stderr
    assert done.stdout.strip() == "1.0"
    assert path.read_bytes() == before


@linux_only
async def test_no_descriptor_outlives_a_zero_copy_load(tmp_path: Path) -> None:
    # copy=False maps the file; Python's mmap before 3.13 keeps a dup of the descriptor for as
    # long as the mapping lives, i.e. as long as any array handed out (stream_st maps through
    # the C library there). The promise is that no descriptor outlives the call: with one held
    # per mapped file, a sharded or dataset read of more files than RLIMIT_NOFILE allows fails
    # with EMFILE while the arrays live.
    paths = []
    for i in range(3):
        path = tmp_path / f"f{i}.safetensors"
        await stream_st.save(path, {"a": np.full(16, i, np.float32)})
        paths.append(path)
    held = [await stream_st.load(path, copy=False) for path in paths]
    assert [int(arrays["a"][0]) for arrays in held] == [0, 1, 2]
    leaked = [p for p in _open_paths() if p.startswith(str(tmp_path))]
    assert leaked == []
