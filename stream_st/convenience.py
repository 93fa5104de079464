"""One-call helpers: :func:`save` a dict of arrays, :func:`load` a whole file into a dict."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Unpack

import numpy as np

from ._frameworks import spec_of
from ._limits import TransportOptions, clock_of
from .errors import UsageError
from .header import DEFAULT_MAX_HEADER_SIZE, Header
from .integrity import Digests
from .reader import Include, open_stream
from .sinks import SinkLike
from .sources import SourceLike
from .writer import Order, TensorWriter, as_array

__all__ = ["load", "save"]


async def save(
    dst: SinkLike,
    tensors: Mapping[str, Any],
    *,
    metadata: Mapping[str, str] | None = None,
    order: Order = "reference",
    fsync: bool = False,
    checksums: bool | str | Digests = False,
    **options: Unpack[TransportOptions],
) -> Header:
    """Write ``{name: array}`` to ``dst`` and return the header written.

    By default tensors are ordered as the reference writer orders them, so a file is
    byte-identical to ``safetensors.numpy.save_file`` of the same dict and metadata;
    ``order="plan"`` keeps the dict's order. Each array's dtype and shape make its plan entry
    (a torch ``float4_e2m1fn_x2`` tensor is F4; other packed F4/F6 tensors need
    :func:`~stream_st.open_writer` with an explicit plan). Arrays are
    written straight from their memory, one after another; nothing is committed unless all are.
    Time limits, ``headers`` and ``ssl_context`` as in :func:`~stream_st.open_writer`.

    ``checksums=True`` (or an algorithm's name) records every tensor's digest in
    ``__metadata__`` (see :func:`~stream_st.open_writer`); on a destination written front to
    back (a socket, a pipe, an HTTP upload) they are computed from the arrays before the header
    goes out.
    """
    if not isinstance(tensors, Mapping):
        raise UsageError(f"save takes a mapping of names to arrays, got {type(tensors).__name__}")
    arrays = {name: as_array(array, name) for name, array in tensors.items()}
    plan = [spec_of(name, tensors[name], array) for name, array in arrays.items()]
    writer = TensorWriter(
        dst,
        plan,
        metadata=metadata,
        order=order,
        fsync=fsync,
        checksums=checksums,
        clock=clock_of(options),
        digests_up_front=lambda algorithm: Digests.compute(arrays, algorithm),
    )
    async with writer:
        for info in writer.header.tensors:
            await writer.write(info.name, arrays[info.name])
    return writer.header


async def load(
    source: SourceLike,
    *,
    include: Include = None,
    max_header_size: int = DEFAULT_MAX_HEADER_SIZE,
    verify: bool = True,
    copy: bool = True,
    **options: Unpack[TransportOptions],
) -> dict[str, np.ndarray[Any, Any]]:
    """Read a whole safetensors message into ``{name: array}`` in offset order.

    Takes every source :func:`~stream_st.open_stream` takes, and the same options: digests
    recorded in the header are checked (``verify=False`` skips that), and nothing is returned
    unless every tensor passed. ``copy=False`` maps a local file and returns read-only views of
    it (see :func:`~stream_st.open_stream` for when not to).
    """
    stream = open_stream(
        source,
        include=include,
        max_header_size=max_header_size,
        verify=verify,
        copy=copy,
        **options,
    )
    return {name: array async for name, array in stream}
