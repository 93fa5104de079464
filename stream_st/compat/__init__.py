"""The whole ``safetensors`` package, over stream_st: a stand-in for code written for the
reference (``huggingface/safetensors``).

It has what the reference's top level has: :class:`safe_open`, ``_safe_open_handle`` (a
``safe_open`` over an open file object), :data:`SafetensorError`, :class:`TensorSpec`,
:func:`serialize`, :func:`serialize_file`, :func:`deserialize` and ``__version__``; and its
``torch`` and ``numpy`` submodules are :mod:`stream_st.torch` and :mod:`stream_st.numpy`.
:func:`install` makes every later ``import safetensors``, ``import safetensors.torch`` and
``from safetensors import safe_open`` give these instead::

    import stream_st.compat
    stream_st.compat.install()  # before transformers (or anything else) imports safetensors

    import transformers  # now reads and writes through stream_st

Errors: ``SafetensorError`` is :class:`stream_st.SafetensorsError`, the root of every error
stream_st raises. Where the reference raises a built-in type (``ValueError``, ``TypeError``,
``IndexError``, ``FileNotFoundError``, ``RuntimeError``), the error raised here derives from that
type too. The reference API over the streaming core lives in :mod:`._reference`, run on a private
event loop (:mod:`._sync`) for remote sources; local files are read synchronously
(:mod:`._local`).
"""

from __future__ import annotations

import os
import sys
import warnings
from types import ModuleType
from typing import IO, TYPE_CHECKING, Any

from ..errors import ArgumentTypeError, StreamStWarning, UsageError
from ._errors import SafetensorError, WrongTypeError

if TYPE_CHECKING:
    from .. import numpy as numpy
    from .. import torch as torch
    from ._reference import serialize, serialize_file
    from ._serialize import TensorSpec, deserialize

__all__ = [
    "SafetensorError",
    "TensorSpec",
    "__version__",
    "_safe_open_handle",
    "deserialize",
    "install",
    "installed",
    "safe_open",
    "serialize",
    "serialize_file",
    "uninstall",
]

__version__ = "0.8.0"
"""The reference's version whose API this stands in for (code checks it before using a
feature); stream_st's own is :data:`stream_st.__version__`."""

_NAMES = ("safetensors", "safetensors.torch", "safetensors.numpy")
_saved: dict[str, ModuleType | None] = {}


if TYPE_CHECKING:  # for checkers the handle's class itself, its methods and arguments typed
    from ._reference import SafeOpen as safe_open
else:

    class safe_open:
        """Open ``filename`` (a file, URL or sharded index) to read tensors by name, as the
        reference's ``safe_open``, a class as there: ``safe_open(filename, framework,
        device="cpu", *, backend="mmap", verify=True, cache=None, **transport_options)``, with
        ``framework`` ``"pt"`` or ``"np"``. The handle it gives is an instance of it (of its
        subclass :class:`._reference.SafeOpen`, which documents it), so code may annotate with it
        and test ``isinstance(handle, safe_open)``. It is one object, ``stream_st.torch``'s and
        ``stream_st.numpy``'s too, as the reference's is; defined here, apart from the handle, so
        that importing it imports no streaming core."""

        __slots__ = ()

        class _Signature:
            """What ``inspect.signature(safe_open)`` (``help``, an editor) shows: the handle's
            ``__init__``'s arguments, read when asked (where ``__new__``'s ``*args, **kwargs``
            showed nothing)."""

            def __get__(self, instance: object, owner: type) -> Any:
                import importlib
                import inspect

                handle = importlib.import_module("._reference", __name__).SafeOpen
                signature = inspect.signature(handle.__init__)
                return signature.replace(parameters=list(signature.parameters.values())[1:])

        __signature__ = _Signature()

        def __init_subclass__(cls, **kwargs: Any) -> None:
            """Refused, as the reference's class refuses to be a base (it would make a blank
            object that opens nothing): only the handle's own class derives from it."""
            if (cls.__module__, cls.__qualname__) != (f"{__name__}._reference", "SafeOpen"):
                raise ArgumentTypeError(
                    f"type '{__name__}.safe_open' is not an acceptable base type, as the "
                    "reference's is not: wrap the handle safe_open(...) gives instead"
                )
            super().__init_subclass__(**kwargs)

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            """A handle, not yet set up: its ``__init__`` takes the arguments."""
            if cls is not safe_open:  # the handle's class (the only subclass), made as itself
                return object.__new__(cls)
            import importlib  # as __getattr__ does: _reference imports this module

            return object.__new__(importlib.import_module("._reference", __name__).SafeOpen)


