"""stream_st.torch against the reference safetensors.torch: the same calls, the same results, on
local files and over HTTP, S3 (moto) and tcp://; reading into memory the caller owns; the sync
calls inside running event loops."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import textwrap
import threading
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import safetensors.torch as reference
import torch
import trio
from safetensors import SafetensorError
from safetensors import safe_open as reference_open

import stream_st
import stream_st.numpy
import stream_st.torch as st
from stream_st.errors import (
    ArgumentTypeError,
    DeviceError,
    DtypeError,
    IntegrityError,
    SafetensorsError,
    TensorNotFoundError,
    TruncatedStreamError,
    UnsupportedDeviceError,
    UsageError,
)

from ..drivers.test_writer import assert_same_file
from ..fuzz.fault_suite import Collector, Sender
from ..memory.test_zero_copy import linux_only, modify_in_place
from ..servers.http_server import RangeHTTPServer
from ..transports import test_s3 as s3_tests
from . import test_numpy_api
from .test_numpy_api import corrupt, in_mapping_of

Tensors = dict[str, torch.Tensor]


def every_dtype() -> Tensors:
    """One tensor of each dtype torch shares with safetensors (F4 aside: the reference cannot
    read it), shapes that include a scalar and an empty tensor."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    tensors = {
        "f64": base.double(),
        "f32": base,
        "f16": base.half(),
        "bf16": base.bfloat16(),
        "i64": (base * 100).long(),
        "i32": (base * 100).int(),
        "i16": (base * 100).short(),
        "i8": (base * 10).to(torch.int8),
        "u8": (base.abs() * 10).to(torch.uint8),
        "u16": (base.abs() * 100).to(torch.uint16),
        "u32": (base.abs() * 100).to(torch.uint32),
        "u64": (base.abs() * 100).to(torch.uint64),
        "bool": base > 0,
        "f8_e4m3": base.to(torch.float8_e4m3fn),
        "f8_e5m2": base.to(torch.float8_e5m2),
        "f8_e4m3fnuz": base.to(torch.float8_e4m3fnuz),
        "f8_e5m2fnuz": base.to(torch.float8_e5m2fnuz),
        "c64": torch.complex(base, -base),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }
    return tensors


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaN-safe, and for dtypes without comparisons)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (a, b)]
    return torch.equal(*as_bytes)


