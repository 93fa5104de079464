"""A drop-in for ``safetensors.torch``: the same names, arguments and results, synchronous, over
every source and destination stream_st reads and writes (paths, ``http(s)://``, ``s3://``,
``hf://``, ``tcp://``, a sharded checkpoint's ``*.index.json``)::

    import stream_st.torch as safetensors_torch  # was: import safetensors.torch

    tensors = safetensors_torch.load_file("https://host/model.safetensors")
    safetensors_torch.save_file(tensors, "s3://bucket/model.safetensors")
    missing, unexpected = safetensors_torch.load_model(model, "hf://org/repo/model.safetensors")

Every call runs the async core on a private event loop (in the calling thread, or in a worker
thread when the calling thread runs an event loop already), so it works from a plain script, from
any thread, and inside a running event loop (a notebook cell, async code calling sync code)
alike. Beyond the reference's arguments, each call that takes an address also takes stream_st's
transport options (``headers=``, ``ssl_context=``, ``timeout=``, ``deadline=``, ``speed_limit=``,
``speed_time=``). Every dtype torch shares with safetensors is
read and written, BF16, the F8 family, F4, BOOL and U16/U32/U64 included.

A local file is mapped, as the reference maps it: ``load_file`` and ``safe_open`` hand out its
tensors as writable copy-on-write views of a private mapping (writes stay in this process, never
reach the file). Other sources are read straight into each tensor's own memory, handed over
without a further copy; so is a local file with ``backend="pread"``.

Integrity, beyond the reference: ``save_file``, ``save`` and ``save_model`` take
``checksums=True`` (or an algorithm's name) to record every tensor's digest in the metadata (off
by default, so files stay byte-identical to the reference's); ``load_file``, ``load``,
``safe_open`` and ``load_model`` check such digests unless given ``verify=False``.

Needs torch: ``pip install torch==2.13.0`` (or the ``torch`` extra from a checkout).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Unpack

from . import compat
from .compat import _local, _save, _shared, safe_open
from .compat._errors import InvalidTensorsError, MetaTensorError, NotAModuleError, TorchDtypeError
from .core.arrays import (
    TorchlessDtypeError,
    is_torch_tensor,
    load_torch,
    torch_device,
    torch_dtypes,
)
from .errors import SafetensorsError, UsageError

if TYPE_CHECKING:
    import torch

    from .compat import TensorSpec as TensorSpec
    from .compat import _reference as _facade
    from .compat import deserialize as deserialize
    from .compat import serialize as serialize
    from .compat import serialize_file as serialize_file
    from .reader import Include
    from .sharded.ranks import Slices
    from .transports.cache import CacheLike
    from .transports.options import Clock, TransportOptions
    from .transports.registry import SinkLike, SourceLike

    # Made when first asked for (__getattr__ below), declared here for checkers.
    _SIZE: dict[torch.dtype, int]
else:  # the streaming core, imported when a call needs it (see stream_st.compat._lazy)
    from .compat._lazy import reference as _facade

__all__ = [
    "TensorSpec",
    "_end_ptr",
    "_find_shared_tensors",
    "_is_complete",
    "_remove_duplicate_names",
    "deserialize",
    "load",
    "load_file",
    "load_model",
    "safe_open",
    "save",
    "save_file",
    "save_model",
    "serialize",
    "serialize_file",
    "storage_ptr",
    "storage_size",
]

_torch = load_torch()  # a clear error at import when torch is missing


def load_file(
    filename: SourceLike,
    device: str | int | torch.device = "cpu",
    *,
    backend: str = "mmap",
    verify: bool = True,
    process_group: Any = None,
    include: Include = None,
    slices: Slices | None = None,
    cache: CacheLike = None,
    max_tensor_bytes: int | None = None,
    max_total_bytes: int | None = None,
    **options: Unpack[TransportOptions],
) -> dict[str, torch.Tensor]:
    """Every tensor of ``filename`` (a file, URL or index) as ``{name: tensor}`` on the CPU.

    A local file is mapped (``backend="mmap"``, the default, as in the reference): each tensor
    is a view of a private mapping of the file, nothing copied; the tensors are writable, and a
    write copies the page for this process only (the file never changes). Use
    ``backend="pread"`` (each tensor read into fresh memory) for a file on a network file
    system, or one that may be rewritten or truncated while the tensors live: a
    mapped tensor sees such a change, and touching a page lost to truncation kills the process
    with ``SIGBUS``. Other sources are always read into fresh memory.

    Digests recorded in the header (``checksums=`` of :func:`save_file`) are checked, each
    before its tensor is handed over, unless ``verify=False``.

    ``max_tensor_bytes`` and ``max_total_bytes`` cap what the file may make the read allocate
    (:class:`~stream_st.AllocationError` before anything is), as for
    :func:`stream_st.open_stream`.

    ``device`` (``"cuda"``, ``"cuda:1"``, an index, a ``torch.device``): each tensor is received
    on the CPU (a local file mapped, as above) and copied to that device, its CPU memory let go
    as it is copied. A device this torch cannot use is a :class:`~stream_st.UsageError` before
    anything is read.

    ``process_group`` (a ``torch.distributed`` process group; every rank calls): each rank
    reads its share of the bytes, the group exchanges them, and every rank gets the tensors it
    wants; ``include=`` and ``slices=`` choose those per rank (see :mod:`stream_st.sharded.ranks`).
    Without a group, ``include=`` (names, or a predicate) reads only those tensors. ``cache=``
    (see :func:`stream_st.open_stream`) is refused with a group or ``slices=``: each rank reads
    only its share.
    """
    if process_group is not None or slices is not None:
        caps = (max_tensor_bytes, max_total_bytes)
        return _distributed_load(
            filename, process_group, include, slices, verify, device, caps, backend, cache, options
        )
    target = torch_device(device)
    given = {
        **options,
        "cache": cache,
        "include": include,
        "max_tensor_bytes": max_tensor_bytes,
        "max_total_bytes": max_total_bytes,
    }
    tensors = _local.load_mapped(filename, True, verify, backend, given)
    if tensors is None:
        tensors = _facade.load_file(
            filename,
            True,
            backend,
            verify,
            cache=cache,
            include=include,
            max_tensor_bytes=max_tensor_bytes,
            max_total_bytes=max_total_bytes,
            **options,
        )
    if target is None:
        return tensors
    return {name: tensors.pop(name).to(target) for name in list(tensors)}


def _distributed_load(
    filename: SourceLike,
    group: Any,
    include: Include,
    slices: Slices | None,
    verify: bool,
    device: str | int | torch.device,
    caps: tuple[int | None, int | None],
    backend: str,
    cache: CacheLike,
    options: Mapping[str, Any],
) -> dict[str, torch.Tensor]:
    """``load_file`` with a process group (see :mod:`stream_st.sharded.ranks`); ``caps``: its
    ``(max_tensor_bytes, max_total_bytes)``. A call this rank refuses is told to the group.
    ``backend`` is checked as without a group, though each rank reads its share into fresh
    memory whichever it names."""
    from ._api import no_cache_with_ranks
    from .compat._sync import check_sync_address, run
    from .sharded import ranks
    from .transports.options import clock_of

    try:
        _facade.maps(backend)
        no_cache_with_ranks(cache)
        check_sync_address(filename, "source")
        clock = clock_of(options)
    except SafetensorsError as exc:
        ranks.refuse(group, exc)
    return run(
        functools.partial(
            ranks.load,
            filename,
            group,
            include=include,
            slices=slices,
            verify=verify,
            clock=clock,
            device=device,
            max_tensor_bytes=caps[0],
            max_total_bytes=caps[1],
        )
    )


def load(data: bytes | bytearray | memoryview, *, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file given as ``bytes`` (or a ``bytearray`` or
    ``memoryview``), checked against the digests the header records, if any (unless
    ``verify=False``). A tensor of a dtype torch has none for (``F6_E2M3``) raises
    :class:`~stream_st.DtypeError`, a ``KeyError`` as well, as the reference raises. A dtype a
    program put into ``_TYPES`` (as programs patch the reference's: ``_TYPES["BF16"] =
    torch.int16``) is the one the tensors of its code are viewed as, as the reference's
    ``load`` views them."""
    try:
        tensors = _facade.load_bytes(data, True, verify)
    except TorchlessDtypeError as exc:
        raise TorchDtypeError(str(exc)) from None
    tensors.update(_view2torch(_facade.retyped_views(data, tensors, _TYPES, torch_dtypes())))
    return tensors


