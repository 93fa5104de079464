"""A local regular file replaced atomically, with no event loop: what :class:`~.sink.FileSink`
is built on, and the whole write of :func:`save_at_once` (the drop-ins' ``save_file``, and
:func:`~stream_st.save` to a local file), which imports nothing of the asynchronous core.

The message goes to a temporary file in the destination's directory, written with positioned
writes (``os.pwritev``) of at most :data:`WRITE_CALL` bytes each, cut at multiples of it in the
file: see there why. Where the file system allows it (Linux ``O_TMPFILE``) that file has no name
until the commit: a process killed at any point (even by SIGKILL) leaves nothing behind.
Where the file system gives such a file no name (no ``/proc``...), the commit copies it into a
hidden one first, and later files there are hidden ones from the start. Elsewhere it is a hidden
file, ``.<name>.<random>.tmp``, or ``.<random>.tmp`` where that would pass the longest name the
directory takes: any valid destination name can be written; it is made, renamed and removed
through a handle on its directory, so that a write whose directory was moved away meanwhile
removes it wherever it went. The blocks
of a file of :data:`ALLOCATE_FROM` bytes or more are reserved up front (Linux ``fallocate``): a
full disk shows before any data is written, and the page-cache writes ran faster
(``benchmarks/bench_write.py --variants stream_st,nofalloc``: 1.24x paired at load average ~2.3;
1.12x in an in-process A/B). A smaller file is not: there the reservation cost more than it
saved, and a full disk fails its first write instead, leaving nothing behind all the same.

The commit links a nameless file in at the destination's name when nothing is there (``linkat``),
else under a short hidden name, renamed over the destination (``os.replace``, atomic on POSIX); a
failed write deletes it. Either goes to the destination's path as it is at the commit: where its
directory was moved away meanwhile, the commit fails. Until the commit the destination keeps its
previous content. A symlink at the destination is replaced itself, as ``os.replace`` and the
reference's ``save_file`` replace it, whatever it leads to (a file, nothing, a directory): the file
it led to stays as it was (a blob that other links share, as in a Hugging Face cache). A link that
leads to what is not a regular file (a FIFO, a device) is written through, as that would be
(:func:`replaced`). A file replaced keeps its permission bits (a link replaced, those of the file it
led to).
"""

from __future__ import annotations

import _thread
import contextlib
import ctypes
import errno
import functools
import itertools
import os
import stat
import sys
import warnings
import weakref
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from typing import Any

from ...core.header import Header
from ...core.message import Order, lay_out
from ...errors import (
    SafetensorsError,
    SourceNotFoundError,
    TransportError,
    UnsupportedSinkError,
    UnsupportedSourceError,
    UsageError,
    WriterError,
)

__all__ = [
    "ALLOCATE_FROM",
    "USE_TMPFILE",
    "WRITE_CALL",
    "Abandoned",
    "AtomicFile",
    "Blocks",
    "closed_when_dropped",
    "fsync_directory",
    "local_destination",
    "local_path",
    "local_target",
    "name_max",
    "open_held",
    "path_from_url",
    "replaced",
    "save_at_once",
    "write_blocks",
]

WRITE_CALL = 256 << 10
"""The most bytes one ``pwritev`` call writes: a buffer is cut at multiples of it in the file.

Linux sizes the page-cache folios of a buffered write by the length of the call, up to 2 MiB: a
call of 2 MiB or more asks for 2 MiB folios, the size transparent huge pages take too. Where
memory is fragmented and the caller's arrays sit on huge pages (numpy asks for them from 4 MiB),
those allocations stall in compaction, and 32 MiB calls from fresh numpy arrays ran at 0.15x of
the same bytes written in 8 MiB calls by 2 threads, while a writer issuing 1 MiB calls kept that
pace in every round. The first write of a fresh process still paid for 1 MiB folios: writing
640 MiB of 64 KiB tensors took 1.5-2.1 s in 1 MiB calls, 0.47-0.78 s in 256 KiB ones (the
reference's ``save_file`` 0.52-0.87 s), and 512 MiB of 32 MiB tensors 0.45-1.43 s against
0.30-0.51 s (3 interleaved rounds each, a fresh process per run, load average ~6). Aligned
256 KiB calls ask for folios of that size; 2 GiB take 8,192 calls.
"""

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_OPEN_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | _CLOEXEC  # read back: FileSink.read_at
_TMPFILE_FLAGS = os.O_RDWR | getattr(os, "O_TMPFILE", 0) | _CLOEXEC
# a handle on the directory a named temporary is made, renamed and removed in (*at calls):
# O_PATH asks for no read permission, which making a file there needs none of either
_DIRECTORY_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC

USE_TMPFILE = hasattr(os, "O_TMPFILE")
"""Write through a nameless file (``O_TMPFILE``) where the file system allows it; ``False``
always writes through a hidden named one (set by tests to exercise that path)."""

_NAME_MAX = 255
"""The longest file name, in bytes, where the directory does not say (Linux, macOS, Windows)."""

ALLOCATE_FROM = 4 << 20
"""Files smaller than this are not preallocated. Reserving the blocks of a small file cost more
than it saved: a file of 4 KiB took 185 us to write and commit with them reserved, 35 us
without; 400 KiB 258 against 79 us, 1 MiB 303 against 194 us; from 4 MiB on it paid (4 MiB
even, 8 MiB 2.0 against 6.1 ms; medians on an ext4 file system at load average ~7)."""


def _load_fallocate() -> Callable[[int, int], int] | None:
    """Linux ``fallocate(fd, 0, 0, size)`` without glibc's ``posix_fallocate`` fallback.

    ``os.posix_fallocate`` writes a zero into every block where the filesystem cannot reserve
    space (NFS, ZFS...), doubling the I/O; the raw call just fails there and is skipped.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.fallocate
    except (OSError, AttributeError):  # pragma: no cover - not glibc / musl
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    function.restype = ctypes.c_int

    def fallocate(fd: int, size: int) -> int:
        """0, or the errno."""
        return 0 if function(fd, 0, 0, size) == 0 else ctypes.get_errno()

    return fallocate


_FALLOCATE = _load_fallocate()


_IOV_MAX = 1024
"""The most buffers one ``pwritev`` call takes (Linux's ``IOV_MAX``; POSIX allows no fewer
than 16, which no platform stream_st runs on comes near)."""


def pwrite_fully(fd: int, views: list[memoryview], offset: int) -> None:
    """Positioned write of all of ``views``, back to back from ``offset`` (the kernel may take
    them in several calls)."""
    size = sum(map(len, views))
    while True:
        written = os.pwritev(fd, views, offset)
        if written == size:  # all of it, as a regular file takes it
            return
        offset += written
        size -= written
        done = 0
        while written >= len(views[done]):
            written -= len(views[done])
            done += 1
        views = views[done:]
        if written:
            views[0] = views[0][written:]


def _cut(pieces: Iterable[memoryview], offset: int) -> Iterator[tuple[int, list[memoryview]]]:
    """``pieces`` laid back to back from ``offset``, one block of :data:`WRITE_CALL` bytes of the
    file at a time: each block's offset and the views that fill it (a piece that crosses a
    block's end is cut there; a block takes at most :data:`_IOV_MAX` views)."""
    views: list[memoryview] = []
    at = end = offset
    room = WRITE_CALL - offset % WRITE_CALL  # bytes left before the block's end
    for piece in pieces:
        size = len(piece)
        if 0 < size < room and len(views) < _IOV_MAX - 1:  # most small pieces: no block ends
            views.append(piece)
            end += size
            room -= size
            continue
        start = 0
        while start < size:
            count = min(room, size - start)
            views.append(piece if count == size else piece[start : start + count])
            start += count
            end += count
            room -= count
            if not room or len(views) == _IOV_MAX:
                yield at, views
                views, at = [], end
                room = room or WRITE_CALL
    if views:
        yield at, views


class Blocks:
    """The blocks of :func:`_cut`, handed out one at a time to the threads that share them (an
    iterator each thread may take from)."""

    def __init__(self, pieces: Iterable[memoryview], offset: int) -> None:
        self._blocks = _cut(pieces, offset)
        self._lock = _thread.allocate_lock()

    def __iter__(self) -> Blocks:
        return self

    def __next__(self) -> tuple[int, list[memoryview]]:
        """The next block; ``StopIteration`` when every one is taken."""
        with self._lock:
            return next(self._blocks)


class Abandoned(WriterError):
    """A write at once (:meth:`AtomicFile.write_whole`) called off by its ``stop``: nothing was
    committed and the temporary file is gone."""

    def __init__(self) -> None:
        super().__init__("the write was called off before its commit: nothing was written")


