"""The drop-in behaves as the reference (``safetensors``, installed next to it) does: the same
names, results, error types and messages, each error also a :class:`stream_st.SafetensorsError`.
Every test runs the reference and stream_st side by side."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import inspect
import io
import json
import pickle
import subprocess
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import safetensors
import safetensors.numpy as ref_np
import safetensors.torch as ref_pt
import torch

import stream_st.compat as compat
import stream_st.numpy as st_np
import stream_st.torch as st_pt
from stream_st import HeaderError, SafetensorsError, UnsupportedFrameworkError
from stream_st.compat._reference import SafeOpen

from .test_local_load import odd_file


def outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    """``("ok", result)`` or ``("error", (message, builtin types of the error))``."""
    try:
        return "ok", call()
    except Exception as exc:  # the point: compare whatever is raised
        builtin = {t for t in type(exc).__mro__ if t.__module__ == "builtins"} - {
            Exception,
            BaseException,
            object,
        }
        return "error", (str(exc), builtin)


def raises_as_reference(ours: Callable[[], Any], reference: Callable[[], Any]) -> BaseException:
    """Both raise; ours with the reference's message and built-in type, and a
    SafetensorsError. Returns our exception."""
    kind, (message, types) = outcome(reference)
    assert kind == "error"
    with pytest.raises(Exception) as caught:
        ours()
    assert isinstance(caught.value, SafetensorsError)
    assert str(caught.value) == message
    assert all(isinstance(caught.value, t) for t in types), (type(caught.value).__mro__, types)
    return caught.value


# ------------------------------------------------------------------------------------ names


def test_every_name_the_reference_exports_is_there() -> None:
    exported = [name for name in dir(safetensors) if not name.startswith("__")]
    exported = [name for name in exported if not isinstance(getattr(safetensors, name), type(io))]
    for name in [*exported, "__version__"]:  # the names, not the submodules it imported
        assert hasattr(compat, name), name
    for name in (
        "storage_ptr",
        "storage_size",
        "_find_shared_tensors",
        "_remove_duplicate_names",
        "_is_complete",
        "_end_ptr",
        "load",
        "load_file",
        "load_model",
        "save",
        "save_file",
        "save_model",
    ):
        assert callable(getattr(st_pt, name)), name
    assert compat.SafetensorError is SafetensorsError
    assert compat.torch is st_pt and compat.numpy is st_np


DROPIN = Path(__file__).parents[2] / "docs" / "dropin.md"


def shared_callables() -> list[tuple[str, Callable[..., Any], Callable[..., Any]]]:
    """``(name, reference's, ours)`` for each function or class both modules of a pair have
    (the handle's public methods too), signatures readable on both sides."""
    found = []
    for reference, ours in ((safetensors, compat), (ref_pt, st_pt), (ref_np, st_np)):
        for name in dir(reference):
            theirs = getattr(reference, name)
            if name.startswith("__") or not callable(theirs) or not hasattr(ours, name):
                continue
            if getattr(theirs, "__module__", None) == "typing" or (
                isinstance(theirs, type) and issubclass(theirs, BaseException)
            ):
                continue  # typing's names the module imported, and its error class
            found.append((f"{reference.__name__}.{name}", theirs, getattr(ours, name)))
    for name in dir(safetensors.safe_open):
        if not name.startswith("_"):
            method = getattr(SafeOpen, name)  # the class of the handle compat.safe_open gives
            found.append((f"safe_open.{name}", getattr(safetensors.safe_open, name), method))
    return found


def test_every_function_takes_the_reference_s_arguments_by_its_names() -> None:
    """Each function both have takes the reference's parameters, named and of the kinds
    there, in its order (``_find_shared_tensors(state_dict=)``, ``deserialize(bytes=)`` were
    a bare TypeError); ours may add keyword-only ones after them that docs/dropin.md names
    as additions (the transport options as ``**options``)."""
    documented = DROPIN.read_text()
    compared = 0
    for name, theirs, ours in shared_callables():
        wanted = list(inspect.signature(theirs).parameters.values())
        given = list(inspect.signature(ours).parameters.values())
        if name.startswith("safe_open."):  # the reference's self is positional-only
            wanted, given = wanted[1:], given[1:]
        assert [(p.name, p.kind) for p in given[: len(wanted)]] == [
            (p.name, p.kind) for p in wanted
        ], name
        for added in given[len(wanted) :]:
            if added.kind is inspect.Parameter.VAR_KEYWORD:
                assert "transport options" in documented, name
            else:
                assert added.kind is inspect.Parameter.KEYWORD_ONLY, (name, added.name)
                assert f"`{added.name}=`" in documented, (name, added.name)
        compared += 1
    assert compared >= 20


def test_the_reference_s_keywords_are_taken_and_give_its_kinds_of_result() -> None:
    """``state_dict=`` and ``bytes=`` as the reference's callers pass them; a name kept for no
    other is ``[]`` in ``_remove_duplicate_names``' defaultdict, as there."""
    shared = torch.zeros(4)
    state = {"a": shared, "b": shared, "c": torch.ones(1)}
    assert st_pt._find_shared_tensors(state_dict=state) == ref_pt._find_shared_tensors(
        state_dict=state
    )
    ours = st_pt._remove_duplicate_names(state_dict=state, discard_names=["a"])
    theirs = ref_pt._remove_duplicate_names(state_dict=state, discard_names=["a"])
    assert (type(ours), ours, ours["c"]) == (type(theirs), theirs, theirs["c"])
    data = ref_pt.save({"c": state["c"]})
    for module in (compat, st_pt, st_np):
        assert module.deserialize(bytes=data) == safetensors.deserialize(bytes=data)


# -------------------------------------------------------------------------- saving refused


def test_save_refuses_what_the_reference_refuses_with_its_messages(tmp_path: Path) -> None:
    dst = tmp_path / "x.safetensors"
    bad: list[Any] = [
        "notadict",
        {"test": {"some": "thing"}},
        {"test": torch.zeros(2, 3).to_sparse()},
        {"t": torch.arange(6.0).reshape(2, 3)[:, 1]},  # not contiguous
    ]
    for tensors in bad:
        error = raises_as_reference(
            partial(st_pt.save_file, tensors, dst), partial(ref_pt.save_file, tensors, dst)
        )
        assert isinstance(error, ValueError)
        raises_as_reference(partial(st_pt.save, tensors), partial(ref_pt.save, tensors))
    assert not dst.exists()


def test_shared_and_meta_tensors_are_runtime_errors(tmp_path: Path) -> None:
    dst = tmp_path / "x.safetensors"
    base = torch.arange(6.0).reshape(2, 3)
    for tensors in ({"A": base, "B": base[:1]}, {"A": base, "B": base[1:]}):
        with pytest.raises(RuntimeError) as caught:
            st_pt.save_file(tensors, dst)
        assert isinstance(caught.value, SafetensorsError)
        with pytest.raises(RuntimeError):
            ref_pt.save_file(tensors, dst)
    meta = {"test": torch.zeros((10, 10), device="meta")}
    with pytest.raises(RuntimeError, match="Cannot copy out of meta tensor") as caught:
        st_pt.save_file(meta, dst)
    assert isinstance(caught.value, SafetensorsError)
    assert not dst.exists()


@pytest.mark.parametrize("metadata", [{"a": 1}, {1: "a"}, {"a": None}])
def test_metadata_that_is_not_text_is_a_type_error(tmp_path: Path, metadata: Any) -> None:
    dst = tmp_path / "x.safetensors"
    pairs = [
        (lambda: st_pt.save_file({"x": torch.zeros(2)}, dst, metadata), ref_pt.save),
        (lambda: st_np.save_file({"x": np.zeros(2)}, dst, metadata), ref_np.save),
        (lambda: st_np.save({"x": np.zeros(2)}, metadata), ref_np.save),
    ]
    for ours, _ in pairs:
        with pytest.raises(TypeError, match="argument 'metadata'") as caught:
            ours()
        assert isinstance(caught.value, SafetensorsError)
    with pytest.raises(TypeError):
        ref_np.save({"x": np.zeros(2)}, metadata=metadata)
    assert not dst.exists()


def raises_the_reference_s_type(ours: Callable[[], Any], reference: Callable[[], Any]) -> None:
    """Both raise; ours a SafetensorsError deriving from every built-in type the reference's
    error does (the messages may differ)."""
    kind, (_, types) = outcome(reference)
    assert kind == "error" and types
    with pytest.raises(SafetensorsError) as caught:
        ours()
    assert all(isinstance(caught.value, t) for t in types), (type(caught.value).__mro__, types)


def test_arguments_of_the_wrong_type_are_type_errors(tmp_path: Path) -> None:
    dst = tmp_path / "x.safetensors"
    for ours, reference, tensor in ((st_pt, ref_pt, torch.zeros(2)), (st_np, ref_np, np.zeros(2))):
        named_by_int = {1: tensor}
        raises_the_reference_s_type(
            partial(ours.save, named_by_int), partial(reference.save, named_by_int)
        )
        raises_the_reference_s_type(
            partial(ours.save_file, named_by_int, dst),
            partial(reference.save_file, named_by_int, dst),
        )
        for data in ("x.safetensors", None, np.zeros(3), [1, 2], 5):
            raises_the_reference_s_type(partial(ours.load, data), partial(reference.load, data))
    assert not dst.exists()


def test_a_misspelt_keyword_is_a_type_error_as_the_reference_s(tmp_path: Path) -> None:
    """``devcie=``, ``stict=``, ``metdata=``: Python's TypeError for an unexpected keyword
    argument in the reference, where the drop-ins raised a UsageError (a RuntimeError) that
    ``except TypeError`` missed."""
    path = tmp_path / "x.safetensors"
    devcie: dict[str, Any] = {"devcie": "cpu"}  # misspelt on purpose (a checker sees them)
    stict: dict[str, Any] = {"stict": False}
    metdata: dict[str, Any] = {"metdata": {}}
    ref_pt.save_file({"a": torch.ones(2)}, path)
    calls: list[tuple[Callable[[], object], Callable[[], object]]] = [
        (
            partial(compat.safe_open, path, "pt", **devcie),
            partial(safetensors.safe_open, path, "pt", **devcie),
        ),
        (
            partial(st_pt.load_file, path, **devcie),
            partial(ref_pt.load_file, path, **devcie),
        ),
        (
            partial(st_pt.load_model, torch.nn.Module(), path, **stict),
            partial(ref_pt.load_model, torch.nn.Module(), path, **stict),
        ),
        (
            partial(st_np.save_file, {"a": np.ones(2)}, tmp_path / "y.safetensors", **metdata),
            partial(ref_np.save_file, {"a": np.ones(2)}, tmp_path / "y.safetensors", **metdata),
        ),
    ]
    for ours, reference in calls:
        raises_the_reference_s_type(ours, reference)
        with pytest.raises(TypeError, match="unknown option"):
            ours()
    assert not (tmp_path / "y.safetensors").exists()


@pytest.mark.parametrize("framework", ["pt", "np"])
def test_a_bad_backend_or_device_is_the_reference_s_type_of_error(
    tmp_path: Path, framework: str
) -> None:
    """A backend that is no string is a TypeError, a device name torch cannot parse a
    ValueError, with numpy too (they were a UsageError alone)."""
    path = tmp_path / "x.safetensors"
    ref_np.save_file({"x": np.zeros(2)}, path)
    for options in ({"backend": None}, {"backend": 1}, {"device": "cuda:x"}, {"device": "cuda:-1"}):
        raises_the_reference_s_type(
            partial(compat.safe_open, path, framework, **options),
            partial(safetensors.safe_open, path, framework, **options),
        )


def test_a_meta_tensor_is_not_implemented_as_in_the_reference(tmp_path: Path) -> None:
    dst = tmp_path / "x.safetensors"
    meta = {"a": torch.empty(3, device="meta")}
    raises_the_reference_s_type(partial(st_pt.save, meta), partial(ref_pt.save, meta))
    raises_the_reference_s_type(
        partial(st_pt.save_file, meta, dst), partial(ref_pt.save_file, meta, dst)
    )
    assert not dst.exists()


class NonContiguous(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.a.weight = torch.nn.Parameter(torch.zeros((4, 4)).T)


def test_save_model_force_contiguous(tmp_path: Path) -> None:
    model = NonContiguous()
    with pytest.raises(ValueError, match=r"use save_model\(\.\.\., force_contiguous=True\)") as e:
        st_pt.save_model(model, tmp_path / "x.safetensors", force_contiguous=False)
    assert isinstance(e.value, SafetensorsError)
    assert not (tmp_path / "x.safetensors").exists()
    st_pt.save_model(model, tmp_path / "ours.safetensors")
    ref_pt.save_model(model, str(tmp_path / "ref.safetensors"))
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()


# ---------------------------------------------------------------------------- load_model


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = self.a


class Untied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)


def test_load_model_strict_messages_are_the_references(tmp_path: Path) -> None:
    torch.manual_seed(0)
    for saved, loaded in ((Tied(), Untied()), (Untied(), Tied())):
        path = tmp_path / f"{type(saved).__name__}.safetensors"
        st_pt.save_model(saved, path)
        error = raises_as_reference(
            partial(st_pt.load_model, copy.deepcopy(loaded), path),
            partial(ref_pt.load_model, copy.deepcopy(loaded), path),
        )
        assert isinstance(error, RuntimeError)
        missing, unexpected = st_pt.load_model(copy.deepcopy(loaded), path, strict=False)
        ref_missing, ref_unexpected = ref_pt.load_model(copy.deepcopy(loaded), path, strict=False)
        assert (missing, unexpected) == (set(ref_missing), ref_unexpected)


# ---------------------------------------------------------------------------- safe_open


def small(tmp_path: Path) -> Path:
    path = tmp_path / "small.safetensors"
    ref_pt.save_file(
        {"a": torch.arange(50.0).reshape(10, 5), "s": torch.tensor(3.0)},
        path,
        metadata={"k": "v"},
    )
    return path


@pytest.mark.parametrize("where", ["absent", "under a file", "with a NUL"])
def test_missing_file_is_worded_as_the_reference(tmp_path: Path, where: str) -> None:
    """A path under a regular file (ENOTDIR) or holding a NUL is no file to the reference
    either: a FileNotFoundError, where they were a TransportError and a UsageError."""
    name = {
        "absent": str(tmp_path / "notafile"),
        "under a file": str(small(tmp_path) / "model.safetensors"),
        "with a NUL": str(tmp_path / "a\0b.safetensors"),
    }[where]
    for framework in ("pt", "np"):
        error = raises_as_reference(
            partial(compat.safe_open, name, framework),
            partial(safetensors.safe_open, name, framework),
        )
        assert isinstance(error, FileNotFoundError)
    for backend in ("mmap", "pread"):
        raises_as_reference(
            partial(st_pt.load_file, name, backend=backend), partial(ref_pt.load_file, name)
        )
    raises_as_reference(partial(st_np.load_file, name), partial(ref_np.load_file, name))
    for model in (torch.nn.Linear(2, 2), torch.nn.Linear(2, 2, device="meta")):
        raises_as_reference(
            partial(st_pt.load_model, model, name), partial(ref_pt.load_model, model, name)
        )


def test_a_closed_handle_answers_nothing_but_its_slices_still_read(tmp_path: Path) -> None:
    path = small(tmp_path)
    for backend in ("mmap", "pread"):
        with compat.safe_open(path, "pt", backend=backend) as f:
            kept = f.get_slice("a")
            tensor = f.get_tensor("a")
        for call in (f.keys, f.metadata, f.offset_keys, f.get_tensors):
            with pytest.raises(compat.SafetensorError, match="File is closed"):
                call()
        for name_call in (f.get_tensor, f.get_slice):
            with pytest.raises(compat.SafetensorError, match="File is closed"):
                name_call("a")
        assert torch.equal(tensor, torch.arange(50.0).reshape(10, 5))
        assert torch.equal(kept[2:4], torch.arange(10.0, 20.0).reshape(2, 5)), backend
    with safetensors.safe_open(path, "pt") as ref:
        pass
    with pytest.raises(safetensors.SafetensorError, match="File is closed"):
        ref.keys()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_read_cut_short_by_a_close_answers_file_is_closed(
    tmp_path: Path, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread closing the handle while ``get_tensors`` runs (here: as its first tensor
    is handed out) makes it raise ``File is closed``, as the handle then answers, chained from
    what the close cut short, where that came out as it was (an ``AssertionError``)."""
    path = tmp_path / "two.safetensors"
    ref_pt.save_file({"a": torch.zeros(2), "b": torch.ones(2)}, path)
    f = compat.safe_open(path, "pt", backend=backend)
    out = SafeOpen._out

    def closing(handle: SafeOpen, array: Any, info: Any) -> Any:
        handle.close()
        return out(handle, array, info)

    monkeypatch.setattr(SafeOpen, "_out", closing)  # a handle takes no attribute of its own
    with pytest.raises(compat.SafetensorError, match="File is closed") as caught:
        f.get_tensors()
    assert caught.value.__cause__ is not None


def test_numpy_arrays_at_odd_offsets_are_aligned_as_the_reference_s(tmp_path: Path) -> None:
    """A tensor whose bytes start at an odd offset of the file (a valid file, its header not
    padded) was an unaligned view of the mapping from ``load_file`` (``flags.aligned`` False:
    numba, Cython and other code wanting aligned memory break on it), where the reference's
    array is aligned, as stream_st's own ``safe_open``'s was: every numpy read of the drop-in is
    aligned, mapped or through the streaming core, of the file or of an index naming it. (Torch
    tensors stay views at any address, as the reference's are.)"""
    path = tmp_path / "odd.safetensors"
    written = odd_file(path)
    index = tmp_path / "odd.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": dict.fromkeys(written, path.name)}))
    assert all(array.flags.aligned for array in ref_np.load_file(str(path)).values())
    for source in (path, index):
        with st_np.safe_open(source, "np") as f:
            whole = [
                st_np.load_file(source),
                st_np.load_file(source, timeout=30),  # through the streaming core's mapping
                {name: f.get_tensor(name) for name in written},
                f.get_tensors(),
                {name: f.get_slice(name)[...] for name in written},
            ]
            rows = {name: f.get_slice(name)[1:] for name in ("a", "b", "d")}
        for got, take in [*((read, np.s_[:]) for read in whole), (rows, np.s_[1:])]:
            for name, array in got.items():
                assert array.flags.aligned, (source, name)
                assert array.tobytes() == written[name][take].tobytes(), (source, name)


def writes_seen(f: Any) -> list[float]:
    """What reads of tensor ``a`` through handle ``f`` see after a write into another call's
    result (``get_tensor``, ``get_tensors``, a ``get_slice`` of some rows, of all): the value
    a next ``get_tensor`` and a next slice read where each write went."""
    takes = [
        lambda: f.get_tensor("a"),
        lambda: f.get_tensors()["a"],
        lambda: f.get_slice("a")[:2],
        lambda: f.get_slice("a")[...],
    ]
    seen = []
    for value, take in enumerate(takes, start=100):
        take()[0] = value
        seen += [float(f.get_tensor("a")[0, 0]), float(f.get_slice("a")[:1][0, 0])]
    return seen


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_write_into_a_read_reaches_later_reads_as_in_the_reference(
    tmp_path: Path, framework: str
) -> None:
    """A numpy ``safe_open`` of an index handed its shards' tensors out as views of their
    mapping: a write into one (``get_tensor``, ``get_tensors``, a slice) was in every later
    read of it, where each numpy array of the reference is a copy of its own. Now every numpy
    read is the caller's own, of a file or of an index naming it, and torch tensors are views
    of the mapping, a write into one seen by later reads, as the reference's are; neither write
    reaches the file."""
    path = small(tmp_path)
    index = tmp_path / "small.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": path.name, "s": path.name}}))
    with safetensors.safe_open(path, framework) as r:
        expected = writes_seen(r)
    assert expected == (
        [0.0] * 8 if framework == "np" else [100, 100, 101, 101, 102, 102, 103, 103]
    )
    for source in (path, index):
        with compat.safe_open(source, framework) as f:
            assert writes_seen(f) == expected, source
    for source in (path, index):
        with compat.safe_open(source, framework, backend="pread") as f:
            assert writes_seen(f) == [0.0] * 8, source  # fresh memory, each read
        loaded = (st_np if framework == "np" else st_pt).load_file(source)
        loaded["a"][0] = 100
        assert ref_np.load_file(str(path))["a"][0, 0] == 0.0
        assert st_np.load_file(source)["a"][0, 0] == 0.0