def save_file(
    tensors: dict[str, torch.Tensor],
    filename: SinkLike,
    metadata: dict[str, str] | None = None,
    *,
    checksums: bool | str = False,
    **options: Unpack[TransportOptions],
) -> None:
    """Write ``tensors`` to ``filename`` (a path or URL), laid out as the reference does.

    Refused as the reference refuses them, with its messages: anything but a dict of torch
    tensors, sparse tensors and non-contiguous ones (``ValueError``), tensors that share memory
    (``RuntimeError``: use :func:`save_model`), tensors on the ``meta`` device, metadata that is
    not ``str`` to ``str`` (``TypeError``); each error is also a
    :class:`~stream_st.SafetensorsError`. Tensors on another device are copied to the CPU, and
    tensors that require grad are detached. A failed write leaves nothing at the destination.
    ``checksums=True`` (or ``"sha256"``, ``"blake3"``) records each tensor's digest in the
    metadata for readers to check (see :mod:`stream_st.integrity`); the file then differs from
    the reference's by those metadata entries.
    """
    checked = _checked(tensors)
    if not _save.save_local(checked, filename, metadata, checksums, options):
        _facade.save_file(checked, filename, metadata, checksums, **options)


def save(
    tensors: dict[str, torch.Tensor],
    metadata: dict[str, str] | None = None,
    *,
    checksums: bool | str = False,
) -> bytes:
    """``tensors`` as the bytes of a safetensors file (see :func:`save_file`)."""
    return _save.save_bytes(_checked(tensors), metadata, checksums)


