"""The drop-ins' ``save_file`` and ``save`` of a dict in memory, to a local file or to bytes,
take a direct path with no event loop: the same bytes as the reference (and as the streamed
writer, digests included), the same refusals, and the same all-or-nothing commit. Other
destinations (a FIFO, a URL) still go through the streamed writer."""

from __future__ import annotations

import json
import os
import resource
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy
from stream_st import SafetensorsError, TransportError
from stream_st.transports.file import atomic

Arrays = dict[str, np.ndarray[Any, Any]]


def numpy_tensors(count: int = 400) -> Arrays:
    """Small tensors the reference's numpy writer takes: mixed dtypes, scalars, empties, a
    big-endian one, names that JSON escapes."""
    rng = np.random.default_rng(3)
    dtypes = [np.float32, np.float16, np.int64, np.uint8, np.bool_, np.complex64]
    arrays: Arrays = {}
    for i in range(count):
        shape = [(), (0,), (5,), (3, 4)][i % 4]
        values = np.asarray(rng.standard_normal(shape) * 50)
        arrays[f"t{i:04d}"] = values.astype(dtypes[i % len(dtypes)])
    arrays['quote"back\\slash·ü'] = np.arange(6, dtype=">i4")
    return arrays


def test_numpy_save_file_and_save_match_the_reference(tmp_path: Path) -> None:
    arrays = numpy_tensors()
    metadata = {"note": "ü"}  # one key: the reference orders several as its hash map does
    expected = reference_numpy.save(arrays, metadata=metadata)
    path = tmp_path / "n.safetensors"
    stream_st.numpy.save_file(arrays, path, metadata=metadata)
    assert path.read_bytes() == expected
    assert stream_st.numpy.save(arrays, metadata=metadata) == expected
    stream_st.numpy.save_file(arrays, f"file://{path}")  # replaced, through a file:// URL
    assert path.read_bytes() == reference_numpy.save(arrays)
    assert os.listdir(tmp_path) == ["n.safetensors"]


def test_torch_save_file_and_save_match_the_reference(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import safetensors.torch as reference_torch
    import torch

    import stream_st.torch

    generator = torch.Generator().manual_seed(5)
    dtypes = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int16, torch.bool]
    tensors = {
        f"w{i:03d}": (torch.randn((i % 3) + 1, 4, generator=generator) * 10).to(dtypes[i % 5])
        for i in range(300)
    }
    path = tmp_path / "t.safetensors"
    stream_st.torch.save_file(tensors, str(path), metadata={"m": "1"})
    expected = reference_torch.save(tensors, metadata={"m": "1"})
    assert path.read_bytes() == expected
    assert stream_st.torch.save(tensors, metadata={"m": "1"}) == expected


STREAMING = (
    "anyio",
    "stream_st._api",
    "stream_st.reader",
    "stream_st.writer",
    "stream_st.transports.registry",
    "stream_st.compat._reference",
)
"""What a write at once needs none of (the event loop's library, the streaming core)."""


