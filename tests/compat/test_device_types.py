"""``device=`` of each Python type, against the reference: the torch drop-in takes what the
reference takes (a ``str``, a CUDA index) and the extras docs/dropin.md lists (a
``torch.device``, ``"cpu:0"``), and refuses anything else as the reference does, with its
``SafetensorError`` worded as its message is."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

import safetensors.torch as reference
import torch
from safetensors import SafetensorError as ReferenceError
from safetensors import safe_open as reference_open

import stream_st.torch as st
from stream_st.compat import SafetensorError
from stream_st.errors import DeviceError

CUDA = torch.cuda.is_available()


class CpuName(str):
    """A ``str`` subclass: the reference takes it as the ``str`` it is."""


class SaysCpu:
    """An object whose ``str()`` is ``"cpu"``, which is no device name for all that."""

    def __str__(self) -> str:
        return "cpu"

    def __repr__(self) -> str:
        return "SaysCpu()"


Load = Callable[[Any, Path, Any], Any]


def _load_file(api: Any, path: Path, device: Any) -> Any:
    """``api.load_file`` of ``path`` on ``device``."""
    return api.load_file(path, device=device)


def _safe_open(api: Any, path: Path, device: Any) -> Any:
    """The one tensor of ``path``, from ``api``'s ``safe_open(path, "pt", device=device)``."""
    handle = (st.safe_open if api is st else reference_open)(path, "pt", device=device)
    with handle:
        return handle.get_tensor("a")


def _load_model(api: Any, path: Path, device: Any) -> Any:
    """``api.load_model`` of ``path`` into an empty module (``strict=False``) on ``device``."""
    return api.load_model(torch.nn.Module(), path, strict=False, device=device)


LOADS = [_load_file, _safe_open, _load_model]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    """A file of one small tensor, written by the reference."""
    written = tmp_path / "one.safetensors"
    reference.save_file({"a": torch.arange(4, dtype=torch.float32)}, written)
    return written


def _outcome(load: Load, api: Any, path: Path, device: Any) -> BaseException | None:
    """What ``load`` does with ``device``: the exception raised, or None where it loads."""
    try:
        load(api, path, device)
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize(
    "device", [b"cpu", bytearray(b"cpu"), SaysCpu(), 1.0, ["cpu"], np.bool_(False)], ids=repr
)
def test_a_device_of_another_type_is_invalid_as_the_reference_says(
    path: Path, load: Load, device: Any
) -> None:
    """``device=b"cpu"`` (or anything whose ``str()`` is ``"cpu"``) was taken as the CPU, where
    the reference raises ``SafetensorError: device b'cpu' is invalid``; it is refused alike,
    with the same class and wording, a DeviceError (a ValueError) too, before anything is read."""
    with pytest.raises(ReferenceError) as theirs:
        load(reference, path, device)
    assert str(theirs.value) == f"device {device!r} is invalid"
    with pytest.raises(SafetensorError, match=f"^{re.escape(str(theirs.value))}") as ours:
        load(st, path, device)
    assert isinstance(ours.value, DeviceError)
    assert isinstance(ours.value, ValueError)


@pytest.mark.parametrize("device", [SaysCpu(), b"cpu", 1.0], ids=repr)
def test_numpy_handles_refuse_a_device_of_another_type_as_the_reference(
    path: Path, device: Any
) -> None:
    """``safe_open(path, "np", device=...)`` took an object whose ``str()`` is ``"cpu"`` as the
    CPU; the reference refuses it, as every other type that is no device."""
    with pytest.raises(ReferenceError) as theirs:
        reference_open(path, "np", device=device)
    with pytest.raises(SafetensorError, match=f"^{re.escape(str(theirs.value))}"):
        st.safe_open(path, "np", device=device)


CPU_DEVICES = [None, "cpu", CpuName("cpu"), torch.device("cpu"), "cpu:0"]


@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize("device", CPU_DEVICES, ids=repr)
def test_the_cpu_is_taken_named_as_the_reference_or_the_docs_name_it(
    path: Path, load: Load, device: Any
) -> None:
    """``None``, ``"cpu"`` and a ``str`` subclass of it load on the CPU, as the reference's
    do; a ``torch.device`` of the CPU and ``"cpu:0"``, which the reference refuses, load as
    docs/dropin.md says."""
    theirs = _outcome(load, reference, path, device)
    if isinstance(device, CpuName) or device in (None, "cpu"):
        assert theirs is None
    else:
        assert isinstance(theirs, ReferenceError)
    assert _outcome(load, st, path, device) is None


@pytest.mark.skipif(CUDA, reason="checks the refusals of a torch without CUDA")
@pytest.mark.parametrize("load", LOADS)
@pytest.mark.parametrize(
    "device", ["cuda", "cuda:0", CpuName("cuda"), 0, 1, np.int64(0), True, False], ids=repr
)
def test_a_cuda_device_without_cuda_is_a_runtime_error_as_the_reference(
    path: Path, load: Load, device: Any
) -> None:
    """A CUDA device (a name, a ``str`` subclass, an index of any integer type) without CUDA is
    a RuntimeError from the reference, and a UsageError (a RuntimeError) from the drop-in, which
    says so before anything is read. A ``bool``, which the reference takes as the index it
    stands for, is refused here whatever the machine (a DeviceError, a RuntimeError too)."""
    theirs = _outcome(load, reference, path, device)
    assert type(theirs) is RuntimeError
    ours = _outcome(load, st, path, device)
    assert isinstance(ours, RuntimeError)
    assert isinstance(ours, SafetensorError)
    if isinstance(device, bool):
        assert isinstance(ours, DeviceError)
        assert str(ours).startswith(f"device {device!r} is invalid")
    else:
        assert "no usable CUDA device" in str(ours)


@pytest.mark.parametrize("load", LOADS)
def test_a_negative_index_is_refused_as_the_reference(path: Path, load: Load) -> None:
    """``device=-1``: the reference's SafetensorError, and the drop-in's DeviceError (one)."""
    assert isinstance(_outcome(load, reference, path, -1), ReferenceError)
    ours = _outcome(load, st, path, -1)
    assert isinstance(ours, DeviceError)
    assert isinstance(ours, SafetensorError)


def test_without_torch_numpy_handles_take_only_a_str_as_the_cpu(path: Path) -> None:
    """Without torch, ``"cpu:0"`` was read from ``str(device)``, so any object that prints so
    was taken as the CPU; only a ``str`` is, as with torch."""
    script = f"""
import sys
sys.modules["torch"] = None  # no torch
import stream_st.numpy as st
from stream_st.compat import SafetensorError
class Printed:
    def __str__(self):
        return "cpu:0"
with st.safe_open({str(path)!r}, "np", device="cpu:0") as handle:
    assert handle.get_tensor("a").tolist() == [0.0, 1.0, 2.0, 3.0]
try:
    st.safe_open({str(path)!r}, "np", device=Printed())
except SafetensorError as exc:
    print(type(exc).__name__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["UsageError"]
