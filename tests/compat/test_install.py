"""``stream_st.compat.install()``: every later ``import safetensors...`` gives stream_st, in a
fresh process each (an install lasts for the process)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_install_makes_every_later_import_stream_st() -> None:
    pytest.importorskip("torch")
    out = run(
        """
        import sys
        import stream_st.compat as compat
        compat.install()
        import safetensors
        import safetensors.torch
        import safetensors.numpy as sn
        from safetensors import safe_open, SafetensorError, serialize_file
        from safetensors.torch import storage_ptr, _find_shared_tensors
        import stream_st, stream_st.torch, stream_st.numpy
        assert safetensors is compat and compat.installed()
        assert safetensors.torch is stream_st.torch and sn is stream_st.numpy
        assert safe_open is compat.safe_open and SafetensorError is stream_st.SafetensorsError
        assert "safetensors._safetensors_rust" not in sys.modules
        compat.uninstall()
        assert not compat.installed()
        import safetensors
        assert safetensors.__name__ == "safetensors", safetensors
        print("ok")
        """
    )
    assert out == "ok"


def test_install_without_torch_gives_the_numpy_drop_in() -> None:
    """Without torch (``import torch`` refused here), ``install()`` raised the
    :class:`~stream_st.UsageError` importing ``stream_st.torch`` gives; ``safetensors.numpy``
    is the drop-in, and ``safetensors.torch`` fails to import, as the reference's does there."""
    out = run(
        """
        import sys
        sys.modules["torch"] = None  # import torch: ModuleNotFoundError, as without it
        import stream_st.compat as compat
        compat.install()
        import safetensors.numpy as sn
        import stream_st.numpy
        assert compat.installed() and sn is stream_st.numpy
        assert "safetensors.torch" not in sys.modules
        try:
            import safetensors.torch
        except ImportError:
            print("ok")
        """
    )
    assert out == "ok"


def test_install_after_the_reference_was_imported_warns() -> None:
    pytest.importorskip("torch")
    out = run(
        """
        import warnings
        import safetensors.torch
        import stream_st.compat as compat
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compat.install()
        assert any("before stream_st.compat.install()" in str(w.message) for w in caught)
        import safetensors
        assert safetensors is compat
        compat.uninstall()
        import safetensors.torch as again
        assert again.__name__ == again.save_file.__module__ == "safetensors.torch"
        print("ok")
        """
    )
    assert out == "ok"


def test_the_numpy_drop_in_has_the_names_of_the_references_module() -> None:
    """``TensorSpec``, ``serialize``, ``serialize_file`` and ``deserialize``, which programs import
    from ``safetensors.numpy``: the package's own, imported when first asked for."""
    out = run(
        """
        import sys
        import numpy as np
        import stream_st.compat as compat
        compat.install()
        import safetensors.numpy as sn
        assert "stream_st.compat._serialize" not in sys.modules, "imported with the module"
        from safetensors.numpy import TensorSpec, deserialize, serialize, serialize_file
        names = ("TensorSpec", "deserialize", "serialize", "serialize_file")
        assert (TensorSpec, deserialize, serialize, serialize_file) == tuple(
            getattr(compat, name) for name in names
        )
        assert [name for name, _ in deserialize(sn.save({"a": np.ones(3, np.float32)}))] == ["a"]
        try:
            sn.deserialise
        except AttributeError as exc:
            print(exc)
        """
    )
    assert out == "module 'stream_st.numpy' has no attribute 'deserialise'"