def test_saving_to_a_local_file_imports_no_event_loop_nor_streaming_core(tmp_path: Path) -> None:
    """In a fresh process: numpy's ``save_file`` (a path, a ``file://`` URL, digests) and
    ``save``, then torch's (torch itself imports asyncio and ssl), load nothing of the
    streaming core, and write the reference's bytes."""
    pytest.importorskip("torch")
    import safetensors.torch as reference_torch
    import torch

    import stream_st.torch

    script = f"""
import json, sys
import numpy as np
import stream_st.numpy
arrays = {{"b": np.arange(12, dtype=np.float32).reshape(3, 4), "a": np.arange(3, dtype=np.int64)}}
stream_st.numpy.save_file(arrays, {str(tmp_path / "n.safetensors")!r}, metadata={{"k": "v"}})
stream_st.numpy.save_file(arrays, {(tmp_path / "u.safetensors").as_uri()!r})
stream_st.numpy.save_file(arrays, {str(tmp_path / "c.safetensors")!r}, checksums=True)
stream_st.numpy.save(arrays)
after_numpy = [m for m in {(*STREAMING, "asyncio", "ssl")!r} if m in sys.modules]
import torch
import stream_st.torch
tensors = {{"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(2, dtype=torch.bfloat16)}}
stream_st.torch.save_file(tensors, {str(tmp_path / "t.safetensors")!r})
stream_st.torch.save_file(tensors, {str(tmp_path / "t.safetensors")!r})  # replaced
stream_st.torch.save(tensors)
after_torch = [m for m in {STREAMING!r} if m in sys.modules]
print(json.dumps([after_numpy, after_torch]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [[], []]
    arrays: Arrays = {
        "b": np.arange(12, dtype=np.float32).reshape(3, 4),
        "a": np.arange(3, dtype=np.int64),
    }
    assert (tmp_path / "n.safetensors").read_bytes() == reference_numpy.save(arrays, {"k": "v"})
    assert (tmp_path / "u.safetensors").read_bytes() == reference_numpy.save(arrays)
    digested = (tmp_path / "c.safetensors").read_bytes()
    assert digested == stream_st.numpy.save(arrays, checksums=True) != reference_numpy.save(arrays)
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "h": torch.ones(2, dtype=torch.bfloat16)}
    assert (tmp_path / "t.safetensors").read_bytes() == reference_torch.save(tensors)
    assert sorted(os.listdir(tmp_path)) == [
        "c.safetensors",
        "n.safetensors",
        "t.safetensors",
        "u.safetensors",
    ]


def test_what_the_reference_refuses_is_written_as_save_writes_it(tmp_path: Path) -> None:
    """Where the reference's numpy writer refuses a dtype (or writes a strided array's memory
    as it lies), the bytes are those of save()."""
    arrays = {
        "a": np.ones((2, 3), ml_dtypes.bfloat16),
        "b": np.zeros(4, ml_dtypes.float8_e5m2),
        "strided": np.arange(40, dtype=np.float64).reshape(5, 8)[:, ::2],
    }
    stream_st.numpy.save_file(arrays, tmp_path / "d.safetensors")
    anyio.run(stream_st.save, tmp_path / "s.safetensors", arrays)
    assert (tmp_path / "d.safetensors").read_bytes() == (tmp_path / "s.safetensors").read_bytes()


@pytest.mark.parametrize("algorithm", [True, "sha256"])
def test_checksums_match_the_streamed_writer(tmp_path: Path, algorithm: bool | str) -> None:
    arrays = numpy_tensors(60)
    direct, streamed = tmp_path / "d.safetensors", tmp_path / "s.safetensors"
    stream_st.numpy.save_file(arrays, direct, checksums=algorithm)
    anyio.run(lambda: stream_st.save(streamed, arrays, checksums=algorithm))
    assert direct.read_bytes() == streamed.read_bytes()
    assert stream_st.numpy.save(arrays, checksums=algorithm) == direct.read_bytes()
    loaded = stream_st.numpy.load_file(direct)  # every digest checked
    assert all(np.array_equal(loaded[n], a) for n, a in arrays.items())


async def test_called_inside_a_running_event_loop(tmp_path: Path) -> None:
    arrays = numpy_tensors(20)
    stream_st.numpy.save_file(arrays, tmp_path / "x.safetensors")
    assert (tmp_path / "x.safetensors").read_bytes() == reference_numpy.save(arrays)


def test_a_replaced_file_keeps_its_mode_and_a_symlink_is_replaced(tmp_path: Path) -> None:
    """A symlink at the destination is replaced by the new file, as the reference replaces it:
    in a Hugging Face cache layout the blob two snapshots link to stays as it was."""
    blobs, rev1, rev2 = tmp_path / "blobs", tmp_path / "rev1", tmp_path / "rev2"
    for folder in (blobs, rev1, rev2):
        folder.mkdir()
    old = {"w": np.zeros(4, np.float32)}
    reference_numpy.save_file(old, str(blobs / "abc"))
    (blobs / "abc").chmod(0o640)
    for rev in (rev1, rev2):
        (rev / "model.safetensors").symlink_to(Path("..") / "blobs" / "abc")
    arrays = numpy_tensors(10)
    stream_st.numpy.save_file(arrays, rev1 / "model.safetensors")
    assert not (rev1 / "model.safetensors").is_symlink()
    assert (rev1 / "model.safetensors").read_bytes() == reference_numpy.save(arrays)
    assert stat.S_IMODE((rev1 / "model.safetensors").stat().st_mode) == 0o640
    assert (rev2 / "model.safetensors").read_bytes() == reference_numpy.save(old)
    assert os.listdir(blobs) == ["abc"] and os.listdir(rev1) == ["model.safetensors"]
    for name, to in (("dangling", tmp_path / "nowhere" / "x"), ("folder", blobs)):
        (tmp_path / name).symlink_to(to)  # replaced too, as the reference replaces them
        stream_st.numpy.save_file(arrays, tmp_path / name)
        assert (tmp_path / name).read_bytes() == reference_numpy.save(arrays)
    assert not (tmp_path / "nowhere").exists() and os.listdir(blobs) == ["abc"]


def test_the_destination_is_looked_at_once_but_through_a_symlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ``lstat`` tells the drop-in's ``save_file`` what is at the destination, new or
    replaced; a symlink there is followed as well, to find what it leads to."""
    looks: list[tuple[str, bool]] = []
    real_stat = os.stat

    def counted(path: Any, *args: Any, follow_symlinks: bool = True, **kwargs: Any) -> Any:
        if str(path).endswith(".safetensors"):
            looks.append((os.path.basename(path), follow_symlinks))
        return real_stat(path, *args, follow_symlinks=follow_symlinks, **kwargs)

    monkeypatch.setattr(os, "stat", counted)
    arrays = numpy_tensors(3)
    for _ in range(2):  # new, then replaced
        stream_st.numpy.save_file(arrays, tmp_path / "a.safetensors")
    assert looks == [("a.safetensors", False)] * 2
    looks.clear()
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "a.safetensors")
    stream_st.numpy.save_file(arrays, tmp_path / "b.safetensors")
    assert looks == [("b.safetensors", False), ("b.safetensors", True), ("b.safetensors", True)]
    assert not (tmp_path / "b.safetensors").is_symlink()
    assert (tmp_path / "b.safetensors").read_bytes() == reference_numpy.save(arrays)


