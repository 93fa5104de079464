"""Writers that roll over to a new shard at a target size, then write the index or manifest.

Two layouts:

* :func:`open_sharded_writer`: a Hugging Face checkpoint, ``model-00001-of-0000N.safetensors`` and
  ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": ...}``).
* :func:`open_dataset_writer`: the safetensors-spark dataset layout,
  ``part-{task:05d}-{shard:04d}-{uuid}.safetensors`` and ``dataset_manifest.json`` (format_version,
  total_samples, total_bytes, shards with shard_path / samples_count / bytes, schema).

A safetensors header comes first, but which tensors a shard will hold is known only when it is
full. So each shard's data goes, as it arrives (constant memory), straight into the shard's
temporary file in the directory (a :class:`~stream_st.transports.file.sink.FileSink`: a file with
no name, ``O_TMPFILE``, where the file system allows it), after room left for the header
(:func:`header_room`); when the shard is sealed its header is written into that room, padded with
spaces as the format allows. A header that outgrows its room is written to a new file, the data
copied after it. A sealed shard stays open, and nameless, until the commit. A group of tensors
(one ``write`` or ``write_batch`` call) never straddles two shards; a shard is sealed before a
group that would take it past the target size. On any failure (a full disk included: every I/O
error is a :class:`~stream_st.TransportError` naming the place) or cancellation before the
commit, the writer is aborted and nothing new is left in the directory.

The commit comes once the index or manifest is written whole, seen to its end whatever
cancellation comes (asyncio's own, which goes through anyio's shields, is raised once it has
ended; a commit that failed is thrown away then, never while it runs, one done is kept): every
file is linked in under a held name (hidden, ``_RollingWriter._held_name``), then the shards are
renamed to their final names and the index last (``ShardedWriter._rename_sealed`` says in which
order, so that a process killed at any point leaves a previous checkpoint whole, the new one
whole, or no index). An earlier file that a rename replaces, or that the commit removes (the
previous index...), is first set aside under a held name (``_RollingWriter._set_aside``): a
commit that fails part way puts each one back, leaving the previous checkpoint as it was, and
one done removes them. A writer holds its directory while it works (a shared ``flock``); one
that finds no other writer there first removes what writers killed there left under held names
(``_claim``). The directory is made (with its parents) for the first shard only: one removed
or moved away meanwhile is not made again, the next shard or the commit fails
(:class:`~stream_st.SourceNotFoundError`) and the writer is aborted, as a single file's write
whose directory was moved away fails. The writer holds a descriptor of the directory from then
on: the commit's renames, and the removals after it or at an abort, go through it, so they reach
the directory written in wherever it went, never another folder put at its path; an abort
removes a folder only where it is still the one the writer made, and empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import json
import os
import re
import shutil
import stat
import struct
import uuid
import weakref
from collections.abc import AsyncIterator, Collection, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import anyio
import anyio.to_thread
import numpy as np

from .._util import AsyncClosing, allow_open_files, seen_through
from ..core.arrays import as_array, spec_of
from ..core.digests import (
    DEFAULT_ALGORITHM,
    Digests,
    algorithm_named,
    asked_for,
    digest_of,
    without_record,
)
from ..core.dtypes import dtype_for, wire_bytes
from ..core.header import DEFAULT_MAX_HEADER_SIZE, LENGTH_PREFIX_SIZE
from ..core.layout import TensorSpec, build_header
from ..core.shards import (
    HELD_NAME,
    INDEX_NAME,
    MANIFEST_DTYPES,
    MANIFEST_NAME,
    SHARD_NAME,
    ShardEntry,
    manifest_document,
    scheme_of,
    shard_file_name,
    shard_name,
)
from ..errors import (
    ArgumentTypeError,
    DtypeError,
    HeaderError,
    SafetensorsError,
    SourceNotFoundError,
    TransportError,
    UnsupportedSinkError,
    UsageError,
    WriterError,
    boolean,
    integer_at_least,
    redact,
    some_names,
)
from ..transports.file.atomic import _existing, name_max, path_from_url, temp_keeps_name
from ..transports.file.mmap import Held, open_descriptor
from ..transports.file.sink import FileSink
from .reader import MAX_INDEX_SIZE

__all__ = [
    "DatasetWriter",
    "ShardedWriter",
    "checkpoint_files",
    "make_folders",
    "missing_folders",
    "open_dataset_writer",
    "open_sharded_writer",
    "remove_new_folders",
    "remove_unlisted",
    "tensor_index_table",
]

Array = np.ndarray[Any, Any]


COPY_CHUNK = 8 << 20
"""Data is copied behind a header that outgrew its room in pieces of this many bytes."""

ROOM_PER_DATA = 4096
"""A shard leaves one byte of room for its header per this many bytes of its target size..."""

ROOM_MAX = 1 << 20
"""...up to this much: enough for ~9000 tensors of 5 GiB shards with short names. The room is
also at least twice the header of the shard's first group, and a multiple of 4 KiB, but never
more than :data:`ROOM_LIMIT`."""

ROOM_LIMIT = (LENGTH_PREFIX_SIZE + DEFAULT_MAX_HEADER_SIZE) // 4096 * 4096
"""The most room a header is given: the largest multiple of 4 KiB whose header, padded to fill
it, is within the :data:`~stream_st.core.header.DEFAULT_MAX_HEADER_SIZE` bytes every reader
takes (the reference's too)."""


def header_room(target_size: int, first_header: int) -> int:
    """Bytes to leave for the header of a shard of ``target_size`` bytes of data whose first
    group alone has a header of ``first_header`` bytes (see :data:`ROOM_PER_DATA`)."""
    room = max(min(target_size // ROOM_PER_DATA, ROOM_MAX), 2 * first_header)
    return min(-(-room // 4096) * 4096, ROOM_LIMIT)


def _index_text(name: str, document: Mapping[str, Any]) -> tuple[str, bytes]:
    """The index (or manifest) ``name`` and the text of its ``document``; a
    :class:`~stream_st.WriterError` where it would be larger than the
    :data:`~stream_st.sharded.reader.MAX_INDEX_SIZE` bytes readers take."""
    text = json.dumps(document, indent=2, ensure_ascii=False).encode("utf-8")
    if len(text) > MAX_INDEX_SIZE:
        raise WriterError(
            f"{name} would be {len(text)} bytes, over the {MAX_INDEX_SIZE} bytes readers take: "
            "write less metadata, or fewer or shorter tensor names"
        )
    return name, text


def _padded(prefix: bytes, size: int) -> bytes:
    """The header ``prefix`` (length and JSON) made ``size`` bytes long with trailing spaces."""
    text = prefix[8:] + b" " * (size - len(prefix))
    return struct.pack("<Q", len(text)) + text


@contextlib.contextmanager
def _io(doing: str, path: Path, position: int | None = None) -> Iterator[None]:
    """An ``OSError`` inside (a full disk...) becomes a TransportError saying what failed where."""
    try:
        yield
    except SafetensorsError:
        raise
    except OSError as exc:
        raise TransportError(
            f"{doing} failed: {exc.strerror or exc}", url=str(path), position=position
        ) from exc


async def _filled(
    path: Path, head: bytes, rest: FileSink | None = None, start: int = 0, size: int = 0
) -> FileSink:
    """A :class:`~stream_st.transports.file.sink.FileSink` for ``path`` holding ``head``, then
    what ``rest`` holds from ``start`` on (``size`` bytes in all, when known), complete and not
    committed (a temporary file, removed on any failure or cancellation)."""
    sink = FileSink(path)
    try:
        await sink.allocate(size)
        await sink.send(memoryview(head))
        if rest is not None:
            chunk = memoryview(bytearray(COPY_CHUNK))
            while got := await rest.read_at(start, chunk):
                await sink.send(chunk[:got])
                start += got
        await sink.prepare()
    except BaseException:
        await sink.abort()
        raise
    return sink


async def _write_file(path: Path, head: bytes) -> None:
    """``head`` as the file ``path``: complete, then moved into place shielded from
    cancellation; nothing is left on any failure."""
    sink = await _filled(path, head)
    with anyio.CancelScope(shield=True):
        await sink.aclose()


class _Shard:
    """One shard in the making: its plan, and its data written into its file after ``room``
    bytes left for the header."""

    def __init__(self, destination: Path, room: int, algorithm: str | None) -> None:
        self.destination = destination
        self.file = FileSink(destination)
        self.room = room
        self.specs: list[TensorSpec] = []
        self.names: set[str] = set()
        self.data_bytes = 0
        self.samples = 0
        self.algorithm = algorithm
        self.digests: dict[str, str] = {}

    async def add(self, spec: TensorSpec, array: Array) -> None:
        """Write ``array``, the bytes of tensor ``spec``, after the data so far."""
        name = spec.name
        view = wire_bytes(array)
        at = self.room + self.data_bytes
        await self.file.allocate(at + len(view))
        await self.file.write_at(at, view)
        if self.algorithm is not None:
            self.digests[name] = await anyio.to_thread.run_sync(digest_of, self.algorithm, view)
        self.specs.append(TensorSpec(name, dtype_for(spec.dtype).code, spec.shape))
        self.names.add(name)
        self.data_bytes += len(view)

    async def seal(self, metadata: Mapping[str, str] | None) -> int:
        """Write the header; :attr:`file` is then the complete shard, not committed. Returns the
        file's size. On any failure nothing is left."""
        try:
            if self.algorithm is not None:
                digests = Digests(self.algorithm, self.digests)
                metadata = digests.add_to(metadata, [spec.name for spec in self.specs])
            prefix, _ = build_header(self.specs, metadata)
            if len(prefix) <= self.room:
                await self.file.write_at(0, memoryview(_padded(prefix, self.room)))
                await self.file.prepare()
                return self.room + self.data_bytes
            size = len(prefix) + self.data_bytes
            outgrown = self.file
            self.file = await _filled(self.destination, prefix, outgrown, self.room, size)
        except BaseException:
            await self.file.abort()
            raise
        await outgrown.abort()  # its data now follows the header in the new file
        return size


def _local_folder(directory: object) -> Path:
    """The local folder ``directory`` names: a path, or a ``file://`` URL; a URL of another
    scheme (``s3://``, ``https://``: these writers write local files only, where it would have
    made a folder named ``s3:``) raises :class:`~stream_st.UnsupportedSinkError`, an empty
    path or one holding a NUL :class:`~stream_st.UsageError` (as :func:`~stream_st.save` refuses
    them), anything else :class:`~stream_st.ArgumentTypeError`."""
    if isinstance(directory, os.PathLike):
        directory = os.fspath(directory)
    if not isinstance(directory, str):
        raise ArgumentTypeError(
            f"the folder must be a path or a file:// URL, got {type(directory).__name__}"
        )
    scheme = scheme_of(directory)
    if scheme is not None:
        if scheme != "file":
            raise UnsupportedSinkError(
                f"shards are written to a local folder, not to a {scheme}:// URL "
                f"({redact(directory)}): write them here, then copy the checkpoint there with "
                "'stream-st cp INDEX URL/'"
            )
        directory = path_from_url(directory, UnsupportedSinkError)
    if not directory:  # the current directory, where save("") is refused
        raise UsageError("the folder is an empty path: name a folder ('.' for this one)")
    if "\0" in directory:
        raise UsageError(f"invalid path {directory!r}: embedded null byte")
    return Path(directory)


def _algorithm_asked(checksums: object) -> str | None:
    """The digest algorithm ``checksums=`` asks for: the one it names, the default for True,
    None for False. A :class:`~stream_st.Digests` is an :class:`~stream_st.ArgumentTypeError`:
    its values are digests given up front, which :func:`~stream_st.open_writer` checks the bytes
    written against, where these writers compute each tensor's digest as they write it and
    would commit other bytes under them unchecked. Anything else is a
    :class:`~stream_st.UsageError` naming what ``checksums=`` takes."""
    if isinstance(checksums, str):
        return algorithm_named(checksums, "checksums=").name
    if isinstance(checksums, Digests):
        raise ArgumentTypeError(
            "checksums takes no Digests here: a sharded or dataset writer computes each "
            "tensor's digest as it writes it, and checks none given up front (open_writer and "
            "save do); give checksums=True or an algorithm name"
        )
    return DEFAULT_ALGORITHM if asked_for(checksums, "or an algorithm name") else None


_OPEN, _COMMITTED, _ABORTED = "open", "committed", "aborted"
"""A rolling writer's states: it takes writes, its index is in place, or it threw all away."""


class _RollingWriter(AsyncClosing):
    """Shards rolled over at ``target_size`` bytes of data; subclasses name them and write the
    index."""

    unique_names = True
    """Whether a name may be written once in all; if not, once per shard (a group repeating a
    name of the current shard starts the next one)."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        target_size: int,
        checksums: bool | str = False,
        size_option: str = "max_shard_size",
    ) -> None:
        integer_at_least(size_option, target_size, 1)
        self._algorithm = _algorithm_asked(checksums)
        self.directory = _local_folder(directory)
        self._new_folders = missing_folders(self.directory)  # removed again by abort()
        self.target_size = target_size
        self._tag = uuid.uuid4().hex[:8]  # in the held names (_held_name)
        self._current: _Shard | None = None
        # name (held, then final), bytes, samples
        self._sealed: list[tuple[str, int, int, list[TensorSpec]]] = []
        self._files: list[FileSink] = []  # complete, not linked in yet: the sealed shards, index
        self._index_file: Path | None = None  # the index's held name, until it is in place
        self._aside: list[tuple[str, str]] = []  # earlier files set aside: name, held name
        self._hold: weakref.finalize[Any, Any] | None = None  # lets the directory go (_claim)
        self._drop: weakref.finalize[Any, Any] | None = None  # the new folders, if dropped open
        self._folder: tuple[int, int] | None = None  # the directory held (_identity), once made
        self._held_fd: Held | None = None  # a descriptor of it (_open_folder), until let go
        self._made: dict[Path, tuple[int, int]] = {}  # the folders made (make_folders)
        self._written: set[str] = set()
        self._state = _OPEN
        self._failure: BaseException | None = None  # why it was aborted (None: by abort())
        self._turns = anyio.Lock()  # held by one write at a time, or the close (_turn)
        self._in_flight = 0  # writes begun and not ended: a close meanwhile is refused
        self._closing = False  # a close began: a write begun since is refused

    def _check_open(self) -> None:
        """:class:`UsageError` once the writer is closed: committed, or aborted (saying why)."""
        if self._state == _ABORTED:
            raise UsageError(self._aborted()) from self._failure
        if self._state == _COMMITTED:
            raise UsageError("the writer is closed")
        if self._closing:
            raise UsageError("the writer is closing")

    def _aborted(self) -> str:
        """What an aborted writer says when used or closed: why it was aborted."""
        why = "by abort()" if self._failure is None else f"({self._failure!r})"
        return f"the write was aborted {why}; no shard was committed"

    async def __aenter__(self) -> Self:
        """The writer, still open: a closed one is not entered again (as a
        :class:`~stream_st.TensorWriter` is not), where leaving the block did nothing."""
        self._check_open()
        return self

    @contextlib.asynccontextmanager
    async def _turn(self) -> AsyncIterator[None]:
        """One write's turn. A write reads the writer's state (the shard in the making, where
        its data ends) and updates it across awaits, so writes from tasks at once take turns,
        each whole, in the order they came; the close takes one too (:meth:`aclose`). A write
        cancelled while it waits aborts the writer, as one cancelled while it writes does: the
        commit would lack it."""
        self._check_open()
        self._in_flight += 1
        try:
            try:
                await self._turns.acquire()
            except BaseException as exc:
                await self._abort(exc)
                raise
            try:
                self._check_open()  # aborted while it waited (a close waits for no write)
                yield
            finally:
                self._turns.release()
        finally:
            self._in_flight -= 1

    async def _add_group(
        self, arrays: Mapping[str, Array], specs: Sequence[TensorSpec], samples: int
    ) -> None:
        """Write ``arrays`` (:func:`_taken`, with their plan entries ``specs``), a group of
        ``samples`` samples, into one shard, in the write's :meth:`_turn`."""
        current = self._current
        repeats = current is not None and not current.names.isdisjoint(arrays)
        for name in arrays:
            if name in (self._written if self.unique_names else ()):
                raise WriterError(f"tensor {name!r:.80} was already written", name=name)
        # refuses, before any write, what no header takes: a dtype safetensors cannot carry, a
        # name that is not a string, is __metadata__ or is not Unicode text (a lone surrogate)
        build_header(specs)
        size = sum(a.nbytes for a in arrays.values())
        try:
            if (
                current
                and current.specs
                and (repeats or current.data_bytes + size > self.target_size)
            ):
                await self._seal()
                current = None
            if current is None:
                await self._open_directory()
                current = self._current = self._new_shard(specs)
            for spec in specs:
                await current.add(spec, arrays[spec.name])
                self._written.add(spec.name)
        except BaseException as exc:
            await self._abort(exc)  # a shard missing bytes must never be sealed
            raise
        current.samples += samples

    async def _open_directory(self) -> None:
        """Make the directory (and its parents, :func:`make_folders`), open it (its descriptor,
        :attr:`_dir_fd`, which the commit goes through) and hold it (:func:`_claim`) the first
        time; a later shard, or the commit, finds it still there (:meth:`_check_directory`)."""
        if self._folder is not None:
            self._check_directory()
        else:
            with _io("creating the directory", self.directory):
                make_folders(self.directory, self._made)
                self._held_fd = _open_folder(self.directory)
                self._folder = _identity(self._held_fd.fileno())
            if self._new_folders:  # a writer dropped unclosed leaves them as it found them
                mine = re.compile(rf"\.\.?{self._tag}\.partial\..+")  # its held names
                self._drop = weakref.finalize(
                    self,
                    _dropped_open,
                    self.directory,
                    mine,
                    self._new_folders,
                    self._made,
                    os.getpid(),
                )
            claim = functools.partial(anyio.to_thread.run_sync, self._hold_directory)
            # seen to its end (it waits at most for another writer's sweep), for the writer,
            # cancelled, to let the directory go
            await seen_through(claim)

    def _check_directory(self) -> None:
        """:class:`~stream_st.SourceNotFoundError` where the directory made (or found) and held
        for the first shard is no longer at its path: removed, or moved away (another one may
        have taken its place). It is not made again: the checkpoint would land in a folder the
        user removed, its sealed shards linked in there, and the folders made again would stay
        after a failure (:meth:`abort` removes those it made at first)."""
        with _io("looking at the directory", self.directory):
            try:
                found: tuple[int, int] | None = _identity(self.directory)
            except (FileNotFoundError, NotADirectoryError):
                found = None
        if found == self._folder:
            return
        if found is None:
            why = f"no such directory: {self.directory}: it was removed or moved away"
        else:
            why = f"{self.directory} is another directory: the one written in was moved away"
        raise SourceNotFoundError(
            f"{why} while the writer wrote in it; nothing was committed", url=str(self.directory)
        )

    @property
    def _dir_fd(self) -> int:
        """The descriptor of the directory held (:meth:`_open_directory`): the commit's renames,
        and the removals after it or at an abort, go through it, so they reach that directory
        wherever it was moved, never another folder put at its path."""
        fd = self._folder_fd()
        assert fd >= 0, "the directory is open from the first shard on, until it is let go"
        return fd

    def _folder_fd(self) -> int:
        """The descriptor of the directory held, -1 before it is made or once let go."""
        return -1 if self._held_fd is None else self._held_fd.fileno()

    def _hold_directory(self) -> None:
        """:func:`_claim` the directory (in a worker thread), its descriptor held by the writer
        before the thread returns. The claim is seen through a cancellation (asyncio's own went
        through anyio's shield and left the thread to claim it after the writer was aborted),
        then raised: the writer, aborted, lets the directory go (:meth:`_let_go`), where its
        descriptor was left open, and the directory held by no writer at work, for the rest of
        the process."""
        held = _claim(self.directory)
        if held is not None:  # closed once the writer is done, or dropped
            self._hold = weakref.finalize(self, os.close, held)

    def _held_name(self, name: str) -> Path:
        """Where the file to be named ``name`` is linked in at the commit, before it is renamed
        to that name: ``.<tag>.partial.<name>``, hidden (the tag is this writer's), or
        ``.<tag>.partial.<digest of name>`` where that, or its temporary file's name, would
        pass the longest name the directory takes (any valid final name can be written). A
        writer's sweep (:func:`_claim`) removes such files, and a hidden temporary file of one
        (where the file system has no nameless file: ``..<tag>.partial.<name>.<random>.tmp``),
        that a killed writer left."""
        held = f".{self._tag}.partial.{name}"
        if not temp_keeps_name(str(self.directory), held):
            digest = hashlib.blake2b(os.fsencode(name), digest_size=8).hexdigest()
            held = f".{self._tag}.partial.{digest}"
        return self.directory / held

    def _new_shard(self, first: Sequence[TensorSpec]) -> _Shard:
        """The next shard, opened with room for a header that ``first`` starts."""
        metadata = self._shard_metadata()
        if self._algorithm is not None:  # as long as the digests to come
            names = [spec.name for spec in first]
            placeholder = digest_of(self._algorithm, memoryview(b""))
            metadata = Digests(self._algorithm, dict.fromkeys(names, placeholder)).add_to(
                metadata, names
            )
        room = header_room(self.target_size, len(build_header(first, metadata)[0]))
        allow_open_files(len(self._files) + 1)  # every sealed shard is held open until the end
        return _Shard(self._held_name(self._shard_name(len(self._sealed))), room, self._algorithm)

    def _shard_name(self, index: int) -> str:
        """The name of shard ``index`` as it is written (its held name's end)."""
        raise NotImplementedError

    def _final_name(self, index: int) -> str:
        """The name shard ``index`` takes at the commit."""
        return self._shard_name(index)

    def _shard_metadata(self) -> Mapping[str, str] | None:
        return None

    async def _seal(self) -> None:
        shard, self._current = self._current, None
        if shard is None:
            return
        size = await shard.seal(self._shard_metadata())
        self._files.append(shard.file)
        self._sealed.append((shard.destination.name, size, shard.samples, shard.specs))

    def _index(self) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def _put(self, index: int, final: str) -> None:
        """Rename the sealed shard ``index`` to ``final``, an earlier file of that name kept
        aside (:meth:`_set_aside`) until the commit is done."""
        name, size, samples, specs = self._sealed[index]
        with _io("moving a shard into place", self.directory / final):
            self._set_aside(final, keep=True)
            os.replace(name, final, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        self._sealed[index] = (final, size, samples, specs)  # abort() removes it from here

    def _set_aside(self, name: str, *, keep: bool = False, folders: bool = False) -> None:
        """Move the earlier file ``name``, one the commit replaces or removes, aside under a held
        name (:meth:`_held_name`, hidden), in the directory held (:attr:`_dir_fd`): an abort puts
        it back (:meth:`_put_back`), the commit removes it once the index is in place, a later
        writer's sweep (:func:`_claim`) where a process killed meanwhile left it. With ``keep``
        it stays at ``name`` too (a hard link aside; renamed where the file system makes none),
        so that the rename over it replaces it at once. Nothing where nothing is at ``name``,
        nor where a folder is, but with ``folders`` (a rename over one then fails)."""
        folder = self._dir_fd
        found = _found(name, folder)
        if found is None or (stat.S_ISDIR(found.st_mode) and not folders):
            return
        aside = self._held_name(f"aside.{name}").name
        linked = False
        if keep:
            with contextlib.suppress(OSError):  # no hard link there: renamed
                os.link(name, aside, src_dir_fd=folder, dst_dir_fd=folder, follow_symlinks=False)
                linked = True
        if not linked:
            os.rename(name, aside, src_dir_fd=folder, dst_dir_fd=folder)
        self._aside.append((name, aside))

    def _put_back(self, cause: BaseException | None) -> set[str]:
        """Put the earlier files set aside (:meth:`_set_aside`) back in their places, over what
        the commit put there, the last set aside first: an earlier index, set aside before the
        shards it names, goes back only once each of them is back. One that cannot be put back
        stops it, a note on ``cause`` saying so: it and those still aside stay under their held
        names, and no earlier index names a mix of shards. Returns the names put back."""
        restored: set[str] = set()
        while self._aside:
            name, aside = self._aside[-1]
            folder = self._dir_fd  # open wherever a file was set aside
            try:
                os.replace(aside, name, src_dir_fd=folder, dst_dir_fd=folder)
            except OSError as exc:
                if cause is not None:
                    cause.add_note(
                        f"putting the earlier {name} back failed too ({exc.strerror or exc}): it "
                        f"is left as {aside}, which the next writer in {self.directory} removes"
                    )
                break
            self._aside.pop()
            restored.add(name)
            with contextlib.suppress(OSError):  # a link of the file at name: os.replace left it
                os.unlink(aside, dir_fd=folder)
        return restored

    def _rename_sealed(self, index: Path) -> None:
        """Give the sealed shards, linked in under their held names, their final names (see
        :meth:`_final_name`), just before the index takes its place, ``index``."""
        for number in range(len(self._sealed)):
            self._put(number, self._final_name(number))

    def _commit(self, index: Path) -> None:
        """The shards to their final names, then the index to ``index`` (in a worker thread),
        all in the directory held (:attr:`_dir_fd`). The files were linked in by its path: the
        directory is first found still there (:meth:`_check_directory`), or what went into a
        folder put at its path is taken away again by the abort (:meth:`_remove_held`)."""
        self._check_directory()
        self._rename_sealed(index)
        assert self._index_file is not None  # linked in by aclose
        folder = self._dir_fd
        with _io("moving the index into place", index):
            os.replace(self._index_file.name, index.name, src_dir_fd=folder, dst_dir_fd=folder)
        self._index_file = None
        self._state = _COMMITTED
        self._remove_held([aside for _, aside in self._aside])  # the earlier files replaced
        self._aside.clear()

    async def _link_and_commit(self, index: Path) -> None:
        """Link every file in under its held name, then :meth:`_commit` (the index last)."""
        while self._files:
            await self._files[0].aclose()  # removes itself if it fails
            del self._files[0]
        await anyio.to_thread.run_sync(self._commit, index)

    async def _before_index(self) -> None:
        """A hook to write what goes beside the shards before the index commits them."""

    async def _nothing_written(self) -> None:
        """A hook for a writer closed with no tensor written (an empty index by default)."""

    def _after_commit(self) -> None:
        """A hook run once the index is in place."""

    def _remove_unlisted(self, ours: re.Pattern[str]) -> None:
        """Remove the files of the directory whose names ``ours`` matches (an earlier write's
        shards) that the new index, in place, does not name."""
        remove_unlisted(self.directory, ours, {name for name, *_ in self._sealed}, self._dir_fd)

    async def aclose(self) -> None:
        """Seal the last shard, write the index (or manifest) whole, then commit, seen through
        whatever cancellation comes meanwhile (:func:`~stream_st._util.seen_through`: asyncio's
        own too, raised once the commit has ended): every file linked in under its held name,
        then the shards renamed to their final names and the index into place
        (:meth:`_link_and_commit`). A writer aborted before (a write that failed or was
        cancelled, its error caught, or :meth:`abort`) raises :class:`~stream_st.WriterError`
        saying why: nothing was written. So does a close while writes of other tasks are in
        flight (begun, not ended), which aborts the writer (as a
        :class:`~stream_st.TensorWriter` closed with tensors not completely written does): the
        commit would lack them. A write begun while the writer closes is refused
        (:class:`~stream_st.UsageError`); closes from tasks at once commit once."""
        if self._in_flight and self._state == _OPEN:
            error = WriterError(
                f"the writer closed while {self._in_flight} write(s) of other tasks were in "
                "flight: nothing was committed; let every write end before closing the writer"
            )
            await self._abort(error)
            raise error
        closing, self._closing = self._closing, True
        try:
            await self._turns.acquire()
        except BaseException as exc:
            if not closing:  # nothing of the commit runs yet; else another close's runs
                await self._abort(exc)
            raise
        try:
            await self._close()
        finally:
            self._turns.release()

    async def _close(self) -> None:
        """:meth:`aclose`, in its turn."""
        if self._state == _ABORTED:
            raise WriterError(self._aborted()) from self._failure
        if self._state == _COMMITTED:
            return
        try:
            await self._seal()
            await self._open_directory()  # nothing written: not made yet; else found still there
            if not self._sealed:
                await self._nothing_written()
            await self._before_index()
            name, text = _index_text(*self._index())
            self._index_file = self._held_name(name)
            self._files.append(await _filled(self._index_file, text))
            commit = functools.partial(self._link_and_commit, self.directory / name)
            # seen to its end: renames are quick, and stopping between two of them would leave
            # the directory as a killed process leaves it (see ShardedWriter._rename_sealed)
            await seen_through(commit)
        except BaseException as exc:
            if self._state != _COMMITTED:  # nothing of the commit runs still: throw it all away
                await self._abort(exc)
            raise  # committed, then cancelled: asyncio's own cancellation, raised once settled
        finally:
            if self._state == _COMMITTED:
                self._after_commit()
                self._let_go()

    def _let_go(self) -> None:
        """Let the directory go (see :func:`_claim`)."""
        if self._drop is not None:
            self._drop.detach()
        if self._hold is not None:
            self._hold()
        if self._held_fd is not None:
            self._held_fd.close()

    async def abort(self) -> None:
        """Remove every shard written so far and the one in the making, and the index if written;
        nothing is left behind. Closing the writer then raises :class:`~stream_st.WriterError`
        (as :meth:`~stream_st.TensorWriter.abort` makes it)."""
        await self._abort(None)

    async def _abort(self, cause: BaseException | None) -> None:
        """:meth:`abort` for ``cause`` (None: the caller's :meth:`abort`), the first one kept."""
        if self._state != _OPEN:
            return
        self._state, self._failure = _ABORTED, cause
        if self._current is not None:
            await self._current.file.abort()
            self._current = None
        for file in self._files:
            await file.abort()
        self._files.clear()
        names = [name for name, *_ in self._sealed]
        if self._index_file is not None:
            names.append(self._index_file.name)
            self._index_file = None
        restored = self._put_back(cause)  # over the new files there: those are gone
        self._remove_held([name for name in names if name not in restored])
        self._sealed.clear()
        self._let_go()
        remove_new_folders(self._new_folders, self._made)

    def _remove_held(self, names: Sequence[str]) -> None:
        """Remove ``names``, files (or a staged index's folder) the writer holds until its commit,
        from the directory held (:attr:`_dir_fd`); and from another folder put at its path, where
        the commit, which links the files in by the path, may have put them (a held name, with
        the writer's tag in it, is the writer's own). Nothing where the directory was never
        made; an error is let pass: removing the rest matters more."""
        fd = self._folder_fd()
        if fd < 0:  # never made, or let go
            return
        try:
            elsewhere = _identity(self.directory) != self._folder
        except OSError:  # nothing at the path: nothing went there
            elsewhere = False
        for name in names:
            with contextlib.suppress(OSError):
                _remove_entry(name, fd)
            if elsewhere:
                with contextlib.suppress(OSError):
                    _remove_entry(str(self.directory / name))

    async def _abandon(self, cause: BaseException) -> None:
        await self._abort(cause)


def _checked_prefix(prefix: object) -> str:
    """``prefix=`` of a sharded checkpoint, checked before anything is written: a plain file
    name, not empty, without ``/`` or surrounding spaces, that makes shard names an index may
    hold (:func:`~stream_st.core.shards.shard_name`: no control character, ``\\``, ``:``,
    ``?`` or ``#``), none of them a held name (:data:`~stream_st.core.shards.HELD_NAME`,
    which a writer's sweep removes).
    :class:`ArgumentTypeError` unless a string, :class:`UsageError` else."""
    if not isinstance(prefix, str):
        raise ArgumentTypeError(f"prefix must be a string, got {type(prefix).__name__}")
    try:
        shard_name(f"{prefix}.safetensors", "prefix")
    except HeaderError:
        plain = False
    else:
        plain = bool(prefix) and "/" not in prefix and prefix == prefix.strip()
    if not plain:
        raise UsageError(
            "prefix must be a plain file name, without '/', surrounding spaces, control "
            f"characters, '\\', ':', '?' or '#', got {prefix!r}"
        )
    if any(HELD_NAME.fullmatch(f"{prefix}{end}") for end in (".safetensors", "-00001.safetensors")):
        raise UsageError(
            f"prefix {prefix!r} makes names of the form .<8 hex digits>.partial.<name>, those a "
            "writer holds until its commit: the next writer in the folder would remove the "
            "checkpoint as a killed writer's leftovers"
        )
    return prefix


def checkpoint_files(prefix: str) -> re.Pattern[str]:
    """The names of the files of a checkpoint of ``prefix`` (its index
    ``{prefix}.safetensors.index.json``): ``{prefix}.safetensors`` and the shards
    ``{prefix}-NNNNN-of-NNNNN.safetensors``. Those beside an index that it does not name are an
    earlier checkpoint's, removed at its commit, as transformers' ``save_pretrained`` does: a
    loader takes ``{prefix}.safetensors`` before the index, so a stale one would be loaded in
    place of the new checkpoint."""
    # ASCII digits only: \d takes any script's, and a name no writer makes is no earlier shard
    return re.compile(rf"{re.escape(prefix)}(-[0-9]{{5}}-of-[0-9]{{5}})?\.safetensors")


def remove_unlisted(
    directory: Path, ours: re.Pattern[str], kept: Collection[str], dir_fd: int | None = None
) -> None:
    """Remove the files of ``directory`` whose names ``ours`` matches (an earlier write's
    shards) that are not in ``kept`` (those the new index, in place, names). With ``dir_fd``, a
    descriptor of ``directory`` (:func:`_open_folder`), the listing and the removals go
    through it: they reach that directory wherever it was moved, never another folder put at
    its path."""
    try:
        with os.scandir(directory if dir_fd is None else dir_fd) as listing:
            # an entry's path is its name where the listing went through a descriptor
            stale = [
                entry.path
                for entry in listing
                if ours.fullmatch(entry.name) and entry.name not in kept and not entry.is_dir()
            ]
    except OSError:
        return
    for path in stale:
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to remove
            os.unlink(path, dir_fd=dir_fd)


class ShardedWriter(_RollingWriter):
    """A Hugging Face sharded checkpoint; see :func:`open_sharded_writer`."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_shard_size: int,
        prefix: str = "model",
        metadata: Mapping[str, str] | None = None,
        checksums: bool | str = False,
    ) -> None:
        self.prefix = _checked_prefix(prefix)
        build_header((), metadata)  # refuses metadata that is no mapping of str to str, as save
        self.metadata = dict(metadata or {})
        if "total_size" in self.metadata:  # it replaced the index's own
            raise UsageError(
                "metadata may not hold 'total_size': the index's total_size is the writer's "
                "count of the checkpoint's bytes"
            )
        super().__init__(directory, max_shard_size, checksums)
        self._check_names_fit()
        if self._algorithm is None:  # a digest record copied in describes another file's bytes
            self.metadata = dict(without_record(self.metadata) or {})  # left out, as save does
        _index_text(*self._index())  # metadata too large for the index: refused before any write

    def _check_names_fit(self) -> None:
        """:class:`UsageError` where a name the checkpoint may take (at the longest
        ``{prefix}-NNNNN-of-NNNNN.safetensors``, or the index's) would pass the longest name
        its directory takes: refused before anything is written, where the commit failed once
        every byte was."""
        folder = self._new_folders[-1].parent if self._new_folders else self.directory
        limit = name_max(str(folder))
        names = [
            f"{self.prefix}-00001-of-00002.safetensors",
            f"{self.prefix}.safetensors.index.json",
        ]
        longest = max(len(os.fsencode(name)) for name in names)
        if longest > limit:
            raise UsageError(
                f"prefix is too long ({len(os.fsencode(self.prefix))} bytes): the checkpoint's "
                f"file names ({{prefix}}-NNNNN-of-NNNNN.safetensors) would be {longest} bytes, "
                f"over the {limit} bytes a file name in {folder} may have"
            )

    async def write(self, name: str, array: Any) -> None:
        """Add one tensor (to the current shard, or a new one if it would overflow). Writes
        from tasks at once land whole, in the order they came."""
        self._check_open()
        arrays, specs = _taken({name: array})
        async with self._turn():
            await self._add_group(arrays, specs, 0)

    def _shard_name(self, index: int) -> str:
        # The total is unknown until the end: a provisional name, replaced at the commit.
        return f"{self.prefix}-{index + 1:05d}.safetensors"

    def _shard_metadata(self) -> Mapping[str, str] | None:
        return {"format": "pt", **self.metadata}

    def _final_name(self, index: int) -> str:
        count = len(self._sealed)
        if count == 1:
            return f"{self.prefix}.safetensors"
        return f"{self.prefix}-{index + 1:05d}-of-{count:05d}.safetensors"

    def _rename_sealed(self, index: Path) -> None:
        """The shards to their final names, the previous checkpoint kept whole for as long as
        it can be. A shard whose name is free goes there first: the previous index names no
        such file. Then, where a shard takes the place of a file (a previous shard of that
        name), or the new checkpoint is or replaces ``{prefix}.safetensors`` (loaders take it
        before any index), the previous index is set aside (:meth:`_set_aside`) before any of
        that: a process killed from then until the new index is in place leaves no index,
        never one naming a mix of old and new shards; a commit that fails puts it back, and
        every file replaced, once the new shards are gone. All in the directory held
        (:attr:`_dir_fd`)."""
        folder = self._dir_fd
        single = f"{self.prefix}.safetensors"
        finals = [self._final_name(number) for number in range(len(self._sealed))]
        later = []
        for number, final in enumerate(finals):
            if final == single or _found(final, folder) is not None:
                later.append(number)
            else:
                self._put(number, final)
        stale = single not in finals and _found(single, folder) is not None
        if not later and not stale:
            return
        for number in later:  # refused while the previous checkpoint is whole, not once its
            # index is gone: a directory there cannot be replaced
            found = _found(finals[number], folder)
            if found is not None and stat.S_ISDIR(found.st_mode):
                with _io("moving a shard into place", self.directory / finals[number]):
                    raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
        with _io("setting the previous index aside", index), contextlib.suppress(FileNotFoundError):
            self._set_aside(index.name)
        for number in later:
            self._put(number, finals[number])
        if stale:
            with contextlib.suppress(OSError):  # not a file ours to remove: _after_commit's say
                self._set_aside(single)

    def _after_commit(self) -> None:
        """Remove the shards of an earlier checkpoint of this prefix that the new index does not
        name, as transformers' ``save_pretrained`` does: a loader takes ``{prefix}.safetensors``
        before the index, so a stale one would be loaded in place of the new checkpoint."""
        self._remove_unlisted(checkpoint_files(self.prefix))

    def _index(self) -> tuple[str, dict[str, Any]]:
        weight_map = {
            spec.name: self._final_name(index)
            for index, (_, _, _, specs) in enumerate(self._sealed)
            for spec in specs
        }
        # the tensors' bytes, as transformers and huggingface_hub count it (not the files')
        total = sum(build_header(specs)[1].data_size for _, _, _, specs in self._sealed)
        document = {"metadata": {"total_size": total, **self.metadata}, "weight_map": weight_map}
        return f"{self.prefix}.safetensors.index.json", document


class DatasetWriter(_RollingWriter):
    """A safetensors-spark style dataset; see :func:`open_dataset_writer`."""

    unique_names = False  # batch mode: every shard holds the same columns

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        target_shard_size: int,
        task_id: int = 0,
        checksums: bool | str = False,
        generate_index: bool = False,
    ) -> None:
        super().__init__(directory, target_shard_size, checksums, "target_shard_size")
        # in every shard's name, as readers parse it
        self.task_id = integer_at_least("task_id", task_id, 0)
        self.generate_index = boolean("generate_index", generate_index)
        self._uuid = str(uuid.uuid4())
        self._schema: dict[str, dict[str, Any]] = {}
        self._index_placed = False  # the new _tensor_index.parquet is at its name (_abort)
        self._columns: frozenset[str] | None = None  # the first group's (see _check_columns)
        self._batches = False  # a group taken was surely a batch: its rows were checked
        self._kv_rows = False  # a group of other columns than the first was taken
        # why a group taken unchecked (maybe KV rows) was no batch, the first one's
        self._no_batch: str | None = None

    async def write_batch(self, tensors: Mapping[str, Any], samples: int) -> None:
        """Add a group of tensors holding ``samples`` samples; the group stays in one shard.

        Batch mode: every column is ``[samples, *sample_shape]``; a column of another number of
        rows, or of no dimension at all, is a :class:`UsageError` naming it, and nothing of the
        group is written (the manifest would count samples its shard does not hold); so is a
        group of no tensor but some samples, a batch whose columns are not those of the
        dataset's first (:meth:`_check_columns`), and a batch whose column is of another dtype,
        or holds rows of another shape, than the schema records (:meth:`_schema_problem`).
        Arrays are taken as :func:`~stream_st.save` takes them (torch tensors included), of a
        dtype the manifest's schema can record (:data:`~stream_st.core.shards.MANIFEST_DTYPES`:
        not ``BOOL``, an 8-bit float nor F4, a :class:`DtypeError`). A group whose ``samples``
        is 1, or its number of tensors, may instead be KV-mode rows (the tensors
        ``{name}{separator}{column}`` of one name, or one tensor a sample, as the Spark writer
        counts them), each a value of any shape: it is taken as it is, unless batches of the
        same columns were taken before (then it is a batch, its rows checked: a last batch of
        one sample). A batch after such groups of its columns is refused where one of them was
        no batch (:meth:`_check_columns`).

        The schema records each name's dtype and shape as first written, in a group taken (a
        group refused records nothing).
        """
        samples = integer_at_least("samples", samples, 0)
        if not isinstance(tensors, Mapping):
            raise ArgumentTypeError(
                f"write_batch takes {{name: array}}, got {type(tensors).__name__}"
            )
        arrays, specs = _taken(tensors)
        if samples and not arrays:
            raise UsageError(
                f"write_batch: a batch of {samples} samples holds no tensor (a shard would count "
                "samples it does not hold); nothing was written"
            )
        for spec in specs:
            code = dtype_for(spec.dtype).code  # refuses dtypes safetensors cannot carry
            if code not in MANIFEST_DTYPES:
                raise DtypeError(
                    f"write_batch: column {spec.name!r:.80} is {code}, a dtype the dataset "
                    f"manifest's schema cannot record (it allows {', '.join(MANIFEST_DTYPES)}): "
                    "cast it (BOOL to U8, as the Spark writer writes booleans); nothing of the "
                    "batch was written"
                )
        async with self._turn():  # the dataset's state is read and updated from here on
            # else maybe KV rows, their shapes free; but not once batches of these columns were
            # taken
            batch = samples not in (1, len(arrays)) or (
                self._batches and self._columns == frozenset(arrays)
            )
            if batch:
                _refuse(_rows_problem(arrays, samples))
            self._check_columns(arrays, samples, batch)
            if batch:
                _refuse(self._schema_problem(specs))
            await self._add_group(arrays, specs, samples)  # checks every column before any write
            if arrays:  # only a batch taken is recorded
                if self._columns is None:
                    self._columns = frozenset(arrays)
                self._kv_rows |= self._columns != set(arrays)
                self._batches |= batch
                if not (batch or self._no_batch):  # the schema not yet updated by this group
                    self._no_batch = _rows_problem(arrays, samples) or self._schema_problem(specs)
            for spec in specs:
                self._schema.setdefault(
                    spec.name, {"dtype": dtype_for(spec.dtype).code, "shape": list(spec.shape)}
                )

    def _check_columns(self, arrays: Mapping[str, Array], samples: int, batch: bool) -> None:
        """:class:`UsageError` where a group of ``samples`` samples (``batch``: surely a batch,
        its rows checked) would mix batch mode with other columns: a batch whose columns are
        not those of the dataset's first group, a group of other columns once a batch was
        taken, or a batch after KV-mode rows (groups of other tensors). Readers take shards of
        other tensors for KV-mode rows, and a shard would hold, and its manifest entry count,
        samples of two batches. So is a batch after groups of its columns taken unchecked (1
        sample, or as many as their columns: maybe KV-mode rows) where one of them was no batch
        (:func:`_rows_problem`, :meth:`_schema_problem`): its shard's manifest entry would
        count samples it does not hold, or readers would refuse the dataset. The groups taken
        stay as written, as a group that is no batch is refused after a batch."""
        if not arrays or self._columns is None or not (batch or self._batches):
            return
        names = f"{len(arrays)} columns ({some_names(sorted(arrays))})"
        if self._kv_rows:
            raise UsageError(
                f"write_batch: a batch of {samples} samples of {names} after KV-mode rows "
                "(groups of other tensors): a dataset holds batches of the same columns, or KV "
                "rows; nothing of the batch was written"
            )
        if self._columns != set(arrays):
            raise UsageError(
                f"write_batch: the batch's {names} are not the dataset's {len(self._columns)} "
                f"columns ({some_names(sorted(self._columns))}): every batch holds the same "
                "columns (readers take shards of other columns for KV-mode rows); nothing of the "
                "batch was written"
            )
        if self._no_batch:
            raise UsageError(
                f"write_batch: a batch of {samples} samples of {names} after a group of these "
                f"columns that was no batch, taken as KV-mode rows ({self._no_batch}): a dataset "
                "holds batches of the same columns, or KV rows; nothing of the batch was written"
            )

    def _schema_problem(self, specs: list[TensorSpec]) -> str | None:
        """Which column of a batch (of the dataset's columns, see :meth:`_check_columns`) holds
        another dtype, or rows of another shape, than the schema records (the manifest would
        contradict the batch's shard, and readers refuse shards whose columns differ); None
        where none does."""
        for spec in specs:
            recorded = self._schema.get(spec.name)
            if recorded is None:
                continue
            code = dtype_for(spec.dtype).code
            if code != recorded["dtype"] or list(spec.shape[1:]) != recorded["shape"][1:]:
                return (
                    f"column {spec.name!r:.80} is {code} rows of shape {list(spec.shape[1:])}, the "
                    f"dataset's {recorded['dtype']} rows of shape {recorded['shape'][1:]}: a "
                    "column's rows are of one dtype and shape in every batch (readers refuse "
                    "shards whose columns differ)"
                )
        return None

    def _shard_name(self, index: int) -> str:
        return shard_file_name(self.task_id, index, self._uuid)

    def _after_commit(self) -> None:
        """Remove the shards (``part-*.safetensors``) the new manifest does not list, an earlier
        dataset's, as the Spark writer's overwrite removes them."""
        self._remove_unlisted(SHARD_NAME)

    async def _nothing_written(self) -> None:
        """The layout's manifest lists at least one shard: an empty dataset is one shard of no
        tensor and no sample (as the Spark writer writes it)."""
        self._current = self._new_shard([])
        await self._seal()

    def _index(self) -> tuple[str, dict[str, Any]]:
        shards = [
            ShardEntry(self._final_name(index), samples, size)
            for index, (_, size, samples, _) in enumerate(self._sealed)
        ]
        return MANIFEST_NAME, manifest_document(shards, self._schema)

    @property
    def _staged_index(self) -> Path:
        """Where the new ``_tensor_index.parquet`` is written before it takes the old one's
        place (a held name, hidden: readers and listings of the dataset skip it)."""
        return self._held_name(INDEX_NAME)

    async def _before_index(self) -> None:
        """With ``generate_index``: ``_tensor_index.parquet``, a directory Spark reads (it skips
        a leaf file whose name begins with ``_``), written under a hidden name; it replaces the
        old one just before the manifest commits (:meth:`_rename_sealed`), so a failed write
        keeps the dataset's index as it was."""
        if not self.generate_index:
            return
        rows = [
            (spec.name, self._final_name(index), list(spec.shape), dtype_for(spec.dtype).code)
            for index, (_, _, _, specs) in enumerate(self._sealed)
            for spec in specs
        ]
        table = await anyio.to_thread.run_sync(tensor_index_table, rows)
        staged = self._staged_index
        staged.mkdir()
        await _write_file(staged / f"part-00000-{self._uuid}-c000.parquet", table)

    def _rename_sealed(self, index: Path) -> None:
        """The shards to their final names (new ones: the writer's UUID is in them), then the new
        ``_tensor_index.parquet`` in the old one's place (without ``generate_index``, an earlier
        one removed: it would name shards the new manifest does not), the old one set aside
        (:meth:`_set_aside`): put back where the manifest then fails to take its place."""
        super()._rename_sealed(index)
        folder = self._dir_fd
        with _io("moving the tensor index into place", self.directory / INDEX_NAME):
            self._set_aside(INDEX_NAME, folders=True)
            if self.generate_index:
                staged = self._staged_index.name
                os.replace(staged, INDEX_NAME, src_dir_fd=folder, dst_dir_fd=folder)
                self._index_placed = True

    async def _abort(self, cause: BaseException | None) -> None:
        """:meth:`_RollingWriter._abort`, the new ``_tensor_index.parquet`` removed first, staged
        or in place (where an earlier one then goes back)."""
        if self.generate_index and self._state == _OPEN:  # the directory held: no sweep races it
            if self._index_placed:
                with contextlib.suppress(OSError):  # removing the rest matters more
                    _remove_entry(INDEX_NAME, self._dir_fd)
            else:
                self._remove_held([self._staged_index.name])
        await super()._abort(cause)


def _taken(tensors: Mapping[str, Any]) -> tuple[dict[str, Array], list[TensorSpec]]:
    """The arrays ``tensors`` are written as (:func:`~stream_st.core.arrays.as_array`), and
    their plan entries (:func:`~stream_st.core.arrays.spec_of`: a torch ``float4_e2m1fn_x2``
    tensor is F4, its last dimension doubled, as :func:`~stream_st.save` writes it)."""
    arrays = {name: as_array(value, name) for name, value in tensors.items()}
    return arrays, [spec_of(name, tensors[name], array) for name, array in arrays.items()]


def _rows_problem(arrays: Mapping[str, Array], samples: int) -> str | None:
    """Which one of ``arrays`` (a batch of ``samples`` samples, see
    :meth:`DatasetWriter.write_batch`) does not hold ``samples`` rows, a leading dimension of
    that size; None where every one does."""
    for name, array in arrays.items():
        if array.ndim == 0:
            return (
                f"column {name!r:.80} is 0-d (a single value): a batch of {samples} samples holds "
                f"[{samples}, ...] of every column"
            )
        if array.shape[0] != samples:
            return (
                f"column {name!r:.80} holds {array.shape[0]} rows (shape {list(array.shape)}), not "
                f"samples={samples}: a batch holds one row of every column per sample"
            )
    return None


def _refuse(problem: str | None) -> None:
    """:class:`UsageError` saying ``problem`` (:func:`_rows_problem`,
    :meth:`DatasetWriter._schema_problem`) of a batch, where there is one."""
    if problem:
        raise UsageError(f"write_batch: {problem}; nothing of the batch was written")


def make_folders(directory: Path, made: dict[Path, tuple[int, int]]) -> None:
    """Make ``directory`` and the folders above it that are missing (as ``mkdir -p`` does), each
    one made here put in ``made`` as it is made, with its device and inode (:func:`_identity`):
    not one made by another meanwhile, which :func:`remove_new_folders` then leaves."""
    for folder in reversed(missing_folders(directory)):
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue
        made[folder] = _identity(folder)


def missing_folders(directory: Path) -> list[Path]:
    """``directory`` and those above it that do not exist yet, the deepest first: what a writer
    makes, and takes away again if its write fails (:func:`remove_new_folders`). One that cannot
    be looked at (a name or path too long, a folder above it one may not search) is a
    :class:`~stream_st.TransportError` naming it, as :func:`~stream_st.save` says."""
    missing = []
    for folder in (directory, *directory.parents):
        if _existing(str(folder)) is not None:
            break
        if folder.name not in ("", ".", ".."):  # made (and removed) as the folder it names
            missing.append(folder)
    return missing


def remove_new_folders(
    folders: Sequence[Path], made: Mapping[Path, tuple[int, int]] | None = None
) -> None:
    """Remove ``folders`` (:func:`missing_folders`, the deepest first) where a failed write left
    them empty: one not empty stays, with those above it. With ``made`` (the device and inode of
    each folder the write made, :func:`make_folders`), a folder is removed only where it is
    still the one made: one another made, or put at its path once the write's was moved away,
    stays, with those above it (which hold it)."""
    for folder in folders:
        try:
            if made is not None and _identity(folder) != made.get(folder):
                break
            folder.rmdir()
        except FileNotFoundError:
            continue
        except OSError:
            break


def _dropped_open(
    directory: Path,
    mine: re.Pattern[str],
    folders: Sequence[Path],
    made: Mapping[Path, tuple[int, int]],
    pid: int,
) -> None:
    """Take away what a writer dropped unclosed left: the files under its held names in
    ``directory`` (``mine``), then the ``folders`` it made, where still those ``made``
    (:func:`remove_new_folders`). Its shards' hidden temporary files (where the file system
    has no nameless file) are among those files: their own finalizers, which remove them too,
    may run only after this one, when the writer lets its shards go, and would find the folders
    kept. In a process forked from ``pid``, the writer's, nothing is removed: the folders and
    files are the parent's, whose writer may still be at work on them."""
    if os.getpid() == pid:
        _sweep(directory, mine)
        remove_new_folders(folders, made)


def _identity(folder: Path | int) -> tuple[int, int]:
    """The device and inode of ``folder`` (or of the directory open as it): what tells it from
    another put at its path."""
    found = os.stat(folder)
    return found.st_dev, found.st_ino


_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
"""How a writer opens its directory (:func:`_open_folder`)."""


def _open_folder(directory: Path) -> Held:
    """A descriptor of ``directory``, held (closed once dropped, in C where the compiled module
    was built: :func:`~stream_st.transports.file.mmap.open_descriptor`), to list it and to
    rename and remove in it (:attr:`_RollingWriter._dir_fd`); where it may not be read (a
    folder one may only write in), ``O_PATH`` where there is one: renames and removals only,
    the listing then fails (as it failed by the path)."""
    try:
        return open_descriptor(str(directory), _FOLDER_FLAGS)
    except PermissionError:
        only_path = getattr(os, "O_PATH", 0)
        if not only_path:
            raise
        return open_descriptor(str(directory), only_path | _FOLDER_FLAGS)


def _found(name: str, folder: int | None = None) -> os.stat_result | None:
    """What ``name`` is (in the directory open as ``folder``, where given; a link itself, not
    followed); None where nothing is."""
    try:
        return os.lstat(name, dir_fd=folder)
    except FileNotFoundError:
        return None


def _claim(directory: Path) -> int | None:
    """A descriptor of ``directory`` holding a shared ``flock`` of it, the mark of a writer at
    work there (the kernel lets it go when the process ends, killed or not). First, where no
    other writer holds the directory (an exclusive lock is granted at once), remove what writers
    killed there left under held names (:data:`~stream_st.core.shards.HELD_NAME`): none is at
    work to commit them. None where the file system has no such lock (nothing is removed then)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # another writer is at work here: what looks left may be its own
        else:
            _sweep(directory)
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only for another writer's sweep
    except BaseException as exc:
        os.close(fd)
        if isinstance(exc, OSError):
            return None
        raise
    return fd


def _sweep(directory: Path, held: re.Pattern[str] = HELD_NAME) -> None:
    """Remove the files (and a staged index's folder) under held names (``held``) in
    ``directory``."""
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return
    for entry in entries:
        if held.fullmatch(entry.name):
            with contextlib.suppress(OSError):  # gone meanwhile: nothing to do
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)


def _remove_entry(name: str, folder: int | None = None) -> None:
    """Remove ``name`` (in the directory open as ``folder``, where given): a folder with what it
    holds (``_tensor_index.parquet``, or a staged one), or a file (or, as older writers made
    ``_tensor_index.parquet``, a file of that name); nothing where nothing is there."""
    found = _found(name, folder)
    if found is None:
        return
    if stat.S_ISDIR(found.st_mode):
        shutil.rmtree(name, dir_fd=folder)
    else:
        os.unlink(name, dir_fd=folder)


def tensor_index_table(rows: Iterable[tuple[str, str, Sequence[int], str]]) -> bytes:
    """The parquet bytes of ``_tensor_index.parquet``: a row ``(tensor_key, file_name, shape,
    dtype)`` per tensor of every shard (seed 003's index). Needs pyarrow (the ``spark`` extra)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(
            "writing _tensor_index.parquet needs pyarrow: pip install 'stream-st[spark]'"
        ) from None
    listed = list(rows)
    keys, files, shapes, dtypes = zip(*listed, strict=True) if listed else ((), (), (), ())
    table = pa.table(
        {
            "tensor_key": pa.array(keys, pa.string()),
            "file_name": pa.array(files, pa.string()),
            "shape": pa.array([list(shape) for shape in shapes], pa.list_(pa.int32())),
            "dtype": pa.array(dtypes, pa.string()),
        }
    )
    out = io.BytesIO()
    pq.write_table(table, out)
    return out.getvalue()


def open_sharded_writer(
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int = 5 << 30,
    prefix: str = "model",
    metadata: Mapping[str, str] | None = None,
    checksums: bool | str = False,
) -> ShardedWriter:
    """Write a sharded checkpoint into ``directory``: ``write(name, array)`` per tensor, a new
    shard whenever the next tensor would take the current one past ``max_shard_size`` bytes of
    data, then ``{prefix}.safetensors.index.json``. A single shard is named
    ``{prefix}.safetensors``; ``prefix`` is a plain file name (no ``/``, surrounding spaces,
    control characters, ``\\``, ``:``, ``?`` or ``#``, nor the start of a name a writer holds
    until its commit, ``.<8 hex digits>.partial.``) short enough for the directory to take
    ``{prefix}-NNNNN-of-NNNNN.safetensors`` (27 bytes longer), refused with ``metadata`` that is no
    mapping of strings before anything is written. ``checksums=True`` (or an algorithm's name)
    records each tensor's digest in its shard's ``__metadata__``, as
    :func:`~stream_st.open_writer` does; without it, a digest record in ``metadata``
    (``stream_st.digest``...) is left out of the shards and the index, as
    :func:`~stream_st.save` leaves it out. Shards of an earlier checkpoint of the same prefix
    that the new index does not name (``{prefix}.safetensors``,
    ``{prefix}-NNNNN-of-NNNNN.safetensors``) are removed, as
    transformers' ``save_pretrained`` removes them: loaders take a ``{prefix}.safetensors``
    before the index, so that one goes before the new index is in place, the others once it is.
    A process killed at any point of the commit leaves the previous checkpoint whole, the new
    one whole, or no index."""
    return ShardedWriter(
        directory,
        max_shard_size=max_shard_size,
        prefix=prefix,
        metadata=metadata,
        checksums=checksums,
    )


def open_dataset_writer(
    directory: str | os.PathLike[str],
    *,
    target_shard_size: int = 256 << 20,
    task_id: int = 0,
    checksums: bool | str = False,
    generate_index: bool = False,
) -> DatasetWriter:
    """Write a dataset into ``directory``: ``write_batch({name: array}, samples)`` per group, shards
    rolled over at ``target_shard_size`` bytes of data, or when a group repeats a name of the
    current shard (batch mode: one batch of every column per shard, every batch of the same
    columns), then ``dataset_manifest.json``; the shards of an earlier dataset there that it
    does not list are removed then. ``checksums`` as for :func:`open_sharded_writer`.
    ``task_id`` (an integer >= 0, default 0) is the task number every shard's name carries,
    ``part-{task_id:05d}-{index:04d}-{uuid}.safetensors``, as a Spark task names its shards.
    ``generate_index=True`` also writes ``_tensor_index.parquet`` (a row per tensor: key, shard,
    shape, dtype), as the Spark writer's option of that name does; it needs pyarrow. It is
    ``True`` or ``False`` (anything else an :class:`~stream_st.ArgumentTypeError`)."""
    return DatasetWriter(
        directory,
        target_shard_size=target_shard_size,
        task_id=task_id,
        checksums=checksums,
        generate_index=generate_index,
    )
