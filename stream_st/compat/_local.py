"""A local safetensors file opened for reads by name, synchronously: what ``safe_open`` of a
path costs, kept as small as the reference's.

Opening reads the 8-byte length and the header with positioned reads, parses it, and (with
``mapped``, the default) maps the whole file privately and closes the descriptor at once: an
open handle then holds no descriptor, no thread and no event loop, only its mapping. Tensors are
writable copy-on-write views of the mapping (a write stays in this process), as the reference's
are; the mapping goes when the handle and the last tensor viewing it are gone.

Python before 3.13 keeps a duplicate of the descriptor for as long as an ``mmap.mmap`` lives;
there the mapping is made with the C library's ``mmap`` directly (POSIX), so a thousand open
shards take no descriptor each. Without ``mapped`` (``backend="pread"``) the descriptor stays
open and each tensor is read into fresh memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import sys
import weakref
from typing import Any

import numpy as np

from ..core.digests import Digests
from ..core.dtypes import wire_bytes
from ..core.header import (
    DEFAULT_MAX_HEADER_SIZE,
    LENGTH_PREFIX_SIZE,
    Header,
    TensorInfo,
    parse_header,
    parse_header_length,
)
from ..errors import TrailingDataError, TransportError, TruncatedStreamError, UsageError
from ..memory.fresh import fresh_bytes
from ..transports.file.pread import pread_fully
from ._errors import NoSuchFileError

__all__ = ["LocalFile"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


class _LibcMapping:
    """The C library's ``mmap`` and ``munmap``, where there are (POSIX)."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap = libc.mmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = (
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int64,
        )
        self.munmap = libc.munmap
        self.munmap.restype = ctypes.c_int
        self.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)

    def map_private(self, fd: int, size: int) -> Any:
        """``size`` bytes of ``fd`` mapped copy-on-write, as a ctypes array that unmaps them
        when it is collected."""
        address = self.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
        if address is None or address == ctypes.c_void_p(-1).value:
            error = ctypes.get_errno()
            raise OSError(error, os.strerror(error))
        region = (ctypes.c_ubyte * size).from_address(address)
        weakref.finalize(region, self.munmap, address, size)
        return region


def _libc_mapping() -> _LibcMapping | None:
    if sys.version_info >= (3, 13) or os.name != "posix":
        return None
    try:
        return _LibcMapping()
    except (OSError, AttributeError):  # pragma: no cover - a libc without mmap
        return None


_LIBC = _libc_mapping()


def _map_private(fd: int, size: int) -> Any:
    """The file ``fd`` of ``size`` bytes mapped copy-on-write, holding no descriptor where the
    platform allows."""
    if _LIBC is not None:
        return _LIBC.map_private(fd, size)
    options: dict[str, Any] = {"trackfd": False} if sys.version_info >= (3, 13) else {}
    if os.name == "posix":
        flags = {"flags": mmap.MAP_PRIVATE, "prot": mmap.PROT_READ | mmap.PROT_WRITE}
    else:  # pragma: no cover - Windows' copy on write
        flags = {"access": mmap.ACCESS_COPY}
    return mmap.mmap(fd, size, **flags, **options)


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
    the header records, if any."""

    def __init__(self, name: str, *, mapped: bool = True, verify: bool = True) -> None:
        self.name = name
        fd = _open(name)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise UsageError(f"{name} is not a regular file")
            self.header = _read_header(fd, info.st_size, name)
            self._digests = Digests.from_header(self.header) if verify else None
            self._region: Any = _map_private(fd, info.st_size) if mapped else None
        except OSError as exc:
            os.close(fd)
            raise TransportError(f"cannot read: {exc.strerror or exc}", url=name) from exc
        except BaseException:
            os.close(fd)
            raise
        if mapped:
            os.close(fd)
            fd = -1
        self._fd = fd
        self._checked: set[str] = set()

    @property
    def mapped(self) -> bool:
        """Whether tensors are views of the file's mapping."""
        return self._region is not None

    def array(self, info: TensorInfo, rows: tuple[int, int] | None = None) -> np.ndarray[Any, Any]:
        """Tensor ``info`` (or its ``rows``) as the reader delivers it: a view of the mapping, or
        fresh memory read now. A whole tensor is checked against its digest."""
        wanted = info if rows is None else info.rows(*rows)
        start = self.header.data_start + wanted.start
        if self._region is not None:
            raw = np.frombuffer(self._region, dtype=np.uint8, count=wanted.nbytes, offset=start)
        else:
            if self._fd < 0:
                raise UsageError(f"{self.name} is closed")
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
        array = raw.view(wanted.array_dtype).reshape(wanted.array_shape)
        if rows is None and self._digests is not None and info.name not in self._checked:
            hasher = self._digests.hasher()
            hasher.update(wire_bytes(array))
            self._digests.check(info.name, hasher, self.name)
            if self._region is not None:  # what the caller writes to a view since is no damage
                self._checked.add(info.name)
        return array

    def close(self) -> None:
        """Close the descriptor (``pread``). A mapping stays while this object or a view of it
        lives (slices taken before the close still read, as the reference's do)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open(name: str) -> int:
    try:
        return os.open(name, os.O_RDONLY | _CLOEXEC)
    except FileNotFoundError:
        raise NoSuchFileError(name) from None
    except OSError as exc:
        raise TransportError(f"cannot open: {exc.strerror or exc}", url=name) from None
    except ValueError as exc:  # a NUL byte
        raise UsageError(f"invalid path {name!r}: {exc}") from None


_FIRST_READ = 64 << 10
"""Bytes read at open, hoping they hold the whole header (one read instead of two)."""


def _read_header(fd: int, size: int, name: str) -> Header:
    """The header of the file ``fd`` of ``size`` bytes, checked against its size."""
    first = bytearray(min(size, _FIRST_READ))
    got = pread_fully(fd, memoryview(first), 0)
    if got < LENGTH_PREFIX_SIZE:
        raise TruncatedStreamError(
            "the header length", name=None, offset=got, expected=LENGTH_PREFIX_SIZE, source=name
        )
    length = parse_header_length(
        first[:LENGTH_PREFIX_SIZE], max_header_size=DEFAULT_MAX_HEADER_SIZE
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
