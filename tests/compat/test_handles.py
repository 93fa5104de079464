"""An open ``safe_open`` of a local file costs what the reference's costs: no thread, no
descriptor (a mapping only), so a thousand shards open at once fit under ``ulimit -n 1024``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

pytest.importorskip("torch")

import safetensors.torch as ref_pt
import torch

import stream_st.torch as st_pt

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def open_descriptors() -> set[tuple[str, str]]:
    """Each descriptor of the process and what it is open on (a file's path, a socket...)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own, closed since
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return found


def mappings_of(path: Path) -> int:
    return Path("/proc/self/maps").read_text().count(str(path))


@linux_only
def test_idle_handles_hold_no_thread_and_no_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    ref_pt.save_file({"w": torch.randn(8, 8)}, path)
    # What the handles opened: the descriptors and threads there are now and were not before.
    # Not their counts: threads of earlier tests (anyio's idle workers) end a little after them,
    # and may end here.
    before_fds, before_threads = open_descriptors(), set(threading.enumerate())
    handles = [st_pt.safe_open(path, "pt") for _ in range(48)]
    handles += [st_pt.safe_open(f"file://{path}", "pt"), st_pt.safe_open(str(path), "pt")]
    tensors = [f.get_tensor("w") for f in handles]
    assert open_descriptors() <= before_fds
    assert set(threading.enumerate()) <= before_threads
    assert mappings_of(path) >= 1
    for f in handles:
        f.close()
    assert all(torch.equal(t, tensors[0]) for t in tensors)  # views outlive the handle
    del f, handles, tensors
    assert mappings_of(path) == 0  # the mapping went with the last view


@linux_only
def test_pread_backend_holds_its_descriptor_until_closed(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    ref_pt.save_file({"w": torch.randn(8, 8)}, path)
    before = descriptors()
    with st_pt.safe_open(path, "pt", backend="pread") as f:
        assert descriptors() == before + 1
        tensor = f.get_tensor("w")
    assert descriptors() == before
    assert mappings_of(path) == 0
    assert torch.equal(tensor, ref_pt.load_file(path)["w"])


@pytest.mark.skipif(os.name != "posix", reason="ulimit")
def test_a_thousand_shards_open_at_once_under_ulimit_1024(tmp_path: Path) -> None:
    paths = []
    for i in range(1000):
        path = tmp_path / f"model-{i:05d}.safetensors"
        ref_pt.save_file({f"layer.{i}": torch.full((2,), float(i))}, path)
        paths.append(str(path))
    (tmp_path / "paths.txt").write_text("\n".join(paths))
    script = textwrap.dedent(
        f"""
        import resource
        import stream_st.torch as st
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
        paths = open({str(tmp_path / "paths.txt")!r}).read().split("\\n")
        handles = [st.safe_open(p, "pt") for p in paths]
        total = sum(float(f.get_tensor(f.keys()[0])[0]) for f in handles)
        print(len(handles), total)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1000", str(float(sum(range(1000))))]


@pytest.mark.skipif(os.name != "posix", reason="ulimit")
def test_an_index_of_more_shards_than_descriptors_loads(tmp_path: Path) -> None:
    """``load_file`` of an index maps each shard through the streaming core: the mappings hold
    no descriptor, so 300 shards load under ``ulimit -n 128``, read-only views where the
    mapping is shared, writable ones where it is private."""
    shards = 300
    for i in range(shards):
        ref_pt.save_file({f"layer.{i}": torch.full((2,), float(i))}, tmp_path / f"m-{i}.st")
    weight_map = {f"layer.{i}": f"m-{i}.st" for i in range(shards)}
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    script = textwrap.dedent(
        f"""
        import resource
        import anyio
        import stream_st, stream_st.numpy, stream_st.torch
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        arrays = stream_st.numpy.load_file({str(index)!r})
        tensors = stream_st.torch.load_file({str(index)!r})
        streamed = anyio.run(lambda: stream_st.load({str(index)!r}, copy=False))
        try:  # a shared mapping's views cannot be made writable
            streamed["layer.1"].flags.writeable = True
        except ValueError:
            pass
        arrays["layer.1"][0] = -1.0  # a private mapping's copy on write
        print(len(arrays), sum(float(a[1]) for a in arrays.values()),
              sum(float(t[1]) for t in tensors.values()), float(arrays["layer.1"][0]),
              all(not a.flags.writeable for a in streamed.values()))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300
    )
    assert done.returncode == 0, done.stderr
    total = str(float(sum(range(shards))))
    assert done.stdout.split() == [str(shards), total, total, "-1.0", "True"]
    assert ref_pt.load_file(tmp_path / "m-1.st")["layer.1"].tolist() == [1.0, 1.0]
