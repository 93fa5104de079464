"""The streaming reader: drives a source through the header core and yields numpy arrays.

:class:`TensorStream` (:mod:`.stream`) reads one safetensors file as a stream; :mod:`.header`
receives and parses its header, :mod:`.tensors` reads one tensor, :mod:`.ahead` reads a local
file's tensors ahead of the caller, :mod:`.caps` holds the caps on what a read may allocate and
:mod:`.turns` the turns the reader gives the event loop.
"""

from __future__ import annotations

from .caps import NO_CAPS as NO_CAPS
from .caps import Caps
from .stream import Include, TensorStream
from .tensors import READ_CHUNK, read_hashing
from .tensors import _read_tensor as _read_tensor
from .tensors import merge_ranges as merge_ranges

__all__ = ["READ_CHUNK", "Caps", "Include", "TensorStream", "read_hashing"]
