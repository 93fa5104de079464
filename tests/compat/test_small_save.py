"""The compiled writer of small files of plain numpy arrays (``stream_st/core/_small.c``) against
the Python write and the reference: the same bytes and permission bits wherever it writes, and
wherever it does not take a file (it says so, nothing written), the Python write makes it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st
import stream_st.numpy as st_np
from stream_st.compat import _save
from stream_st.transports.file import atomic

from .._util import nameless_works

pytest.importorskip("stream_st.core._small", reason="the C module was not built")


@pytest.fixture(autouse=True)
def _nameless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that names nameless files, as the compiled writer needs."""
    if not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here: every file is written the Python way")
    monkeypatch.setattr(atomic, "_UNLINKABLE", set())


def python_bytes(tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> bytes:
    """The file the Python write makes of ``tensors``."""
    return st_np.save(tensors, metadata)


def written(tensors: Any, path: object, metadata: Any = None) -> bool:
    """Whether the compiled writer took the file."""
    return _save._written_small(tensors, path, metadata)


def random_tensors(seed: int) -> dict[str, np.ndarray[Any, Any]]:
    """Tensors of every dtype the compiled writer takes, of odd shapes (0-d, empty, several
    dimensions), under names that sort differently as code points and as the reference sorts
    them (by dtype first), non-ASCII ones among them."""
    rng = np.random.default_rng(seed)
    dtypes: list[Any] = [np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.float16, np.int32]
    dtypes += [np.uint32, np.float32, np.int64, np.uint64, np.float64, np.complex64, np.longlong]
    names = [
        "a",
        "b",
        "Z",
        "é",
        "日本",
        "x.y",
        "layer.10",
        "layer.9",
        "",
        " ",
        "~",
        "\U0001d538",
    ]  # past the BMP
    tensors = {}
    for name in rng.choice(names, size=int(rng.integers(0, len(names))), replace=False):
        dtype = np.dtype(rng.choice(dtypes))
        shape = tuple(int(n) for n in rng.integers(0, 5, size=int(rng.integers(0, 4))))
        tensors[str(name)] = np.asarray(rng.standard_normal(shape) * 100).astype(dtype)
    return tensors


@pytest.mark.parametrize("seed", range(40))
def test_it_writes_the_python_writes_bytes(tmp_path: Path, seed: int) -> None:
    tensors = random_tensors(seed)
    # one key each: the reference writes several in no set order
    metadata = [None, {"format": "np"}, {"é": '\u2028 \x7f"\\'}][seed % 3]
    path = tmp_path / "m.safetensors"
    assert written(tensors, path, metadata)
    assert path.read_bytes() == python_bytes(tensors, metadata)
    assert path.read_bytes() == reference_numpy.save(tensors, metadata)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    assert os.listdir(tmp_path) == ["m.safetensors"]


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_it_cuts_its_writes_anywhere_in_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of 4 KiB, and 3,000 pieces (past the 1,024 one call takes): the bytes are right."""
    monkeypatch.setattr(atomic, "WRITE_CALL", 4096)
    tensors: dict[str, np.ndarray[Any, Any]] = {
        f"t{i}": np.full(i % 7, i, np.float32) for i in range(3000)
    }
    tensors["big"] = np.arange(30_001, dtype=np.float64)
    path = tmp_path / "m.safetensors"
    assert written(tensors, path)
    assert path.read_bytes() == python_bytes(tensors)


def test_a_replaced_file_keeps_its_permission_bits_less_set_id(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"OLD")
    path.chmod(0o6640)
    tensors = {"a": np.ones(3, np.float32)}
    assert written(tensors, path)
    assert path.read_bytes() == python_bytes(tensors)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_a_relative_path_and_a_path_object(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tensors = {"a": np.ones(3, np.float32)}
    assert written(tensors, "m.safetensors")
    assert written(tensors, Path("n.safetensors"))
    assert written(tensors, tmp_path / "o.safetensors")
    for name in ("m", "n", "o"):
        assert (tmp_path / f"{name}.safetensors").read_bytes() == python_bytes(tensors)


def _declined_tensors() -> dict[str, Any]:
    """What the compiled writer leaves to the Python write, by what it is."""
    plain = np.arange(12, dtype=np.float32).reshape(3, 4)
    return {
        "strided": {"a": plain[:, ::2]},
        "fortran": {"a": np.asfortranarray(plain)},
        "big-endian": {"a": plain.astype(">f4")},
        "bfloat16": {"a": plain.astype(ml_dtypes.bfloat16)},
        "float8": {"a": plain.astype(ml_dtypes.float8_e4m3fn)},
        "subclass": {"a": plain.view(np.recarray)},
        "quote": {'a"b': plain},
        "backslash": {"a\\b": plain},
        "line break": {"a\nb": plain},
        "too big": {"a": np.zeros(_save.SMALL // 4 + 1, np.float32)},
    }


@pytest.mark.parametrize("case", list(_declined_tensors()))
def test_what_it_does_not_take_the_python_write_makes(tmp_path: Path, case: str) -> None:
    tensors = _declined_tensors()[case]
    path = tmp_path / "m.safetensors"
    assert not written(tensors, path)
    assert os.listdir(tmp_path) == []
    st_np.save_file(tensors, path)
    assert path.read_bytes() == python_bytes(tensors)
    if case not in ("bfloat16", "float8", "strided", "fortran"):  # the reference's own: none
        assert path.read_bytes() == reference_numpy.save(tensors)  # or their memory as it lies


@pytest.mark.parametrize(
    "tensors",
    [
        {"__metadata__": np.ones(2, np.float32)},
        {1: np.ones(2, np.float32)},
        {"\ud800": np.ones(2, np.float32)},
        {"a": np.array([object()])},
    ],
    ids=["reserved name", "int name", "lone surrogate", "object"],
)
def test_bad_tensors_get_the_python_writes_error(tmp_path: Path, tensors: dict[Any, Any]) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(stream_st.SafetensorsError):
        st_np.save_file(tensors, path)
    assert os.listdir(tmp_path) == []


def test_metadata_it_cannot_encode_gets_the_python_writes_error(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    with pytest.raises(stream_st.SafetensorsError):
        st_np.save_file({"a": np.ones(2, np.float32)}, path, {"k": "\udc80"})
    with pytest.raises(TypeError):
        st_np.save_file({"a": np.ones(2, np.float32)}, path, {"k": 1})  # type: ignore[dict-item]
    assert os.listdir(tmp_path) == []


def test_a_digest_record_in_the_metadata_is_left_out(tmp_path: Path) -> None:
    """A record copied from a checksummed file's metadata would make the new file fail its own
    check: the compiled writer leaves it out, as the Python write does."""
    tensors = {"a": np.ones(2, np.float32)}
    source = tmp_path / "checked.safetensors"
    st_np.save_file(tensors, source, checksums=True)
    with st_np.safe_open(source, "np") as checked:  # its metadata, as a program copies it
        metadata = checked.metadata() or {}
    assert any(key.startswith("stream_st.") for key in metadata)
    path = tmp_path / "m.safetensors"
    assert written(tensors, path, {**metadata, "kept": "yes"})
    assert path.read_bytes() == python_bytes(tensors, {**metadata, "kept": "yes"})
    with st_np.safe_open(path, "np") as copied:
        assert copied.metadata() == {"kept": "yes"}


@pytest.mark.parametrize("there", ["symlink", "dangling symlink", "directory", "fifo"])
def test_a_destination_that_is_no_regular_file_is_left_to_the_python_write(
    tmp_path: Path, there: str
) -> None:
    path = tmp_path / "m.safetensors"
    if there == "symlink":
        (tmp_path / "real").write_bytes(b"OLD")
        path.symlink_to(tmp_path / "real")
    elif there == "dangling symlink":
        path.symlink_to(tmp_path / "nowhere")
    elif there == "directory":
        path.mkdir()
    else:
        os.mkfifo(path)
    before = sorted(os.listdir(tmp_path))
    assert not written({"a": np.ones(2, np.float32)}, path)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize(
    "where",
    ["missing/m.safetensors", "file/m.safetensors", "m.safetensors/", "", "file:///x", "s3://b/k"],
)
def test_a_path_it_cannot_plainly_write_is_left_to_the_python_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_bytes(b"")
    assert not written({"a": np.ones(2, np.float32)}, where)
    assert os.listdir(tmp_path) == ["file"]


def test_a_read_only_directory_gets_the_python_writes_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only directory")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert not written({"a": np.ones(2, np.float32)}, folder / "m.safetensors")
        with pytest.raises(stream_st.TransportError):
            st_np.save_file({"a": np.ones(2, np.float32)}, folder / "m.safetensors")
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o700)


FULL_DISK = """
import os, resource, signal, sys
import numpy as np
import stream_st, stream_st.numpy as st_np
from stream_st.compat import _save
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))
tensors = {"a": np.ones(200_000, np.uint8)}
print("compiled writer took it:", _save._written_small(tensors, sys.argv[1], None))
print("left:", sorted(os.listdir(os.path.dirname(sys.argv[1]))))
try:
    st_np.save_file(tensors, sys.argv[1])