def assert_same(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert list(got) == list(expected) or sorted(got) == sorted(expected)
    for name in expected:
        assert same(got[name], expected[name]), name


@pytest.fixture
def ref_file(tmp_path: Path) -> Path:
    path = tmp_path / "ref.safetensors"
    reference.save_file(every_dtype(), path, metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------- local, differential


def test_save_is_byte_identical_to_the_reference(tmp_path: Path) -> None:
    tensors = every_dtype()
    st.save_file(tensors, tmp_path / "ours.safetensors", metadata={"a": "b"})
    reference.save_file(tensors, tmp_path / "ref.safetensors", metadata={"a": "b"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()
    assert st.save(tensors) == reference.save(tensors)


def test_conjugate_and_negative_views_are_written_as_they_show(tmp_path: Path) -> None:
    """The values a conjugate or negative view shows are written, so the file reads back as
    the tensor saved; the reference writes the memory under the view (its file reads back the
    other way), a difference docs/dropin.md declares."""
    conj = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()
    neg = torch.tensor([1.0, 2.0])._neg_view()
    tensors = {"conj": conj, "neg": neg}
    st.save_file(tensors, tmp_path / "ours.safetensors")
    for data in (st.save(tensors), (tmp_path / "ours.safetensors").read_bytes()):
        assert data != reference.save(tensors)
        assert_same(reference.load(data), {"conj": conj.resolve_conj(), "neg": neg.resolve_neg()})
        assert_same(reference.load(reference.save(tensors)), {"conj": conj.conj(), "neg": -neg})
    assert (
        "Conjugate and negative views"
        in (Path(__file__).parents[2] / "docs" / "dropin.md").read_text()
    )


def test_load_file_and_load_match_the_reference(ref_file: Path) -> None:
    expected = reference.load_file(ref_file)
    assert_same(st.load_file(ref_file), expected)
    assert_same(st.load_file(str(ref_file), device="cpu"), expected)
    assert_same(st.load(ref_file.read_bytes()), reference.load(ref_file.read_bytes()))
    assert all(
        t.is_contiguous() and t.device.type == "cpu" for t in st.load_file(ref_file).values()
    )


def test_safe_open_matches_the_reference(ref_file: Path) -> None:
    with reference_open(ref_file, framework="pt") as ref, st.safe_open(ref_file, "pt") as ours:
        assert ours.keys() == ref.keys()
        assert ours.offset_keys() == ref.offset_keys()
        assert ours.metadata() == ref.metadata()
        names = ref.keys()
        for name in names:
            assert same(ours.get_tensor(name), ref.get_tensor(name)), name
        assert_same(ours.get_tensors(), ref.get_tensors())
        with pytest.raises(TensorNotFoundError):
            ours.get_tensor("nope")


SLICES: list[Any] = [
    np.s_[2:5],
    np.s_[1],
    np.s_[-1],
    np.s_[...],
    np.s_[:, 1],
    np.s_[1:4, ::2],
    np.s_[::2],
    np.s_[4:1],
    np.s_[..., 2],
    np.s_[1:100],
    np.s_[-3:],
]


def test_get_slice_matches_the_reference(ref_file: Path) -> None:
    with reference_open(ref_file, framework="pt") as ref, st.safe_open(ref_file, "pt") as ours:
        for name in ("f32", "bf16", "i64", "bool", "f8_e4m3"):
            assert ours.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
            assert ours.get_slice(name).get_dtype() == ref.get_slice(name).get_dtype()
            for key in SLICES:
                assert same(ours.get_slice(name)[key], ref.get_slice(name)[key]), (name, key)
        with pytest.raises(IndexError):
            ours.get_slice("f32")[6]
        assert same(ours.get_slice("scalar")[...], ref.get_slice("scalar")[...])


def test_write_accepts_grad_and_refuses_non_contiguous_tensors(tmp_path: Path) -> None:
    weight = torch.randn(4, 6, requires_grad=True)
    st.save_file({"grad": weight * 2}, tmp_path / "x.safetensors")
    loaded = reference.load_file(tmp_path / "x.safetensors")
    assert same(loaded["grad"], (weight * 2).detach())
    for tensor in (torch.randn(5, 3).T, torch.randn(3, 4).bfloat16().T):
        with pytest.raises(ValueError, match="non contiguous") as error:  # as the reference
            st.save_file({"t": tensor}, tmp_path / "y.safetensors")
        assert isinstance(error.value, SafetensorsError)
        assert not (tmp_path / "y.safetensors").exists()


def test_bad_tensors_are_safetensors_errors(tmp_path: Path) -> None:
    dst = tmp_path / "x.safetensors"
    base = torch.randn(4, 4)
    bad: list[Any] = [
        {"sparse": base.to_sparse()},
        {"c128": torch.zeros(2, dtype=torch.complex128)},
        {"a": base, "b": base[1:]},  # shared memory
        {"list": [1, 2]},
        [base],
    ]
    for tensors in bad:
        with pytest.raises(SafetensorsError):
            st.save_file(tensors, dst)
        assert not dst.exists()
    with pytest.raises(DtypeError):  # also through the async writer
        asyncio.run(stream_st.save(dst, {"c128": torch.zeros(2, dtype=torch.complex128)}))


def test_truncated_file_never_gives_a_tensor(tmp_path: Path) -> None:
    data = reference.save({"a": torch.randn(100), "b": torch.randn(100)})
    (tmp_path / "cut.safetensors").write_bytes(data[:-10])
    with pytest.raises(TruncatedStreamError):
        st.load_file(tmp_path / "cut.safetensors")


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="checks the refusals of a torch without CUDA")
def test_a_device_this_torch_cannot_use_is_refused_clearly(ref_file: Path) -> None:
    for device in ("cuda", "cuda:0", 0, torch.device("cuda", 0)):
        with pytest.raises(UsageError, match="no usable CUDA device"):
            st.load_file(ref_file, device=device)
        with pytest.raises(UsageError, match="no usable CUDA device"):
            st.safe_open(ref_file, framework="pt", device=device)
    with pytest.raises(UsageError, match="only the CPU and CUDA"):
        st.load_file(ref_file, device="meta")
    with pytest.raises(UsageError, match="not a device torch knows"):
        st.load_file(ref_file, device="gpu7")
    with pytest.raises(UsageError, match="numpy arrays live on the CPU"):
        stream_st.numpy.safe_open(ref_file, framework="np", device="cuda")


def test_the_cpu_named_any_way_is_the_cpu(ref_file: Path) -> None:
    expected = reference.load_file(ref_file)
    for device in ("cpu", torch.device("cpu")):
        got = st.load_file(ref_file, device=device)
        assert all(torch.equal(got[name], tensor) for name, tensor in expected.items())
        assert {tensor.device.type for tensor in got.values()} == {"cpu"}


def test_any_cpu_device_is_taken_by_both_frameworks(
    ref_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``"cpu:0"`` and a ``torch.device`` of the CPU, taken for torch tensors, were refused for
    numpy arrays ("numpy arrays live on the CPU"); both frameworks take them, as docs/dropin.md
    says, and without torch numpy takes ``"cpu:0"`` as torch spells it."""
    expected = reference.load_file(ref_file)["f32"].numpy()
    for device in ("cpu:0", torch.device("cpu"), torch.device("cpu", 0)):
        for framework in ("pt", "np"):
            with st.safe_open(ref_file, framework, device=device) as handle:
                assert np.array_equal(np.asarray(handle.get_tensor("f32")), expected)
    monkeypatch.setattr(stream_st.core.arrays, "load_torch", no_torch)
    with stream_st.numpy.safe_open(ref_file, "np", device="cpu:0") as handle:
        assert np.array_equal(handle.get_tensor("f32"), expected)
    for device in ("cpu:01", "cpu:x", "cuda:0"):
        with pytest.raises(UsageError, match="numpy arrays live on the CPU"):
            stream_st.numpy.safe_open(ref_file, "np", device=device)


def test_a_cpu_but_the_one_is_refused(ref_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``"cpu:1"`` and ``torch.device("cpu", 1)``, which the reference refuses, were taken as
    the CPU; both frameworks refuse them with a DeviceError (a ValueError too) naming the one
    CPU device, before anything is read. Without torch, numpy arrays refuse ``"cpu:1"`` alike
    (they took any ``"cpu:N"``)."""
    for device in ("cpu:1", "cpu:2", torch.device("cpu", 1)):
        with pytest.raises(SafetensorError, match="is invalid"):
            reference.load_file(ref_file, device=device)  # type: ignore[arg-type]
        with pytest.raises(DeviceError, match=r"there is one CPU device, 'cpu' \(or 'cpu:0'\)"):
            st.load_file(ref_file, device=device)
        for framework in ("pt", "np"):
            with pytest.raises(ValueError, match="there is one CPU device"):
                st.safe_open(ref_file, framework, device=device)
    with_torch = {}
    for device in ("cpu:1", "cpu:2"):
        with pytest.raises(DeviceError) as caught:
            stream_st.numpy.safe_open(ref_file, "np", device=device)
        with_torch[device] = str(caught.value)
    monkeypatch.setattr(stream_st.core.arrays, "load_torch", no_torch)
    for device, message in with_torch.items():
        with pytest.raises(DeviceError) as caught:
            stream_st.numpy.safe_open(ref_file, "np", device=device)
        assert str(caught.value) == message


def test_a_device_neither_cpu_nor_cuda_is_a_not_implemented_error(ref_file: Path) -> None:
    """The reference's load_file raises torch's NotImplementedError for ``"xla"``; ours was a
    UsageError alone, which ``except NotImplementedError`` missed. Every device neither the CPU
    nor CUDA is refused with an UnsupportedDeviceError, both, before anything is read."""
    with pytest.raises(NotImplementedError):
        reference.load_file(ref_file, device="xla")
    for device in ("xla", "xla:1", "meta", torch.device("mps")):
        with pytest.raises(NotImplementedError, match="only the CPU and CUDA") as caught:
            st.load_file(ref_file, device=device)
        assert isinstance(caught.value, UnsupportedDeviceError)
        assert isinstance(caught.value, UsageError)
        with pytest.raises(NotImplementedError, match="only the CPU and CUDA"):
            st.safe_open(ref_file, framework="pt", device=device)


def no_torch() -> Any:
    raise UsageError("torch tensors need torch")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", 0])
def test_tensors_land_on_the_cuda_device(ref_file: Path, device: str | int) -> None:
    expected = reference.load_file(ref_file, device=device)
    got = st.load_file(ref_file, device=device)
    assert list(got) == list(expected)
    for name, tensor in expected.items():
        assert got[name].device == tensor.device and torch.equal(got[name], tensor)
    with (
        st.safe_open(ref_file, framework="pt", device=device) as handle,
        reference_open(ref_file, framework="pt", device=device) as ref_handle,
    ):
        for name in expected:
            assert torch.equal(handle.get_tensor(name), expected[name])
            if expected[name].dim() == 0:  # refused, as the reference refuses it
                with pytest.raises(IndexError, match="0-dim"):
                    handle.get_slice(name)[:1]
                continue
            sliced, ref_sliced = handle.get_slice(name)[:1], ref_handle.get_slice(name)[:1]
            assert sliced.device == ref_sliced.device and torch.equal(sliced, ref_sliced)
    with pytest.raises(UsageError):
        st.safe_open(ref_file, framework="tf")
    with pytest.raises(UsageError):
        st.load_file(ref_file, backend="fast")


# ---------------------------------------------------------------------- local files mapped


@linux_only
def test_load_file_and_safe_open_map_a_local_file_writably(ref_file: Path) -> None:
    """As the reference does: tensors are views of a mapping of the file, writable, and a write
    never reaches the file (copy on write)."""
    original = ref_file.read_bytes()
    expected = reference.load_file(ref_file)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns for a tensor over read-only memory
        loaded = st.load_file(ref_file)
        with st.safe_open(ref_file, "pt") as f:
            names = f.keys()
            opened = {name: f.get_tensor(name) for name in names}
            part = f.get_slice("f64")[2:4]
    assert in_mapping_of(ref_file, part) and same(part, expected["f64"][2:4])
    for tensors in (loaded, opened):
        assert_same(tensors, expected)
        assert in_mapping_of(ref_file, tensors["f32"]) and in_mapping_of(ref_file, tensors["u8"])
        tensors["f32"] += 1
        tensors["bf16"].zero_()
    assert ref_file.read_bytes() == original
    assert same(reference.load_file(ref_file)["f32"], expected["f32"])


def test_a_handles_tensors_share_its_mapping_as_the_references_do(tmp_path: Path) -> None:
    path = tmp_path / "sum.safetensors"
    st.save_file({"a": torch.zeros(8), "b": torch.ones(3)}, path, checksums=True)
    with st.safe_open(path, "pt") as ours, reference_open(path, framework="pt") as ref:
        for f in (ours, ref):
            f.get_tensor("a")[2:5] = 3  # the digest is checked once: later reads see this
        assert same(ours.get_tensor("a"), ref.get_tensor("a"))
        assert same(ours.get_slice("a")[1:4], ref.get_slice("a")[1:4])
        assert same(ours.get_tensors()["a"], ref.get_tensors()["a"])
    assert same(st.load_file(path)["a"], torch.zeros(8))


@linux_only
def test_backend_pread_reads_fresh_memory(ref_file: Path) -> None:
    for loaded in (
        st.load_file(ref_file, backend="pread"),
        st.safe_open(ref_file, "pt", backend="pread").get_tensors(),
    ):
        assert_same(loaded, reference.load_file(ref_file))
        assert not any(in_mapping_of(ref_file, t) for t in loaded.values())


@linux_only
def test_open_stream_copy_false_gives_torch_writable_private_views(ref_file: Path) -> None:
    """torch has no read-only tensors: copy=False maps privately for it, so a write (which on a
    read-only mapping would kill the process) stays in this process."""
    original = ref_file.read_bytes()

    async def main() -> dict[str, Any]:
        stream = stream_st.open_stream(ref_file, framework="pt", copy=False)
        return {name: tensor async for name, tensor in stream}

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = asyncio.run(main())
    assert in_mapping_of(ref_file, got["f64"])
    got["f64"].fill_(7)
    assert ref_file.read_bytes() == original


# ---------------------------------------------------------------------- integrity


EVERY_ROW: list[Any] = [np.s_[:, 5:6], np.s_[0:100, 3], np.s_[::3], np.s_[..., 1:2], np.s_[:, :]]
"""Keys that read every row of a 100-row tensor, most of them not every byte."""


@pytest.mark.parametrize("where", ["mmap", "pread", "http"])
@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_slice_reading_every_row_is_checked_and_a_failed_tensor_is_never_handed_out(
    tmp_path: Path, http: RangeHTTPServer, framework: str, where: str
) -> None:
    """A get_slice whose rows are all of a tensor's reads its every byte: it is checked against
    the digest as get_tensor is, numpy's as torch's, whichever the key takes of the other
    dimensions. A tensor that failed its check on a handle is handed out in no part there."""
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(1000, dtype=np.float32).reshape(100, 10),
        "b": np.arange(100, dtype=np.int16),
        "c": np.arange(600, dtype=np.float64).reshape(100, 3, 2),
    }
    path = tmp_path / "sum.safetensors"
    stream_st.numpy.save_file(arrays, path, checksums=True)
    good = path.read_bytes()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(good)
    header = asyncio.run(stream_st.read_header(path))
    for name in arrays:  # a byte of the last row of each
        modify_in_place(bad, header.data_start + header[name].end - 1, b"\xa5")
    http.objects |= {"/sum.safetensors": good, "/bad.safetensors": bad.read_bytes()}

    def handle(file: Path) -> Any:
        if where == "http":
            return st.safe_open(http.url(f"/{file.name}"), framework)
        return st.safe_open(file, framework, backend=where)

    def plain(value: Any) -> np.ndarray[Any, Any]:
        return value.numpy() if framework == "pt" else np.asarray(value)

    with handle(path) as f, reference_open(path, framework=framework) as ref:  # undamaged
        for name, key in [("a", k) for k in EVERY_ROW] + [("b", np.s_[0:100]), ("c", np.s_[:, 1])]:
            got, expected = plain(f.get_slice(name)[key]), plain(ref.get_slice(name)[key])
            assert got.dtype == expected.dtype and np.array_equal(got, expected), key
    for key in EVERY_ROW:
        with handle(bad) as f, pytest.raises(IntegrityError, match="'a'"):
            f.get_slice("a")[key]
    with handle(bad) as f:
        for name, key in [("b", np.s_[0:100]), ("b", np.s_[::2]), ("c", np.s_[:, 1, 0])]:
            with pytest.raises(IntegrityError, match=f"'{name}'"):
                f.get_slice(name)[key]
    with handle(bad) as f:  # failed once: no part of it is handed out on this handle
        with pytest.raises(IntegrityError, match="'a'"):
            f.get_tensor("a")
        sliced = f.get_slice("a")  # taken before the next failure too
        for key in (np.s_[99:100], np.s_[0:1], np.s_[0], np.s_[5:7, 2]):
            with pytest.raises(IntegrityError, match=r"'a'.*failed its digest check"):
                sliced[key]
            with pytest.raises(IntegrityError, match="'a'"):
                f.get_slice("a")[key]
        with pytest.raises(IntegrityError, match="'a'"):
            f.get_tensor("a")
        assert np.array_equal(plain(f.get_slice("b")[0:99]), arrays["b"][0:99])  # not failed
        with pytest.raises(IntegrityError):  # the first failing in offset order
            f.get_tensors()
    with handle(bad) as f:  # failed in get_tensors: remembered too
        with pytest.raises(IntegrityError) as failed:
            f.get_tensors()
        first = failed.value.name
        assert first in arrays
        with pytest.raises(IntegrityError, match=f"'{first}'"):
            f.get_slice(first)[0:1]


def test_checksums_are_opt_in_and_verified_by_default(tmp_path: Path) -> None:
    tensors = every_dtype()
    path = tmp_path / "sum.safetensors"
    st.save_file(tensors, path, {"format": "pt"}, checksums=True)
    metadata = reference_open(path, framework="pt").metadata()
    assert metadata["stream_st.digest"] == "xxh3-128" and metadata["format"] == "pt"
    assert st.save(tensors, checksums="sha256") != reference.save(tensors)
    assert st.save(tensors) == reference.save(tensors)  # off by default: byte-identical
    assert_same(st.load_file(path), tensors)
    assert_same(st.load(path.read_bytes()), tensors)

    corrupt(path, "f32")
    for backend in ("mmap", "pread"):
        with pytest.raises(IntegrityError, match="'f32'"):
            st.load_file(path, backend=backend)
        with st.safe_open(path, "pt", backend=backend) as f:
            f.get_slice("f32")[1:3]  # part of a tensor cannot be checked
            with pytest.raises(IntegrityError, match="'f32'"):
                f.get_tensor("f32")
            with pytest.raises(IntegrityError, match="'f32'"):
                f.get_tensors()
            with pytest.raises(IntegrityError, match="'f32'"):
                f.get_slice("f32")[...]  # the whole tensor: checked
            assert same(f.get_tensor("f64"), tensors["f64"])
            with pytest.raises(IntegrityError, match="'f32'"):
                f.get_slice("f32")[1:3]  # known to be damaged
        with st.safe_open(path, "pt", backend=backend, verify=False) as f:
            assert not same(f.get_tensor("f32"), tensors["f32"])
        wrongs: tuple[Any, ...] = ("", None, [])  # only True or False: these read it unchecked
        for wrong in wrongs:
            with pytest.raises(ArgumentTypeError, match="verify must be True or False"):
                st.load_file(path, backend=backend, verify=wrong)
            with pytest.raises(ArgumentTypeError, match="verify must be True or False"):
                st.safe_open(path, "pt", backend=backend, verify=wrong)
    with pytest.raises(IntegrityError):
        st.load(path.read_bytes())
    assert not same(st.load_file(path, verify=False)["f32"], tensors["f32"])
    assert not same(st.load(path.read_bytes(), verify=False)["f32"], tensors["f32"])
    damaged = tmp_path / "damaged.safetensors"  # a digest record without the digests
    reference.save_file(tensors, damaged, metadata={"stream_st.digest": "xxh3-128"})
    with pytest.raises(IntegrityError, match="no digest"):
        st.safe_open(damaged, "pt")
    st.safe_open(damaged, "pt", verify=False).close()


def test_save_model_checksums_and_load_model_verifies(tmp_path: Path) -> None:
    torch.manual_seed(5)
    model = Tied()
    path = tmp_path / "m.safetensors"
    st.save_model(model, path, checksums=True)
    loaded = Tied()
    assert st.load_model(loaded, path) == (set(), [])
    assert torch.equal(loaded.body.weight, model.body.weight)
    assert reference_open(path, framework="pt").metadata()["head.weight"] == "embed.weight"
    corrupt(path, "body.weight")
    with pytest.raises(IntegrityError, match=r"body\.weight"):
        st.load_model(Tied(), path)
    st.load_model(Tied(), path, verify=False)


# ---------------------------------------------------------------------- float4


def test_float4_round_trips_as_f4_as_the_reference_writes_it(tmp_path: Path) -> None:
    packed = torch.arange(24, dtype=torch.uint8).reshape(4, 6)
    tensors = {
        "f4": packed.view(torch.float4_e2m1fn_x2),  # 4 x 12 F4 values
        "f4_1d": packed[0].clone().view(torch.float4_e2m1fn_x2),
        "f4_empty": torch.zeros(0, 3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2),
        "u8": packed.clone(),
    }
    path = tmp_path / "f4.safetensors"
    st.save_file(tensors, path)
    assert path.read_bytes() == reference.save(tensors)
    with reference_open(path, framework="pt") as f:
        assert f.get_slice("f4").get_dtype() == "F4"
        assert f.get_slice("f4").get_shape() == [4, 12]
    header = asyncio.run(stream_st.read_header(path))
    assert (header["f4_1d"].dtype, header["f4_1d"].shape) == ("F4", (12,))
    assert (header["u8"].dtype, header["u8"].shape) == ("U8", (4, 6))
    for loaded in (st.load_file(path), st.load(path.read_bytes()), reference.load_file(path)):
        assert_same(loaded, tensors)
    with st.safe_open(path, "pt") as f:
        assert same(f.get_tensor("f4"), tensors["f4"])
    with pytest.raises(UsageError, match="0-d"):
        st.save({"x": torch.zeros((), dtype=torch.uint8).view(torch.float4_e2m1fn_x2)})


def test_float4_slices_take_the_leading_dimensions_as_torch_does(tmp_path: Path) -> None:
    """Two F4 values a byte: torch indexes the leading dimensions (its rules), the last is
    taken whole; a key that would cut it, or add or mask dimensions, is refused."""
    packed = torch.arange(24, dtype=torch.uint8).reshape(4, 6)
    path = tmp_path / "f4.safetensors"
    f4 = torch.float4_e2m1fn_x2
    st.save_file({"f4": packed.view(f4), "f4_1d": packed[0].clone().view(f4)}, path)
    taken: list[tuple[Any, Any]] = [
        (1, 1),
        (slice(1, 3), slice(1, 3)),
        (slice(-3, None, 2), slice(-3, None, 2)),
        ([3, 0], [3, 0]),
        ((0, ...), 0),
        ((..., slice(None)), ...),
        ((slice(None), slice(0, 100)), ...),
    ]
    with st.safe_open(path, "pt") as f:
        for key, rows in taken:
            assert same(f.get_slice("f4")[key], packed[rows].view(f4)), key
        assert same(f.get_slice("f4_1d")[:], packed[0].view(f4))
        refused = [True, None, [True, False, True, False], (slice(None), 1), (0, slice(0, 2))]
        for key in refused:
            with pytest.raises(IndexError, match="'f4' is F4, packed several values a byte"):
                f.get_slice("f4")[key]
        with pytest.raises(IndexError, match="last dimension can only be taken whole"):
            f.get_slice("f4_1d")[0]


def test_float4_of_an_odd_last_dimension_is_refused_as_the_reference_refuses_it(
    tmp_path: Path,
) -> None:
    """No ``float4_e2m1fn_x2`` tensor holds an F4 tensor whose last dimension is odd: every torch
    read refuses it with the reference's message (a 1-D tensor of its bytes was handed out), while
    its shape is still told and numpy still reads its bytes."""
    for shape, nbytes in (([2, 3], 3), ([4, 1], 2), ([0, 3], 0)):
        entry = {"dtype": "F4", "shape": shape, "data_offsets": [0, nbytes]}
        text = json.dumps({"w": entry}).encode()
        blob = len(text).to_bytes(8, "little") + text + bytes(range(1, nbytes + 1))
        path = tmp_path / f"f4_{shape[0]}_{shape[1]}.safetensors"
        path.write_bytes(blob)
        wording = f"f4_x2 dtype requires that the last dim be divisible by 2 in torch: got {shape}"
        message = f"^{re.escape(wording)}$"
        with reference_open(path, "pt") as f, pytest.raises(SafetensorError, match=message):
            f.get_tensor("w")
        with pytest.raises(DtypeError, match=message):
            st.load_file(path)
        with pytest.raises(DtypeError, match=message):
            st.load(blob)
        with st.safe_open(path, "pt") as f:
            assert f.get_slice("w").get_shape() == shape
            for read in (lambda: f.get_tensor("w"), f.get_tensors, lambda: f.get_slice("w")[:]):
                with pytest.raises(DtypeError, match=message):
                    read()
        with pytest.raises(DtypeError, match=message):
            asyncio.run(read_torch(blob))
        assert stream_st.numpy.load(blob)["w"].tolist() == list(range(1, nbytes + 1))


def test_load_of_a_dtype_torch_lacks_is_a_key_error_as_the_reference_raises() -> None:
    """``load`` of bytes holding an F6 tensor (no torch dtype) raises a ``KeyError``, as the
    reference does, and stream_st's :class:`DtypeError`; ``load_file`` keeps its own error."""
    text = json.dumps({"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}).encode()
    blob = len(text).to_bytes(8, "little") + text + bytes(3)
    with pytest.raises(KeyError):
        reference.load(blob)
    with pytest.raises(DtypeError, match="F6_E2M3 has no torch dtype") as raised:
        st.load(blob)
    assert isinstance(raised.value, KeyError)


async def read_torch(source: bytes) -> None:
    """Every tensor of ``source``, read as torch tensors by :func:`stream_st.open_stream`."""
    async with stream_st.open_stream(source, framework="pt") as stream:
        async for _ in stream:
            pass


# ---------------------------------------------------------------------- models


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.ones(8))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.body(self.embed(ids)) * self.scale)
        return out


def test_save_model_and_load_model_match_the_reference(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Tied()
    st.save_model(model, tmp_path / "ours.safetensors", metadata={"k": "v"})
    reference.save_model(model, str(tmp_path / "ref.safetensors"), metadata={"k": "v"})
    ours_bytes = (tmp_path / "ours.safetensors").read_bytes()
    assert_same_file(ours_bytes, (tmp_path / "ref.safetensors").read_bytes())

    ours, ref = Tied(), Tied()
    expected: Any = reference.load_model(ref, tmp_path / "ref.safetensors")  # (set, list)
    assert st.load_model(ours, tmp_path / "ref.safetensors") == expected
    ids = torch.arange(10)
    assert torch.equal(ours(ids), model(ids))
    assert ours.head.weight is ours.embed.weight


def test_save_model_and_load_model_of_no_module_name_what_was_given(tmp_path: Path) -> None:
    """Something with no ``state_dict`` given as the model raises an ``AttributeError``, as in
    the reference, that is a :class:`UsageError` naming its type; nothing is written."""
    path = tmp_path / "m.safetensors"
    reference.save_file({"a": torch.ones(1)}, path)
    out = tmp_path / "out.safetensors"
    for given in ({"a": torch.ones(1)}, None, "model"):
        with pytest.raises(AttributeError):
            reference.save_model(given, out)  # type: ignore[arg-type]
        name = type(given).__name__
        with pytest.raises(UsageError, match=f"^save_model takes a torch.nn.Module, got {name}$"):
            st.save_model(given, out)  # type: ignore[arg-type]
        with pytest.raises(AttributeError, match=f"^load_model .* got {name}$"):
            st.load_model(given, path)  # type: ignore[arg-type]
    assert not out.exists()


def test_load_model_receives_into_the_models_own_memory(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = Tied()
    st.save_model(source, tmp_path / "m.safetensors")
    target = Tied()
    before = {name: t.data_ptr() for name, t in target.state_dict().items()}
    assert st.load_model(target, tmp_path / "m.safetensors") == (set(), [])
    after = target.state_dict()
    assert {name: t.data_ptr() for name, t in after.items()} == before
    for name, tensor in source.state_dict().items():
        assert torch.equal(after[name], tensor), name


def test_load_model_missing_unexpected_and_mismatches_as_the_reference(tmp_path: Path) -> None:
    torch.manual_seed(2)
    state = dict(Tied().state_dict())
    del state["head.weight"]
    state["extra"] = torch.zeros(3)
    state["body.bias"] = torch.zeros(8, dtype=torch.float64)  # another dtype: cast on load
    del state["scale"]
    reference.save_file(state, tmp_path / "m.safetensors")
    ours, ref = Tied(), Tied()
    got = st.load_model(ours, tmp_path / "m.safetensors", strict=False)
    expected: Any = reference.load_model(ref, tmp_path / "m.safetensors", strict=False)
    assert got == expected
    assert torch.equal(ours.body.bias, ref.body.bias)
    with pytest.raises(UsageError, match="scale") as raised:
        st.load_model(Tied(), tmp_path / "m.safetensors")
    assert isinstance(raised.value, RuntimeError)  # as the reference raises


def meta_tied() -> Tied:
    with torch.device("meta"):
        return Tied()


def test_load_model_assign_fills_a_meta_model_with_the_file_s_tensors(tmp_path: Path) -> None:
    """assign=True: a model built on the meta device (no memory) gets the file's tensors as
    its own, ties kept as one Parameter, requires_grad kept; a local file is mapped, never
    changed by writes to the model, and the old parameters are let go."""
    torch.manual_seed(5)
    source = Tied()
    path = tmp_path / "m.safetensors"
    st.save_model(source, path)
    data = path.read_bytes()
    model = meta_tied()
    model.body.weight.requires_grad_(False)  # the model's choice, kept
    old = weakref.ref(model.body.bias)
    assert st.load_model(model, path, assign=True) == (set(), [])
    assert old() is None  # nothing holds the replaced parameter
    assert model.head.weight is model.embed.weight  # one Parameter, as before loading
    assert isinstance(model.body.bias, torch.nn.Parameter)
    assert not model.body.weight.requires_grad and model.body.bias.requires_grad
    assert all(t.device.type == "cpu" for t in model.state_dict().values())
    ids = torch.arange(10)
    assert torch.equal(model(ids), source(ids))
    with torch.no_grad():
        model.body.bias.add_(1)  # a copy-on-write page: this process only
    assert path.read_bytes() == data
    assert torch.equal(st.load_file(path)["body.bias"], source.body.bias)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_load_model_assign_puts_the_tensors_on_the_device(tmp_path: Path) -> None:
    torch.manual_seed(8)
    source = Tied()
    path = tmp_path / "m.safetensors"
    st.save_model(source, path)
    model = meta_tied()
    assert st.load_model(model, path, assign=True, device="cuda") == (set(), [])
    assert {t.device.type for t in model.state_dict().values()} == {"cuda"}
    assert model.head.weight is model.embed.weight
    for name, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[name].cpu(), tensor), name
    on_device = Tied().cuda()  # without assign: copied into the model's memory on the device
    assert st.load_model(on_device, path) == (set(), [])
    assert all(
        torch.equal(on_device.state_dict()[n].cpu(), t) for n, t in source.state_dict().items()
    )
    ours, ref = Tied().cuda(), Tied().cuda()
    for each in (ours, ref):
        each.body.half()  # another dtype than the file's: through load_state_dict, cast
    assert st.load_model(ours, path) == (set(), [])
    reference.load_model(ref, path, device="cuda")
    assert all(torch.equal(ours.state_dict()[n], t) for n, t in ref.state_dict().items())
    assert ours.body.weight.dtype == torch.float16


def test_load_model_of_a_model_with_nothing_to_receive_on_the_cpu_maps_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model with no tensor to receive into on the CPU (here all on the meta device; on a
    CUDA device, the same) reads a local file as load_file does, mapped; the outcome is the
    reference's, warnings included."""
    torch.manual_seed(9)
    path = tmp_path / "m.safetensors"
    st.save_model(Tied(), path)
    calls: list[object] = []
    mapped = stream_st.compat._local.load_mapped

    def spy(*args: Any) -> Any:
        calls.append(args[0])
        return mapped(*args)

    monkeypatch.setattr(stream_st.compat._local, "load_mapped", spy)
    with warnings.catch_warnings(record=True) as ours_warned:
        warnings.simplefilter("always")
        ours = st.load_model(meta_tied(), path, strict=False)
    with warnings.catch_warnings(record=True) as ref_warned:
        warnings.simplefilter("always")
        ref: Any = reference.load_model(meta_tied(), path, strict=False)
    assert calls == [path]
    assert (set(ours[0]), sorted(ours[1])) == (set(ref[0]), sorted(ref[1]))
    assert [str(w.message) for w in ours_warned] == [str(w.message) for w in ref_warned]
    with warnings.catch_warnings(record=True):
        st.load_model(meta_tied(), path, backend="pread", strict=False)  # read, not mapped
    assert calls == [path]


def test_load_model_assign_over_http_and_with_pread(tmp_path: Path, http: RangeHTTPServer) -> None:
    torch.manual_seed(6)
    source = Tied()
    path = tmp_path / "m.safetensors"
    st.save_model(source, path)
    http.objects["/m.safetensors"] = path.read_bytes()
    for address, backend in ((http.url("/m.safetensors"), "mmap"), (path, "pread")):
        model = meta_tied()
        assert st.load_model(model, address, assign=True, backend=backend) == (set(), [])
        for name, tensor in source.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), (address, name)
        assert model.head.weight is model.embed.weight


def test_load_model_assign_reports_and_refuses_as_without(tmp_path: Path) -> None:
    """Missing and unexpected names are reported as without assign; a shape that differs is
    a UsageError; a dtype that differs is the file's (as torch's assign=True does)."""
    torch.manual_seed(7)
    state = dict(Tied().state_dict())
    del state["head.weight"]
    state["extra"] = torch.zeros(3)
    state["body.bias"] = torch.zeros(8, dtype=torch.float64)
    del state["scale"]
    reference.save_file(state, tmp_path / "m.safetensors")
    expected: Any = st.load_model(Tied(), tmp_path / "m.safetensors", strict=False)
    model = Tied()
    got = st.load_model(model, tmp_path / "m.safetensors", strict=False, assign=True)
    assert got == ({"scale"}, ["extra"]) == (expected[0], expected[1])
    assert model.body.bias.dtype == torch.float64
    with pytest.raises(UsageError, match="scale"):
        st.load_model(Tied(), tmp_path / "m.safetensors", assign=True)
    state = {name: t.clone() for name, t in Tied().state_dict().items() if name != "head.weight"}
    state["body.weight"] = torch.zeros(8, 9)
    reference.save_file(state, tmp_path / "bad.safetensors")
    with pytest.raises(UsageError, match=r"size mismatch for body\.weight"):
        st.load_model(Tied(), tmp_path / "bad.safetensors", assign=True)


class Three(torch.nn.Module):
    """Parameters ``a`` and ``b`` of shape [2], ``c`` of shape [3]."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(2))
        self.b = torch.nn.Parameter(torch.zeros(2))
        self.c = torch.nn.Parameter(torch.zeros(3))


def _bad_c() -> dict[str, torch.Tensor]:
    """``Three``'s tensors, ``c`` (last in a file) of another shape."""
    return {"a": torch.full((2,), 7.0), "b": torch.full((2,), 5.0), "c": torch.ones(4)}


_REFUSED = {
    "shape": (torch.ones(4), r"size mismatch for c: the file has shape \[4\]"),
    "integer": (torch.ones(3, dtype=torch.int64), r"c: the file holds torch.int64.*requires grad"),
}


@pytest.mark.parametrize("bad", sorted(_REFUSED))
@pytest.mark.parametrize("how", ["mapped", "pread", "http"])
def test_load_model_assign_refuses_a_shape_before_anything_is_replaced(
    tmp_path: Path, http: RangeHTTPServer, how: str, bad: str
) -> None:
    """A shape in the file that differs from the model's (``c``'s, after ``a`` and ``b``), or
    an integer dtype for a parameter that requires grad: a UsageError, the model's parameters
    its own still, where ``a`` and ``b`` had been replaced already, the docstring saying
    otherwise (of the integer, a bare RuntimeError from torch's Parameter)."""
    path = tmp_path / "m.safetensors"
    c, message = _REFUSED[bad]
    st.save_file({**_bad_c(), "c": c}, path)
    address: str | Path = path
    options: dict[str, Any] = {"backend": "pread"} if how == "pread" else {}
    if how == "http":
        http.objects["/m.safetensors"] = path.read_bytes()
        address = http.url("/m.safetensors")
    model = Three()
    before = dict(model.named_parameters())
    with pytest.raises(UsageError, match=message):
        st.load_model(model, address, assign=True, **options)
    assert all(getattr(model, name) is old for name, old in before.items()), how
    assert not model.a.any() and not model.b.any()


def test_load_model_assign_refuses_a_shape_before_anything_of_its_shard_is_replaced(
    tmp_path: Path,
) -> None:
    """Of a sharded checkpoint, a shard's shapes are checked as its header is read: a shape that
    differs refuses the load before any tensor of that shard is placed (``b``, before ``c``),
    those of the shards before it in the model, as the docstring says."""
    tensors = _bad_c()
    st.save_file({"a": tensors["a"]}, tmp_path / "one.safetensors")
    st.save_file({"b": tensors["b"], "c": tensors["c"]}, tmp_path / "two.safetensors")
    index = tmp_path / "m.safetensors.index.json"
    shards = {"a": "one.safetensors", "b": "two.safetensors", "c": "two.safetensors"}
    index.write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    model = Three()
    b, c = model.b, model.c
    with pytest.raises(UsageError, match=r"size mismatch for c: the file has shape \[4\]"):
        st.load_model(model, index, assign=True)
    assert torch.equal(model.a, tensors["a"])  # the first shard's: placed
    assert model.b is b and model.c is c


def test_load_model_assign_with_include_names_include(tmp_path: Path) -> None:
    """assign=True with include= (no process group) is refused naming what was given, where the
    message blamed a process_group= the call did not have."""
    path = tmp_path / "m.safetensors"
    st.save_model(torch.nn.Linear(2, 2), path)
    with pytest.raises(UsageError, match=r"^load_model\(include=\.\.\.\) does not take assign"):
        st.load_model(torch.nn.Linear(2, 2), path, assign=True, include=["weight"])


class Scalars(torch.nn.Module):
    """A 0-d parameter and a 0-d buffer, which old checkpoints hold with shape [1]."""

    steps: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.zeros(()))
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))