def test_relative_paths_and_symlinked_directories_are_written_where_they_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Relative names, ``..`` after a symlinked directory (the kernel's parent, as realpath
    finds it), a file replaced through such a directory; a missing directory is named resolved
    in the error."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "linked").symlink_to(tmp_path / "sub" / "deep")
    arrays = numpy_tensors(5)
    expected = reference_numpy.save(arrays)
    stream_st.numpy.save_file(arrays, "here.safetensors")
    stream_st.numpy.save_file(arrays, "linked/../up.safetensors")  # sub/up, not up
    (tmp_path / "sub" / "deep" / "in.safetensors").write_bytes(b"old")
    stream_st.numpy.save_file(arrays, "linked/in.safetensors")
    for name in ("here.safetensors", "sub/up.safetensors", "sub/deep/in.safetensors"):
        assert (tmp_path / name).read_bytes() == expected
    assert (tmp_path / "linked").is_symlink()
    with pytest.raises(SafetensorsError) as missing:
        stream_st.numpy.save_file(arrays, "gone/x.safetensors")
    assert f"no such directory: {os.path.realpath(tmp_path / 'gone')}" in str(missing.value)
    assert sorted(os.listdir(tmp_path)) == ["here.safetensors", "linked", "sub"]
    assert sorted(os.listdir(tmp_path / "sub")) == ["deep", "up.safetensors"]
    assert os.listdir(tmp_path / "sub" / "deep") == ["in.safetensors"]


@pytest.mark.parametrize("named", [False, True], ids=["nameless", "named"])
@pytest.mark.parametrize("reserved", [True, False], ids=["reserving", "writing"])
def test_a_failed_write_leaves_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reserved: bool, named: bool
) -> None:
    """Past a file size limit (EFBIG; Python ignores SIGXFSZ) when the blocks are reserved, or
    while the data is written (no reservation): a TransportError, the old file untouched and
    no temporary file left, named or nameless."""
    if not reserved:
        monkeypatch.setattr(atomic, "_FALLOCATE", None)
    monkeypatch.setattr(atomic, "USE_TMPFILE", not named)
    path = tmp_path / "keep.safetensors"
    path.write_bytes(b"previous")
    arrays = {f"x{i}": np.full(64 << 8, i, np.float32) for i in range(80)}  # 5 MiB: reserved
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(TransportError) as info:
            stream_st.numpy.save_file(arrays, path)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert str(path) in str(info.value)
    assert path.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["keep.safetensors"]


def test_refusals_create_nothing(tmp_path: Path) -> None:
    path = tmp_path / "r.safetensors"
    with pytest.raises(TypeError) as bad_metadata:  # the reference's type
        stream_st.numpy.save_file({"a": np.zeros(2)}, path, metadata={"k": 1})  # type: ignore[dict-item]
    assert isinstance(bad_metadata.value, SafetensorsError)
    with pytest.raises(SafetensorsError):
        stream_st.numpy.save_file({"a": np.array([object()])}, path)
    with pytest.raises(SafetensorsError):
        stream_st.numpy.save_file({"a": np.zeros(2)}, tmp_path / "missing" / "r.safetensors")
    with pytest.raises(SafetensorsError):
        stream_st.numpy.save_file({"a": np.zeros(2)}, tmp_path)  # a directory
    assert os.listdir(tmp_path) == []