def _checked(tensors: object) -> Mapping[str, Any]:
    """``tensors`` if it is a dict of dense, contiguous torch tensors with data that share no
    memory; else the error the reference raises, as a :class:`~stream_st.SafetensorsError`."""
    if not isinstance(tensors, Mapping):
        raise InvalidTensorsError(
            f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}"
        )
    for name, tensor in tensors.items():
        if not is_torch_tensor(tensor):
            raise InvalidTensorsError(
                f"Key `{name}` is invalid, expected torch.Tensor but received {type(tensor)}"
            )
    sparse = [name for name, tensor in tensors.items() if tensor.layout != _torch.strided]
    if sparse:
        raise InvalidTensorsError(
            f"You are trying to save a sparse tensors: `{sparse}` which this library does not "
            "support. You can make it a dense tensor before saving with `.to_dense()` but be "
            "aware this might make a much larger file than needed."
        )
    shared = [sorted(group) for group in _find_shared_tensors(tensors) if len(group) > 1]
    if shared:
        raise UsageError(
            f"Some tensors share memory, this will lead to duplicate memory on disk and potential "
            f"differences when loading them again: {shared}. A potential way to correctly save "
            "your model is to use `save_model`, or pass .clone()s."
        )
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise InvalidTensorsError(
                f"You are trying to save a non contiguous tensor: `{name}` which is not allowed. "
                "It either means you are trying to save tensors which are reference of each other "
                "in which case it's recommended to save only the full tensors, and reslice at load "
                "time, or simply call `.contiguous()` on your tensor to pack it before saving."
            )
        if tensor.is_meta:
            raise MetaTensorError(
                f"Cannot copy out of meta tensor: {name!r} is on the meta device and holds no "
                "data to write"
            )
    return tensors


storage_ptr = _shared.storage_ptr
"""The address of a tensor's storage (0 for one that has none, on ``meta``), as the reference's
``storage_ptr``."""
storage_size = _shared.storage_size
"""The bytes of a tensor's storage (its own bytes for one without), as the reference's
``storage_size``."""
_end_ptr = _shared.end_ptr
_is_complete = _shared.is_complete
_find_shared_tensors = _shared.find_shared_tensors
_remove_duplicate_names = _shared.remove_duplicate_names


_TYPES: dict[str, torch.dtype] = dict(torch_dtypes())
"""Dtype code to torch dtype, for every code this torch has a dtype for: the reference's
private table, which programs import (vLLM) and patch (:func:`load` reads it when called)."""