except stream_st.TransportError as exc:
    print("refused:", exc)
"""


def test_a_disk_that_fills_leaves_the_old_file_and_nothing_else(tmp_path: Path) -> None:
    """Writes that fail partway (the file-size limit, as a full disk): the compiled writer gives
    the file up, the Python write then reports why; the old file stays, nothing else is left."""
    assert written({"a": np.ones(200_000, np.uint8)}, tmp_path / "taken.safetensors")
    os.unlink(tmp_path / "taken.safetensors")  # a file it takes, where nothing stops its writes
    path = tmp_path / "m.safetensors"
    path.write_bytes(b"OLD")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FULL_DISK), os.fspath(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    assert "compiled writer took it: False" in done.stdout, done.stdout
    assert "left: ['m.safetensors']" in done.stdout, done.stdout
    assert "refused:" in done.stdout and "File too large" in done.stdout, done.stdout
    assert path.read_bytes() == b"OLD"
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_torch_tensors_of_numpys_own_types_are_written_as_the_reference_writes_them(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    import safetensors.torch as reference_torch

    tensors = {
        "w": torch.randn(4, 3, requires_grad=True),
        "i": torch.arange(5),
        "b": torch.tensor([True, False]),
        "h": torch.zeros((), dtype=torch.float16),
        "e": torch.zeros(0, 2, dtype=torch.uint8),
    }
    path = tmp_path / "m.safetensors"
    assert written(tensors, path, {"format": "pt"})
    assert path.read_bytes() == reference_torch.save(tensors, {"format": "pt"})


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "float4_e2m1fn_x2"])
def test_torch_tensors_numpy_has_no_type_for_are_left_to_the_python_write(
    tmp_path: Path, dtype: str
) -> None:
    torch = pytest.importorskip("torch")
    import stream_st.torch as st_torch

    if not hasattr(torch, dtype):
        pytest.skip(f"this torch has no {dtype}")
    tensors = {"a": torch.zeros(2, 4, dtype=torch.uint8).view(getattr(torch, dtype))}
    path = tmp_path / "m.safetensors"
    assert not written(tensors, path)
    assert os.listdir(tmp_path) == []
    st_torch.save_file(tensors, path)
    assert path.read_bytes() == st_torch.save(tensors)


def test_a_large_torch_tensor_is_not_copied_for_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensors past the compiled writer's bytes are left to the Python write before any is
    made an array (a device's copied to the CPU, a non-contiguous one packed)."""
    torch = pytest.importorskip("torch")
    made: list[str] = []
    monkeypatch.setattr(_save, "torch_to_array", lambda tensor, name: made.append(name))
    tensors = {"a": torch.zeros(3), "b": torch.zeros(_save.SMALL // 4 + 1)}
    assert not written(tensors, tmp_path / "m.safetensors")
    assert made == []


def test_a_name_of_a_str_subclass_is_left_to_the_python_write(tmp_path: Path) -> None:
    """A subclass of str may compare otherwise: the Python write sorts it its own way."""

    class Name(str):
        __slots__ = ()

    path = tmp_path / "m.safetensors"
    assert not written({Name("a"): np.ones(2, np.float32)}, path)
    assert os.listdir(tmp_path) == []


def test_on_a_big_endian_machine_every_file_is_written_the_python_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled writer copies the arrays' memory as it lies, which is the file's byte order
    only on a little-endian machine: elsewhere the Python write swaps the bytes."""
    _save._compiled.cache_clear()
    monkeypatch.setattr(sys, "byteorder", "big")
    try:
        assert not written({"a": np.ones(2, np.float32)}, tmp_path / "m.safetensors")
        assert _save._compiled() is None
    finally:
        _save._compiled.cache_clear()  # found again, on this machine, by the next write
    assert os.listdir(tmp_path) == []


def test_no_torch_tensor_is_converted_for_a_destination_it_does_not_write(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    made: list[str] = []
    monkeypatch.setattr(_save, "torch_to_array", lambda tensor, name: made.append(name))
    for destination in ("s3://bucket/m.safetensors", "http://127.0.0.1:9/m", object()):
        assert not written({"a": torch.zeros(3)}, destination)
    assert made == []


def test_a_path_not_in_utf8_on_a_file_system_of_another_encoding_is_left_to_the_python_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compiled writer names files in UTF-8: where the file system's encoding is another, a
    path beyond ASCII is the Python write's, which encodes it as every other call does."""
    monkeypatch.setattr(sys, "getfilesystemencoding", lambda: "ascii")
    assert not written({"a": np.ones(2, np.float32)}, tmp_path / "café.safetensors")
    assert written({"a": np.ones(2, np.float32)}, tmp_path / "cafe.safetensors")
    assert os.listdir(tmp_path) == ["cafe.safetensors"]


def test_a_file_replaced_whose_temporary_name_would_be_too_long_is_left_to_the_python_write(
    tmp_path: Path,
) -> None:
    """``.<name>.<12 hex digits>.tmp`` past 255 bytes: the Python write names its temporary
    otherwise, so the compiled writer declines before writing anything; a new file of that
    name needs no temporary name and is its own."""
    tensors = {"a": np.ones(2, np.float32)}
    old = tmp_path / ("m" * 228 + ".safetensors")  # 240 bytes
    old.write_bytes(b"OLD")
    assert not written(tensors, old)
    assert old.read_bytes() == b"OLD"
    assert os.listdir(tmp_path) == [old.name]
    new = tmp_path / ("n" * 228 + ".safetensors")
    assert written(tensors, new)
    assert new.read_bytes() == python_bytes(tensors)
    st_np.save_file(tensors, old)
    assert old.read_bytes() == python_bytes(tensors)
    assert sorted(os.listdir(tmp_path)) == sorted([old.name, new.name])
