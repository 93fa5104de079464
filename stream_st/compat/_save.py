"""The drop-ins' writes of tensors in memory with no event loop: ``save_file`` to a local file
(:func:`save_local`) and ``save`` (:func:`save_bytes`), what :mod:`stream_st.torch` and
:mod:`stream_st.numpy` call first.

Both take the direct path: the same plan and header as :func:`~stream_st.save`
(:func:`~stream_st.core.message.lay_out`), then the whole file in one pass of ``pwritev`` calls,
consecutive small tensors gathered into one call, through a temporary file moved into place,
nothing left on failure (:func:`~stream_st.transports.file.atomic.save_at_once`); or the bytes
joined. The event loop and the per-tensor work of the streaming writer cost more than the
reference's whole ``save_file`` for small tensors (1,000 of 4 KiB: 0.19x of its speed through
the streaming writer), and importing them (the event loop, the reader, the transports) 100 ms
or more before a script's first small file. This module imports only the format's core and the
local file's commit; any other destination, or transport options, go the streamed way
(:func:`stream_st.compat._reference.save_file`). Not public API.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from ..core.arrays import is_torch_tensor, torch_code
from ..core.message import lay_out
from ..errors import DtypeError
from ..transports.file.atomic import local_target, save_at_once
from ._errors import InvalidTensorsError, TorchDtypeError, UnencodableTextError, WrongTypeError

__all__ = ["check_metadata", "checked_tensors", "save_bytes", "save_local"]


def checked_tensors(tensors: object) -> Mapping[str, Any]:
    """``tensors`` if it is a mapping; else :class:`InvalidTensorsError`, as the reference
    words it. Names UTF-8 cannot encode, and torch tensors of a dtype safetensors cannot carry,
    raise what stream_st's writers raise, deriving from the reference's built-in type as well
    (:class:`UnencodableTextError`, :class:`TorchDtypeError`)."""
    if not isinstance(tensors, Mapping):
        raise InvalidTensorsError(
            f"Expected a dict of [str, np.ndarray] but received {type(tensors)}"
        )
    for name in tensors:
        if isinstance(name, str) and not name.isascii():
            _encodable(name, f"tensor name {name!r:.80}")
    if is_torch_tensor(next(iter(tensors.values()), None)):
        _check_torch_dtypes(tensors)
    return tensors


def _encodable(text: str, what: str) -> None:
    """:class:`UnencodableTextError` naming ``what`` unless UTF-8 encodes ``text``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnencodableTextError(what, exc) from None


def _check_torch_dtypes(tensors: Mapping[str, Any]) -> None:
    """:class:`TorchDtypeError` for the first torch tensor of ``tensors`` whose dtype
    safetensors cannot carry (each dtype looked up once)."""
    known: set[Any] = set()
    for name, tensor in tensors.items():
        dtype = getattr(tensor, "dtype", None)
        if dtype in known or not is_torch_tensor(tensor):
            continue
        try:
            torch_code(dtype)
        except DtypeError as exc:
            raise TorchDtypeError(f"tensor {name!r:.80}: {exc}") from None
        known.add(dtype)


def check_metadata(metadata: object) -> dict[str, str] | None:
    """``metadata`` as a dict of ``str`` to ``str``; :class:`WrongTypeError` (a ``TypeError``,
    as the reference raises) for anything else, :class:`UnencodableTextError` (a
    ``UnicodeEncodeError``, as there) for text UTF-8 cannot encode."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise WrongTypeError(
            f"argument 'metadata': '{type(metadata).__name__}' object cannot be converted "
            "to 'PyDict'"
        )
    for key, value in metadata.items():
        for item in (key, value):
            if not isinstance(item, str):
                raise WrongTypeError(
                    f"argument 'metadata': '{type(item).__name__}' object is not an instance "
                    "of 'str'"
                )
            if not item.isascii():
                _encodable(item, f"metadata {key!r:.80}")
    return dict(metadata)


def save_local(
    tensors: object,
    dst: object,
    metadata: object,
    checksums: bool | str,
    options: Mapping[str, object],
) -> bool:
    """Write ``tensors`` to ``dst`` at once and say True, if ``dst`` names a local file that a
    write replaces (a path or a ``file://`` URL, where nothing or a regular file is) and no
    transport option is given; else do nothing and say False (the caller writes it streamed).
    The file, errors and guarantees of the streamed write, laid out as the reference does."""
    if options:
        return False
    found = local_target(dst)
    if found is None:
        return False
    path, seen = found
    save_at_once(checked_tensors(tensors), path, check_metadata(metadata), checksums, seen=seen)
    return True


def save_bytes(tensors: object, metadata: object, checksums: bool | str) -> bytes:
    """``tensors`` as the bytes of a safetensors file, made at once."""
    prefix, _, data = lay_out(checked_tensors(tensors), check_metadata(metadata), checksums)
    return b"".join(itertools.chain([prefix], data))