def _getdtype(dtype_str: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code in ``_TYPES`` (``KeyError`` for one this
    torch lacks, unless patched in), as the reference's private helper that other libraries
    import (torch's checkpoint reader) is."""
    return _TYPES[dtype_str]


def _view2torch(safeview: Any) -> dict[str, torch.Tensor]:
    """The tensors of ``(name, {"dtype", "shape", "data"})`` pairs (what
    :func:`stream_st.compat.deserialize` gives), over their data, as the reference's private
    helper makes them (one of no bytes made anew: torch views no empty buffer)."""
    return {
        name: (
            _torch.frombuffer(view["data"], dtype=_getdtype(view["dtype"])).reshape(view["shape"])
            if len(view["data"])
            else _torch.empty(view["shape"], dtype=_getdtype(view["dtype"]))
        )
        for name, view in safeview
    }


if not TYPE_CHECKING:  # checkers see the names declared above, not Any for every name

    def __getattr__(name: str) -> Any:
        """Names the reference's module has that programs import from it, made when first
        asked for: ``_SIZE`` (torch dtype to its bytes per element), and ``TensorSpec``,
        ``serialize``, ``serialize_file``, ``deserialize`` (:mod:`stream_st.compat`'s, which
        import the streaming core)."""
        if name == "_SIZE":
            value: Any = {dtype: dtype.itemsize for dtype in torch_dtypes().values()}
        elif name in compat._LAZY:
            value = getattr(compat, name)
        else:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        globals()[name] = value
        return value


def save_model(
    model: torch.nn.Module,
    filename: SinkLike,
    metadata: dict[str, str] | None = None,
    force_contiguous: bool = True,
    *,
    checksums: bool | str = False,
    **options: Unpack[TransportOptions],
) -> None:
    """Write ``model``'s state dict to ``filename``, each group of tensors that share memory
    (tied weights) written once, as the reference does: the dropped names go into the metadata
    as ``{dropped: kept}`` unless it already has them. ``force_contiguous`` (the default) writes
    non-contiguous tensors packed; without it they are refused with a ``ValueError``, as in the
    reference. ``checksums`` as in :func:`save_file`."""
    state = dict(_module(model, "save_model").state_dict())
    extra = _save.check_metadata(metadata)  # a dict of its own: the caller's is left as given
    for keep, dropped in _remove_duplicate_names(state).items():
        for name in dropped:
            extra = {} if extra is None else extra
            extra.setdefault(name, keep)
            del state[name]
    if force_contiguous:
        state = {name: tensor.contiguous() for name, tensor in state.items()}
    try:
        save_file(state, filename, extra, checksums=checksums, **options)
    except InvalidTensorsError as exc:
        raise InvalidTensorsError(
            f"{exc} Or use save_model(..., force_contiguous=True), read the docs for potential "
            "caveats."
        ) from None


def load_model(
    model: torch.nn.Module,
    filename: SourceLike,
    strict: bool = True,
    device: str | int | torch.device = "cpu",
    *,
    backend: str = "mmap",
    verify: bool = True,
    assign: bool = False,
    process_group: Any = None,
    include: Include = None,
    slices: Slices | None = None,
    cache: CacheLike = None,
    **options: Unpack[TransportOptions],
) -> tuple[set[str], list[str]]:
    """Load ``filename`` (a file, URL or index) into ``model``; ``(missing, unexpected)`` names.

    Each tensor whose dtype and shape match the model's, on the CPU and contiguous, is received
    straight into the model's own memory: no second copy of the model exists at any time; on a
    CUDA device, it is copied into the model's memory there as it arrives (of a model all on the
    device, from a mapping of a local file, as :func:`load_file` reads one; else from fresh CPU
    memory, let go once copied). The others go through ``model.load_state_dict`` as in the
    reference, as do those of modules that load in their own way (a load pre-hook, as
    ``spectral_norm``'s, or a ``_load_from_state_dict`` of their own), whose code then runs as
    it runs there (not with ``assign=True``, which puts the file's tensors in place), those
    whose ``state_dict()`` entry is not the model's own parameter or buffer (a copy a
    state-dict hook gives), and conjugate or negative views. Tensors
    the model shares (tied weights) count as loaded when one of them is in the file. With
    ``strict``, missing or unexpected names raise :class:`~stream_st.UsageError` (a
    ``RuntimeError``, as the reference raises) after loading.

    ``assign=True`` (as ``torch.nn.Module.load_state_dict(assign=True)``) puts the file's tensors
    in the model instead of copying them into its memory: each parameter and buffer is replaced,
    as soon as its tensor arrives, by the loaded tensor (a parameter by a new ``Parameter`` with
    the old one's ``requires_grad``; tied names get the same one), with the file's dtype. A local
    file is then not copied at all: its tensors are views of a private mapping, as ``load_file``
    gives (``backend="pread"`` reads them into fresh memory instead); the model's old memory is
    freed tensor by tensor. It is the way to load a model built on the ``meta`` device (buffers
    the model does not save, ``persistent=False``, stay as built: set them after loading), and
    the fastest from a local file. The old parameter objects are no longer the model's: build an
    optimizer after loading. A state-dict name that is not the attribute path of its tensor (a
    state-dict hook renaming it) raises :class:`~stream_st.UsageError` before anything is read,
    a shape in the file that differs from the model's, or a dtype of no gradient (an integer
    or bool) for a parameter that requires one, before anything is replaced (of a sharded
    checkpoint, before anything of the shard that holds it is: the earlier shards' tensors are
    in the model then, as after any failed load).

    ``device`` (as for :func:`load_file`): with ``assign=True``, where the model's tensors are
    put (each copied there as it arrives, its CPU memory let go); without it, the tensors go
    into the model's own memory, wherever that is, and ``device`` is only checked (a device this
    torch cannot use is a :class:`~stream_st.UsageError` before anything is read).

    Digests recorded in the header are checked unless ``verify=False``; a tensor that fails
    has already been received into its parameter on the CPU (not into one on a device) when
    :class:`~stream_st.IntegrityError` is raised, so the model is then partly loaded, as after
    any failed load.

    ``process_group``, ``include``, ``slices``: loaded with the group, as by :func:`load_file`
    (names ``include=`` leaves out are not missing; ``assign`` is not taken then).
    """
    from ._api import no_cache_with_ranks
    from .compat._sync import check_sync_address
    from .transports.options import clock_of

    if process_group is not None or include is not None or slices is not None:
        from .sharded import ranks

        try:
            if assign:
                given = {"process_group": process_group, "include": include, "slices": slices}
                named = ", ".join(f"{key}=..." for key, value in given.items() if value is not None)
                raise UsageError(f"load_model({named}) does not take assign=True")
            _facade.maps(backend)  # checked as without a group; each rank reads into fresh memory
            no_cache_with_ranks(cache)
            clock = clock_of(options)
        except SafetensorsError as exc:  # every rank raises it, naming this one
            ranks.refuse(process_group, exc)
        return ranks.load_model(
            model,
            filename,
            process_group,
            strict=strict,
            include=include,
            slices=slices,
            verify=verify,
            clock=clock,
            device=device,
        )
    _module(model, "load_model")  # with a group, a rank's failure is told to every rank there
    target = torch_device(device)
    check_sync_address(filename, "source")
    _local.refuse_missing(filename)
    given = {**options, "cache": cache}
    read = functools.partial(_received, filename, verify, clock_of(options), cache, given)
    if assign:
        slots = _Slots(model, target)
        _, others = read(slots.place, not _facade.maps(backend), None, slots.seen, slots.fits)
        missing, unexpected = slots.outcome(others)
    else:
        missing, unexpected = _load_into(model, read, _facade.maps(backend))
    if strict and (missing or unexpected):
        raise UsageError(_shared.load_errors(model, missing, unexpected))
    return missing, unexpected


def _module(model: torch.nn.Module, call: str) -> torch.nn.Module:
    """``model`` if it has a ``state_dict`` to call; else :class:`NotAModuleError` (an
    ``AttributeError``, as the reference raises), naming what ``call`` was given."""
    if not callable(getattr(model, "state_dict", None)):
        raise NotAModuleError(f"{call} takes a torch.nn.Module, got {type(model).__name__}")
    return model


def _load_into(model: torch.nn.Module, read: _Read, maps: bool) -> tuple[set[str], list[str]]:
    """``load_model`` without ``assign``: every tensor that fits received into the model's own
    memory on the CPU, or copied into it on a CUDA device as it arrives, the others through
    ``load_state_dict``; ``(missing, unexpected)``. ``read`` reads the file (:func:`_received`);
    where the model has no tensor to receive on the CPU (all on a device, meta or not
    contiguous) and ``maps`` (``backend="mmap"``), without a copy (a local file mapped, the
    device's copies made from the mapping); else each tensor into fresh CPU memory, let go once
    copied. A model sharing memory that no name covers whole (a buffer over a slice of
    another's) is refused as by the reference (:func:`~stream_st.compat._shared.shared_groups`),
    the model as it was."""
    state = model.state_dict()
    _shared.shared_groups(state)  # memory no name covers whole: refused before any is read
    receivable = _shared.receivable(model, state)
    into = _shared.in_cpu_memory(receivable)
    on_device = {
        name: tensor for name, tensor in receivable.items() if tensor.device.type == "cuda"
    }
    overruled: set[str] = set()

    def seen(names: Collection[str]) -> None:
        dropped, fresh = _overruled(state, names)
        overruled.update(dropped)
        for name in dropped | fresh:
            into.pop(name, None)

    def place(name: str, tensor: torch.Tensor) -> bool:
        if name in overruled:  # dropped where load_state_dict takes it, else refused there
            return _takes(state[name], tensor)
        if tensor is into.get(name):  # written through another view: autograd told, as by copy_
            _shared.changed_in_place((tensor,))
            return True
        target = on_device.get(name)
        if target is None or target.shape != tensor.shape or target.dtype != tensor.dtype:
            return False
        with _torch.no_grad():
            target.copy_(tensor)  # from pageable memory: done when it returns
        return True

    try:
        placed, fresh = read(place, bool(into) or not maps, into, seen, None)
    except BaseException:  # some may hold bytes already: which, no one can tell
        _shared.changed_in_place(into.values())
        raise
    missing_list, unexpected = _shared.load_state(model, dict(fresh))
    missing = set(missing_list).difference(placed)
    in_file = placed | {name for name, _ in fresh}
    _shared.shared_counted(state, in_file, missing, unexpected)
    return missing, unexpected


def _overruled(state: Mapping[str, Any], names: Collection[str]) -> tuple[set[str], set[str]]:
    """Of the file's ``names``, where more than one of a group sharing memory is in the file:
    those ``load_state_dict`` would overwrite with a later name's (one tensor under several
    names, tied weights: all but the last in the model's order), and those to copy in the
    model's order (names that view parts of the memory otherwise: received fresh, applied by
    ``load_state_dict``). The reference's ``load_model`` ends so, whatever the file's order."""
    in_file = set(names)
    order = {name: position for position, name in enumerate(state)}
    dropped: set[str] = set()
    fresh: set[str] = set()
    for group in _shared.find_shared_tensors(state):
        present = sorted(group.intersection(in_file), key=order.__getitem__)
        if len(present) < 2:
            continue
        if len({_view_of(state[name]) for name in present}) == 1:
            dropped.update(present[:-1])
        else:
            fresh.update(present)
    return dropped, fresh


def _takes(mine: Any, tensor: Any) -> bool:
    """Whether ``load_state_dict`` takes ``tensor`` for the model's tensor ``mine``: the same
    shape, or one value of shape ``[1]`` for a tensor of none (as torch takes a checkpoint of
    its 0.3 versions); the dtype is cast."""
    shape = tuple(tensor.shape)
    return shape == tuple(mine.shape) or (mine.dim() == 0 and shape == (1,))


def _view_of(tensor: Any) -> tuple[Any, ...]:
    """What makes two tensors the same memory seen alike."""
    return (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))


class _Slots:
    """Where a model keeps each tensor of its state dict, for ``load_model(assign=True)``:
    names grouped by the tensor they share (tied weights), no tensor held (so a replaced one is
    freed at once); each tensor placed is first copied to ``device`` unless it is None (the
    CPU). A tensor that views part of another's memory (a buffer over a slice of another) is
    made again over the new tensor (:meth:`outcome`)."""

    def __init__(self, model: torch.nn.Module, device: Any | None) -> None:
        self._model, self._device = model, device
        state = model.state_dict(keep_vars=True)
        by_tensor: dict[int, list[str]] = {}
        for name, value in state.items():
            if isinstance(value, _torch.Tensor):
                by_tensor.setdefault(id(value), []).append(name)
        self._group = {name: names for names in by_tensor.values() for name in names}
        self._order = {name: position for position, name in enumerate(state)}
        self._loaded: set[str] = set()
        self._given: set[str] = set()  # the names the file had that were placed
        self._overruled: set[str] = set()  # tied names the file has with a later one (seen)
        tensors = {name: value for name, value in state.items() if name in self._group}
        for name, value in tensors.items():
            module, attribute = self._slot(name)
            if getattr(module, attribute, None) is not value:
                raise self._unplaceable(name)
        self._shared = [group for group in _shared.shared_groups(tensors) if len(group[0]) > 1]
        self._geometry = {  # of the tensors sharing memory: enough to view the new one alike
            name: _Geometry(tensors[name]) for group, _ in self._shared for name in group
        }

    def seen(self, names: Collection[str]) -> None:
        """The file has ``names``: of tied names, only the last in the model's order is placed
        (as ``load_state_dict`` copies them, the last one's values stay)."""
        in_file = set(names)
        for group in {id(group): group for group in self._group.values()}.values():
            self._overruled.update([name for name in group if name in in_file][:-1])

    def fits(self, kinds: Mapping[str, tuple[tuple[int, ...], Any]]) -> None:
        """:class:`UsageError` for the first of ``kinds`` (shape and torch dtype of a file's
        tensors, or a shard's, told before any of them is placed) that :meth:`place` would
        refuse: a shape not the model's, or a dtype no gradient is taken of (an integer or
        bool) for a parameter that requires one (which torch's ``Parameter`` refuses)."""
        for name, (shape, dtype) in kinds.items():
            names = self._group.get(name)
            if names is not None:
                module, attribute = self._slot(names[0])
                old = getattr(module, attribute)
                _check_shape(name, shape, old)
                graded = dtype.is_floating_point or dtype.is_complex
                if old.requires_grad and not graded and name not in self._overruled:
                    raise UsageError(
                        f"{name}: the file holds {dtype}, and the model's parameter requires "
                        "grad, which only a floating point or complex tensor takes (set "
                        "requires_grad_(False) first, or load without assign=True)"
                    )

    def place(self, name: str, tensor: Any) -> bool:
        """Put ``tensor`` where ``name`` (and every name tied to it) lives; False if the model
        has no such name; :class:`UsageError` for a shape that differs from the model's (shape
        [1] for a 0-d tensor is taken as its scalar, as ``load_state_dict`` takes it). A tied
        name the file has with a later one (:meth:`seen`) is checked so, taken and dropped."""
        names = self._group.get(name)
        if names is None:
            return False
        module, attribute = self._slot(names[0])
        old = getattr(module, attribute)
        _check_shape(name, tuple(tensor.shape), old)
        if old.dim() == 0 and tuple(tensor.shape) == (1,):
            tensor = tensor.reshape(())  # an old checkpoint's scalar, as load_state_dict takes it
        if name in self._overruled:
            self._given.add(name)
            return True
        if self._device is not None:
            tensor = tensor.to(self._device)
        parameter = isinstance(old, _torch.nn.Parameter)
        new = _torch.nn.Parameter(tensor, requires_grad=old.requires_grad) if parameter else tensor
        del old
        self._set(names, new)
        self._loaded.update(names)
        self._given.add(name)
        return True

    def outcome(self, others: list[tuple[str, Any]]) -> tuple[set[str], list[str]]:
        """``(missing, unexpected)`` once every tensor is placed, ``others`` those the model
        had no name for, counted as the reference's ``load_model`` counts them: of names that
        share memory, those but the one kept (see
        :func:`~stream_st.compat._shared.remove_duplicate_names`) are unexpected where the file
        has them, else not missing (:meth:`_share_again` views them in the kept tensor again).
        One that cannot be viewed so (the file's kept tensor of another dtype than the model's,
        or either laid out otherwise than plainly) is missing where the file lacks it, else the
        file's own tensor, the model's now: neither missing nor unexpected. A batch norm's count
        the file lacks is filled in (:meth:`_fills_in`)."""
        missing = set(self._group).difference(self._loaded)
        missing.difference_update([name for name in missing if self._fills_in(name)])
        unexpected = [name for name, _ in others]
        for group, complete in self._shared:
            keep = _shared.kept_name(complete, self._given, frozenset())
            sharing = self._share_again(group, keep)
            for name in sorted(sharing.difference([keep])):
                if name in self._given:
                    unexpected.append(name)
                else:
                    missing.discard(name)
        return missing, unexpected

    def _share_again(self, group: set[str], keep: str) -> set[str]:
        """The names of ``group`` (names sharing memory, ``keep`` the one kept) that share the
        kept tensor's memory once loaded: ``keep``'s ties, and each other tensor of the group
        viewed in it again (:meth:`_view_again`), or left as it was where neither it nor the
        kept one was placed. Where the file has such a tensor, its values are copied through
        the view in the model's order, as the reference's ``load_model`` copies them (those
        before the kept tensor's own, which covers them, are left out)."""
        ties = self._group[keep]
        placed = keep in self._loaded
        last = max([self._order[name] for name in ties if name in self._given], default=-1)
        sharing = set(ties)
        writes: list[tuple[int, Any, Any]] = []
        for names in {id(self._group[name]): self._group[name] for name in group}.values():
            given = [self._order[name] for name in names if name in self._given]
            if names is ties or not (given or placed):
                sharing.update(names)
                continue
            module, attribute = self._slot(names[0])
            value = getattr(module, attribute)  # the file's tensor where given
            view = self._view_again(names, keep)
            if view is None:
                continue
            sharing.update(names)
            if given and max(given) > last:
                writes.append((max(given), view, value))
        with _torch.no_grad():
            for _, view, value in sorted(writes, key=lambda write: write[0]):
                view.copy_(value)
        return sharing

    def _view_again(self, names: list[str], keep: str) -> Any | None:
        """View the tensor of ``names`` (tied names) in the one now ``keep``'s as it viewed
        ``keep``'s old one, and put it in their slots; None where the view cannot be made
        alike."""
        module, attribute = self._slot(keep)
        base = getattr(module, attribute)
        was, view = self._geometry[keep], self._geometry[names[0]]
        if not (was.plain and base.is_contiguous() and base.dtype == was.dtype):
            return None  # laid out otherwise, or of the file's dtype: its bytes are others
        at = base.storage_offset() * was.itemsize + view.offset * view.itemsize
        at -= was.offset * was.itemsize  # the view's first byte in the new storage
        if at < 0 or at % view.itemsize:
            return None
        try:  # a view of another dtype too (as .view(torch.int32) made it)
            new = _torch.empty(0, dtype=view.dtype, device=base.device).set_(
                base.untyped_storage(), at // view.itemsize, view.shape, view.stride
            )
        except RuntimeError:  # past the new storage's end
            return None
        if view.parameter:
            new = _torch.nn.Parameter(new, requires_grad=view.requires_grad)
        self._set(names, new)
        return new

    def _set(self, names: list[str], tensor: Any) -> None:
        """Put ``tensor`` (a parameter or a buffer) in the slots of ``names``."""
        parameter = isinstance(tensor, _torch.nn.Parameter)
        for each in names:
            module, attribute = self._slot(each)
            (module._parameters if parameter else module._buffers)[attribute] = tensor

    def _fills_in(self, name: str) -> bool:
        """Whether the module holding ``name`` fills it in where a file lacks it, as its
        ``load_state_dict`` does: a batch norm's ``num_batches_tracked`` (an older
        checkpoint's, written without it), the module's own count kept, or one on the meta
        device replaced by a fresh ``tensor(0)`` (on ``device``), as torch replaces it."""
        module, attribute = self._slot(name)
        norm = _torch.nn.modules.batchnorm._NormBase
        if not (
            attribute == "num_batches_tracked"
            and isinstance(module, norm)
            and module.track_running_stats
        ):
            return False
        if getattr(module, attribute).is_meta:  # no value to keep: the model could not run
            self._set([name], _torch.tensor(0, dtype=_torch.long, device=self._device))
        return True

    def _slot(self, name: str) -> tuple[torch.nn.Module, str]:
        """The module that holds ``name`` and the attribute it is there; :class:`UsageError`
        where no module is at that path."""
        owner, _, attribute = name.rpartition(".")
        try:
            return self._model.get_submodule(owner), attribute
        except AttributeError:
            raise self._unplaceable(name) from None

    @staticmethod
    def _unplaceable(name: str) -> UsageError:
        """The error for a state-dict name that is not where the model keeps its tensor."""
        return UsageError(
            f"load_model(assign=True): the model's state dict names {name!r}, which is not the "
            "path of the parameter or buffer it holds (a state-dict hook renames it?), so the "
            "file's tensor cannot be put in its place: load with assign=False (through "
            "load_state_dict, its hooks run)"
        )


def _check_shape(name: str, shape: tuple[int, ...], old: Any) -> None:
    """:class:`UsageError` unless a tensor of ``shape`` takes the place of ``old``, the model's
    tensor ``name``: of its shape, or [1] for a 0-d one (an old checkpoint's scalar)."""
    if shape != tuple(old.shape) and not (old.dim() == 0 and shape == (1,)):
        raise UsageError(
            f"size mismatch for {name}: the file has shape {list(shape)}, "
            f"the model {list(old.shape)}"
        )


class _Geometry:
    """How a tensor lies in its storage (in elements): enough to view another storage alike."""

    __slots__ = (
        "dtype",
        "itemsize",
        "offset",
        "parameter",
        "plain",
        "requires_grad",
        "shape",
        "stride",
    )

    def __init__(self, tensor: Any) -> None:
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.stride = tuple(tensor.stride())
        self.offset: int = tensor.storage_offset()
        self.itemsize: int = tensor.element_size()
        self.plain: bool = tensor.is_contiguous()
        self.parameter = isinstance(tensor, _torch.nn.Parameter)
        self.requires_grad: bool = tensor.requires_grad


_Placed = tuple[set[str], list[tuple[str, Any]]]
"""The names ``place`` took (see :func:`_received`), and the tensors it did not."""

_Fits = Callable[[Mapping[str, tuple[tuple[int, ...], Any]]], None]
"""Told the shapes and dtypes (as torch tensors hold them) of a file's tensors, or of a
shard's, before any of them is handed to ``place``; raises to refuse them all (see
:func:`_received`)."""

_Read = Callable[
    [
        Callable[[str, Any], bool],
        bool,
        dict[str, Any] | None,
        Callable[[Collection[str]], None],
        _Fits | None,
    ],
    _Placed,
]
"""``read(place, copy, into, seen, fits)``: :func:`_received` of a ``load_model`` call's
file."""


def _received(
    src: SourceLike,
    verify: bool,
    clock: Clock,
    cache: CacheLike,
    given: Mapping[str, object],
    place: Callable[[str, Any], bool],
    copy: bool,
    into: dict[str, Any] | None,
    seen: Callable[[Collection[str]], None],
    fits: _Fits | None,
) -> _Placed:
    """:func:`_receive` of ``src``, the call's options ``given``. Read without a copy, nothing
    received into given memory, a local file with no option is read as :func:`load_file` reads
    it: mapped, with no event loop to start. ``seen`` is told the file's names before any
    tensor is read or handed to ``place``, ``fits`` (unless None) their shapes and dtypes
    before any is handed to it (of a sharded checkpoint, each shard's before any of that
    shard's is)."""
    from .compat._sync import run

    if not copy and not into:
        loaded = _local.load_mapped(src, True, verify, "mmap", given)
        if loaded is not None:
            seen(list(loaded))
            if fits is not None:
                fits({name: (tuple(t.shape), t.dtype) for name, t in loaded.items()})
            placed: set[str] = set()
            others: list[tuple[str, Any]] = []
            for name in list(loaded):  # each let go once placed
                _hand(place, name, loaded.pop(name), placed, others)
            return placed, others
    return run(_receive, src, place, seen, fits, verify, clock, copy, into, cache)


def _hand(
    place: Callable[[str, Any], bool],
    name: str,
    tensor: Any,
    placed: set[str],
    others: list[tuple[str, Any]],
) -> None:
    """Hand ``tensor`` to ``place``: ``name`` into ``placed`` if it took it, else the pair into
    ``others``."""
    if place(name, tensor):
        placed.add(name)
    else:
        others.append((name, tensor))


async def _receive(
    src: SourceLike,
    place: Callable[[str, Any], bool],
    seen: Callable[[Collection[str]], None],
    fits: _Fits | None,
    verify: bool,
    clock: Clock,
    copy: bool,
    into: dict[str, Any] | None = None,
    cache: CacheLike = None,
) -> _Placed:
    """Read every tensor of ``src`` (``into`` those it can take, as it holds them once ``seen``
    was told the file's names) and hand each to ``place``; the names it took, and the tensors
    it did not. Of an index without a weight map, ``seen`` is told none. ``fits`` (unless None)
    is told the shapes and dtypes of the file's tensors before the first is handed to
    ``place``, of a sharded checkpoint's shard by shard, before each shard's first."""
    from ._api import stream_for
    from .core.arrays import torch_dtype, torch_shape
    from .memory.delivery import Delivery
    from .sharded.reader import ShardedStream

    placed: set[str] = set()
    others: list[tuple[str, Any]] = []
    stream = stream_for(
        os.fspath(src) if isinstance(src, os.PathLike) else src,
        verify=verify,
        clock=clock,
        delivery=Delivery("pt", into, exact=False, writable=True),
        copy=copy,
        cache=cache,
    )
    try:
        await stream.open(read_all=True)  # every byte: one request, the copy given its room
        checked = None  # the header whose shapes fits was told
        if isinstance(stream, ShardedStream):
            seen(list(stream.index.weight_map or ()))
        else:
            seen([info.name for info in stream.header.tensors])
        async for name, tensor in stream:
            if fits is not None and stream.header is not checked:  # the file's, or a new shard's
                checked = stream.header
                infos = checked.tensors
                fits({i.name: (torch_shape(i.dtype, i.shape), torch_dtype(i.dtype)) for i in infos})
            _hand(place, name, tensor, placed, others)
    finally:
        await stream.aclose()
    return placed, others