def test_load_model_assign_takes_shape_1_for_a_0_d_tensor_as_torch_does(tmp_path: Path) -> None:
    """A file's shape [1] for a 0-d parameter or buffer is taken as the scalar it holds, with
    assign=True as without and as torch's load_state_dict(assign=True) takes it; shape [2] is
    still refused."""
    path = tmp_path / "old.safetensors"
    reference.save_file({"gain": torch.tensor([1.5]), "steps": torch.tensor([5])}, path)
    expected = Scalars()
    expected.load_state_dict(reference.load_file(path), assign=True)
    for assign in (False, True):
        model = Scalars()
        assert st.load_model(model, path, assign=assign) == (set(), [])
        assert model.gain.shape == model.steps.shape == expected.steps.shape == ()
        assert isinstance(model.gain, torch.nn.Parameter) and model.gain.requires_grad
        assert (model.gain.item(), model.steps.item()) == (1.5, 5)
    reference.save_file({"gain": torch.tensor([1.5, 2.5]), "steps": torch.tensor([5])}, path)
    with pytest.raises(UsageError, match=r"size mismatch for gain: the file has shape \[2\]"):
        st.load_model(Scalars(), path, assign=True)


def test_load_model_assign_leaves_a_batch_norms_missing_count_as_torch_does(
    tmp_path: Path,
) -> None:
    """A checkpoint without BatchNorm's num_batches_tracked (an older torch's, other tools'):
    torch's load_state_dict(assign=True) fills it in and reports nothing, as load_model without
    assign does; with assign=True it was missing, and strict load_model raised."""
    path = tmp_path / "bn.safetensors"
    state = torch.nn.BatchNorm1d(3).state_dict()
    del state["num_batches_tracked"]
    reference.save_file(state, path)
    expected = torch.nn.BatchNorm1d(3)
    matched = expected.load_state_dict(dict(state), assign=True)
    assert not matched.missing_keys and not matched.unexpected_keys
    for assign in (False, True):
        model = torch.nn.BatchNorm1d(3)
        assert st.load_model(model, path, assign=assign) == (set(), [])
        assert model.num_batches_tracked is not None and model.num_batches_tracked.item() == 0
    model = torch.nn.BatchNorm1d(3, track_running_stats=False)  # no such buffers: unexpected
    _, unexpected = st.load_model(model, path, strict=False, assign=True)
    assert sorted(unexpected) == ["running_mean", "running_var"]


