"""The reference package's API (``safe_open``, ``load_file``, ``save_file``, ``load``) over the
async core, synchronous, for any framework: what :mod:`stream_st.torch` and :mod:`stream_st.numpy`
are made of, beside :mod:`._local` (a local file read) and :mod:`._save` (``save`` and a local
file written), which need no event loop.

Every call runs on a private event loop (``stream_st.compat._sync``); a :class:`SafeOpen` keeps one
for
as long as it is open, with its source (a file, a connection to a server) open on it, so reading
tensors one by one costs one ranged read each. A source that cannot jump (``tcp://``, a pipe) is
read whole when opened. With ``backend="mmap"`` (the default, as in the reference) a local file is
mapped privately instead: its tensors are writable copy-on-write views of the file
(``stream_st.transports.file.mmap``). Digests a header records are checked for every whole tensor
read
(``verify``); a source other than a local file is read through :mod:`._checkpoint`. Not public
API.
"""

from __future__ import annotations

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import (
    TYPE_CHECKING,
    Any,
    Generic,
    Literal,
    NoReturn,
    Self,
    TypeAlias,
    TypeVar,
    Unpack,
    cast,
    overload,
)

import numpy as np

from .._api import save as save_async
from .._api import stream_for
from ..core.arrays import (
    framework_of,
    is_torch_tensor,
    one_cpu,
    raw_bytes,
    to_torch,
    torch_device,
    torch_dtype,
    torch_shape,
)
from ..core.header import (
    LENGTH_PREFIX_SIZE,
    Header,
    TensorInfo,
    parse_header,
    parse_header_length,
)
from ..errors import (
    ArgumentTypeError,
    DeviceError,
    IntegrityError,
    TensorNotFoundError,
    UsageError,
    boolean,
)
from ..memory.delivery import Delivery
from ..reader import Include
from ..reader.caps import NO_CAPS, Caps
from ..reader.stream import tensor_dict
from ..transports.inmemory import as_bytes_view
from ..transports.options import Clock, TransportOptions, clock_of
from ..transports.registry import Sink, SinkLike, SourceLike
from ._checkpoint import Rows, _Checkpoint, _Options
from ._errors import (
    FileClosedError,
    SliceError,
    WrongTypeError,
)
from ._local import LocalFile, aligned, local_path, refuse_missing
from ._save import check_metadata, checked_tensors
from ._serialize import TensorSpec, specs_of, write_specs
from ._slicing import (
    LAST_WHOLE,
    as_bytes,
    byte_plan,
    leading,
    packed_tensor,
    pick,
    plan,
    takes_whole,
    torch_rows,
)
from ._sync import Bridge, check_sync_address, run

if TYPE_CHECKING:
    import torch

    from ..transports.cache import CacheLike

    _Public: TypeAlias = object  # for checkers stream_st.compat.safe_open is SafeOpen itself
else:
    from . import safe_open as _Public  # the reference's class, light, which a handle is of

__all__ = [
    "SafeOpen",
    "Slice",
    "load_bytes",
    "load_file",
    "maps",
    "retyped_views",
    "save_file",
    "serialize",
    "serialize_file",
]

BACKENDS = ("mmap", "pread")

# What a handle (and its slices) hands out: torch tensors for framework="pt", numpy arrays for
# "np"; a bare ``safe_open`` (the reference's class, written in an annotation) is any framework's.
# typing's TypeVar takes a default from Python 3.13 on; checkers know typing_extensions' (their
# own stubs: it is not imported when the code runs).
if TYPE_CHECKING:
    from typing_extensions import TypeVar as DefaultTypeVar

    TensorT = DefaultTypeVar("TensorT", covariant=True, default=Any)
else:
    TensorT = TypeVar("TensorT", covariant=True)