def write_blocks(
    fd: int,
    blocks: Iterator[tuple[int, list[memoryview]]],
    name: str,
    stop: Callable[[], bool] | None = None,
) -> None:
    """Write blocks taken from ``blocks`` (:func:`_cut`'s, or :class:`Blocks` shared by the
    threads writing them) until none is left; a failure is a
    :class:`~stream_st.TransportError` naming ``name`` and the block. ``stop``, asked before
    each block, ends the writing with :class:`Abandoned` when true."""
    for offset, views in blocks:
        if stop is not None and stop():
            raise Abandoned()
        try:
            pwrite_fully(fd, views, offset)
        except OSError as exc:
            raise TransportError(
                f"write failed: {exc.strerror or exc}", url=name, position=offset
            ) from exc


_MAX_HOPS = 40
"""Symlinks followed in a row before giving up, as the kernel does (``ELOOP``)."""


def _existing(path: str, follow: bool = True) -> os.stat_result | None:
    """What is at ``path`` now (through symlinks unless ``follow`` is false), or None if
    nothing (a symlink that leads nowhere, or round in a loop, leads to nothing)."""
    try:
        return os.stat(path, follow_symlinks=follow)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except ValueError as exc:  # a NUL byte: no path the OS takes
        raise UsageError(f"invalid path {path!r}: {exc}") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise TransportError(f"cannot look at {path}: {exc.strerror}", url=path) from exc


def _target_of(
    name: str, seen: tuple[os.stat_result | None] | None = None
) -> tuple[str, os.stat_result | None, int | None]:
    """The path a write of ``name`` replaces, absolute; what is there now (None if nothing; a
    symlink is itself replaced, as ``os.replace`` replaces it, the file it leads to left as it
    is), looked at unless ``seen`` holds it already (:func:`local_target`); and the permission
    bits the new file takes: those of the regular file there, or that a symlink there leads to,
    less set-user-ID and set-group-ID, which a write into that file would clear too (None: the
    default). A relative ``name`` whose working directory was removed is a
    :class:`~stream_st.SourceNotFoundError` naming it, as a missing directory is."""
    try:
        target = name if os.path.isabs(name) else os.path.join(os.getcwd(), name)
    except FileNotFoundError:  # no path leads to the working directory any more
        raise SourceNotFoundError(
            f"{name}: cannot write it: the working directory was removed", url=name
        ) from None
    found = _existing(target, follow=False) if seen is None else seen[0]
    if found is not None and stat.S_ISLNK(found.st_mode) and _through_proc(target):
        held = os.path.realpath(target)  # the file a descriptor holds, not /dev's link
        found = _existing(held, follow=False)
        if found is None:  # the kernel names a removed file "<its old path> (deleted)"
            raise SourceNotFoundError(
                f"{target} leads to a file that was removed ({held}): no file to replace",
                url=name,
            )
        target = held
    led_to = _existing(target) if found is not None and stat.S_ISLNK(found.st_mode) else found
    if led_to is None or not stat.S_ISREG(led_to.st_mode):
        return target, found, None
    return target, found, stat.S_IMODE(led_to.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)


def _through_proc(path: str) -> bool:
    """Whether the symlink at ``path`` leads through ``/proc`` (``/dev/stdout``, ``/dev/fd/N``,
    ``/proc/self/fd/N``: a descriptor of the process), a link that is not the caller's to
    replace: the file it leads to is written as if named."""
    for _ in range(_MAX_HOPS):
        # the folders on the way resolved too: /dev/fd is itself a link to /proc/self/fd
        path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        if path.startswith("/proc/"):
            return True
        try:
            path = os.path.join(os.path.dirname(path), os.readlink(path))
        except OSError:  # not a link (the chain's end), or gone
            return False
    return False


def replaced(path: str) -> bool:
    """Whether a message for ``path`` replaces a file, through an :class:`AtomicFile` (nothing
    there, a regular file, a Unix socket's file, which no open writes through, as the
    reference's ``save_file`` replaces it, or a directory, refused by it; or a symlink to one
    of them, replaced itself), rather than being written in place (a :class:`~.sink.PipeSink`:
    what is there, through a symlink, is a FIFO or a device)."""
    return _replaces(path, _existing(path, follow=False))


def _replaces(path: str, here: os.stat_result | None) -> bool:
    """:func:`replaced`, given ``here``, what is at ``path`` now (not followed)."""
    existing = _existing(path) if here is not None and stat.S_ISLNK(here.st_mode) else here
    return existing is None or any(
        kind(existing.st_mode) for kind in (stat.S_ISREG, stat.S_ISSOCK, stat.S_ISDIR)
    )


def _resolved(directory: str) -> str:
    """``directory`` as messages show it: absolute, with no symlink."""
    return os.path.realpath(directory)


