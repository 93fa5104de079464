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

A small file of plain numpy arrays (no more than :data:`SMALL` bytes of data) is written by the
compiled module ``stream_st/core/_small.c`` where it was built: the same bytes, temporary file
and commit in one call, without the Python write's fixed costs (a 400-byte file written and
committed in 21,000-38,000 instructions against 155,000-176,000, the reference's 51,000-63,000);
anything it does not plainly take, it leaves to the Python write (:func:`_written_small`).
"""

from __future__ import annotations

import functools
import itertools
import os
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np

from ..core.arrays import is_torch_tensor, torch_code, torch_dtypes, torch_to_array
from ..core.dtypes import DTYPES
from ..core.header import DEFAULT_MAX_HEADER_SIZE
from ..core.layout import _metadata_members
from ..core.message import lay_out, unrecorded
from ..errors import DtypeError
from ..transports.file import atomic
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
    if checksums is False and _written_small(tensors, dst, metadata):
        return True
    found = local_target(dst)
    if found is None:
        return False
    path, seen = found
    save_at_once(checked_tensors(tensors), path, check_metadata(metadata), checksums, seen=seen)
    return True


SMALL = 1 << 20
"""The most bytes of data the compiled module writes (holding the GIL as it does)."""


def _written_small(tensors: object, dst: object, metadata: object) -> bool:
    """Whether the compiled module wrote ``tensors`` to ``dst`` and put it in place (see the
    module's docstring); False where it is not built, or left the file to the Python write,
    nothing written."""
    compiled = _compiled()
    unnamed = atomic._UNLINKABLE or not atomic.USE_TMPFILE  # no nameless file to link in
    if compiled is None or type(tensors) is not dict or unnamed:
        return False
    if isinstance(dst, os.PathLike):
        dst = os.fspath(dst)
    if type(dst) is not str or "://" in dst:  # no tensor converted for a stream or a URL
        return False
    if not dst.isascii() and sys.getfilesystemencoding() != "utf-8":  # it names files in UTF-8
        return False
    # the errors of the Python write, in its order: the tensors' checks, the metadata's, then
    # the tensors' conversion (a shape numpy cannot hold)
    checked = checked_tensors(tensors)
    checked_metadata = check_metadata(metadata)
    arrays = _arrays(checked)
    if arrays is None:
        return False
    member = (
        None if checked_metadata is None else _metadata_members(unrecorded(checked_metadata))[0]
    )
    small, formats = compiled
    done = small.save(
        arrays,
        dst,
        formats,
        np.ndarray,
        member,
        SMALL,
        atomic.WRITE_CALL,
        DEFAULT_MAX_HEADER_SIZE,
    )
    return done is True


def _arrays(tensors: Mapping[Any, Any]) -> Mapping[Any, Any] | None:
    """``tensors`` as the compiled module takes them: numpy arrays as they are; torch tensors
    of a dtype numpy has a type of its own for, at most :data:`SMALL` bytes in all, as arrays
    over their memory, as the Python write sees them (None for any other)."""
    if not is_torch_tensor(next(iter(tensors.values()), None)):
        return tensors
    plain, size = _plain_torch_dtypes(), 0
    for tensor in tensors.values():
        size += tensor.nbytes if is_torch_tensor(tensor) and tensor.dtype in plain else SMALL + 1
        if size > SMALL:  # nothing copied from a device, or made contiguous, for nothing
            return None
    return {name: torch_to_array(tensor, name) for name, tensor in tensors.items()}


@functools.cache
def _plain_torch_dtypes() -> frozenset[Any]:
    """The torch dtypes whose arrays are of numpy's own types (not ml_dtypes', not packed)."""
    return frozenset(
        dtype
        for code, dtype in torch_dtypes().items()
        if isinstance(DTYPES[code].kind, np.dtype) and not DTYPES[code].packed
    )


@functools.cache
def _compiled() -> tuple[ModuleType, dict[str, tuple[str, int]]] | None:
    """The compiled module, imported at the first write, and each buffer format of a numpy
    dtype that safetensors carries, with its code and rank; None where it was not built, or on
    a big-endian machine (it copies the arrays' memory as it lies, not in the file's order)."""
    if sys.byteorder != "little":
        return None
    try:
        from ..core import _small
    except ImportError:  # built without a C compiler: every file the Python way
        return None
    # numpy's own types, each type code of one (int64 has two); not ml_dtypes' (which give no
    # buffer, and whose import would cost a first write 8 ms), not the packed ones' uint8
    own = {d.kind: d for d in DTYPES.values() if isinstance(d.kind, np.dtype) and not d.packed}
    formats = {}
    for char in np.typecodes["All"]:
        found = own.get(np.dtype(char))
        if found is not None:
            formats[np.empty(0, char).data.format] = (found.code, found.rank)
    return _small, formats


def save_bytes(tensors: object, metadata: object, checksums: bool | str) -> bytes:
    """``tensors`` as the bytes of a safetensors file, made at once."""
    prefix, _, data = lay_out(checked_tensors(tensors), check_metadata(metadata), checksums)
    return b"".join(itertools.chain([prefix], data))