def _safe_open_handle(
    f: IO[Any], framework: str, device: str | int = "cpu", *, backend: str = "mmap"
) -> safe_open:
    """``safe_open`` over an open file object (a built-in file, an ``fsspec`` local file):
    the file it names, opened again by name as the reference does; a file object with no
    name on disk is read whole."""
    name = getattr(f, "name", None)
    if isinstance(name, str | os.PathLike) and os.path.isfile(name):
        return safe_open(name, framework, device, backend=backend)
    read = getattr(f, "read", None)
    if read is None:
        raise WrongTypeError(f"expected a file object, got {type(f).__name__}")
    if hasattr(f, "seek"):
        f.seek(0)
    data = read()
    if not isinstance(data, bytes | bytearray):
        raise WrongTypeError("the file object must be opened in binary mode ('rb')")
    return safe_open(bytes(data), framework, device, backend=backend)


_LAZY = {
    "serialize": "._reference",
    "serialize_file": "._reference",
    "TensorSpec": "._serialize",
    "deserialize": "._serialize",
}
"""Names imported when first used: the modules that define them import the streaming core,
which ``stream_st.torch`` and ``stream_st.numpy`` (light, under this package) do not need."""


if not TYPE_CHECKING:  # checkers see the names above, not Any for every name (a misspelt one)

    def __getattr__(name: str) -> Any:
        """``torch`` and ``numpy``, the submodules, and the names of :data:`_LAZY`, imported
        when first asked for."""
        import importlib

        if name in ("torch", "numpy"):
            value: Any = importlib.import_module(f"stream_st.{name}")
        elif name in _LAZY:
            value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def install() -> None:
    """Make ``import safetensors`` (and ``safetensors.torch``, ``safetensors.numpy``) give this
    package and :mod:`stream_st.torch` / :mod:`stream_st.numpy` from now on, in the whole
    process. Call it before anything imports safetensors: a module that already holds the
    reference's functions keeps them (a warning says so). :func:`uninstall` undoes it."""
    import importlib

    already = [name for name in _NAMES if _real(name)]
    if already:
        warnings.warn(
            f"{', '.join(already)} was imported before stream_st.compat.install(): modules that "
            "imported names from it keep the reference's",
            StreamStWarning,
            stacklevel=2,
        )
    for name in _NAMES:
        if name not in _saved:
            _saved[name] = sys.modules.get(name) if _real(name) else None
    sys.modules["safetensors"] = sys.modules[__name__]
    sys.modules["safetensors.numpy"] = importlib.import_module("stream_st.numpy")
    try:
        sys.modules["safetensors.torch"] = importlib.import_module("stream_st.torch")
    except (ImportError, UsageError):  # no torch here (stream_st.torch says how to install it):
        sys.modules.pop("safetensors.torch", None)  # safetensors.torch fails, as the reference's


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return sys.modules.get("safetensors") is sys.modules[__name__]


def uninstall() -> None:
    """Undo :func:`install`: ``import safetensors`` gives the reference again (if installed)."""
    for name in _NAMES:
        if name in _saved:
            previous = _saved.pop(name)
            if previous is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = previous


def _real(name: str) -> bool:
    """Whether ``name`` is imported as the reference's own module."""
    module = sys.modules.get(name)
    return module is not None and not (module.__name__ or "").startswith("stream_st")
