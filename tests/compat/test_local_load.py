"""``load_file`` of a local file mapped without the streaming core (``compat._local.load_mapped``):
what importing the facades costs, tensors viewed straight from the mapping at any offset, their
lifetime, and the calls that still go through the streaming core."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("torch")

import safetensors.torch as reference
import torch

import stream_st.numpy
import stream_st.torch
from stream_st.errors import AllocationError, HeaderError, SafetensorsError

CORE = ("anyio", "stream_st._api", "stream_st.reader", "stream_st.compat._reference")
"""What a mapped ``load_file`` needs none of (the event loop, the reader, the transports)."""


def test_importing_the_facades_and_a_mapped_load_import_no_streaming_core(tmp_path: Path) -> None:
    path = tmp_path / "small.safetensors"
    reference.save_file({"w": torch.arange(6.0).reshape(2, 3)}, path)
    script = f"""
import json, sys
import stream_st.numpy, stream_st.torch
first = [m for m in {CORE!r} if m in sys.modules]
tensors = stream_st.torch.load_file({str(path)!r})
arrays = stream_st.numpy.load_file({str(path)!r})
loaded = [m for m in {CORE!r} if m in sys.modules]
print(json.dumps([first, loaded, tensors["w"].tolist(), arrays["w"].tolist()]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    first, loaded, tensor, array = json.loads(done.stdout)
    assert first == [] and loaded == []
    assert tensor == array == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_the_numpy_drop_in_imports_no_threading(tmp_path: Path) -> None:
    """``threading`` (0.5 ms, which numpy does not import) is not imported by the numpy drop-in,
    nor by its ``save_file`` and mapped ``load_file``, small or large: their locks are
    ``_thread``'s."""
    script = f"""
import json, sys
import numpy as np
import stream_st.numpy
for n in (3, 1 << 20):
    path = {str(tmp_path)!r} + f"/{{n}}.safetensors"
    stream_st.numpy.save_file({{"w": np.ones(n, "f4")}}, path, metadata={{"a": "b"}})
    assert stream_st.numpy.load_file(path)["w"].sum() == n
print(json.dumps("threading" in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) is False


def test_ml_dtypes_is_imported_for_its_types_only(tmp_path: Path) -> None:
    """The drop-ins and the writer import ``ml_dtypes`` (a third of the drop-ins' import time)
    only once a tensor or a dtype of its types is met (numpy's own names and types do not): a
    BF16 file still loads in a process that never imported it, and its names are known to
    ``dtype_for`` there."""
    f32, bf16 = tmp_path / "f32.safetensors", tmp_path / "bf16.safetensors"
    reference.save_file({"w": torch.ones(3)}, f32)
    reference.save_file({"w": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}, bf16)
    script = f"""
import json, sys
import stream_st.numpy
from stream_st.core.dtypes import dtype_for
import stream_st.writer
loaded = stream_st.numpy.load_file({str(f32)!r})["w"].tolist()
codes = [dtype_for(name).code for name in ("float32", ">f4", "F16")]
before = "ml_dtypes" in sys.modules
array = stream_st.numpy.load_file({str(bf16)!r})["w"]
print(json.dumps([before, loaded, str(array.dtype), array.astype("f4").tolist(),
                  dtype_for("float8_e4m3fn").code, codes]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, loaded, dtype, values, f8, codes = json.loads(done.stdout)
    assert before is False and loaded == [1.0, 1.0, 1.0] and codes == ["F32", "F32", "F16"]
    assert (dtype, values, f8) == ("bfloat16", [1.5, -2.0], "F8_E4M3")


def odd_file(path: Path) -> dict[str, np.ndarray]:
    """A file whose data start at an odd offset (the header not padded), so no tensor is
    aligned: F32, an empty F32, F16, BF16 and BOOL; its arrays."""
    arrays = {
        "a": np.arange(3, dtype="<f4"),
        "empty": np.zeros((0, 4), dtype="<f4"),
        "b": np.arange(4, dtype="<f2").reshape(2, 2),
        "c": np.array([1.5, -2.0], dtype=ml_dtypes.bfloat16),
        "d": np.array([True, False, True]),
    }
    codes = {"a": "F32", "empty": "F32", "b": "F16", "c": "BF16", "d": "BOOL"}
    header: dict[str, object] = {}
    offset = 0
    for name, array in arrays.items():
        size = array.nbytes
        header[name] = {
            "dtype": codes[name],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * ((1 - len(raw)) % 2)  # 8 + len(raw) odd
    path.write_bytes(
        len(raw).to_bytes(8, "little") + raw + b"".join(a.tobytes() for a in arrays.values())
    )
    return arrays


def test_unaligned_and_empty_tensors_read_as_written(tmp_path: Path) -> None:
    path = tmp_path / "odd.safetensors"
    arrays = odd_file(path)
    tensors = stream_st.torch.load_file(path)
    got = stream_st.numpy.load_file(path)
    assert list(tensors) == list(got) == list(arrays)
    for name, array in arrays.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape
        assert got[name].tobytes() == array.tobytes()
        tensor = tensors[name]
        assert tuple(tensor.shape) == array.shape
        assert tensor.view(torch.uint8).numpy().tobytes() == array.tobytes()
    assert tensors["c"].dtype == torch.bfloat16 and tensors["d"].dtype == torch.bool
    assert reference.load_file(path)["c"].tolist() == tensors["c"].tolist()


def test_mapped_tensors_outlive_every_other_reference_and_stay_private(tmp_path: Path) -> None:
    path = tmp_path / "small.safetensors"
    reference.save_file({"x": torch.arange(4096.0), "y": torch.ones(3, dtype=torch.int64)}, path)
    before = path.read_bytes()
    x = stream_st.torch.load_file(path)["x"]
    y = stream_st.numpy.load_file(f"file://{path}")["y"]  # a file:// URL is mapped the same
    gc.collect()  # the loader and its mapping's owner are gone; the views keep the mapping
    assert x.sum().item() == sum(range(4096)) and y.tolist() == [1, 1, 1]
    x += 1
    y[0] = 7
    assert x[0].item() == 1.0 and y[0] == 7
    assert path.read_bytes() == before


def test_options_caps_and_a_missing_file_keep_their_behaviour(tmp_path: Path) -> None:
    path = tmp_path / "small.safetensors"
    reference.save_file({"x": torch.arange(1024.0)}, path)
    assert stream_st.torch.load_file(path, timeout=30)["x"][5].item() == 5.0
    with pytest.raises(AllocationError):
        stream_st.numpy.load_file(path, max_tensor_bytes=0)
    with pytest.raises(SafetensorsError) as missing:
        stream_st.torch.load_file(tmp_path / "absent.safetensors")
    assert isinstance(missing.value, FileNotFoundError)
    with pytest.raises(SafetensorsError):
        stream_st.numpy.load_file(path, backend="mapped")


@pytest.mark.parametrize("data", [b"", b"\x01\x00", b"\x00" * 7])
def test_a_file_shorter_than_the_header_length_is_a_header_error_read_any_way(
    tmp_path: Path, data: bytes
) -> None:
    """A file of fewer than 8 bytes: mapped (``load_file``, ``safe_open``) it was a
    TruncatedStreamError (an ``EOFError``) where ``backend="pread"``, bytes and URLs give the
    HeaderError (a ``ValueError``) that says a file starts with an 8-byte header length."""
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(data)
    reads = [
        lambda: stream_st.torch.load_file(path),
        lambda: stream_st.numpy.load_file(path),
        lambda: stream_st.torch.load_file(path, backend="pread"),
        lambda: stream_st.torch.safe_open(path, "pt"),
        lambda: stream_st.numpy.safe_open(path, "np", backend="pread"),
        lambda: stream_st.torch.load(data),
    ]
    for read in reads:
        with pytest.raises(HeaderError, match="starts with an 8-byte header length") as caught:
            read()
        assert isinstance(caught.value, ValueError) and not isinstance(caught.value, EOFError)