def name_max(directory: str) -> int:
    """The longest file name ``directory`` takes, in bytes."""
    try:
        return os.pathconf(directory, "PC_NAME_MAX")
    except (OSError, ValueError):
        return _NAME_MAX


_TOKEN_BYTES = 6
"""Random bytes in a temporary's name, written as hex (:func:`_temp_name`)."""


def temp_keeps_name(directory: str, base: str) -> bool:
    """Whether a hidden temporary beside ``base`` in ``directory`` is named after it,
    ``.<base>.<random>.tmp``, the longest name the directory takes allowing (else it is
    ``.<random>.tmp``: :func:`_temp_name`)."""
    extra = len("..") + 2 * _TOKEN_BYTES + len(".tmp")
    return len(os.fsencode(base)) + extra <= name_max(directory)


def _temp_name(directory: str, base: str) -> str:
    """A new hidden name beside ``base`` that fits the directory: ``.<base>.<random>.tmp``, or
    ``.<random>.tmp`` where a long ``base`` would make it too long."""
    token = os.urandom(_TOKEN_BYTES).hex()  # as secrets.token_hex, without importing secrets
    name = f".{base}.{token}.tmp" if temp_keeps_name(directory, base) else f".{token}.tmp"
    return os.path.join(directory, name)


def _at(path: str, directory_fd: int | None) -> str:
    """``path`` as an ``*at`` call takes it beside ``directory_fd``, the handle on its directory
    (its last part), or as it is where there is none."""
    return path if directory_fd is None else os.path.basename(path)


def _missing(directory: str, url: str) -> SourceNotFoundError | None:
    """The error for a write to ``url`` whose ``directory`` is not there (or was moved away
    meanwhile), or None where it is."""
    if os.path.isdir(directory):
        return None
    return SourceNotFoundError(f"no such directory: {_resolved(directory)}", url=url)


def _no_file_in(directory: str, exc: OSError, url: str) -> TransportError:
    """The error for a file that could not be made in ``directory`` (``exc``), the destination
    ``url``'s: :class:`~stream_st.SourceNotFoundError` where it is not found."""
    why = f"cannot create a file in {_resolved(directory)}: {exc.strerror}"
    if not isinstance(exc, FileNotFoundError):
        return TransportError(why, url=url)
    # /proc and the like have the folder, and make no file in it
    return _missing(directory, url) or SourceNotFoundError(why, url=url)


def open_held(opened: list[int], path: str, flags: int, dir_fd: int | None = None) -> int:
    """``os.open(path, flags, 0o666, dir_fd=dir_fd)``, the descriptor appended to ``opened``
    too, for the caller's cleanup to close. Python runs a signal handler (Ctrl-C's, a
    ``SIGALRM`` timeout's) as a call returns, among other points: one that raises as a plain
    ``os.open(...)`` returns leaves the descriptor on the interpreter's stack alone, out of
    any cleanup's reach. Here C code (``list.extend`` over ``map``) calls it and appends what
    it returns, with no bytecode run between."""
    opener = functools.partial(os.open, flags=flags, mode=0o666, dir_fd=dir_fd)
    opened.extend(map(opener, (path,)))
    return opened[-1]


def _open_nameless(directory: str, opened: list[int]) -> int | None:
    """A nameless file in ``directory`` (``O_TMPFILE``), or None where the platform or the file
    system has none, or is known not to link one in (the caller then makes a named one, which
    also reports any error the directory gives). Its descriptor is appended to ``opened``, the
    caller's, for its cleanup (:func:`open_held`): an interruption anywhere leaves it there."""
    if not USE_TMPFILE:
        return None
    try:
        fd = open_held(opened, directory, _TMPFILE_FLAGS)
    except OSError:  # EOPNOTSUPP, EISDIR on kernels without it; ENOENT, EACCES reported later
        return None
    try:
        unlinkable = bool(_UNLINKABLE) and os.fstat(fd).st_dev in _UNLINKABLE
    except OSError:
        unlinkable = True
    if unlinkable:
        del opened[-1]  # forgotten, then closed: no handler runs between
        os.close(fd)
        return None
    return fd


_UNLINKABLE: set[int] = set()
"""The file systems (``st_dev``) where a nameless file could not be linked in."""

_NOT_LINKED = frozenset(
    {errno.ENOENT, errno.EXDEV, errno.EPERM, errno.EACCES, errno.EOPNOTSUPP, errno.EINVAL}
)
"""The errors of a link of a nameless file that say it cannot be done there (``ENOENT``: no
``/proc``), not that the directory is full or failing."""