def test_empty_metadata_reads_back_empty_and_none_as_none(tmp_path: Path) -> None:
    """``metadata={}`` is written as ``"__metadata__":{}`` and ``metadata()`` gives ``{}``
    (not None, which stands for no ``__metadata__`` at all), as the reference has it."""
    metadata: dict[str, str] | None
    for metadata in ({}, None):
        path = tmp_path / f"{metadata}.safetensors"
        st_pt.save_file({"a": torch.ones(1)}, path, metadata=metadata)
        with safetensors.safe_open(path, "pt") as ref:
            expected = ref.metadata()
        assert expected == metadata
        for backend in ("mmap", "pread"):
            with compat.safe_open(path, "pt", backend=backend) as f:
                assert f.metadata() == expected, (metadata, backend)


def test_framework_is_named_as_the_reference_names_it(tmp_path: Path) -> None:
    path = small(tmp_path)
    kinds = {"pytorch": torch.Tensor, "torch": torch.Tensor, "numpy": np.ndarray}
    for framework, kind in kinds.items():
        with compat.safe_open(path, framework) as f:
            assert isinstance(f.get_tensor("a"), kind), framework
    for wrong in (None, 3):
        for opener in (safetensors.safe_open, compat.safe_open):
            with pytest.raises(TypeError):
                opener(path, wrong)  # type: ignore[call-overload]
        with pytest.raises(SafetensorsError, match="framework must be a name"):
            compat.safe_open(path, wrong)  # type: ignore[call-overload]
    with pytest.raises(SafetensorsError, match="framework must be 'pt' or 'np', got 'PT'"):
        compat.safe_open(path, "PT")


