"""Which error the torch drop-in's ``save_file`` raises first for a small tensor it cannot write
(one numpy cannot hold) with metadata it refuses: the metadata's, whichever way the file would
be written (the compiled module's, the Python write's), as the reference raises it too. The
compiled module's way converted the tensors before it looked at the metadata, and raised the
tensor's :class:`~stream_st.UsageError` instead."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("stream_st.core._small", reason="the C module was not built")

import safetensors.torch as reference_torch  # noqa: E402

import stream_st.torch as st_torch  # noqa: E402
from stream_st.compat import _save  # noqa: E402
from stream_st.transports.file import atomic  # noqa: E402

from .._util import nameless_works  # noqa: E402

TENSORS: dict[str, Callable[[], dict[str, Any]]] = {
    "70 dimensions": lambda: {"a": torch.zeros([1] * 70)},
    "shape (0, 2**61)": lambda: {"a": torch.zeros((0, 2**61))},
    "nested": lambda: {"a": torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])},
}
"""Small torch tensors of numpy's own dtypes that stream_st cannot write (the reference writes
the first two; the nested one fails it with an internal error of torch's)."""

METADATA: dict[str, Any] = {
    "a value not str": {"k": 1},
    "a key not str": {1: "v"},
    "not a mapping": 5,
    "text UTF-8 cannot encode": {"k": "\ud800"},
}

ROUTES = ["compiled module", "past its bytes", "no compiled module"]
"""The ways a file is written: the compiled module's where it takes the file; the Python write
where the data pass :data:`~stream_st.compat._save.SMALL` bytes (0 here: an empty tensor's
still reach the module), or where the module is not there."""


@pytest.fixture(autouse=True)
def _nameless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file system that names nameless files, as the compiled module needs."""
    if not nameless_works(tmp_path):
        pytest.skip("no O_TMPFILE here: every file is written the Python way")
    monkeypatch.setattr(atomic, "_UNLINKABLE", set())


def _raised(call: Callable[[], object]) -> BaseException:
    """The exception ``call`` raises (it must raise one)."""
    with pytest.raises(Exception) as caught:
        call()
    return caught.value


def _saved(route: str, tensors: dict[str, Any], path: Path, metadata: Any) -> BaseException:
    """What the torch drop-in's ``save_file`` raises, writing the way ``route`` names."""
    with pytest.MonkeyPatch.context() as patch:
        if route == "past its bytes":
            patch.setattr(_save, "SMALL", 0)
        elif route == "no compiled module":
            patch.setattr(_save, "_compiled", lambda: None)
        return _raised(lambda: st_torch.save_file(tensors, path, metadata))


@pytest.mark.parametrize("metadata", list(METADATA))
@pytest.mark.parametrize("tensors", list(TENSORS))
def test_the_metadatas_error_comes_first_whichever_way_the_file_is_written(
    tmp_path: Path, tensors: str, metadata: str
) -> None:
    path = tmp_path / "m.safetensors"
    raised = {
        route: _saved(route, TENSORS[tensors](), path, METADATA[metadata]) for route in ROUTES
    }
    first = raised["no compiled module"]
    assert "metadata" in str(first), first  # the metadata's, not the tensor's
    for route, exc in raised.items():
        assert (type(exc), str(exc)) == (type(first), str(first)), route
    if tensors != "nested":
        reference = _raised(
            lambda: reference_torch.save_file(TENSORS[tensors](), path, METADATA[metadata])
        )
        assert isinstance(first, type(reference)), (first, reference)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("metadata", [None, {"k": "v"}], ids=["no metadata", "metadata"])
@pytest.mark.parametrize("tensors", list(TENSORS))
def test_with_metadata_it_takes_the_tensors_error_is_the_same_either_way(
    tmp_path: Path, tensors: str, metadata: dict[str, str] | None
) -> None:
    path = tmp_path / "m.safetensors"
    raised = {route: _saved(route, TENSORS[tensors](), path, metadata) for route in ROUTES}
    first = raised["no compiled module"]
    assert "tensor 'a'" in str(first), first
    for route, exc in raised.items():
        assert (type(exc), str(exc)) == (type(first), str(first)), route
    assert os.listdir(tmp_path) == []