def _link(fd: int, path: str) -> None:
    """Give the nameless file open as ``fd`` the name ``path`` (absolute): ``linkat`` of its
    ``/proc`` entry, followed (a link of the entry itself would cross file systems). Python
    calls ``linkat`` rather than ``link`` when given a ``src_dir_fd``: any descriptor does, an
    absolute path ignores it (no directory to open)."""
    os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=fd, follow_symlinks=True)


def _dropped(fd: int, name: str, temporary: str | None, directory_fd: int | None, pid: int) -> None:
    """Close ``fd``, left open by a source or sink dropped unclosed, and remove ``temporary``,
    the named temporary file of a write never committed, if any (in ``directory_fd``, the
    handle on its directory, where there is one: closed then too); then give the
    ``ResourceWarning`` a Python file dropped unclosed gives (last: a filter that makes it an
    error leaves nothing open). In a process forked from ``pid``, the one that opened it, only
    the copies of the descriptors are closed: the temporary is the parent's, still being
    written."""
    os.close(fd)
    try:
        if os.getpid() != pid:
            return
        if temporary is not None:
            with contextlib.suppress(OSError):  # already gone
                os.unlink(_at(temporary, directory_fd), dir_fd=directory_fd)
    finally:
        if directory_fd is not None:
            os.close(directory_fd)
    warnings.warn(f"unclosed file {name!r}", ResourceWarning, stacklevel=1)


def closed_when_dropped(
    owner: object,
    fd: int,
    name: str,
    temporary: str | None = None,
    directory_fd: int | None = None,
) -> weakref.finalize[Any, Any]:
    """A finalizer that closes ``fd`` once ``owner`` is dropped unclosed, and removes
    ``temporary`` (in ``directory_fd``, closed too: see :func:`_dropped`); detach it when
    ``owner`` closes them itself. At interpreter exit it runs only for a ``temporary`` to
    remove (a descriptor, and a nameless file, go with the process)."""
    finalizer = weakref.finalize(owner, _dropped, fd, name, temporary, directory_fd, os.getpid())
    finalizer.atexit = temporary is not None
    return finalizer


def detach_dropped(owner: object, fds: Collection[int]) -> None:
    """Detach each finalizer :func:`closed_when_dropped` made for ``owner`` and one of ``fds``,
    which ``owner`` does not hold: an interrupt (a signal handler's exception) came as it took
    them, and may have kept the finalizer from being stored. Left alive, it would close that
    number again once ``owner`` is dropped, another file's by then; they are the caller's to
    close."""
    for ref in weakref.getweakrefs(owner):
        finalizer = ref.__callback__ if isinstance(ref, weakref.ref) else None
        if isinstance(finalizer, weakref.finalize):
            made = finalizer.peek()  # (owner, function, arguments, keywords) while alive
            if made is not None and made[1] is _dropped and made[2][0] in fds:
                finalizer.detach()


def fsync_directory(directory: str) -> None:
    """Flush ``directory``'s entries (a rename in it) to stable storage."""
    opened: list[int] = []
    try:
        os.fsync(open_held(opened, directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)))
    finally:
        for fd in opened:
            os.close(fd)