def test_safe_open_is_one_class_as_the_references(tmp_path: Path) -> None:
    """``safe_open`` is a class, one object in ``safetensors``, ``safetensors.torch`` and
    ``safetensors.numpy`` as the reference's is, its handles instances of it: code written for
    the reference that uses it as a type runs (a union annotation is evaluated when the ``def``
    runs). Importing it imports no streaming core; ``framework`` is required, as there."""
    pytest.importorskip("torch")
    path = tmp_path / "a.safetensors"
    out = run(
        f"""
        import sys
        import numpy as np
        import stream_st.compat as compat
        compat.install()
        import torch
        import safetensors.numpy, safetensors.torch
        from safetensors import safe_open
        assert "stream_st.compat._reference" not in sys.modules, "imported with safe_open"
        assert safetensors.torch.safe_open is safe_open is safetensors.numpy.safe_open
        assert isinstance(safe_open, type)

        def open_blob(path: str) -> safe_open | torch.nn.Module:
            return safe_open(path, framework="pt")

        safetensors.numpy.save_file({{"a": np.ones(3, np.float32)}}, {str(path)!r})
        with open_blob({str(path)!r}) as handle:
            assert isinstance(handle, safe_open), type(handle)
            assert handle.get_tensor("a").tolist() == [1.0, 1.0, 1.0]
        assert not isinstance(object(), safe_open)
        with safetensors.numpy.safe_open({str(path)!r}, "np") as handle:
            assert isinstance(handle, safetensors.torch.safe_open)
        try:
            safe_open({str(path)!r})
        except TypeError as exc:
            print(type(exc).__name__)
        """
    )
    assert out == "TypeError"


def test_safe_open_shows_its_arguments_and_takes_them_by_the_references_names(
    tmp_path: Path,
) -> None:
    """``inspect.signature(safe_open)`` (what ``help`` and editors show) names the handle's
    arguments, where the class's ``__new__`` showed ``(*args, **kwargs)``; they are taken by
    name as the reference takes them (``filename=``, which the drop-ins' functions took too
    before ``safe_open`` became a class)."""
    pytest.importorskip("torch")
    import inspect

    import safetensors

    import stream_st.numpy
    import stream_st.torch
    from stream_st.compat import safe_open

    names = list(inspect.signature(safe_open).parameters)
    assert names == ["filename", "framework", "device", "backend", "verify", "cache", "options"]
    assert inspect.signature(safe_open).parameters["device"].default == "cpu"
    path = str(tmp_path / "a.safetensors")
    stream_st.numpy.save_file({"a": np.ones(2, np.float32)}, path)
    for opened in (safetensors.safe_open, safe_open, stream_st.torch.safe_open):
        with opened(filename=path, framework="np", device="cpu") as handle:
            assert handle.keys() == ["a"]


def test_safe_open_is_no_base_type_as_the_reference_s_is_not() -> None:
    """A class derived from ``safe_open`` (or from the handle's class) is refused where it is
    defined, as the reference refuses it: a TypeError, and a SafetensorsError. It was made, and
    calling it gave a blank object that opened nothing and checked no argument."""
    import safetensors

    from stream_st.compat import _reference, safe_open
    from stream_st.errors import ArgumentTypeError

    with pytest.raises(TypeError, match="not an acceptable base type"):
        type("Mine", (safetensors.safe_open,), {})
    for base in (safe_open, _reference.SafeOpen):
        with pytest.raises(ArgumentTypeError, match="not an acceptable base type"):
            type("Mine", (base,), {})


@pytest.mark.parametrize("module", ["torch", "numpy"])
def test_star_import_gives_the_names_the_references_gives(module: str) -> None:
    """``from safetensors.torch import *`` (and ``.numpy``) gives the reference's public names
    (it has no ``__all__``): each of its own, ``TensorSpec`` and ``deserialize`` among them,
    comes with the drop-in's too."""
    reference = pytest.importorskip(f"safetensors.{module}")
    importlib.import_module(f"stream_st.{module}")
    theirs: dict[str, Any] = {}
    exec(f"from {reference.__name__} import *", theirs)
    ours: dict[str, Any] = {}
    exec(f"from stream_st.{module} import *", ours)
    own = {
        name
        for name, value in theirs.items()
        if getattr(value, "__module__", "").startswith(("safetensors", "builtins"))
    }
    assert own - set(ours) == set()


def test_the_drop_ins_import_no_url_or_encoding_module_a_local_file_does_not_need() -> None:
    """Importing a drop-in and saving and loading a local file import neither ``urllib.parse``
    (it imports ``ipaddress``, ~5 ms) nor ``base64``: only hiding a secret in a URL needs them."""
    out = run(
        """
        import sys, tempfile, os
        import numpy as np
        import stream_st.numpy as sn
        path = os.path.join(tempfile.mkdtemp(), "a.safetensors")
        sn.save_file({"a": np.ones(3, np.float32)}, path)
        assert list(sn.load_file(path)) == ["a"]
        print(sorted({"urllib.parse", "ipaddress", "base64"} & set(sys.modules)))
        """
    )
    assert out == "[]"
