"""Defects found by the twelfth round of attacks, each with the test that failed before its mend:
sharded and dataset writers given a URL."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

import stream_st
from stream_st import ArgumentTypeError, UnsupportedSinkError

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    "url",
    [
        "s3://bucket/ckpt/",
        "https://user:secret@example.invalid/up/?X-Amz-Signature=abc",
        "tcp://127.0.0.1:1",
    ],
)
async def test_a_sharded_or_dataset_writer_given_a_url_refuses_it_rather_than_making_local_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, url: str
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedSinkError, match="local folder") as info:
        stream_st.open_sharded_writer(url)
    assert "secret" not in str(info.value) and "abc" not in str(info.value)
    with pytest.raises(UnsupportedSinkError, match="local folder"):
        stream_st.open_dataset_writer(url)
    assert list(tmp_path.iterdir()) == []  # no "s3:" or "https:" folder


async def test_a_sharded_writer_takes_a_file_url_as_its_folder(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    async with stream_st.open_sharded_writer(folder.as_uri()) as writer:
        await writer.write("w", np.arange(4, dtype=np.float32))
    assert (folder / "model.safetensors").exists() or list(folder.glob("*.safetensors"))


def test_a_folder_of_another_type_is_an_argument_type_error() -> None:
    with pytest.raises(ArgumentTypeError, match="path or a file:// URL"):
        stream_st.open_sharded_writer(5)  # type: ignore[arg-type]


def test_the_reference_s_private_names_programs_import_are_there() -> None:
    """torch's checkpoint reader imports ``_getdtype`` from ``safetensors.torch``, vLLM
    ``_TYPES``: the drop-ins have them, as the reference's tables say."""
    torch = pytest.importorskip("torch")
    import safetensors.numpy as reference_numpy
    import safetensors.torch as reference_torch

    import stream_st.numpy
    import stream_st.torch
    from stream_st import compat

    for code, dtype in reference_torch._TYPES.items():
        assert stream_st.torch._TYPES[code] is dtype
        assert stream_st.torch._getdtype(code) is dtype
    assert all(stream_st.torch._SIZE[d] == n for d, n in reference_torch._SIZE.items() if d)
    assert stream_st.torch.TensorSpec is compat.TensorSpec
    assert stream_st.torch.deserialize is compat.deserialize
    assert stream_st.torch.serialize is compat.serialize
    assert stream_st.torch.serialize_file is compat.serialize_file
    with pytest.raises(KeyError):
        stream_st.torch._getdtype("NOPE")
    assert {c: np.dtype(t) for c, t in reference_numpy._TYPES.items()} == stream_st.numpy._TYPES
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "a": np.arange(6, dtype=np.int16).reshape(2, 3),
        "b": np.ones(2, np.float64),
    }
    got = stream_st.numpy._view2np(compat.deserialize(reference_numpy.save(arrays)))
    assert all(np.array_equal(got[name], array) for name, array in arrays.items())
    assert torch.float32 in stream_st.torch._SIZE