class AtomicFile:
    """A local regular file, new or replaced, written through a temporary file and moved into
    place by the commit (:meth:`write_whole` writes and commits a whole message; a
    :class:`~.sink.FileSink` writes one piece by piece). ``fsync=True`` flushes the data (and
    then the directory entry) to stable storage before and after the rename, so a crash never
    leaves a partial file at the destination even after a power loss. The rename is the commit
    point."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        fsync: bool = False,
        seen: tuple[os.stat_result | None] | None = None,
    ) -> None:
        self.name = os.fspath(path)
        self.fsync = fsync
        if not self.name:  # realpath would make it the working directory
            raise UsageError("the destination is an empty path: name a file")
        if self.name.endswith((os.sep, os.sep + ".")):  # realpath would drop what says so
            raise UsageError(
                f"the destination {self.name} names a directory (it ends in {os.sep!r}): "
                "name the file to write in it"
            )
        # the new file takes the old one's permission bits (_mode)
        self._target, existing, self._mode = _target_of(self.name, seen)
        self._replacing = existing is not None  # the commit renames over it
        directory, base = os.path.split(self._target)
        if not base or (existing is not None and stat.S_ISDIR(existing.st_mode)):
            raise TransportError("the destination is a directory", url=self.name)
        self._directory = directory
        self._fd = -1
        self._busy = 0  # positioned writes running in worker threads (a FileSink's)
        self._done = False
        self.temp_path: str | None = None  # the temporary's name; None while it has none
        # a handle on the directory a named temporary was made in, which its commit and removal
        # go through: they reach it wherever the directory went (None: by its path)
        self._directory_fd: int | None = None
        # what was opened since the file was last held (_hold), from the moment it was opened:
        # where an interrupt (a signal handler's exception) came before that, it is closed then
        self._opened: list[int] = []
        try:
            fd = _open_nameless(directory, self._opened)
            self._hold(self._create_named(directory, base) if fd is None else self._own(fd))
        except BaseException:  # an error, or an interrupt, before the file was held: nothing stays
            self._remove_temporary()
            self._close_fd()
            raise

    def _hold(self, fd: int) -> None:
        """Write through ``fd``, the temporary file (named :attr:`temp_path`, if named): the
        file dropped unclosed (a writer entered and never left), it is closed and removed,
        with a ``ResourceWarning`` (:func:`closed_when_dropped`). Held from here on: no longer
        among what an interrupt before this closes (:meth:`_close_opened`)."""
        self._unclosed = closed_when_dropped(
            self, fd, self.name, self.temp_path, self._directory_fd
        )
        self._fd = fd
        self._opened.clear()

    def _own(self, fd: int) -> int:
        """``fd``, a new file given the permission bits of the file it replaces, if any."""
        if self._mode is not None:
            with contextlib.suppress(OSError):  # a file system without them: keep the default
                os.fchmod(fd, self._mode)
        return fd

    def _create_named(self, directory: str, base: str) -> int:
        """A new hidden file beside the destination, open (see :meth:`_own`); its name in
        :attr:`temp_path`, made through a handle on ``directory`` (:attr:`_directory_fd`). On
        any failure, an interrupt included, the caller removes it and closes what was opened
        (:meth:`_remove_temporary`, :meth:`_close_fd`)."""
        try:
            self._directory_fd = open_held(self._opened, directory, _DIRECTORY_FLAGS)
        except PermissionError:  # no O_PATH (macOS): a directory one may write, not read
            self._directory_fd = None  # named by its path, as _at then does
        except OSError as exc:
            raise _no_file_in(directory, exc, self.name) from exc
        while True:
            # Named before the open: an interrupt raised as the open returns still finds the
            # name to remove.
            self.temp_path = _temp_name(directory, base)
            at = _at(self.temp_path, self._directory_fd)
            try:
                fd = open_held(self._opened, at, _OPEN_FLAGS, self._directory_fd)
            except OSError as exc:
                self.temp_path = None  # no file of ours has that name
                if isinstance(exc, FileExistsError):  # pragma: no cover - 48 random bits collided
                    continue
                raise _no_file_in(directory, exc, self.name) from exc
            return self._own(fd)

    def reserve(self, size: int) -> None:
        """Reserve ``size`` bytes on disk from :data:`ALLOCATE_FROM` (where the platform can):
        a full disk raises :class:`~stream_st.TransportError` before any data is written."""
        if _FALLOCATE is None or size < ALLOCATE_FROM:
            return
        error = _FALLOCATE(self._fd, size)
        if error in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise TransportError(
                f"cannot reserve {size} bytes: {os.strerror(error)}", url=self.name, position=0
            )
        # Any other failure (EOPNOTSUPP on filesystems without it...) only costs the speed-up.

    def _close_fd(self, keep_directory: bool = False) -> None:
        """Close the file, and unless ``keep_directory`` what was opened and not held yet
        (:meth:`_close_opened`) and the handle on its directory."""
        if not keep_directory:
            self._close_opened()
        fd = self._fd
        if fd >= 0:
            self._unclosed.detach()
            self._fd = -1  # forgotten, then closed: no handler runs between
            os.close(fd)
        if not keep_directory:
            self._close_directory()

    def _close_opened(self) -> None:
        """Close what was opened since the file was last held and nothing holds: an interrupt
        (a signal handler's exception) came between. A finalizer made for it meanwhile, which
        the interrupt may have kept from being stored, is detached (it would close that number
        again once this is dropped, another file's by then)."""
        stray = [fd for fd in self._opened if fd not in (self._fd, self._directory_fd)]
        self._opened.clear()
        if not stray:
            return
        detach_dropped(self, stray)
        for fd in stray:
            with contextlib.suppress(OSError):  # nothing to lose: nothing was written yet
                os.close(fd)

    def _close_directory(self) -> None:
        directory_fd = self._directory_fd
        if directory_fd is not None:
            with contextlib.suppress(OSError):  # nothing to lose: it was only read through
                self._directory_fd = None  # forgotten, then closed: no handler runs between
                os.close(directory_fd)

    def _remove_temporary(self) -> None:
        """Remove the temporary's name, if it has one (through the handle on its directory)."""
        if self.temp_path is not None:
            with contextlib.suppress(OSError):  # already gone, or nothing better to do
                os.unlink(_at(self.temp_path, self._directory_fd), dir_fd=self._directory_fd)

    def _raise_commit_error(self, exc: BaseException) -> None:
        """An OS error ``exc`` before the commit, raised as a :class:`~stream_st.TransportError`
        (the caller re-raises anything else as it is)."""
        if isinstance(exc, OSError) and not isinstance(exc, TransportError):
            raise TransportError(
                f"cannot commit the file: {exc.strerror or exc}", url=self.name
            ) from exc

    def write_whole(
        self, pieces: Iterable[memoryview], size: int, stop: Callable[[], bool] | None = None
    ) -> None:
        """Write the whole message at once and commit it, with no event loop: ``pieces`` back to
        back, ``size`` bytes in all (reserved first, :meth:`reserve`), in blocks of
        :data:`WRITE_CALL` bytes, consecutive small pieces gathered into one call, in the calling
        thread (one thread, whatever the size: a second one sharing the blocks, as a
        :class:`~.sink.FileSink` shares a large buffer's, made the writes of 640 MiB of 64 KiB
        pieces, and of 512 MiB of 32 MiB ones, take 2-3 times as long on a loaded 2-core
        machine); then flushed (with ``fsync``) and moved into place. Any failure, an interrupt
        included, removes the temporary file and raises. ``stop``, asked before each block and
        once more before the commit, calls the write off (:class:`Abandoned`) when true: the way
        another thread stops it."""
        if self._done:
            raise UsageError(f"{self.name}: the file sink is closed")
        try:
            self.reserve(size)
            write_blocks(self._fd, _cut(pieces, 0), self.name, stop)
            if self.fsync:
                os.fsync(self._fd)
            if stop is not None and stop():
                raise Abandoned()
            self._done = True
            self._commit()  # the commit point: nothing raises after it
        except BaseException as exc:
            self._discard()
            self._raise_commit_error(exc)
            raise
        if self.fsync:
            with contextlib.suppress(OSError):  # in place: making the rename durable is best effort
                fsync_directory(self._directory)

    def _commit(self) -> None:
        """Put the complete file at the destination and close it. A nameless file is linked in
        at the destination's name when nothing is there (the commit, with no name left behind
        at any moment), else under a new hidden name first; a named one is renamed over it.
        Either way the file goes to the destination's path as it is now: a directory moved away
        meanwhile is no longer the destination's, and the commit fails, the temporary removed
        by the caller (:meth:`_discard`), wherever the directory went."""
        if self.temp_path is None:
            try:
                if not self._replacing and self._linked_in():
                    return
                base = os.path.basename(self._target)
                while self.temp_path is None:  # to be renamed over the file there
                    # Named before the link: an interrupt (a signal's exception) raised as the
                    # link returns still finds the name to remove.
                    self.temp_path = _temp_name(self._directory, base)
                    try:
                        _link(self._fd, self.temp_path)
                    except FileExistsError:  # 48 random bits collided: that name is not ours
                        self.temp_path = None
            except OSError as exc:
                if exc.errno not in _NOT_LINKED:
                    raise
                self._name_a_copy(self._directory, os.path.basename(self._target))
        temp = self.temp_path
        assert temp is not None  # linked in under it, or made so by _name_a_copy
        self._close_fd(keep_directory=True)
        at = self._directory_fd
        try:
            os.replace(_at(temp, at), self._target, src_dir_fd=at)
        except FileNotFoundError as exc:
            missing = _missing(self._directory, self.name)
            if missing is None:
                raise
            raise missing from exc
        self._close_directory()

    def _linked_in(self) -> bool:
        """Link the nameless file in at the destination's name and close it (the commit, with
        no name left behind at any moment); False if a file came there meanwhile."""
        try:
            _link(self._fd, self._target)
        except FileExistsError:
            return False
        with contextlib.suppress(OSError):  # in place: nothing raises after the commit
            self._close_fd()
        return True

    def _name_a_copy(self, directory: str, base: str) -> None:
        """Where the file system gives a nameless file no name (no ``/proc``, ...): copy its
        bytes into a new hidden file (flushed too with ``fsync``), which takes its place. The
        file system is remembered once that file is made (the directory is there and takes
        files: the link failed for the file system's sake, not for a directory removed
        meanwhile): later files there are named from the start."""
        nameless = self._fd
        # on any failure the caller removes and closes both (:meth:`_discard`)
        named = self._create_named(directory, base)
        with contextlib.suppress(OSError):
            _UNLINKABLE.add(os.fstat(nameless).st_dev)
        size, offset = os.fstat(nameless).st_size, 0
        while offset < size:
            sent = os.sendfile(named, nameless, offset, size - offset)
            if not sent:
                raise OSError(errno.EIO, "the copy of the temporary file ended early")
            offset += sent
        if self.fsync:
            os.fsync(named)
        self._close_fd(keep_directory=True)  # the nameless one
        self._hold(named)

    def _discard(self) -> None:
        """Delete the temporary file (a nameless one goes with its descriptor); the descriptor
        closes once no write is running."""
        self._done = True
        self._remove_temporary()
        if not self._busy:
            self._close_fd()


def path_from_url(url: str, unsupported: type[SafetensorsError] = UnsupportedSourceError) -> str:
    """The local path of a ``file://`` URL; ``unsupported`` is raised for any other URL, a
    :class:`~stream_st.UsageError` for one that cannot be read (an unclosed ``[``)."""
    from urllib.parse import unquote  # numpy imports it already

    from ...core.shards import split_address

    parts = split_address(url)
    scheme = parts.scheme.lower()
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise unsupported(f"file URL with a remote host is not supported: {url}")
        return unquote(parts.path)
    raise unsupported(f"unknown URL scheme {scheme!r} in {url!r}")


def local_path(
    address: str, unsupported: type[SafetensorsError] = UnsupportedSinkError
) -> str | None:
    """The local path ``address`` names (a path, or a ``file://`` URL's, decoded); None for any
    other URL. ``unsupported`` is raised for a ``file://`` URL of a remote host (a destination's
    by default)."""
    if "://" not in address:  # a path: the address helpers are not imported for it
        return address
    from ...core.shards import scheme_of

    scheme = scheme_of(address)
    if scheme is None:  # a path holding "://"
        return address
    if scheme != "file":
        return None
    return path_from_url(address, unsupported)


def local_destination(dst: object) -> str | None:
    """The path of ``dst`` if it names a local file that a write replaces (a path or a
    ``file://`` URL, where nothing, a regular file or a socket's file is), else None (a URL, a
    stream, a FIFO or a device, written through in place; or a path the streamed write refuses,
    in its turn)."""
    found = local_target(dst)
    return None if found is None else found[0]


def local_target(dst: object) -> tuple[str, tuple[os.stat_result | None]] | None:
    """:func:`local_destination`'s path, with what is there now, not followed (None if
    nothing), in a tuple: the ``seen`` of :func:`save_at_once`, which then looks no more."""
    if isinstance(dst, os.PathLike):
        dst = os.fspath(dst)
    if not isinstance(dst, str):
        return None
    try:
        path = local_path(dst, UnsupportedSinkError)
        if path is None:
            return None
        here = _existing(path, follow=False)
        return (path, (here,)) if _replaces(path, here) else None
    except SafetensorsError:
        return None


def save_at_once(
    tensors: Mapping[str, Any],
    path: str,
    metadata: Mapping[str, str] | None = None,
    checksums: bool | str = False,
    *,
    order: Order = "reference",
    fsync: bool = False,
    stop: Callable[[], bool] | None = None,
    seen: tuple[os.stat_result | None] | None = None,
) -> Header:
    """Write ``tensors`` to the local file ``path`` (see :func:`local_destination`) at once, on
    the calling thread, with no event loop: the file :func:`~stream_st.save` writes, with the
    same errors, through the same temporary file and commit (:meth:`AtomicFile.write_whole`).
    ``stop``, asked before each block of writes and once more before the commit, ends the write
    with nothing committed (:class:`Abandoned`) when it says so. ``seen``: what is at ``path``
    now, as :func:`local_target` found it (else looked at). Returns the header written."""
    prefix, header, data = lay_out(tensors, metadata, checksums, order)
    written = AtomicFile(path, fsync=fsync, seen=seen)
    try:
        written.write_whole(itertools.chain([memoryview(prefix)], data), header.file_size, stop)
    except BaseException:  # also an interrupt as the call began, before it could clean up
        written._discard()
        raise
    return header