def _lone_surrogate_cases() -> list[tuple[Any, Any, Any, Any]]:
    """(reference save, stream_st save, tensors, metadata) of text UTF-8 cannot encode."""
    import safetensors.torch as reference_torch
    import torch

    import stream_st.torch

    np_one, pt_one = np.zeros(2, np.float32), torch.zeros(2)
    return [
        (reference_numpy.save, stream_st.numpy.save, {"\ud800": np_one}, None),
        (reference_torch.save, stream_st.torch.save, {"\udcff": pt_one}, None),
        (reference_numpy.save, stream_st.numpy.save, {"a": np_one}, {"k": "\ud800"}),
        (reference_torch.save, stream_st.torch.save, {"a": pt_one}, {"\udc80": "v"}),
    ]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch on quantized and complex32 tensors
def test_refusals_derive_from_the_references_built_in_types(tmp_path: Path) -> None:
    """A torch dtype safetensors cannot carry is the reference's ``KeyError``, text UTF-8 cannot
    encode its ``UnicodeEncodeError``; each a SafetensorsError too (DtypeError, HeaderError),
    on the direct path and the streamed one, nothing created."""
    pytest.importorskip("torch")
    import safetensors.torch as reference_torch
    import torch

    import stream_st.torch

    zeros = torch.zeros(2)
    dtypes = [
        torch.zeros(2, dtype=torch.complex128),
        torch.zeros(2, dtype=torch.complex32),
        torch.quantize_per_tensor(zeros, 0.1, 0, torch.qint8),
        torch.zeros(2, dtype=torch.uint8).view(torch.uint4),  # type: ignore[attr-defined]
        torch.zeros(2, dtype=torch.uint8).view(torch.bits8),
    ]
    path = tmp_path / "t.safetensors"
    for tensor in dtypes:
        tensors = {"ok": zeros, "x": tensor}
        with pytest.raises(KeyError):
            reference_torch.save(tensors)
        refused = pytest.raises(KeyError, match=f"tensor 'x': torch dtype {tensor.dtype} has no")
        with refused as caught_dtype:
            stream_st.torch.save(tensors)
        assert isinstance(caught_dtype.value, stream_st.DtypeError)
        with refused:
            stream_st.torch.save_file(tensors, path)
        with refused:
            stream_st.torch.save_file(tensors, path, timeout=9)  # the streamed way
    for reference, ours, tensors, metadata in _lone_surrogate_cases():
        with pytest.raises(UnicodeEncodeError):
            reference(tensors, metadata)
        with pytest.raises(UnicodeEncodeError, match="must be valid Unicode text") as caught:
            ours(tensors, metadata)
        assert isinstance(caught.value, stream_st.HeaderError)
        assert caught.value.reason == "surrogates not allowed"
        arrays = {name: np.zeros(2) for name in tensors}
        with pytest.raises(UnicodeEncodeError):
            stream_st.numpy.save_file(arrays, path, metadata)
        with pytest.raises(UnicodeEncodeError):
            stream_st.numpy.save_file(arrays, path, metadata, timeout=9)
    assert os.listdir(tmp_path) == []


def test_a_unix_sockets_file_at_the_destination_is_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A socket's file, which no open writes through, went to the streamed writer's pipe sink
    (as a FIFO does) and its open failed (``ENXIO``); the reference's ``save_file`` replaces it
    with the file: so do ``save_file`` and ``save``, and a symlink to a socket is replaced
    itself, the socket left as it is."""
    monkeypatch.chdir(tmp_path)  # a socket's path is short (108 bytes)
    arrays = numpy_tensors(5)
    for save in (
        lambda path: stream_st.numpy.save_file(arrays, path),
        lambda path: anyio.run(stream_st.save, path, arrays),
    ):
        for path in ("sock", "link"):
            with socket.socket(socket.AF_UNIX) as bound:
                bound.bind("sock")
            if path == "link":
                os.symlink("sock", path)
            save(path)
            assert Path(path).read_bytes() == reference_numpy.save(arrays)
            assert not Path(path).is_symlink()
            assert stat.S_ISSOCK(os.lstat("sock").st_mode) == (path == "link")
            for left in os.listdir():
                os.unlink(left)


def test_a_fifo_is_written_through_by_the_streamed_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    arrays = numpy_tensors(50)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    try:
        stream_st.numpy.save_file(arrays, fifo)
    finally:
        reader.join(10)
    assert got == [reference_numpy.save(arrays)]
    assert stat.S_ISFIFO(fifo.stat().st_mode)
