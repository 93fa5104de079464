"""A local safetensors file opened for reads by name, synchronously: what ``safe_open`` of a
path costs, kept as small as the reference's.

Opening reads the 8-byte length and the header with positioned reads, parses it, and (with
``mapped``, the default) maps the whole file privately and closes the descriptor at once: an
open handle then holds no descriptor, no thread and no event loop, only its mapping. Tensors are
writable copy-on-write views of the mapping (a write stays in this process), as the reference's
are; the mapping goes when the handle and the last tensor viewing it are gone.

Python before 3.13 keeps a duplicate of the descriptor for as long as an ``mmap.mmap`` lives;
there the mapping is made with the C library's ``mmap`` directly (POSIX), so a thousand open
shards take no descriptor each (:func:`stream_st.transports.file.mmap.map_file`, which maps
the shards of an index too). Without ``mapped`` (``backend="pread"``) the descriptor stays open
and each tensor is read into fresh memory.

:func:`load_mapped` is ``load_file`` of such a file (:mod:`stream_st.torch`,
:mod:`stream_st.numpy`): no event loop, and nothing of the streaming core imported, so a script
that loads one small file pays little more than the reference does. This module imports only
the format's core; what it needs for other sources (an index, a ``file://`` URL, digests to
check) it imports when it meets them.
"""

from __future__ import annotations

import os
import stat
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.arrays import load_torch, to_torch, torch_dtype, torch_shape
from ..core.dtypes import array_shape, wire_bytes
from ..core.header import (
    DEFAULT_MAX_HEADER_SIZE,
    LENGTH_PREFIX_SIZE,
    Header,
    TensorInfo,
    parse_header,
    parse_header_length,
)
from ..core.stats import LoadStats, record_last
from ..errors import (
    TrailingDataError,
    TransportError,
    TruncatedStreamError,
    UnsupportedSourceError,
    UsageError,
    boolean,
)
from ..memory.fresh import fresh_bytes
from ..transports.file.mmap import Held, map_file, open_descriptor
from ..transports.file.pread import pread_fully
from ._errors import NoSuchFileError

if TYPE_CHECKING:
    from ..core.digests import Digests