def _normed() -> torch.nn.Module:
    """A net whose batch norm reads its count in forward (momentum=None: a cumulative mean)."""
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4, momentum=None))


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("counted", [True, False], ids=["count", "no-count"])
def test_load_model_assign_into_meta_fills_a_batch_norms_count_as_torch_does(
    tmp_path: Path, strict: bool, counted: bool
) -> None:
    """A model built on the meta device, loaded with assign=True: torch's load_state_dict puts a
    fresh CPU tensor(0) for a count the file lacks in place of the meta one; load_model left the
    meta one, so the model's state dict could not be saved and momentum=None's forward failed."""
    path = tmp_path / "bn.safetensors"
    state = _normed().state_dict()
    state["1.num_batches_tracked"] = torch.tensor(7)
    if not counted:
        del state["1.num_batches_tracked"]
    reference.save_file(state, path)
    with torch.device("meta"):
        expected, model = _normed(), _normed()
    matched = expected.load_state_dict(reference.load_file(path), strict=strict, assign=True)
    outcome = st.load_model(model, path, strict=strict, assign=True)
    assert outcome == (set(matched.missing_keys), matched.unexpected_keys)
    mine, theirs = model.state_dict(), expected.state_dict()
    assert list(mine) == list(theirs)
    for name, tensor in theirs.items():
        assert (mine[name].device, mine[name].dtype) == (tensor.device, tensor.dtype), name
        assert torch.equal(mine[name], tensor), name
    x = torch.randn(3, 4)
    torch.testing.assert_close(model.train()(x), expected.train()(x))
    assert torch.equal(model.state_dict()["1.num_batches_tracked"], theirs["1.num_batches_tracked"])


