"""The drop-ins' ``_TYPES`` tables and ``_getdtype`` against the reference's: the same values
(numpy's scalar types and the builtin ``bool``, torch's dtypes), and ``load`` of bytes reading
the table when called, so that a program patching it (PaddleNLP's
``safetensors.numpy._TYPES.update({"BF16": np.uint16})``, ``_TYPES["BF16"] =
ml_dtypes.bfloat16``, torch's ``_TYPES["BF16"] = torch.int16``) gets what the reference gives:
the tensor's bytes viewed as the patched dtype, or the reference's error where they cannot be."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy as reference_numpy

import stream_st.numpy as sn

Arrays = dict[str, np.ndarray[Any, Any]]


def checkpoint(with_bf16: bool) -> bytes:
    """A file of tensors of several dtypes and shapes (a 0-d one, an empty one), with a BF16
    one if ``with_bf16`` (which the reference's numpy ``load`` reads only once patched in)."""
    arrays: Arrays = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "i16": np.array([1, -2, 3], np.int16),
        "flags": np.array([True, False, True, True]),
        "empty": np.zeros((0, 2), np.uint8),
        "scalar": np.array(2.5, np.float64),
    }
    if with_bf16:
        arrays["bf16"] = np.array([1.0, 2.0, -3.5], ml_dtypes.bfloat16)
    return sn.save(arrays)


def outcome(load: Callable[[bytes], dict[str, Any]], data: bytes) -> Any:
    """What ``load(data)`` gives: its result, or the type and message of what it raised."""
    try:
        return load(data)
    except Exception as exc:
        return (type(exc), str(exc))


def test_numpy_table_holds_the_reference_s_values() -> None:
    """Scalar types (``np.float32``, the builtin ``bool``), not dtype instances: programs call
    them and look dtypes up by ``array.dtype.type``."""
    assert sn._TYPES.keys() == reference_numpy._TYPES.keys()
    for code, kind in reference_numpy._TYPES.items():
        assert sn._TYPES[code] is kind
        assert sn._getdtype(code) is kind
    assert sn._TYPES["BOOL"] is bool
    assert repr(sn._getdtype("F32")(1.5)) == repr(np.float32(1.5))
    reverse = {kind: code for code, kind in sn._TYPES.items()}
    assert reverse[np.zeros(1, np.float32).dtype.type] == "F32"


NUMPY_PATCHES = [
    ("BF16", np.uint16),
    ("BF16", ml_dtypes.bfloat16),
    ("F32", np.int32),
    ("BOOL", np.uint8),
    ("U8", np.float32),  # only the empty tensor: an empty array of float32
    ("F32", np.uint8),  # itemsize divides, but the shape no longer fits: reshape's error
    ("I16", np.float32),  # 6 bytes are no whole number of float32s: frombuffer's error
]


@pytest.mark.parametrize(("code", "kind"), NUMPY_PATCHES)
def test_numpy_load_reads_a_patched_table(
    code: str, kind: type[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    data = checkpoint(code == "BF16")
    monkeypatch.setitem(reference_numpy._TYPES, code, kind)
    monkeypatch.setitem(sn._TYPES, code, kind)
    assert sn._getdtype(code) is kind
    expected = outcome(reference_numpy.load, data)
    got = outcome(sn.load, data)
    if isinstance(expected, tuple):
        assert got == expected
        return
    assert isinstance(got, dict) and got.keys() == expected.keys()
    for name, want in expected.items():
        have = got[name]
        assert (have.dtype, have.shape, have.flags.writeable) == (
            want.dtype,
            want.shape,
            want.flags.writeable,
        ), name
        assert have.tobytes() == want.tobytes(), name


def test_numpy_load_is_back_to_its_own_once_the_patch_is_undone() -> None:
    data = checkpoint(True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sn._TYPES, "BF16", np.uint16)
        assert sn.load(data)["bf16"].dtype == np.uint16
    arrays = sn.load(data)
    assert arrays["bf16"].dtype == ml_dtypes.bfloat16
    assert arrays["flags"].dtype == np.bool_


TORCH_PATCHES = [
    ("BF16", "int16"),
    ("F32", "int32"),
    ("BOOL", "uint8"),
    ("U8", "float32"),  # only the empty tensor: torch.empty of float32
    ("F32", "uint8"),  # reshape's error
    ("I16", "float32"),  # frombuffer's error
]


@pytest.mark.parametrize(("code", "name"), TORCH_PATCHES)
def test_torch_load_reads_a_patched_table(
    code: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    import safetensors.torch as reference_torch

    import stream_st.torch as st

    data = checkpoint(True)
    dtype = getattr(torch, name)
    monkeypatch.setitem(reference_torch._TYPES, code, dtype)
    monkeypatch.setitem(st._TYPES, code, dtype)
    assert st._getdtype(code) is dtype is reference_torch._getdtype(code)
    expected = outcome(reference_torch.load, data)
    got = outcome(st.load, data)
    if isinstance(expected, tuple):
        assert got == expected
        return
    assert isinstance(got, dict) and got.keys() == expected.keys()
    for key, want in expected.items():
        have = got[key]
        assert (have.dtype, have.shape) == (want.dtype, want.shape), key
        assert torch.equal(have.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))


def test_torch_table_is_the_reference_s() -> None:
    torch = pytest.importorskip("torch")
    import safetensors.torch as reference_torch

    import stream_st.torch as st

    for code, dtype in reference_torch._TYPES.items():
        assert st._TYPES[code] is dtype
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(st._TYPES, "BF16", torch.int16)
        assert st._getdtype("BF16") is torch.int16
    assert st.load(checkpoint(True))["bf16"].dtype == torch.bfloat16


@pytest.mark.parametrize("code", ["F32", "BOOL"])
def test_numpy_load_fails_as_the_reference_for_a_code_removed(
    code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A code a program deleted from ``_TYPES`` made the reference's ``load`` raise its
    ``KeyError`` while the drop-in read the tensor as before."""
    data = checkpoint(False)
    monkeypatch.delitem(reference_numpy._TYPES, code)
    monkeypatch.delitem(sn._TYPES, code)
    expected = outcome(reference_numpy.load, data)
    assert isinstance(expected, tuple) and expected[0] is KeyError
    assert outcome(sn.load, data) == expected