__all__ = ["LocalFile", "aligned", "load_mapped", "local_path", "refuse_missing"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _pread_exact(fd: int, size: int, offset: int, name: str, what: str) -> bytes:
    data = bytearray(size)
    got = pread_fully(fd, memoryview(data), offset)
    if got < size:
        raise TruncatedStreamError(
            what, name=None, offset=offset + got, expected=offset + size, source=name
        )
    return bytes(data)


class LocalFile:
    """One local safetensors file, its header parsed; tensors viewed in its private mapping
    (``mapped``) or read into fresh memory. ``verify`` checks whole tensors against the digests
    the header records, if any. The mapping, or the descriptor read from, lives as long as this
    object or a view of the mapping does: a handle drops it when closed, and slices taken before
    (which hold it) still read, as the reference's do."""

    def __init__(self, name: str, *, mapped: bool = True, verify: bool = True) -> None:
        self.name = name
        held = _open(name)  # closed when dropped: no interrupt can leave it to no one
        fd = held.fileno()
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UsageError(f"{name} is not a regular file")
            self.header = _read_header(fd, info.st_size, name)
            self._digests = _digests(self.header) if verify else None
            self._region: Any = map_file(fd, info.st_size, private=True) if mapped else None
        except OSError as exc:
            held.close()
            raise TransportError(f"cannot read: {exc.strerror or exc}", url=name) from exc
        except BaseException:
            held.close()  # now: the error's frames hold it
            raise
        if mapped:
            held.close()
            fd = -1
        else:  # closed with the last user: the handle, or a slice taken before its close
            self._held = held
        self._fd = fd
        self._checked: set[str] = set()

    @property
    def mapped(self) -> bool:
        """Whether tensors are views of the file's mapping."""
        return self._region is not None

    def array(self, info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray[Any, Any]:
        """Tensor ``info`` (or its ``rows``) as the reader delivers it: a view of the mapping, or
        fresh memory read now. A whole tensor is checked against its digest. Rows of a mapped
        tensor with a digest not yet checked are a copy: a caller writing to a view of them
        would change the mapping a later check of the whole reads."""
        wanted = info if rows is None else info.rows(*rows)
        start = self.header.data_start + wanted.start
        row = wanted.dtype_info
        dtype = row.numpy
        shape = array_shape(row, wanted.shape) if row.packed else wanted.shape
        if self._region is not None:
            count = wanted.nbytes // dtype.itemsize
            array = np.frombuffer(self._region, dtype=dtype, count=count, offset=start)
            if rows is not None and self._digests is not None and info.name not in self._checked:
                array = array.copy()
            array = array.reshape(shape)
        else:
            raw = fresh_bytes(wanted.nbytes)
            got = pread_fully(self._fd, raw.data, start)
            if got < wanted.nbytes:
                raise TruncatedStreamError(
                    f"tensor {info.name!r}",
                    name=info.name,
                    offset=start + got,
                    expected=start + wanted.nbytes,
                    source=self.name,
                )
            array = raw.view(dtype).reshape(shape)
        if rows is None and self._digests is not None and info.name not in self._checked:
            self._digests.check_bytes(info.name, wire_bytes(array), self.name)
            if self._region is not None:  # what the caller writes to a view since is no damage
                self._checked.add(info.name)
        return array

    def tensor(self, info: TensorInfo, torch: bool) -> Any:
        """Tensor ``info`` whole, as :meth:`array` gives it (a copy where that is unaligned,
        see :func:`aligned`), or as a torch tensor (``torch``): from a mapping with no digest to
        check, viewed in it straight away (``torch.frombuffer``, no numpy array made on the way;
        at any address, as the reference's torch tensors are)."""
        if not torch:
            return aligned(self.array(info))
        if self._region is None or self._digests is not None or not info.nbytes:
            return to_torch(self.array(info), info.dtype, info.shape)
        dtype = torch_dtype(info.dtype)
        shape = torch_shape(info.dtype, info.shape)
        start = self.header.data_start + info.start
        count = info.nbytes // dtype.itemsize
        flat = load_torch().frombuffer(self._region, dtype=dtype, count=count, offset=start)
        return flat.reshape(shape)


def aligned(array: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``array``, or a copy of it where its memory does not start at a multiple of its dtype's
    alignment: a view of a tensor at an odd offset of a file's data (a valid file, unpadded),
    which numba, Cython and other code wanting aligned memory break on. The reference's numpy
    arrays are copies, so aligned, whatever the offset; a drop-in's numpy reads hand out no
    other."""
    return array if array.flags.aligned else array.copy()


def _digests(header: Header) -> Digests | None:
    """The digests ``header`` records, if any (:mod:`stream_st.core.digests` imported only for
    a header with metadata, where they are kept)."""
    if not header.metadata:
        return None
    from ..core.digests import Digests

    return Digests.from_header(header)


def local_path(src: object) -> str | None:
    """The path of ``src`` if it names a local regular file (a path, a ``file://`` URL) that
    is not a sharded checkpoint's index, or a file that does not exist (as the reference sees
    it: also a path under a regular file, or one holding a NUL); else None (a remote address,
    a FIFO, bytes...)."""
    if isinstance(src, os.PathLike):
        src = os.fspath(src)
    if not isinstance(src, str):
        return None
    if ".json" in src:
        from ..core.shards import is_index

        if is_index(src):
            return None
    if "://" in src:  # a URL, or a path holding it (the address helpers imported only then)
        from ..transports.file.atomic import local_path as path_of

        path = path_of(src, UnsupportedSourceError)
        if path is None:
            return None
        src = path
    try:
        mode = os.stat(src).st_mode
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL
        return src  # the local reader says so, as the reference words it
    except OSError:
        return None  # the transports say what is wrong with it
    return src if stat.S_ISREG(mode) else None


def load_mapped(
    src: object, torch: bool, verify: bool, backend: str, given: Mapping[str, object]
) -> dict[str, Any] | None:
    """``load_file`` of a local file mapped, as the reference maps it: every tensor as a
    writable copy-on-write view of a private mapping of ``src`` (torch tensors with ``torch``,
    else numpy arrays), checked against the header's digests unless not ``verify``; read here,
    with no event loop to start (a fixed cost a small file feels). None where that is not the
    way: ``src`` names no local regular file (see :func:`local_path`), ``backend`` is not
    ``"mmap"``, or the call was ``given`` anything else (transport options, ``cache=``,
    ``include=``, caps: not None) or runs under caps ``using_caps()`` set; the caller then
    reads through the streaming core. A file that does not exist is
    :class:`~stream_st.compat.SafetensorError` (a ``FileNotFoundError``) here; a ``verify``
    that is no bool an :class:`~stream_st.ArgumentTypeError`, whichever way the file is read."""
    verify = boolean("verify", verify)
    if backend != "mmap" or any(value is not None for value in given.values()) or _capped():
        return None
    path = local_path(src)
    if path is None:
        return None
    stats = LoadStats()
    stats.begin()
    file = LocalFile(path, verify=verify)
    stats.received(file.header.data_start)
    tensors = {}
    for info in file.header.tensors:
        tensors[info.name] = file.tensor(info, torch)
        stats.handed(info.nbytes)
    record_last(stats)  # what last_stats() gives, as a streamed load_file leaves it
    return tensors


def _capped() -> bool:
    """Whether ``using_caps()`` (:mod:`stream_st.reader.caps`) caps the reads in this context. Never
    before :mod:`stream_st.reader.caps` is imported (nothing can have set caps then), so asking
    imports no reader."""
    caps = sys.modules.get("stream_st.reader.caps")
    return caps is not None and bool(caps.current_caps() != caps.NO_CAPS)


def _open(name: str) -> Held:
    try:
        return open_descriptor(name, os.O_RDONLY | _CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, ValueError):  # ValueError: a NUL
        raise NoSuchFileError(name) from None  # as the reference says of all three
    except OSError as exc:
        raise TransportError(f"cannot open: {exc.strerror or exc}", url=name) from None


def refuse_missing(src: object) -> None:
    """Raise :class:`~.NoSuchFileError` (a ``FileNotFoundError``), worded as the reference
    words it, where ``src`` names a local file that does not exist (see :func:`local_path`)."""
    path = local_path(src)
    if path is not None and not os.path.lexists(path):
        raise NoSuchFileError(path)


_FIRST_READ = 64 << 10
"""Bytes read at open, hoping they hold the whole header (one read instead of two)."""


def _read_header(fd: int, size: int, name: str) -> Header:
    """The header of the file ``fd`` of ``size`` bytes, checked against its size."""
    first = bytearray(min(size, _FIRST_READ))
    got = pread_fully(fd, memoryview(first), 0)
    if got < min(size, LENGTH_PREFIX_SIZE):  # the file said it had more: cut off while read
        raise TruncatedStreamError(
            "the header length",
            name=None,
            offset=got,
            expected=min(size, LENGTH_PREFIX_SIZE),
            source=name,
        )
    length = parse_header_length(  # a file shorter than the length: a HeaderError, as read else
        first[: min(got, LENGTH_PREFIX_SIZE)],
        max_header_size=DEFAULT_MAX_HEADER_SIZE,
        fixed_limit=True,
    )
    end = LENGTH_PREFIX_SIZE + length
    if end <= got:
        raw: bytes | bytearray | memoryview = memoryview(first)[LENGTH_PREFIX_SIZE:end]
    else:
        raw = _pread_exact(fd, length, LENGTH_PREFIX_SIZE, name, "the header")
    header = parse_header(raw)
    expected = header.file_size
    if size < expected:
        raise TruncatedStreamError(
            "the tensors' data", name=None, offset=size, expected=expected, source=name
        )
    if size > expected:
        raise TrailingDataError(f"{name}: bytes follow the last tensor at byte {expected}")
    return header