class TiedBackwards(torch.nn.Module):
    """Two tied names whose order in the model (``z`` first) is not the file's (sorted)."""

    def __init__(self) -> None:
        super().__init__()
        self.z = torch.nn.Linear(4, 4, bias=False)
        self.a = torch.nn.Linear(4, 4, bias=False)
        self.a.weight = self.z.weight


@pytest.mark.parametrize("how", ["received", "pread", "http", "other dtype", "assign"])
def test_load_model_of_both_tied_names_keeps_the_last_in_the_model_s_order(
    tmp_path: Path, http: RangeHTTPServer, how: str
) -> None:
    """A file holding both names of a tied pair, with different values: the model ends with
    the value of the name last in the model's order, as the reference's ``load_state_dict``
    copies them, whatever the order in the file; the other is reported unexpected."""
    path = tmp_path / "m.safetensors"
    reference.save_file(
        {"a.weight": torch.full((4, 4), 1.0), "z.weight": torch.full((4, 4), 2.0)}, path
    )
    expected = TiedBackwards()
    ref: Any = reference.load_model(expected, path, strict=False)
    assert torch.equal(expected.z.weight.detach(), torch.full((4, 4), 1.0))  # "a": last
    model = TiedBackwards()
    address, options = _tied_load(path, http, how, strict=False)
    if how == "other dtype":
        model.z.double()  # through load_state_dict, cast
        expected.z.double()
    got: Any = st.load_model(model, address, **options)
    assert (set(got[0]), sorted(got[1])) == (set(ref[0]), sorted(ref[1]))
    assert model.a.weight is model.z.weight
    assert torch.equal(model.z.weight.float(), torch.full((4, 4), 1.0)), how


def _tied_load(
    path: Path, http: RangeHTTPServer, how: str, *, strict: bool
) -> tuple[str | Path, dict[str, Any]]:
    """Where and how a tied-names test loads ``path``: the address (served by ``http`` for
    ``"http"``) and ``load_model``'s options (``"pread"``, ``"assign"``)."""
    address: str | Path = path
    options: dict[str, Any] = {"strict": strict}
    if how == "pread":
        options["backend"] = "pread"
    elif how == "http":
        http.objects["/m.safetensors"] = path.read_bytes()
        address = http.url("/m.safetensors")
    elif how == "assign":
        options["assign"] = True
    return address, options


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("how", ["received", "pread", "http", "assign"])
def test_load_model_of_both_tied_names_checks_the_shape_of_the_one_dropped(
    tmp_path: Path, http: RangeHTTPServer, how: str, strict: bool
) -> None:
    """Of a tied pair both in the file, the name the last one overrules (``z``, first in the
    model's order) with a shape that differs from the model's: a size mismatch for it, as the
    reference raises, the other's values in the model; it was dropped unlooked at, the load
    reporting success (``strict=False``) or only the other name unexpected."""
    path = tmp_path / "m.safetensors"
    reference.save_file(
        {"a.weight": torch.full((4, 4), 1.0), "z.weight": torch.full((4, 5), 2.0)}, path
    )
    expected = TiedBackwards()
    with pytest.raises(RuntimeError, match=r"size mismatch for z\.weight"):
        reference.load_model(expected, path, strict=strict)
    model = TiedBackwards()
    weight = model.z.weight
    address, options = _tied_load(path, http, how, strict=strict)
    with pytest.raises(UsageError, match=r"size mismatch for z\.weight"):
        st.load_model(model, address, **options)
    if how == "assign":  # refused before anything is replaced
        assert model.a.weight is model.z.weight is weight
    else:
        assert torch.equal(model.z.weight, expected.z.weight)
        assert torch.equal(model.a.weight, torch.full((4, 4), 1.0))


