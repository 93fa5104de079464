"""The reference's API over the streaming core (:mod:`._reference`), imported when first used.

:mod:`stream_st.torch` and :mod:`stream_st.numpy` call it for everything but ``load_file`` of a
local file they map (:func:`._local.load_mapped`), ``save_file`` to a local file and ``save``
(:mod:`._save`), so importing them imports no reader, transport or event loop: hundreds of
milliseconds that a script loading or saving one small file would otherwise pay before its first
tensor. Not public API.
"""

from __future__ import annotations

from typing import Any

__all__ = ["reference"]


class _Deferred:
    """Each attribute of :mod:`._reference`, which is imported on the first one asked for."""

    def __getattr__(self, name: str) -> Any:
        from . import _reference

        return getattr(_reference, name)


reference = _Deferred()
"""Stands for the module :mod:`._reference` (``from .compat import _reference`` under
``TYPE_CHECKING``, so the names keep their types)."""