@pytest.mark.parametrize(
    ("framework", "library"),
    [
        ("tf", "tensorflow"),
        ("tensorflow", "tensorflow"),
        ("flax", "jax"),
        ("jax", "jax"),
        ("mlx", "mlx"),
        ("paddle", "paddle"),
    ],
)
def test_another_framework_of_the_reference_is_an_import_error(
    tmp_path: Path, framework: str, library: str
) -> None:
    """The reference's other frameworks fail with ModuleNotFoundError where their library is
    missing; ours was refused with a UsageError alone, which ``except ImportError`` missed. It
    is refused as the handle opens (those tensors are not handed out), an ImportError too."""
    path = small(tmp_path)
    if importlib.util.find_spec(library) is None:  # the reference's refusal, as said
        with pytest.raises(ImportError), safetensors.safe_open(path, framework) as f:
            f.get_tensor("a")
    with pytest.raises(ImportError, match=f"framework='{framework}' is not supported") as caught:
        compat.safe_open(path, framework)
    assert isinstance(caught.value, UnsupportedFrameworkError)
    assert isinstance(caught.value, SafetensorsError)


def test_a_contiguous_tensor_with_a_strided_dimension_of_one_is_written(tmp_path: Path) -> None:
    """torch calls a tensor of shape (1,) and stride (2,) contiguous; the reference writes it,
    and so do the drop-in's writers (they once raised torch's bare RuntimeError)."""
    tensors = {
        "a": torch.arange(4.0)[::2][:1],
        "b": torch.arange(6.0).reshape(3, 2)[:, :1][1:2],
    }
    assert all(t.is_contiguous() and t.stride()[0] != 1 for t in tensors.values())
    assert st_pt.save(tensors) == ref_pt.save(tensors)
    st_pt.save_file(tensors, tmp_path / "a.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == ref_pt.save(tensors)

    class Strided(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.as_strided(torch.tensor([3.0]), (1,), (2,)))

    st_pt.save_model(Strided(), tmp_path / "m.safetensors")
    assert st_pt.load_file(tmp_path / "m.safetensors") == {"b": torch.tensor([3.0])}


def test_a_torch_tensor_numpy_cannot_shape_is_a_clear_error(tmp_path: Path) -> None:
    for tensor in (torch.zeros((1,) * 70), torch.empty((0, 2**61))):
        with pytest.raises(SafetensorsError, match="cannot be written: stream_st writes through"):
            st_pt.save({"a": tensor})
        with pytest.raises(SafetensorsError, match="cannot be written"):
            st_pt.save_file({"a": tensor}, tmp_path / "a.safetensors")
        assert not (tmp_path / "a.safetensors").exists()


def test_load_model_of_a_shape_that_differs_raises_as_the_reference(tmp_path: Path) -> None:
    """torch's error, with its message and type (a RuntimeError), and a SafetensorsError."""
    path = tmp_path / "linear.safetensors"
    ref_pt.save_file({"weight": torch.zeros(4, 2), "bias": torch.zeros(3)}, path)
    raises_as_reference(
        lambda: st_pt.load_model(torch.nn.Linear(2, 3), path),
        lambda: ref_pt.load_model(torch.nn.Linear(2, 3), path),
    )


KEYS: list[Any] = [
    ...,
    (),
    [],
    slice(None),
    slice(2, 5),
    slice(0, 10, 3),
    1,
    -1,
    np.int64(2),
    np.int32(-2),
    torch.tensor(3),
    (slice(None), 1),
    (..., 2),
    (1, slice(0, 2)),
    (slice(2, None), -5),
    # refused by both
    10,
    -11,
    (slice(None), 5),
    (slice(2, None), -6),
    (1, 2, 3),
    1.5,
    (slice(None), []),
    # clipped by torch, refused by the reference's numpy rules
    slice(None, 20),
    slice(10, None),
    (slice(None), slice(None, 20)),
    slice(5, 2),
    [1, 3],
    # bools: torch's new dimension (of 1 or 0) and masks; the reference's numpy rules take a
    # bool as the int it is and refuse a mask
    True,
    False,
    (0, True),
    (True, 0),
    (slice(None), False),
    (..., True),
    np.bool_(True),
    torch.tensor(True),
    [True, False] * 5,
    (slice(None), [True, False, True, True, False]),
    np.array([False, True] * 5),
    torch.tensor([True] * 3 + [False] * 7),
    torch.tensor([[True] * 5] * 10),
    [True],
    ([True] * 10, [0, 2]),
    # refused by torch as ValueError and TypeError
    slice(1, 2, 0),
    "a",
]


@pytest.mark.filterwarnings("ignore:Using a non-tuple sequence")  # torch's, on "a"
@pytest.mark.parametrize("backend", ["mmap", "pread"])
@pytest.mark.parametrize("framework", ["pt", "np"])
def test_get_slice_gives_or_refuses_as_the_reference(
    tmp_path: Path, framework: str, backend: str
) -> None:
    path = small(tmp_path)
    opened = compat.safe_open(path, framework, backend=backend)
    with opened as ours, safetensors.safe_open(path, framework) as ref:
        for name in ("a", "s"):
            assert ours.get_slice(name).get_shape() == ref.get_slice(name).get_shape()
            assert ours.get_slice(name).get_dtype() == ref.get_slice(name).get_dtype()
        for key in KEYS:
            want = outcome(partial(ref.get_slice("a").__getitem__, key))
            if framework == "np" and isinstance(key, slice) and key == slice(5, 2):
                continue  # the reference fails inside (SystemError); ours selects nothing
            if want[0] == "ok":
                got = ours.get_slice("a")[key]
                assert type(got) is type(want[1]) and got.shape == want[1].shape, key
                assert np.array_equal(np.asarray(got), np.asarray(want[1])), key
                continue
            with pytest.raises(SafetensorsError) as caught:
                ours.get_slice("a")[key]
            assert str(caught.value) == want[1][0], key
            assert all(isinstance(caught.value, t) for t in want[1][1]), (key, want[1][1])
        assert ours.get_slice("s")[...].shape == ref.get_slice("s")[...].shape


TORCH_KEYS: list[Any] = [
    (slice(None), [0, 1], slice(None), 0),  # torch drops the int's dimension first
    (1, slice(None), [2, 0]),
    ([0, 2], slice(None), [1, 3]),
    (None, 1),
    (slice(1, None, 2), None, ..., True),
    (torch.tensor([2, 0]), [[1], [3]]),
    (np.array([1, 1]),),
    (slice(-2, None), torch.ones(4, 5, dtype=torch.bool)),
    (2, [True, False, True, False], ..., 1),
    (slice(None), torch.tensor(1), 0),
    (slice(None, None, -1),),  # refused by torch (ValueError)
    (0, slice(None, None, -1)),
    (0, 0, 0, 0, 0),  # too many (IndexError)
    2**70,  # past 64 bits: torch's ValueError, not an index out of bounds
    (-(2**70), 0),
    (slice(None, None, 0), 0, 0, 0, 0),  # too many, told before the step
    (slice(None, None, -1), 0, 0, 0, 0),
    (7, 0, 0, 0, 0),  # too many, told before the bound
]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_torch_keys_mean_what_they_mean_to_torch(tmp_path: Path, backend: str) -> None:
    """Keys beyond what the reference's own tests use (advanced indexes with ints between,
    ``None``, masks over several dimensions): the slice is what torch gives, or torch's
    refusal, whatever the rows read."""
    whole = torch.arange(360.0).reshape(3, 4, 5, 6)
    path = tmp_path / "four.safetensors"
    ref_pt.save_file({"t": whole}, path)
    with compat.safe_open(path, "pt", backend=backend) as f:
        for key in TORCH_KEYS:
            want = outcome(partial(whole.__getitem__, key))
            if want[0] == "ok":
                got = f.get_slice("t")[key]
                assert got.shape == want[1].shape and torch.equal(got, want[1]), key
                continue
            with pytest.raises(SafetensorsError) as caught:
                f.get_slice("t")[key]
            assert str(caught.value) == want[1][0], key
            assert all(isinstance(caught.value, t) for t in want[1][1]), (key, want[1][1])


TENSOR_BOUNDS = """
import sys, torch
import stream_st.compat as compat

def answer(key):
    try:
        f.get_slice("a")[key]
    except Exception as exc:
        print(type(exc).__name__, isinstance(exc, compat.SafetensorError), exc)

with compat.safe_open(sys.argv[1], "pt") as f:
    answer(slice(None, torch.tensor(-3), -1))
    answer(slice(torch.tensor(1), 3, 0))
    try:  # torch 2.13 itself then fails (SystemError) at a zero step with a tensor bound
        torch.zeros(4)[slice(None, torch.tensor(-3), -1)]
    except ValueError:
        pass
    answer((0, slice(torch.tensor(1), 3, 0)))
"""


def test_a_negative_step_with_a_tensor_bound_leaves_torch_as_it_was(tmp_path: Path) -> None:
    """torch answers a negative first step with a tensor bound, then fails inside
    (``SystemError``) at a zero step with one: get_slice does not set it off, and gives a
    :class:`SafetensorsError` where torch fails (in a process of its own: torch stays so)."""
    done = subprocess.run(
        [sys.executable, "-c", TENSOR_BOUNDS, str(small(tmp_path))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    answers = done.stdout.splitlines()
    assert answers[:2] == [
        "SliceValueError True step must be greater than zero",
        "SliceValueError True slice step cannot be zero",
    ]
    assert answers[2].split()[1] == "True", answers[2]


def test_get_slice_beyond_the_reference(tmp_path: Path) -> None:
    """Where the reference fails on a key Python takes (negative bounds and steps for numpy),
    the drop-in gives what numpy gives."""
    path = small(tmp_path)
    whole = np.arange(50.0).reshape(10, 5)
    with compat.safe_open(path, "np") as f:
        for key in (slice(-3, None), slice(None, -2), slice(None, None, -1), slice(8, 2, -2)):
            assert np.array_equal(f.get_slice("a")[key], whole[key]), key


def test_bounds_outside_a_dimension_are_refused_whichever_the_step(tmp_path: Path) -> None:
    """numpy: a bound past the last row or before the first is refused with a negative step as
    with a positive one (it was clipped); torch refuses every negative step, as the
    reference's."""
    path = small(tmp_path)
    whole = np.arange(50.0).reshape(10, 5)
    outside: list[Any] = [
        slice(10, None, -1),
        slice(None, -11, -1),
        slice(100, -100, -1),
        slice(-11, None, -1),
        slice(None, 11, -1),
        (slice(None), slice(5, None, -1)),
    ]
    inside: list[Any] = [
        slice(9, None, -1),
        slice(None, -10, -1),
        slice(-10, 0, -1),
        (1, slice(4, 0, -2)),
    ]
    with compat.safe_open(path, "np") as f:
        for key in outside:
            with pytest.raises(IndexError, match=r"out of bounds|Invalid index") as caught:
                f.get_slice("a")[key]
            assert isinstance(caught.value, SafetensorsError), key
        for key in inside:
            assert np.array_equal(f.get_slice("a")[key], whole[key]), key
    with compat.safe_open(path, "pt") as ours, safetensors.safe_open(path, "pt") as ref:
        for key in outside + inside:
            raises_as_reference(
                partial(ours.get_slice("a").__getitem__, key),
                partial(ref.get_slice("a").__getitem__, key),
            )


def test_a_numpy_slice_bound_before_the_first_row_is_an_overflow_error(tmp_path: Path) -> None:
    """The reference raises OverflowError for a negative numpy slice bound; one before the first
    row was a SliceError here, an IndexError that ``except OverflowError`` missed. It is both
    (and a SafetensorsError); torch's slices are clipped, as the reference's."""
    path = small(tmp_path)
    keys: list[Any] = [
        slice(-11, 2),
        slice(None, -100),
        slice(2, -11),
        (slice(None), slice(-6, None)),
        slice(-100, None, -1),
    ]
    with compat.safe_open(path, "np") as ours, safetensors.safe_open(path, "np") as ref:
        for key in keys:
            with pytest.raises(OverflowError):
                ref.get_slice("a")[key]
            with pytest.raises(OverflowError, match="Invalid index") as caught:
                ours.get_slice("a")[key]
            assert isinstance(caught.value, IndexError) and isinstance(
                caught.value, SafetensorsError
            ), key
    with compat.safe_open(path, "pt") as ours, safetensors.safe_open(path, "pt") as ref:
        for key in keys[:4]:
            assert torch.equal(ours.get_slice("a")[key], ref.get_slice("a")[key]), key


def test_a_numpy_slice_bound_past_64_bits_or_on_no_dimension_is_an_overflow_error(
    tmp_path: Path,
) -> None:
    """The reference takes every numpy slice bound as an unsigned 64-bit integer before it counts
    dimensions or checks a range: one of 2**64 or more, or a negative one on a 0-d tensor (or an
    index past the last dimension), is an OverflowError there. They were a SliceError here (an
    IndexError only); each is a SliceOverflowError now, an OverflowError and an IndexError. Each
    index is checked before the next, as there. Torch's answers are the reference's, as they
    were."""
    path = small(tmp_path)
    keys: list[tuple[str, Any]] = [
        ("a", slice(None, 2**64)),
        ("a", slice(2**64, None)),
        ("a", slice(2**70, None, -1)),
        ("a", slice(None, 2**64, 0)),
        ("a", (slice(None, 10), slice(None, 2**64))),
        ("a", (slice(None, 10), slice(-9, None))),
        ("a", (slice(None), slice(None), slice(-1, None))),
        ("a", (0, 0, slice(None, 2**64))),
        ("s", slice(-2, None)),
        ("s", slice(None, -2)),
        ("s", slice(None, 2**64)),
        ("s", (..., slice(-2, None))),
        ("s", (0, slice(-1, None))),
    ]
    with compat.safe_open(path, "np") as ours, safetensors.safe_open(path, "np") as ref:
        for name, key in keys:
            with pytest.raises(OverflowError):
                ref.get_slice(name)[key]
            with pytest.raises(OverflowError, match="Invalid index") as caught:
                ours.get_slice(name)[key]
            assert isinstance(caught.value, IndexError) and isinstance(
                caught.value, SafetensorsError
            ), (name, key)
        # just inside 64 bits, or a 0-d tensor's bounds that are not negative: out of bounds;
        # a step of 0 or a position before the first row, met before such a bound, checked first
        refused: list[tuple[str, Any]] = [
            ("a", slice(None, 2**64 - 1)),
            ("s", slice(0, 2**64 - 1)),
            ("a", (-11, slice(-9, None))),
            ("a", (slice(None, None, 0), slice(-9, None))),
            ("a", (slice(None, 20), -6)),
            ("a", (0, 0, -1)),
            ("s", -1),
            ("s", (-1, slice(None, 2**64))),
        ]
        for name, key in refused:
            raises_as_reference(
                partial(ours.get_slice(name).__getitem__, key),
                partial(ref.get_slice(name).__getitem__, key),
            )
    with compat.safe_open(path, "pt") as ours, safetensors.safe_open(path, "pt") as ref:
        for name, key in keys:
            if outcome(partial(ref.get_slice(name).__getitem__, key))[0] == "ok":
                assert torch.equal(ours.get_slice(name)[key], ref.get_slice(name)[key]), key
            else:
                raises_as_reference(
                    partial(ours.get_slice(name).__getitem__, key),
                    partial(ref.get_slice(name).__getitem__, key),
                )


def test_open_file_objects_as_the_reference(tmp_path: Path) -> None:
    fsspec = pytest.importorskip("fsspec")
    path = small(tmp_path)
    expected = ref_np.load_file(path)
    with contextlib.ExitStack() as stack:
        opened: list[Any] = [
            stack.enter_context(open(path)),  # text mode too, as the reference takes it
            stack.enter_context(open(path, "rb")),
            stack.enter_context(fsspec.filesystem("file").open(str(path))),
            io.BytesIO(path.read_bytes()),
        ]
        for handle in opened:
            with compat._safe_open_handle(handle, framework="np") as g:
                names = g.keys()
                assert names == ["a", "s"] and g.metadata() == {"k": "v"}
                for name in names:
                    assert np.array_equal(g.get_tensor(name), expected[name])


# ---------------------------------------------------------------- sharing helpers (torch)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(10, 10)
        self.b = self.a
        self.c = torch.nn.Linear(10, 10)


def states() -> list[dict[str, torch.Tensor]]:
    a = torch.zeros(4)
    big = torch.zeros((3, 3))
    m = torch.randn(10)
    n = torch.empty([], dtype=m.dtype)
    n.set_(source=m.untyped_storage()[: 4 * m.element_size()])
    meta = torch.zeros((2, 2), device="meta")
    return [
        {"A": big, "B": big[:1, :]},
        {"B": a[:2], "C": a[2:]},
        {"B": a[:2], "C": a[1:]},
        {"B": a[:2], "C": a[2:], "D": a[:1]},
        {"m": m, "n": n},
        {"C": meta, "D": meta[:1]},
        dict(Model().state_dict()),
        {"A": big, "B": big[:1, :], "C": big},
    ]


def test_sharing_helpers_agree_with_the_reference() -> None:
    for state in states():
        assert st_pt._find_shared_tensors(state) == ref_pt._find_shared_tensors(state)
        for tensor in state.values():
            assert st_pt.storage_ptr(tensor) == ref_pt.storage_ptr(tensor)
            assert st_pt.storage_size(tensor) == ref_pt.storage_size(tensor)
            assert st_pt._is_complete(tensor) == ref_pt._is_complete(tensor)
            if tensor.device.type != "meta":
                assert st_pt._end_ptr(tensor) == ref_pt._end_ptr(tensor)
        want = outcome(partial(ref_pt._remove_duplicate_names, state))
        got = outcome(partial(st_pt._remove_duplicate_names, state))
        assert got[0] == want[0]
        if want[0] == "ok":
            assert got[1] == want[1]
    strided = torch.zeros(16)[::4]
    assert st_pt._end_ptr(strided) - strided.data_ptr() == 16 * 3 + 4
    state = dict(Model().state_dict())
    for preferred in (["b.weight"], ["a.bias", "b.weight"]):
        assert st_pt._remove_duplicate_names(state, preferred_names=preferred) == dict(
            ref_pt._remove_duplicate_names(state, preferred_names=preferred)
        )
    assert st_pt._remove_duplicate_names(state, discard_names=["a.weight"]) == dict(
        ref_pt._remove_duplicate_names(state, discard_names=["a.weight"])
    )


def test_a_view_inside_the_storage_after_a_shorter_one_shares_it(tmp_path: Path) -> None:
    """``C`` starts past ``B``'s end but inside ``A``: one group, ``A`` kept for both (the
    reference's groups are ``{A, B}`` and ``{C}``, and it then refuses to save), as
    docs/dropin.md says."""

    class Views(torch.nn.Module):
        A: torch.Tensor
        C: torch.Tensor

        def __init__(self) -> None:
            super().__init__()
            base = torch.arange(10.0)
            self.register_buffer("A", base)
            self.register_buffer("B", base[2:4])
            self.register_buffer("C", base[5:8])

    state = dict(Views().state_dict())
    assert st_pt._find_shared_tensors(state) == [{"A", "B", "C"}]
    assert st_pt._remove_duplicate_names(state) == {"A": ["B", "C"]}
    st_pt.save_model(Views(), tmp_path / "views.safetensors")
    with safetensors.safe_open(tmp_path / "views.safetensors", "pt") as f:
        assert f.keys() == ["A"] and f.metadata() == {"B": "A", "C": "A"}
    model = Views()
    model.A.zero_()
    assert st_pt.load_model(model, tmp_path / "views.safetensors") == (set(), [])
    assert torch.equal(model.C, torch.arange(5.0, 8.0))


# ---------------------------------------------------------------- low-level functions


def test_serialize_and_deserialize_as_the_reference(tmp_path: Path) -> None:
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "u8": np.arange(5, dtype=np.uint8),
        "empty": np.zeros((0, 3), dtype=np.float16),
    }

    def specs(kind: Any) -> dict[str, Any]:
        return {
            name: kind(
                dtype=array.dtype.name,
                shape=array.shape,
                data_ptr=array.ctypes.data,
                data_len=array.nbytes,
            )
            for name, array in arrays.items()
        }

    metadata = {"format": "np"}
    data = compat.serialize(specs(compat.TensorSpec), metadata)
    assert data == safetensors.serialize(specs(safetensors.TensorSpec), metadata)
    compat.serialize_file(specs(compat.TensorSpec), tmp_path / "ours.safetensors", metadata)
    safetensors.serialize_file(
        specs(safetensors.TensorSpec), tmp_path / "ref.safetensors", metadata
    )
    assert (tmp_path / "ours.safetensors").read_bytes() == data
    assert (tmp_path / "ref.safetensors").read_bytes() == data
    assert sorted(compat.deserialize(data)) == sorted(safetensors.deserialize(data))
    strided = np.repeat(np.frombuffer(data, np.uint8), 2)[::2].data  # not contiguous
    assert compat.deserialize(strided) == compat.deserialize(data)  # was a bare TypeError
    spec = compat.TensorSpec(dtype="float4_e2m1fn_x2", shape=[3, 2], data_ptr=0, data_len=0)
    ref_spec = safetensors.TensorSpec(
        dtype="float4_e2m1fn_x2", shape=[3, 2], data_ptr=0, data_len=0
    )
    assert (spec.dtype, spec.shape, repr(spec)) == (ref_spec.dtype, ref_spec.shape, repr(ref_spec))


@pytest.mark.parametrize(
    "shape",
    [
        [1.9],
        ["1"],
        [np.float64(2.0)],
        [2.0],
        5,
        None,
        "12",
        [np.int64(2)],
        (2, 3),
        [True],
        [],
        [-1],
        [3, -2],
        {4, 2},
        {2: 0, 4: 0},
        iter((2, 4)),
        range(3),
        np.array([2, 3]),
        b"\x02\x03",
        bytearray(b"\x04"),
        b"",
    ],
)
def test_a_tensor_spec_s_shape_is_taken_as_the_reference_takes_it(shape: Any) -> None:
    """Integers (Python's, numpy's: anything with ``__index__``) and nothing else: a float is
    refused, not truncated; in a sequence, not a set (taken in its order: ``{4, 2}`` gave
    ``[2, 4]``), a dict or an iterator, which were taken. ``bytes`` and ``bytearray`` are
    sequences of their byte values, as in the reference (they were refused)."""

    def spec(kind: Any) -> Any:
        return kind(dtype="float32", shape=shape, data_ptr=0, data_len=0)

    reference = partial(spec, safetensors.TensorSpec)
    want = outcome(reference)
    if want[0] == "ok":
        assert spec(compat.TensorSpec).shape == want[1].shape
    else:
        raises_the_reference_s_type(partial(spec, compat.TensorSpec), reference)


def test_serialize_writes_a_shape_given_as_bytes_as_the_reference() -> None:
    data = np.arange(6, dtype=np.float32)
    for shape in (b"\x02\x03", bytearray(b"\x06")):

        def specs(kind: Any, shape: bytes | bytearray = shape) -> dict[str, Any]:
            return {"x": kind(dtype="float32", shape=shape, data_ptr=data.ctypes.data, data_len=24)}

        written = compat.serialize(specs(compat.TensorSpec))
        assert written == safetensors.serialize(specs(safetensors.TensorSpec))
        assert compat.deserialize(written)[0][1]["shape"] == list(shape)


@pytest.mark.parametrize(
    "arguments",
    [
        {"dtype": "F32"},
        {"dtype": "BOOL"},
        {"dtype": "BF16"},
        {"dtype": "Float32"},
        {"dtype": "nonsense"},
        {"dtype": "float32"},
        {"dtype": "bool"},
        {"dtype": "float8_e8m0fnu"},
        {"dtype": "complex64"},
        {"dtype": 1},
        {"dtype": []},
        {"dtype": None},
        {"dtype": b"float32"},
        {"data_ptr": "1"},
        {"data_ptr": 1.0},
        {"data_len": 1.5},
        {"data_ptr": np.int64(0)},
        {"data_ptr": True},
        {"data_ptr": -1},
        {"data_len": -1},
        {"data_ptr": 1 << 64},
        {"shape": [1 << 64]},
        {"shape": [(1 << 64) - 1]},
        {"dtype": "float4_e2m1fn_x2", "shape": [1 << 63]},
        {"dtype": "float4_e2m1fn_x2", "shape": [2, (1 << 63) - 1]},
        {"dtype": "complex128", "data_len": None},
        {"dtype": "complex128", "shape": [-1]},
        {"dtype": "F32", "shape": [1.0]},
        {"dtype": "nonsense", "data_ptr": 1 << 64},
    ],
)
def test_a_tensor_spec_takes_the_dtypes_and_integers_the_reference_takes(
    arguments: dict[str, Any],
) -> None:
    """The reference's dtype names only: a safetensors code (``"F32"``) was taken, where the
    reference raises ``SafetensorError('Unknown dtype "F32". Supported dtypes: ...')``; a dtype
    not a string, an address or length not an integer (a float was truncated) or past 64 bits
    are refused with the reference's built-in type; an F4 last dimension past 64 bits once
    doubled with its ``SafetensorError`` (an ``OverflowError`` too), where it was taken. An
    unknown dtype beside an argument of the wrong type is the argument's error, the reference
    checking types first, where it was the dtype's ``SafetensorError``."""

    def spec(kind: Any) -> Any:
        return kind(**{"dtype": "float32", "shape": [0], "data_ptr": 0, "data_len": 0} | arguments)

    reference = partial(spec, safetensors.TensorSpec)
    want = outcome(reference)
    if want[0] == "ok":
        assert repr(spec(compat.TensorSpec)) == repr(want[1])
    elif want[1][1]:  # a built-in type (TypeError, OverflowError)
        raises_the_reference_s_type(partial(spec, compat.TensorSpec), reference)
    else:  # the reference's SafetensorError, its message as the reference words it
        raises_as_reference(partial(spec, compat.TensorSpec), reference)


def test_low_level_misuse_is_refused_as_by_the_reference() -> None:
    with pytest.raises(compat.SafetensorError):
        compat.TensorSpec(dtype="nonsense", shape=[1], data_ptr=0, data_len=0)
    raw = {"test": {"dtype": "float32", "shape": [1], "data_ptr": 0, "data_len": 0}}
    with pytest.raises(TypeError) as caught:
        compat.serialize(raw)  # type: ignore[arg-type]
    assert isinstance(caught.value, SafetensorsError)
    short = np.zeros(2, dtype=np.float32)
    spec = compat.TensorSpec(dtype="float32", shape=[3], data_ptr=short.ctypes.data, data_len=8)
    with pytest.raises(compat.SafetensorError, match="Error while serializing"):
        compat.serialize({"a": spec})
    with pytest.raises(compat.SafetensorError):
        compat.deserialize(b"garbage")
    for empty in (b"", np.zeros((0, 4), np.float32).data):  # the second: a TypeError
        with pytest.raises(compat.SafetensorError, match="got only 0 bytes"):
            compat.deserialize(empty)
    with pytest.raises(OverflowError):  # the F4 dimension doubled: past 64 bits
        compat.TensorSpec(dtype="float4_e2m1fn_x2", shape=[1 << 63], data_ptr=0, data_len=0)


def test_serialize_refuses_a_name_utf8_cannot_encode_as_the_reference(tmp_path: Path) -> None:
    """A lone surrogate in a name: the reference's ``UnicodeEncodeError`` (and a
    ``HeaderError``), as the dict API raises it, where ``serialize`` and ``serialize_file``
    raised a ``HeaderError`` alone; nothing written."""
    data = np.arange(2, dtype=np.float32)
    path = tmp_path / "t.safetensors"

    def specs(kind: Any) -> dict[str, Any]:
        spec = kind(dtype="float32", shape=[2], data_ptr=data.ctypes.data, data_len=8)
        return {"a": spec, "\udcff": spec}

    for name in ("serialize", "serialize_file"):
        args = (path,) if name == "serialize_file" else ()
        ours = partial(getattr(compat, name), specs(compat.TensorSpec), *args)
        raises_the_reference_s_type(
            ours, partial(getattr(safetensors, name), specs(safetensors.TensorSpec), *args)
        )
        with pytest.raises(UnicodeEncodeError, match="must be valid Unicode text") as caught:
            ours()
        assert str(caught.value).startswith("tensor name '\\udcff'")
        assert isinstance(caught.value, HeaderError)
        assert caught.value.reason == "surrogates not allowed"
    assert not path.exists()


def test_a_tensor_spec_refused_is_named_with_its_module(tmp_path: Path) -> None:
    """The reference's TensorSpec given to ``serialize`` is refused (a ``TypeError``), each
    class named with its module, where the message read ``expected str -> TensorSpec, got str
    -> TensorSpec``."""
    data = np.arange(2, dtype=np.float32)
    theirs = safetensors.TensorSpec(
        dtype="float32", shape=[2], data_ptr=data.ctypes.data, data_len=8
    )
    ours = compat.TensorSpec(dtype="float32", shape=[2], data_ptr=data.ctypes.data, data_len=8)
    expected = "argument 'tensor_dict': expected str -> stream_st.compat.TensorSpec, got "
    path = tmp_path / "t.safetensors"
    cases: list[tuple[Any, str]] = [
        ({"a": theirs}, "str -> safetensors.TensorSpec"),
        ({1: ours}, "int -> stream_st.compat.TensorSpec"),
        ({"a": data}, "str -> numpy.ndarray"),
    ]
    for tensors, got in cases:
        for call in (
            partial(compat.serialize, tensors),
            partial(compat.serialize_file, tensors, path),
        ):
            with pytest.raises(TypeError) as caught:
                call()
            assert str(caught.value) == expected + got
            assert isinstance(caught.value, SafetensorsError)
    assert not path.exists()


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_handle_and_its_slices_are_not_pickled_as_by_the_reference(
    tmp_path: Path, backend: str
) -> None:
    """A handle holds this process's descriptor or mapping: a pickled ``pread`` handle read
    another file through the reused descriptor number, and meant nothing in another process (a
    DataLoader's spawned worker). Refused with the reference's ``TypeError`` and message."""
    path = small(tmp_path)
    with safetensors.safe_open(path, "np") as r, compat.safe_open(path, "np", backend=backend) as f:
        for ours, theirs in ((f, r), (f.get_slice("a"), r.get_slice("a"))):
            with pytest.raises(TypeError) as expected:
                pickle.dumps(theirs)
            with pytest.raises(TypeError, match=expected.value.args[0]) as info:
                pickle.dumps(ours)
            assert isinstance(info.value, SafetensorsError)


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_handle_and_its_slices_take_no_new_attributes_as_the_reference_s(
    tmp_path: Path, backend: str
) -> None:
    """``handle.foo = 1`` (a caller's typo, say) was kept on stream_st's handle where the
    reference's raises AttributeError: a handle and its slices take no attribute of their own,
    nor one over a method, as the reference's take none."""
    path = small(tmp_path)
    for framework in ("pt", "np"):
        with (
            safetensors.safe_open(path, framework) as r,
            compat.safe_open(path, framework, backend=backend) as f,
        ):
            pairs = ((f, r, "keys"), (f.get_slice("a"), r.get_slice("a"), "get_shape"))
            for ours, theirs, method in pairs:
                for made in (ours, theirs):
                    with pytest.raises(AttributeError):
                        made.foo = 1  # type: ignore[union-attr]
                    with pytest.raises(AttributeError):
                        setattr(made, method, list)
                    with pytest.raises(TypeError):
                        vars(made)
            assert f.keys() == r.keys()