class TiedScalar(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.z = torch.nn.Parameter(torch.tensor(0.0))
        self.a = self.z


def test_load_model_drops_a_tied_name_load_state_dict_takes_of_another_shape(
    tmp_path: Path,
) -> None:
    """A tied scalar the file holds as one value of shape ``[1]`` (which ``load_state_dict``
    takes, as a checkpoint of torch 0.3) overruled by the later name: dropped, the later one's
    value kept, as by the reference."""
    path = tmp_path / "m.safetensors"
    reference.save_file({"a": torch.tensor(1.0), "z": torch.tensor([2.0])}, path)
    expected, model = TiedScalar(), TiedScalar()
    ref: Any = reference.load_model(expected, path, strict=False)  # (set, list)
    assert st.load_model(model, path, strict=False) == ref
    assert model.z.item() == expected.z.item() == 1.0


class Renamed(torch.nn.Module):
    """Saves its tensors under other names than their attribute paths (a state-dict hook) and
    reads them back (a load pre-hook): ``lin.*`` as ``linear.*``, or ``a`` and ``b`` swapped."""

    def __init__(self, renames: dict[str, str]) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("a", torch.zeros(2))
        self.register_buffer("b", torch.ones(2))
        self.renames = renames
        self._register_state_dict_hook(Renamed._save_as)
        self._register_load_state_dict_pre_hook(self._load_as)

    @staticmethod
    def _save_as(module: Renamed, state: dict[str, Any], prefix: str, meta: Any) -> None:
        tensors = {module._renamed(k, module.renames): state.pop(k) for k in list(state)}
        state.update(tensors)

    def _load_as(self, state: dict[str, Any], prefix: str, *args: Any) -> None:
        back = {saved: own for own, saved in self.renames.items()}
        tensors = {self._renamed(k, back): state.pop(k) for k in list(state)}
        state.update(tensors)

    @staticmethod
    def _renamed(name: str, renames: dict[str, str]) -> str:
        head, dot, tail = name.partition(".")
        return renames.get(head, head) + dot + tail


@pytest.mark.parametrize("renames", [{"lin": "linear"}, {"a": "b", "b": "a"}])
def test_load_model_assign_of_names_that_are_no_attribute_paths_is_a_usage_error(
    tmp_path: Path, renames: dict[str, str]
) -> None:
    """assign=True puts each tensor at its name's attribute path: a name that is none (a
    state-dict hook renames it) is a UsageError naming it, before anything is replaced;
    without assign it loads through load_state_dict, its hooks run."""
    path = tmp_path / "m.safetensors"
    trained = Renamed(renames)
    with torch.no_grad():
        trained.lin.weight.fill_(5.0)
    st.save_model(trained, path)
    model = Renamed(renames)
    before = dict(model.state_dict(keep_vars=True))
    with pytest.raises(UsageError, match=r"names '(linear\.\w+|a|b)'.*assign=False"):
        st.load_model(model, path, assign=True)
    assert all(model.state_dict(keep_vars=True)[k] is v for k, v in before.items())
    assert st.load_model(model, path) == (set(), [])
    assert torch.equal(model.lin.weight, trained.lin.weight)
    for name in ("a", "b"):
        assert torch.equal(model.get_buffer(name), trained.get_buffer(name))


class PartFirstInFile(torch.nn.Module):
    """A buffer viewing part of another, before it in the file's (sorted) order."""

    full: torch.Tensor
    a_part: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("full", torch.zeros(8))
        self.register_buffer("a_part", self.full[2:6])


def test_load_model_of_a_view_and_its_base_both_in_the_file_copies_in_the_model_s_order(
    tmp_path: Path,
) -> None:
    path = tmp_path / "m.safetensors"
    reference.save_file({"full": torch.full((8,), 1.0), "a_part": torch.full((4,), 2.0)}, path)
    ours, ref = PartFirstInFile(), PartFirstInFile()
    got: Any = st.load_model(ours, path, strict=False)
    expected: Any = reference.load_model(ref, path, strict=False)
    assert torch.equal(ref.full, torch.tensor([1.0, 1, 2, 2, 2, 2, 1, 1]))
    assert torch.equal(ours.full, ref.full) and ours.a_part.data_ptr() == ours.full.data_ptr() + 8
    assert (set(got[0]), sorted(got[1])) == (set(expected[0]), sorted(expected[1]))


class ViewShare(torch.nn.Module):
    """A buffer that views part of another's memory (as another ``dtype``, if given)."""

    full: torch.Tensor
    part: torch.Tensor

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        full = torch.arange(8.0)
        self.register_buffer("full", full)
        self.register_buffer("part", full[2:6] if dtype is None else full[2:6].view(dtype))


@pytest.mark.parametrize("dtype", [None, torch.int32])
def test_load_model_assign_views_a_buffer_again_in_the_tensor_it_viewed(
    tmp_path: Path, dtype: torch.dtype | None
) -> None:
    """save_model writes the buffer a view shares once; load_model(assign=True) makes the view
    again over the new tensor, of its own dtype (it once reported it missing, left over the old
    memory)."""
    source = ViewShare(dtype)
    source.full.mul_(10).add_(0.5)
    st.save_model(source, tmp_path / "v.safetensors")
    assert list(st.load_file(tmp_path / "v.safetensors")) == ["full"]
    for backend in ("mmap", "pread"):
        model = ViewShare(dtype)
        got = st.load_model(model, tmp_path / "v.safetensors", assign=True, backend=backend)
        expected: Any = reference.load_model(ViewShare(dtype), tmp_path / "v.safetensors")
        assert got == (set(), []) == expected
        assert torch.equal(model.full, torch.arange(8.0) * 10 + 0.5)
        viewed = model.full[2:6]
        assert torch.equal(model.part, viewed if dtype is None else viewed.view(dtype))
        assert model.part.untyped_storage().data_ptr() == model.full.untyped_storage().data_ptr()
        model.full[3] = -1.0
        assert model.part[1] == (-1.0 if dtype is None else model.full[3:4].view(dtype)[0])


def test_load_model_assign_counts_both_names_of_a_tied_pair_as_without(tmp_path: Path) -> None:
    """A file holding both names of a tied pair: the one not kept is unexpected, as the
    reference and load_model without assign count it."""
    state = {name: t.clone() for name, t in Tied().state_dict().items()}
    reference.save_file(state, tmp_path / "both.safetensors")
    expected: Any = reference.load_model(Tied(), tmp_path / "both.safetensors", strict=False)
    assert expected[1]  # the pair's second name
    for assign in (False, True):
        got = st.load_model(Tied(), tmp_path / "both.safetensors", strict=False, assign=assign)
        assert got == expected, assign


def test_load_model_assign_counts_a_tied_pair_the_file_lacks_once_as_without(
    tmp_path: Path,
) -> None:
    """A file holding neither name of a tied pair: only the kept name is missing, as the
    reference and load_model without assign count it (with assign=True both were, and a strict
    load named both); on the meta device nothing shares memory, so both are, as there."""
    path = tmp_path / "untied.safetensors"
    state = {name: t.clone() for name, t in Tied().state_dict().items()}
    reference.save_file({k: v for k, v in state.items() if k.startswith(("body", "scale"))}, path)
    expected: Any = reference.load_model(Tied(), path, strict=False)
    assert expected == ({"embed.weight"}, [])
    with warnings.catch_warnings():  # copying into a meta tensor does nothing, torch warns
        warnings.simplefilter("ignore", UserWarning)
        on_meta: Any = reference.load_model(meta_tied(), path, strict=False)
        assert st.load_model(meta_tied(), path, strict=False) == on_meta
    assert on_meta == ({"embed.weight", "head.weight"}, [])
    assert st.load_model(meta_tied(), path, strict=False, assign=True) == on_meta
    for assign in (False, True):
        model = Tied()
        embed = model.embed.weight
        assert st.load_model(model, path, strict=False, assign=assign) == expected, assign
        assert model.head.weight is model.embed.weight is embed  # left as built, still tied
    with pytest.raises(RuntimeError) as theirs:
        reference.load_model(Tied(), path)
    with pytest.raises(UsageError) as ours:
        st.load_model(Tied(), path, assign=True)
    assert str(ours.value) == str(theirs.value)


class RowsView(torch.nn.Module):
    """A buffer ``sub.part`` viewing two rows of the parameter ``l.weight``, its module before
    the parameter's in the model's order where ``view_first``."""

    def __init__(self, view_first: bool = False) -> None:
        super().__init__()
        linear, holder = torch.nn.Linear(3, 4), torch.nn.Module()
        holder.register_buffer("part", linear.weight.data[1:3])
        for name, module in [("l", linear), ("sub", holder)][:: -1 if view_first else 1]:
            self.add_module(name, module)


@pytest.mark.parametrize("view_first", [False, True], ids=["view-last", "view-first"])
@pytest.mark.parametrize("base", [True, False], ids=["base", "no-base"])
def test_load_model_assign_copies_a_view_the_file_holds_through_it_as_the_reference(
    tmp_path: Path, view_first: bool, base: bool
) -> None:
    """A file holding a buffer that views rows of a parameter (as save_file of a cloned state
    dict writes it): load_model(assign=True) keeps the buffer a view of the parameter, the
    file's values copied through it in the model's order, and reports it unexpected, as the
    reference does (it put the file's buffer in the model, no longer a view, reported
    unexpected); without the parameter in the file, the model's own parameter is written."""
    path = tmp_path / "view.safetensors"
    torch.manual_seed(3)
    state = {"l.weight": torch.randn(4, 3), "l.bias": torch.randn(4)}
    reference.save_file({**state, "sub.part": torch.full((2, 3), 7.0)}, path)
    if not base:
        reference.save_file({"l.bias": state["l.bias"], "sub.part": torch.full((2, 3), 7.0)}, path)
    data = path.read_bytes()
    torch.manual_seed(4)
    expected_model = RowsView(view_first)
    expected: Any = reference.load_model(expected_model, path, strict=False)
    assert expected[1] == ["sub.part"]
    for backend in ("mmap", "pread"):
        torch.manual_seed(4)
        model = RowsView(view_first)
        got = st.load_model(model, path, strict=False, assign=True, backend=backend)
        assert got == expected, backend
        loaded = model.state_dict()
        for name, tensor in expected_model.state_dict().items():
            assert torch.equal(loaded[name], tensor), (backend, name)
        assert loaded["sub.part"].data_ptr() == loaded["l.weight"][1].data_ptr()  # still a view
        assert path.read_bytes() == data  # a mapped file's private pages written, not the file


def test_load_model_assign_puts_a_view_it_cannot_make_again_as_its_own_tensor(
    tmp_path: Path,
) -> None:
    """Where the file's parameter has another dtype than the model's, a buffer that viewed it
    cannot view the new one alike: the file's buffer is the model's, its own tensor, and is
    reported neither missing nor unexpected (the model holds it)."""
    path = tmp_path / "view.safetensors"
    weight = torch.randn(4, 3, dtype=torch.float64)
    part = torch.full((2, 3), 7.0)
    reference.save_file({"l.weight": weight, "l.bias": torch.zeros(4), "sub.part": part}, path)
    model = RowsView()
    assert st.load_model(model, path, assign=True) == (set(), [])
    loaded = model.state_dict()
    assert torch.equal(loaded["l.weight"], weight) and torch.equal(loaded["sub.part"], part)


def test_transformers_sharded_bf16_checkpoint_loads_into_the_same_class(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = tmp_path / "model.safetensors.index.json"
    assert len(set(json.loads(index.read_text())["weight_map"].values())) > 1

    torch.manual_seed(4)
    fresh = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    missing, unexpected = st.load_model(fresh, index, strict=False)
    assert not unexpected
    assert missing <= {"lm_head.weight"}  # tied or saved: either way it is loaded now
    ids = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)
    with st.safe_open(index, "pt") as f:
        name = "model.layers.1.mlp.up_proj.weight"
        assert same(f.get_tensor(name), model.state_dict()[name])
        assert same(f.get_slice(name)[3:9], model.state_dict()[name][3:9])
        assert sorted(f.keys()) == f.keys()


# ---------------------------------------------------------------------- into= and framework=


def test_open_stream_into_callers_memory(ref_file: Path) -> None:
    expected = reference.load_file(ref_file)
    f32 = torch.empty(6, 5)
    bf16 = torch.empty(6, 5, dtype=torch.bfloat16)
    raw = bytearray(6 * 5 * 8)
    array = np.empty((6, 5), dtype=np.int32)

    async def main() -> dict[str, Any]:
        into = {"f32": f32, "bf16": bf16, "i64": raw, "i32": array}
        stream = stream_st.open_stream(ref_file, framework="pt", into=into)
        return {name: tensor async for name, tensor in stream}

    got = asyncio.run(main())
    assert got["f32"] is f32 and got["bf16"] is bf16
    assert same(f32, expected["f32"]) and same(bf16, expected["bf16"])
    assert torch.equal(torch.frombuffer(raw, dtype=torch.int64).reshape(6, 5), expected["i64"])
    assert np.array_equal(array, expected["i32"].numpy())
    assert_same(got, expected)


@pytest.mark.parametrize(
    "into",
    [
        {"f32": torch.empty(5, 6)},
        {"f32": torch.empty(6, 5, dtype=torch.float64)},
        {"f32": bytearray(10)},
        {"f32": bytes(120)},
        {"f32": torch.empty(5, 6).T},
        {"f32": torch.zeros(6, 5)._neg_view()},  # these two: a bare RuntimeError, before
        {"c64": torch.zeros(6, 5, dtype=torch.complex64).conj()},
    ],
)
def test_into_that_does_not_fit_is_refused(ref_file: Path, into: dict[str, Any]) -> None:
    async def main() -> None:
        async for _ in stream_st.open_stream(ref_file, into=into):
            pass

    with pytest.raises(UsageError, match="into="):
        asyncio.run(main())


def test_into_a_name_the_file_lacks_is_refused(ref_file: Path) -> None:
    async def main() -> None:
        async for _ in stream_st.open_stream(ref_file, into={"nope": bytearray(4)}):
            pass

    with pytest.raises(TensorNotFoundError):
        asyncio.run(main())


# ---------------------------------------------------------------------- sync from anywhere


def test_sync_api_inside_asyncio_run_and_trio(ref_file: Path) -> None:
    expected = reference.load_file(ref_file)

    async def notebook_cell() -> Tensors:
        loaded = st.load_file(ref_file)
        with st.safe_open(ref_file, "pt") as f:
            assert same(f.get_tensor("bf16"), expected["bf16"])
        st.save_file(loaded, ref_file.with_name("again.safetensors"), {"format": "pt"})
        return loaded

    assert_same(asyncio.run(notebook_cell()), expected)
    assert_same(trio.run(notebook_cell), expected)
    assert ref_file.with_name("again.safetensors").read_bytes() == ref_file.read_bytes()


def test_sync_api_from_threads(ref_file: Path) -> None:
    expected = reference.load_file(ref_file)
    results: list[Tensors] = []
    with st.safe_open(ref_file, "pt") as shared:

        def work() -> None:
            results.append(st.load_file(ref_file))
            results.append({"bf16": shared.get_tensor("bf16")})

        threads = [threading.Thread(target=work) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(results) == 8
    for result in results:
        assert_same(result, {name: expected[name] for name in result})


def test_a_sync_call_after_close_is_a_usage_error(ref_file: Path) -> None:
    f = st.safe_open(ref_file, "pt")
    f.close()
    with pytest.raises(UsageError):
        f.get_tensor("f32")


FORKED = textwrap.dedent(
    """
    import gc, json, os, signal, sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    import stream_st.torch as st
    from stream_st.errors import UsageError

    torch.set_num_threads(1)

    def in_child(work, end):  # work() in a copy made by os.fork(), then end(0): what it gave
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a hang is a death by SIGALRM
            os.close(r)
            try:
                said = work()
            except UsageError as exc:
                said = "UsageError: " + str(exc)
            os.write(w, said.encode())
            os.close(w)
            end(0)
        os.close(w)
        _, status = os.waitpid(pid, 0)
        with os.fdopen(r) as pipe:
            said = pipe.read()
        if os.WIFSIGNALED(status):
            return f"{said} | killed by signal {os.WTERMSIG(status)}"
        return f"{said} | exit {os.WEXITSTATUS(status)}"

    class Rows(Dataset):
        def __len__(self):
            return 2
        def __getitem__(self, i):
            return held["f"].get_tensor("a")[i]

    def loaded():  # by DataLoader workers, forked
        batches = iter(
            DataLoader(
                Rows(), batch_size=2, num_workers=2, multiprocessing_context="fork", timeout=20
            )
        )
        try:
            return str([b.tolist() for b in batches])
        except UsageError as exc:
            return "UsageError: " + str(exc)
        finally:  # its workers stopped now, not left to be copied into the next loader's
            del batches
            gc.collect()

    def collected():
        held.clear()
        gc.collect()
        return "collected"

    out = {}
    for step in ("forked", "loaded"):  # DataLoader's SIGCHLD handler last: it sees any child
        for name, source in zip(["mmap", "pread", "http", "index"], sys.argv[1:5]):
            backend = "pread" if name == "pread" else "mmap"
            held = {"f": st.safe_open(source, "pt", backend=backend)}
            held["f"].get_tensor("a")  # used in the parent first
            if step == "forked":
                read = in_child(lambda: str(held["f"].get_tensor("a").tolist()), os._exit)
                out[name] = [read, in_child(collected, sys.exit)]  # sys.exit: finalizers run
            else:
                out[name].append(loaded())
            held["f"].close()
    print(json.dumps(out))
    """
)


@linux_only
def test_a_handle_used_in_a_forked_process_reads_or_says_to_open_it_again(
    tmp_path: Path, http: RangeHTTPServer
) -> None:
    """A safe_open copied by os.fork() (a DataLoader worker's dataset): a local file's reads
    there; a remote source's or an index's (a private event loop whose thread the copy lacks,
    the parent's connections) is a UsageError saying to open it again in that process, where
    it waited for ever; collecting the copy, or exiting, never waits on that loop."""
    path = tmp_path / "a.safetensors"
    st.save_file({"a": torch.arange(2.0)}, path)
    http.objects["/a.safetensors"] = path.read_bytes()
    index = tmp_path / "m.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {"a": "a.safetensors"}}))
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    sources = [str(path), str(path), http.url("/a.safetensors"), str(index)]
    done = subprocess.run(
        [sys.executable, str(script), *sources],
        cwd=Path(__file__).parents[2],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "opened in another process" not in done.stderr, done.stderr[-3000:]  # let go quietly
    out = json.loads(done.stdout)
    for name in ("mmap", "pread"):
        assert out[name] == ["[0.0, 1.0] | exit 0", "collected | exit 0", "[[0.0, 1.0]]"], name
    for name in ("http", "index"):
        read, collected, loaded = out[name]
        assert read.startswith("UsageError: this file was opened in another process"), read
        assert read.endswith("| exit 0") and "Open it again in this process" in read, read
        assert loaded.startswith("UsageError: Caught UsageError in DataLoader worker"), loaded
        assert "Open it again in this process" in loaded, loaded
        assert collected == "collected | exit 0", name


# ---------------------------------------------------------------------- remote sources


@pytest.fixture
def http() -> Iterator[RangeHTTPServer]:
    with RangeHTTPServer() as server:
        yield server


s3 = s3_tests.s3
aws_env = s3_tests.aws_env
aws = test_numpy_api.aws


def check_remote(address: str, ref_file: Path) -> None:
    """Every reading call on ``address`` gives what the reference gives on the local file."""
    expected = reference.load_file(ref_file)
    assert_same(st.load_file(address), expected)
    with reference_open(ref_file, framework="pt") as ref, st.safe_open(address, "pt") as ours:
        assert ours.keys() == ref.keys() and ours.metadata() == ref.metadata()
        assert ours.offset_keys() == ref.offset_keys()
        assert same(ours.get_tensor("bf16"), ref.get_tensor("bf16"))
        for key in SLICES[:6]:
            assert same(ours.get_slice("f32")[key], ref.get_slice("f32")[key]), key
    model = Tied()
    st.save_model(model, ref_file.with_name("model.safetensors"))
    loaded = Tied()
    destination = address.replace(ref_file.name, "model.safetensors")
    st.save_model(model, destination)
    assert st.load_model(loaded, destination) == (set(), [])
    assert torch.equal(loaded.body.weight, model.body.weight)


def test_http(http: RangeHTTPServer, ref_file: Path) -> None:
    http.objects["/ref.safetensors"] = ref_file.read_bytes()
    check_remote(http.url("/ref.safetensors"), ref_file)
    st.save_file(every_dtype(), http.url("/up.safetensors"))
    assert http.objects["/up.safetensors"] == reference.save(every_dtype())


@pytest.mark.usefixtures("aws")
def test_s3(ref_file: Path) -> None:
    address = "s3://models/torch-api/ref.safetensors"
    st.save_file(reference.load_file(ref_file), address, {"format": "pt"})
    check_remote(address, ref_file)


def test_tcp(ref_file: Path) -> None:
    sender = Sender(ref_file.read_bytes())
    try:
        expected = reference.load_file(ref_file)
        address = f"tcp://127.0.0.1:{sender.port}"
        assert_same(st.load_file(address), expected)
        with st.safe_open(address, "pt") as f:  # read whole at open: a connection cannot jump
            assert f.keys() == sorted(expected)
            assert same(f.get_slice("bf16")[1:3], expected["bf16"][1:3])
    finally:
        sender.stop()
    collector = Collector()
    try:
        st.save_file(expected, f"tcp://127.0.0.1:{collector.port}", {"format": "pt"})
    finally:
        collector.stop()
    assert collector.received == [ref_file.read_bytes()]


def test_get_slice_of_a_remote_tensor_reads_only_its_rows(http: RangeHTTPServer) -> None:
    big = torch.randn(1024, 256)  # 1 MiB
    data = reference.save({"big": big, "other": torch.randn(64, 64)})
    http.objects["/big.safetensors"] = data
    with st.safe_open(http.url("/big.safetensors"), "pt") as f:
        http.settle()
        opened = sum(sent for *_, sent in http.requests)
        part = f.get_slice("big")[128:256]
    http.settle()
    assert torch.equal(part, big[128:256])
    read = sum(sent for *_, sent in http.requests) - opened
    assert read == big[128:256].nbytes
    assert opened <= 64 << 10


def test_a_sync_call_leaves_the_thread_s_event_loop_as_it_was(ref_file: Path) -> None:
    """Code that sets a loop for its thread (``asyncio.set_event_loop``) and runs it itself
    still finds that loop after a sync call, which runs a loop of its own in that thread."""
    found: list[object] = []

    def work() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            st.load_file(ref_file)
            found.append(asyncio.get_event_loop() is loop)
        except RuntimeError as exc:  # no current event loop
            found.append(exc)
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert found == [True]


class Doubling(torch.nn.Module):
    """Keeps twice the checkpoint's weight (a load pre-hook converts it)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))
        self._register_load_state_dict_pre_hook(self._convert)

    def _convert(self, state: dict[str, torch.Tensor], prefix: str, *args: Any) -> None:
        if prefix + "weight" in state:
            state[prefix + "weight"] = state[prefix + "weight"] * 2


class Transposing(torch.nn.Module):
    """Its own ``_load_from_state_dict`` (a legacy layout), as some libraries have."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(2, 2))

    def _load_from_state_dict(self, state: Any, prefix: str, *args: Any) -> None:
        if prefix + "weight" in state:
            state[prefix + "weight"] = state[prefix + "weight"].t().contiguous()
        super()._load_from_state_dict(state, prefix, *args)


def with_load_hooks() -> torch.nn.Sequential:
    model = torch.nn.Sequential(
        Doubling(), Transposing(), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    )
    torch.nn.utils.spectral_norm(model[2])
    return model


def test_load_model_runs_the_model_s_own_loading_as_the_reference(tmp_path: Path) -> None:
    """Modules that load in their own way (a load pre-hook, their own _load_from_state_dict,
    spectral_norm's) get their tensors through load_state_dict, as the reference's load_model
    gives them; the others are still received in place."""
    torch.manual_seed(3)
    path = tmp_path / "m.safetensors"
    reference.save_model(with_load_hooks(), str(path))
    ours, ref = with_load_hooks(), with_load_hooks()
    plain = ours.state_dict()["3.weight"].data_ptr()
    expected: Any = reference.load_model(ref, str(path))
    assert st.load_model(ours, path) == expected
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    assert ours.state_dict()["3.weight"].data_ptr() == plain


class Defaulting(torch.nn.Module):
    """Fills a buffer an old checkpoint lacks with its default: a load post-hook told it is
    missing (a common backward-compatibility pattern); records what each call was told."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("scale", torch.ones(3))
        self.told: list[tuple[list[str], list[str]]] = []
        self.register_load_state_dict_post_hook(Defaulting._defaults)

    @staticmethod
    def _defaults(module: Defaulting, incompatible: Any) -> None:
        module.told.append((sorted(incompatible.missing_keys), list(incompatible.unexpected_keys)))
        if "scale" in incompatible.missing_keys:
            module.get_buffer("scale").fill_(1.0)
            incompatible.missing_keys.remove("scale")


@pytest.mark.parametrize("nested", [False, True])
def test_load_model_tells_a_load_post_hook_what_the_reference_tells_it(
    tmp_path: Path, nested: bool
) -> None:
    """A load post-hook (on the model or on a module in it) is told the missing and unexpected
    names of the whole load as under the reference: tensors received in place were told it
    as missing, and the hook overwrote them with its defaults."""

    def build() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(2, 2), Defaulting()) if nested else Defaulting()

    trained = build()
    with torch.no_grad():
        for tensor in trained.state_dict().values():
            tensor.fill_(5.0)
    path = tmp_path / "m.safetensors"
    reference.save_model(trained, str(path))
    ours, ref = build(), build()
    expected: Any = reference.load_model(ref, str(path))
    assert st.load_model(ours, path) == expected
    hooked = [m for model in (ours, ref) for m in model.modules() if isinstance(m, Defaulting)]
    assert hooked[0].told == hooked[1].told == [([], [])]
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
        assert tensor.eq(5.0).all(), name


class SlicedBuffer(torch.nn.Module):
    """A buffer over part of a storage no name covers whole."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("x", torch.zeros(6)[:3])


class StridedBuffer(torch.nn.Module):
    """A buffer that is every other column of a storage no name covers whole."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.register_buffer("x", torch.zeros(4, 6)[:, ::2])


class OverlappingViews(torch.nn.Module):
    """Two buffers over overlapping parts of one storage, neither covering it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        base = torch.zeros(6)
        self.register_buffer("x", base[:4])
        self.register_buffer("y", base[2:])


@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("build", [SlicedBuffer, StridedBuffer, OverlappingViews])
def test_load_model_refuses_memory_no_name_covers_before_loading_as_the_reference(
    tmp_path: Path, build: type[torch.nn.Module], backend: str
) -> None:
    """A model sharing memory that no name covers whole is refused with the reference's
    message, the model as it was (the reference refuses before loading anything), where every
    tensor had been loaded into the model before the refusal."""
    path = tmp_path / "m.safetensors"
    reference.save_file({n: torch.ones(t.shape) for n, t in build().state_dict().items()}, path)
    torch.manual_seed(3)
    expected = build()
    with pytest.raises(RuntimeError, match="Refusing to save/load the model") as raised:
        reference.load_model(expected, path)
    torch.manual_seed(3)
    model = build()
    worded = str(raised.value).split("storage.")[0]  # the advice after it is stream_st's
    with pytest.raises(UsageError, match=re.escape(worded)):
        st.load_model(model, path, strict=False, backend=backend)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


class CopyOnSave(torch.nn.Module):
    """Saves a copy of its weight (``detach().clone()``), as some modules do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4))

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        destination[prefix + "weight"] = self.weight.detach().clone()


class HookCopy(torch.nn.Module):
    """A state-dict post hook (public API) hands out copies of every tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(4))
        self.register_state_dict_post_hook(HookCopy._copies)

    @staticmethod
    def _copies(module: Any, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, tensor in list(state.items()):
            state[name] = tensor.clone()


class Views(torch.nn.Module):
    """Buffers that are conjugate and negative views (their bytes are not their values)."""

    def __init__(self) -> None:
        super().__init__()
        values = torch.tensor([1 + 2j, 3 + 4j], dtype=torch.complex64)
        self.register_buffer("conj", values.conj())
        self.register_buffer("neg", torch._neg_view(values.clone()))


@pytest.mark.parametrize("build", [CopyOnSave, HookCopy, Views])
def test_load_model_loads_what_state_dict_gives_as_no_tensor_of_the_model(
    tmp_path: Path, build: type[torch.nn.Module]
) -> None:
    """Tensors ``state_dict()`` gives that are not the model's own memory seen alike (copies,
    conjugate and negative views) go through load_state_dict, as the reference's load_model
    gives them: copies were filled and the model left as it was, reporting success, and a
    conjugate view raised a bare RuntimeError."""
    path = tmp_path / "m.safetensors"
    reference.save_file(
        {name: torch.rand_like(t) for name, t in build().state_dict().items()}, str(path)
    )
    ours, ref = build(), build()
    expected: Any = reference.load_model(ref, str(path))
    assert st.load_model(ours, path) == expected
    loaded = reference.load_file(str(path))
    for name, tensor in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
        assert torch.equal(tensor, loaded[name]), name


def test_load_model_tells_autograd_the_parameters_changed_as_the_reference(
    tmp_path: Path,
) -> None:
    """A tensor received in place counts as changed in place, as after the reference's
    ``copy_``: a backward through a graph built before the load raises, where it silently used
    the new weights."""
    path = tmp_path / "m.safetensors"
    reference.save_file({"weight": torch.full((1, 3), 5.0), "bias": torch.zeros(1)}, str(path))
    for load in (reference.load_model, st.load_model):
        model = torch.nn.Linear(3, 1)
        before = model.weight._version
        out = model(torch.ones(1, 3, requires_grad=True)).sum()
        load(model, str(path))
        assert model.weight._version > before
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.backward()


def test_load_model_failing_part_done_tells_autograd_of_what_it_may_have_written(
    tmp_path: Path,
) -> None:
    """A load that fails on a damaged tensor (its digest checked as it lands in the model's own
    memory) counts every tensor it received in place as changed: a backward through a graph
    built before it raises, where it used the damaged bytes left in the weight."""
    path = tmp_path / "m.safetensors"
    st.save_file({"weight": torch.full((1, 3), 5.0), "bias": torch.zeros(1)}, path, checksums=True)
    damaged = bytearray(path.read_bytes())
    damaged[-5] ^= 0xFF  # in the weight, the last tensor in offset order
    path.write_bytes(damaged)
    model = torch.nn.Linear(3, 1)
    before = model.weight._version
    out = model(torch.ones(1, 3, requires_grad=True)).sum()
    with pytest.raises(IntegrityError):
        st.load_model(model, path, verify=True)
    assert model.weight._version > before
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


@pytest.mark.parametrize("strict", [True, False])
def test_load_model_of_batch_norm_without_num_batches_tracked_as_the_reference(
    tmp_path: Path, strict: bool
) -> None:
    """A checkpoint of no version (the reference's load_file gives no metadata): BatchNorm
    takes one without num_batches_tracked, as many converted checkpoints are."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = {k: v for k, v in model.state_dict().items() if "num_batches_tracked" not in k}
    path = tmp_path / "m.safetensors"
    reference.save_file(state, str(path))
    fresh = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    expected: Any = reference.load_model(fresh, str(path), strict=strict)
    ours = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    assert st.load_model(ours, path, strict=strict) == expected


def test_load_model_over_http_reads_the_file_with_one_request(
    tmp_path: Path, http: RangeHTTPServer
) -> None:
    """Every byte is read: the whole object is asked for at once (no first part, then the
    rest), as load_file asks for it."""
    torch.manual_seed(4)
    model = torch.nn.Linear(256, 256)
    path = tmp_path / "m.safetensors"
    st.save_model(model, path)
    http.objects["/m.safetensors"] = path.read_bytes()
    assert st.load_model(torch.nn.Linear(256, 256), http.url("/m.safetensors")) == (set(), [])
    http.settle()
    assert [(method, ranged) for method, _, ranged, _ in http.requests] in (
        [("GET", "")],
        [("GET", "bytes=0-")],
    ), http.requests


@pytest.mark.parametrize("metadata", ["format=pt", 5, [("format", "pt")]])
def test_save_model_refuses_metadata_that_is_no_dict_as_the_reference(
    tmp_path: Path, metadata: Any
) -> None:
    with pytest.raises(TypeError):
        reference.save_model(Tied(), str(tmp_path / "ref.safetensors"), metadata=metadata)
    with pytest.raises(TypeError) as raised:
        st.save_model(Tied(), tmp_path / "ours.safetensors", metadata=metadata)
    assert isinstance(raised.value, stream_st.SafetensorsError)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("device", ["cuda:x", "cuda:-1"])
def test_a_device_name_torch_cannot_parse_is_a_value_error_as_the_reference(
    ref_file: Path, device: str
) -> None:
    with pytest.raises(ValueError):
        reference.load_file(ref_file, device=device)
    for call in (st.load_file, lambda path, device: st.safe_open(path, "pt", device=device)):
        with pytest.raises(ValueError, match="not a device torch knows") as raised:
            call(ref_file, device=device)
        assert isinstance(raised.value, UsageError)
