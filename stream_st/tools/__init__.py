"""The library side of the ``stream-st`` commands: inspect, hash, diff, validate, cp.

Each takes any source :func:`~stream_st.open_stream` takes (a path, ``http(s)://``, ``s3://``,
``tcp://``, a sharded ``*.index.json``) and works in constant memory: one tensor at a time.
``progress``, where accepted, is called with ``(bytes_done, tensors_done)`` as data moves; if it
also has a ``totals`` method, that is called once with ``(bytes, tensors)`` to expect, as soon as
the headers are read (so a progress bar needs no look-up of its own, and works on a pipe or a
``tcp://`` peer, which give their bytes once). :func:`model_sources` turns a local model
directory into the sources it holds.
Each takes the options of :func:`~stream_st.open_stream` (``timeout``, ``deadline``,
``speed_limit``, ``speed_time``, ``headers``, ``ssl_context``), which apply to the whole command:
every source and destination it opens.
"""

from __future__ import annotations

from .common import model_sources
from .cp import CONVERTIBLE, Copy, cp, mirror
from .diff import Diff, diff
from .hash import content_digests, file_sha256, hash, structural_hash
from .inspect import Inspection, inspect
from .validate import TensorStats, Validation, validate
from .weight_inspect import weight_inspect

__all__ = [
    "CONVERTIBLE",
    "Copy",
    "Diff",
    "Inspection",
    "TensorStats",
    "Validation",
    "content_digests",
    "cp",
    "diff",
    "file_sha256",
    "hash",
    "inspect",
    "mirror",
    "model_sources",
    "structural_hash",
    "validate",
    "weight_inspect",
]