def maps(backend: object) -> bool:
    """Whether ``backend`` maps local files (``"mmap"``) rather than reading each tensor into
    fresh memory (``"pread"``); :class:`UsageError` if it is neither (an
    :class:`ArgumentTypeError`, a ``TypeError`` too as the reference's, if it is no string)."""
    if backend not in BACKENDS:
        wrong = ArgumentTypeError if not isinstance(backend, str) else UsageError
        raise wrong(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend == "mmap"


def _on_cpu(device: object) -> None:
    """Refuse ``device`` for numpy arrays, which live on the CPU, unless it is the CPU device,
    taken as for torch tensors (``"cpu"``, ``"cpu:0"``, a ``torch.device`` of either; without
    torch, such a name as torch spells it): a :class:`UsageError`; a :class:`DeviceError` (a
    ``ValueError`` too, as the reference's) for a CPU but the one (``"cpu:1"``, with torch or
    without), or for a name torch does not know (``"cuda:x"``), where torch is there to tell."""
    if device is None or (isinstance(device, str) and device == "cpu"):
        return
    try:
        if torch_device(device) is None:  # a CPU device
            return
    except DeviceError:  # a name torch does not know, or a CPU but the one
        raise
    except UsageError:  # torch missing, or a device this torch cannot use: refused below
        kind, _, index = str(device).partition(":")
        if (
            isinstance(device, str)
            and kind == "cpu"
            and index.isascii()
            and index.isdigit()
            and str(int(index)) == index
        ):
            one_cpu(device, int(index))
            return  # "cpu:0" without torch to tell
    raise UsageError(f"device={device!r}: numpy arrays live on the CPU")


def _metadata(header: Header) -> dict[str, str] | None:
    """What the reference's ``metadata()`` gives for ``header``: its ``__metadata__``, ``{}``
    where it is there but empty, None where it is not there."""
    return dict(header.metadata) if header.metadata or header.has_metadata else None


def _shut(bridge: Bridge, checkpoint: _Checkpoint) -> None:
    try:
        if bridge.here:  # in a forked copy, the connections are the parent's: let them be
            bridge.call(checkpoint.aclose)
    finally:
        bridge.close()


Read: TypeAlias = Callable[[TensorInfo, Rows], np.ndarray[Any, Any]]
"""Reads a tensor's rows (``None``: the whole tensor, checked against its digest if any)."""


class _Checks:
    """What a handle's digest checks found, applied to its reads (:meth:`read`): rows that
    cover a tensor (``(0, n)`` of ``n``: every byte of it, whatever a key then takes of its
    other dimensions) are read as the whole tensor, so checked, at no more cost; a tensor that
    failed its check is handed out in no part (a slice of it, which cannot be checked, is an
    :class:`~stream_st.IntegrityError`), and a whole read of it is checked again."""

    def __init__(self) -> None:
        self._failed: dict[str, tuple[str, str]] = {}  # name -> the failure's message, source

    def read(self, read: Read, info: TensorInfo, rows: Rows) -> np.ndarray[Any, Any]:
        """``read(info, rows)``, as :class:`_Checks` has it."""
        if rows is not None and rows == (0, info.shape[0]):
            rows = None
        failed = self._failed.get(info.name)
        if failed is not None and rows is not None:
            message, source = failed
            raise IntegrityError(
                f"tensor {info.name!r} failed its digest check on this handle: no part of it "
                f"is delivered ({message})",
                name=info.name,
                source=source,
            )
        with self.noting():
            array = read(info, rows)
        if rows is None:  # checked whole (a remote copy damaged on the way, read again)
            self._failed.pop(info.name, None)
        return array

    @contextlib.contextmanager
    def noting(self) -> Iterator[None]:
        """Remember the tensor whose check fails in the block (the message only: the error's
        frames would keep its bytes)."""
        try:
            yield
        except IntegrityError as exc:
            if exc.name is not None:
                self._failed[exc.name] = (str(exc), exc.source)
            raise


class SafeOpen(_Public, Generic[TensorT]):
    """A safetensors file (or sharded checkpoint) opened for reading tensors by name: what the
    reference's ``safe_open`` gives (:class:`stream_st.compat.safe_open`, whose subclass this is:
    calling that makes one of these). Close it with ``with`` or :meth:`close`; every method but
    those of a :class:`Slice` already taken then raises ``File is closed`` (a
    :class:`~stream_st.UsageError`), as does a call another thread had begun and the close cut
    short.

    ``filename``: a file, URL or index (named as in the reference); ``framework``: ``"pt"``
    (torch tensors) or ``"np"`` (numpy arrays), required as in the reference; ``device``:
    where tensors are handed out, as for :func:`stream_st.torch.load_file` (numpy arrays: the
    CPU only); ``cache=`` and the transport options (``headers=``, ``timeout=``, ...) for a
    remote source, as for :func:`stream_st.open_stream`. Read with ``keys()``,
    ``offset_keys()``, ``metadata()``, ``get_tensor(name)``, ``get_tensors()``,
    ``get_slice(name)[...]``.

    A local file is read synchronously: with ``backend="mmap"`` it is mapped privately and its
    descriptor closed at once, so an open handle holds no descriptor and no thread (torch
    tensors are copy-on-write views of the mapping, a write into one seen by later reads, as the
    reference's are; numpy arrays are copies of their own, as the reference's are: see
    :meth:`_shares`); ``"pread"`` keeps the descriptor and reads each tensor into fresh memory.
    Other sources (URLs, an index's shards) are read on a private event loop the handle keeps,
    an index's local shards mapped as a local file is, others one ranged read per tensor; a
    slice over the first dimension reads only those rows' bytes. Slices index as the
    reference's do (see :mod:`._slicing`). ``verify`` checks each whole tensor read
    (``get_tensor``, ``get_tensors``, a ``get_slice`` key taking every row) against the digest
    the header records for it, if any (a ``verify`` that is no bool is an
    :class:`~stream_st.ArgumentTypeError`, as everywhere); a ``get_slice`` of some rows cannot
    be checked (a digest covers the whole tensor), but one of a tensor that failed its check on
    the handle is refused (:class:`_Checks`).

    A handle takes no attribute but its own (``handle.foo = 1`` is an ``AttributeError``), as
    the reference's takes none; unlike it, it may be referred to weakly (what closes a remote
    source's connections when a handle is dropped unclosed needs that).

    For type checkers a handle is ``safe_open[torch.Tensor]`` opened with ``framework="pt"``,
    ``safe_open[np.ndarray[Any, Any]]`` with ``"np"``: what its ``get_tensor``, ``get_tensors``
    and slices hand out; ``safe_open`` alone (a framework named only when the code runs) hands
    out ``Any``. ``safe_open[...]`` is for checkers only: write it in an annotation quoted, or
    under ``from __future__ import annotations``."""

    __slots__ = (
        "__weakref__",
        "_bridge",
        "_checkpoint",
        "_checks",
        "_closed",
        "_closer",
        "_device",
        "_local",
        "_torch",
    )

    @overload
    def __init__(
        self: SafeOpen[torch.Tensor],
        filename: SourceLike,
        framework: Literal["pt", "torch", "pytorch"],
        device: str | int | torch.device = "cpu",
        *,
        backend: str = "mmap",
        verify: bool = True,
        cache: CacheLike = None,
        **options: Unpack[TransportOptions],
    ) -> None: ...

    @overload
    def __init__(
        self: SafeOpen[np.ndarray[Any, Any]],
        filename: SourceLike,
        framework: Literal["np", "numpy"],
        device: str | int | torch.device = "cpu",
        *,
        backend: str = "mmap",
        verify: bool = True,
        cache: CacheLike = None,
        **options: Unpack[TransportOptions],
    ) -> None: ...

    @overload
    def __init__(
        self: SafeOpen[Any],
        filename: SourceLike,
        framework: str,
        device: str | int | torch.device = "cpu",
        *,
        backend: str = "mmap",
        verify: bool = True,
        cache: CacheLike = None,
        **options: Unpack[TransportOptions],
    ) -> None: ...

    def __init__(
        self,
        filename: SourceLike,
        framework: str,
        device: str | int | torch.device = "cpu",
        *,
        backend: str = "mmap",
        verify: bool = True,
        cache: CacheLike = None,
        **options: Unpack[TransportOptions],
    ) -> None:
        verify = boolean("verify", verify)
        self._torch = framework_of(framework, required=True)
        if self._torch:
            self._device = torch_device(device)
        else:
            _on_cpu(device)
            self._device = None
        check_sync_address(filename, "source")
        clock = clock_of(options) if options else Clock()
        mapped = maps(backend)
        self._local: LocalFile | None = None
        self._bridge: Bridge | None = None
        self._closer: Callable[[], Any] | None = None
        self._closed = False
        self._checks = _Checks()
        path = local_path(filename)
        if path is not None:
            self._local = LocalFile(path, mapped=mapped, verify=verify)
            return
        how = _Options(clock, verify, mapped, cache)
        bridge = Bridge()
        try:
            self._checkpoint = bridge.call(_Checkpoint.open, filename, how)
        except BaseException:
            bridge.close()
            raise
        self._bridge = bridge
        self._closer = weakref.finalize(self, _shut, bridge, self._checkpoint)

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        """``File is closed`` (:class:`FileClosedError`) if the handle is, else run the block:
        an error from it once another thread has closed the handle meanwhile (a read cut short,
        its source or mapping gone) is ``File is closed`` too, chained from it."""
        if self._closed:
            raise FileClosedError()
        try:
            yield
        except Exception as exc:
            if not self._closed:
                raise
            raise FileClosedError() from exc

    def _out(self, array: np.ndarray[Any, Any], info: TensorInfo) -> TensorT:
        if self._torch:
            return cast(TensorT, self._place(to_torch(array, info.dtype, info.shape)))
        return cast(TensorT, array.copy() if self._shares(info) else aligned(array))

    def _shares(self, info: TensorInfo) -> bool:
        """Whether ``info``'s arrays are views of a mapping (a local file's, or that of the
        index's shard holding it), which numpy's are not to be: the reference hands out each
        numpy array a copy of its own (a caller writing to one must not change the next one it
        reads). Torch tensors stay views, as the reference's are. Read fresh
        (``backend="pread"``, a remote source), an array is already the caller's own."""
        local = self._local
        if local is not None:
            return local.mapped
        return self._checkpoint.mapped(info.name)

    def _place(self, tensor: Any) -> Any:
        """``tensor`` on the handle's device."""
        return tensor if self._device is None else tensor.to(self._device)

    def _info(self, name: str) -> TensorInfo:
        if not isinstance(name, str):  # as the reference's argument check words it
            raise WrongTypeError(
                f"argument 'name': '{type(name).__name__}' object is not an instance of 'str'"
            )
        local = self._local
        if local is not None:
            if name not in local.header:
                raise TensorNotFoundError(f"File does not contain tensor {name}")
            return local.header[name]
        assert self._bridge is not None
        return self._bridge.call(self._checkpoint.info, name)

    def keys(self) -> list[str]:
        """The tensors' names, sorted."""
        with self._reading():
            if self._local is not None:
                return sorted(self._local.header.names())
            return sorted(self._checkpoint.where)

    def offset_keys(self) -> list[str]:
        """The tensors' names in the order of their bytes (for an index, shard after shard in
        the order :func:`~stream_st.open_stream` reads them, whichever were read before)."""
        with self._reading():
            if self._local is not None:
                return self._local.header.names()
            assert self._bridge is not None
            headers = self._bridge.call(self._checkpoint.headers)
            return [name for header in headers for name in header.names()]

    def metadata(self) -> dict[str, Any] | None:
        """The header's ``__metadata__`` (``None`` if it has none); an index's ``metadata``
        (typed ``Any``: a header's values are strings, an index's whatever its JSON holds, such
        as the number ``total_size``)."""
        with self._reading():
            if self._local is not None:
                return _metadata(self._local.header)
            index = self._checkpoint.index
            if index is not None:
                return dict(index.metadata) or None
            return _metadata(self._checkpoint.files[""].header)

    def get_tensor(self, name: str) -> TensorT:
        """The whole tensor ``name``, viewed in the mapped file (or read from the source now)
        and checked against its digest, if the header records one."""
        with self._reading():
            info = self._info(name)
            return self._out(self._reader(info)(None), info)

    def get_tensors(self) -> dict[str, TensorT]:
        """Every tensor, in offset order, each checked as by :meth:`get_tensor`."""
        with self._reading():
            if self._local is not None:
                tensors = self._local.header.tensors
                return {t.name: self._out(self._reader(t)(None), t) for t in tensors}
            assert self._bridge is not None
            with self._checks.noting():
                arrays = self._bridge.call(self._checkpoint.read_all)
            headers = self._bridge.call(self._checkpoint.headers)
            infos = {t.name: t for header in headers for t in header.tensors}
            return {name: self._out(array, infos[name]) for name, array in arrays.items()}

    def get_slice(self, name: str) -> Slice[TensorT]:
        """A :class:`Slice` of tensor ``name``: index it to read part of it."""
        with self._reading():
            info = self._info(name)
            if self._torch:
                return Slice(info, self._reader(info), place=self._place)
            return Slice(info, self._reader(as_bytes(info) or info), copy=self._shares(info))

    def _reader(self, info: TensorInfo) -> Callable[[Rows], np.ndarray[Any, Any]]:
        """Reads ``info``'s rows (all of them for None), as :class:`_Checks` has it."""
        local = self._local
        read: Read
        if local is not None:
            read = local.array
        else:
            bridge = self._bridge
            assert bridge is not None
            read = functools.partial(bridge.call, self._checkpoint.read)
        return functools.partial(self._checks.read, read, info)

    def close(self) -> None:
        """Close the file (a mapped one's views stay valid); for a remote source, its
        connections and the private event loop."""
        self._closed = True
        self._local = None  # the file goes with the last tensor or slice using it
        if self._closer is not None:
            self._closer()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> NoReturn:
        """Refused, where ``async with`` was a bare ``TypeError``: the handle is entered with
        a plain ``with``, also inside a coroutine."""
        raise UsageError("safe_open is a context manager: use `with`, not `async with`")

    async def __aexit__(self, *exc_info: object) -> None:
        """Never called (:meth:`__aenter__` raises); ``async with`` wants it to call that."""

    def __reduce__(self) -> Any:
        raise _unpicklable("safe_open")


def _unpicklable(kind: str) -> ArgumentTypeError:
    """A handle or slice holds a descriptor, a mapping or an event loop of this process: a copy
    elsewhere would read another file through a reused descriptor number, or nothing (another
    process: a DataLoader's spawned worker). Refused, as the reference refuses it; open the
    file again there."""
    return ArgumentTypeError(
        f"cannot pickle 'builtins.{kind}' object: open the file again where it is needed"
    )


class Slice(Generic[TensorT]):
    """Part of one tensor, read on indexing: ``f.get_slice(name)[2:5]``, ``[0]``, ``[..., :3]``,
    ``[1:3, ::2]``: numpy arrays by the reference's strict rules, torch tensors as torch indexes
    them (``place`` given: it puts a tensor on the handle's device; see
    :mod:`stream_st.compat._slicing`). Only the rows the first index selects are read from the
    source (``read`` reads rows of the array a tensor is delivered as; a tensor delivered as its
    packed bytes, :func:`~._slicing.as_bytes`, is read as bytes, a slice of it is the bytes of
    whole rows); the other indexes apply to them in memory. A digest covers a whole tensor, so
    some rows of one cannot be checked against it: only a key taking every row (``[...]``,
    ``[:, 5:6]``, a mask) is (a part of a mapped tensor not yet checked is read as a copy, so
    that writing to it changes nothing such a check reads); no rows of a tensor that failed its
    check are. numpy arrays are copies of their own (``copy``), as the
    reference's are. A slice of a local file still
    reads after the file is closed, as the reference's do. It takes no attribute but its own,
    as the reference's takes none. For type checkers it hands out what its handle does
    (``Slice[torch.Tensor]`` of a ``safe_open[torch.Tensor]``)."""

    __slots__ = ("_copy", "_info", "_place", "_read")

    def __init__(
        self,
        info: TensorInfo,
        read: Callable[[Rows], np.ndarray[Any, Any]],
        *,
        place: Callable[[Any], Any] | None = None,
        copy: bool = False,
    ) -> None:
        self._info = info
        self._read = read
        self._place = place
        self._copy = copy  # numpy arrays read as views of a mapping are handed out as copies

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The tensor's safetensors dtype code (``"F32"``, ``"BF16"``, ...)."""
        return self._info.dtype

    def __reduce__(self) -> Any:
        raise _unpicklable("PySafeSlice")

    def __getitem__(self, key: object) -> TensorT:
        if self._place is not None:
            return cast(TensorT, self._torch_item(key, self._place))
        info = self._info
        planned = plan(key, info.shape)
        if as_bytes(info) is not None:  # read as its bytes (get_slice), a row a line
            span = byte_plan(planned, info)
            picked = self._read(span.span).reshape(span.lines)[span.index].reshape(-1)
        else:
            rows, index = planned.rows, planned.index
            if info.dtype_info.packed and info.shape:  # F4 (its last dimension halved), 1-D
                last = len(info.shape) - 1
                if len(index) > last and not takes_whole(index[last], info.shape[last]):
                    raise SliceError(f"{packed_tensor(info.name, info.dtype)}: {LAST_WHOLE}")
                index = index[:last]
                if not last:
                    rows = None
            picked = self._read(rows)[(*index, ...)]  # an array even where ints name one value
        return cast(
            TensorT,
            picked.copy() if self._copy or not picked.flags.c_contiguous else aligned(picked),
        )

    def _torch_item(self, key: object, place: Callable[[Any], Any]) -> Any:
        """``key`` taken by torch from the rows it names (on the CPU: only what it takes goes
        to the handle's device)."""
        info = self._info
        packed = info.dtype_info.packed and bool(info.shape)
        if packed:  # torch indexes the bytes, two values each, over the leading dimensions
            torch_shape(info.dtype, info.shape)  # refuses an F4 tensor no torch tensor holds
            key = leading(key, info.shape, packed_tensor(info.name, info.dtype))
        rows, key = torch_rows(key, info.shape[:-1] if packed else info.shape)
        array = self._read(rows)
        picked = pick(to_torch(array, "U8" if packed else info.dtype, array.shape), key)
        if packed:
            picked = picked.view(torch_dtype(info.dtype))
        return place(picked)  # a view where torch gives one, as the reference's


class _BytesSink(Sink):
    """The message written into memory, for :func:`save_bytes`."""

    random_access = True
    name = "<bytes>"

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    async def allocate(self, size: int) -> None:
        self.data = bytearray(size)

    async def send(self, buffer: memoryview) -> None:
        await self.write_at(self.position, buffer)
        self.position += len(buffer)

    async def write_at(self, offset: int, buffer: memoryview) -> None:
        self.data[offset : offset + len(buffer)] = buffer

    async def aclose(self) -> None:
        pass

    async def abort(self) -> None:
        self.data = bytearray()


def save_file(
    tensors: Mapping[str, Any],
    dst: SinkLike,
    metadata: Mapping[str, str] | None = None,
    checksums: bool | str = False,
    **options: Any,
) -> None:
    """Write ``tensors`` to ``dst`` as the reference writer lays them out (``checksums``: with
    every tensor's digest recorded, see :func:`~stream_st.save`), streamed on an event loop (the
    facades write a local file at once themselves, ``_save.save_local``, when nothing else is
    asked for)."""
    check_sync_address(dst, "destination")
    checked = checked_tensors(tensors)
    run(_save, checked, dst, check_metadata(metadata), checksums, options)


def save_specs_file(
    specs: Mapping[str, TensorSpec], dst: SinkLike, metadata: Mapping[str, str] | None
) -> None:
    """Write the tensors ``specs`` point at to ``dst`` (for ``serialize_file``)."""
    check_sync_address(dst, "destination")
    run(write_specs, os.fspath(dst) if isinstance(dst, os.PathLike) else dst, specs, metadata)


def save_specs_bytes(specs: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None) -> bytes:
    """The bytes of a file holding the tensors ``specs`` point at (for ``serialize``)."""
    sink = _BytesSink()
    run(write_specs, sink, specs, metadata)
    return bytes(sink.data)


async def _save(
    tensors: Mapping[str, Any],
    dst: SinkLike,
    metadata: Mapping[str, str] | None,
    checksums: bool | str,
    options: TransportOptions,
) -> None:
    await save_async(dst, tensors, metadata=metadata, checksums=checksums, **options)


def load_file(
    src: SourceLike, torch: bool, backend: str, verify: bool, **options: Any
) -> dict[str, Any]:
    """Every tensor of ``src`` (a file, URL or index), as numpy arrays or torch tensors, read
    on an event loop (the facades map a local file themselves, ``_local.load_mapped``,
    when nothing else is asked for)."""
    copy = not maps(backend)
    check_sync_address(src, "source")
    refuse_missing(src)
    cache = options.pop("cache", None)  # cache= (stream_st._api)
    include = options.pop("include", None)  # include= (stream_st.torch.load_file)
    caps = Caps.of(options.pop("max_tensor_bytes", None), options.pop("max_total_bytes", None))
    return run(_load, src, torch, verify, copy, clock_of(options), cache, caps, include)


def load_bytes(data: bytes | bytearray | memoryview, torch: bool, verify: bool) -> dict[str, Any]:
    """Every tensor of a safetensors file given as bytes (or a bytearray or memoryview)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ArgumentTypeError(f"load takes the bytes of a file, got {type(data).__name__}")
    return run(_load, data, torch, verify, True, Clock())


def retyped_views(
    data: bytes | bytearray | memoryview,
    tensors: Mapping[str, Any],
    types: Mapping[str, object],
    built_in: Mapping[str, object],
) -> list[tuple[str, dict[str, Any]]]:
    """The tensors of ``data`` whose dtype code ``types`` (a drop-in's ``_TYPES``, which
    programs patch as they patch the reference's) maps to another dtype than ``built_in`` (the
    table as the drop-in made it) does, or no longer holds, as :func:`~._serialize.deserialize`
    gives tensors, each one's ``data`` the memory of its tensor in ``tensors`` (what
    :func:`load_bytes` gave for ``data``, checked; no copy): for the drop-in's ``_view2np`` or
    ``_view2torch`` to view as the patched dtype (or fail, a code removed, as the reference's
    ``load`` fails), as the reference's ``load`` does. None (an empty list), at the cost of
    comparing the two tables, while ``types`` is unpatched."""
    if types == built_in:
        return []
    codes = {code for code, kind in types.items() if code not in built_in or built_in[code] != kind}
    codes.update(built_in.keys() - types.keys())  # removed: the drop-in's lookup fails there
    view = as_bytes_view(data)
    length = parse_header_length(view[:LENGTH_PREFIX_SIZE])
    header = parse_header(view[LENGTH_PREFIX_SIZE : LENGTH_PREFIX_SIZE + length])
    return [
        (
            info.name,
            {"dtype": info.dtype, "shape": list(info.shape), "data": _memory(tensors[info.name])},
        )
        for info in header.tensors
        if info.dtype in codes
    ]


def _memory(tensor: Any) -> np.ndarray[Any, Any]:
    """The memory of a contiguous array or CPU tensor as a 1-D ``uint8`` array (no copy)."""
    if is_torch_tensor(tensor):
        return raw_bytes(tensor)
    flat: np.ndarray[Any, Any] = tensor.reshape(-1).view(np.uint8)
    return flat


async def _load(
    src: SourceLike,
    torch: bool,
    verify: bool,
    copy: bool,
    clock: Clock,
    cache: Any = None,
    caps: Caps = NO_CAPS,
    include: Include = None,
) -> dict[str, Any]:
    """Every tensor of ``src`` as :func:`load_file` and :func:`load_bytes` give them (numpy
    arrays each :func:`~._local.aligned`, as the reference's are)."""
    delivery = Delivery("pt" if torch else "np", writable=True)
    stream = stream_for(
        src,
        include=include,
        verify=verify,
        clock=clock,
        delivery=delivery,
        copy=copy,
        cache=cache,
        max_tensor_bytes=caps.tensor,
        max_total_bytes=caps.total,
    )
    tensors = await tensor_dict(stream)
    return tensors if torch else {name: aligned(array) for name, array in tensors.items()}


def serialize(
    tensor_dict: Mapping[str, TensorSpec], metadata: Mapping[str, str] | None = None
) -> bytes:
    """The bytes of a safetensors file holding the tensors ``tensor_dict``'s specs point at."""
    return save_specs_bytes(specs_of(tensor_dict), check_metadata(metadata))


def serialize_file(
    tensor_dict: Mapping[str, TensorSpec],
    filename: str | os.PathLike[str],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write the tensors ``tensor_dict``'s specs point at to ``filename`` (a path or any
    destination stream_st writes to); nothing is left there if it fails. The GIL is free while
    the bytes are written."""
    save_specs_file(specs_of(tensor_dict), filename, check_metadata(metadata))
