"""Which torch tensors of a state dict share memory: the helpers the reference's
``safetensors.torch`` offers under these names (``storage_ptr``, ``storage_size``,
``_find_shared_tensors``, ``_remove_duplicate_names``, ``_is_complete``, ``_end_ptr``), which
transformers and other code import, with the same results but for one case. A tensor joins
the group of those before it (by address) when it starts before the furthest end any of them
reaches, where the reference's compares its start with the end of the one just before only:
for ``A`` a whole storage, ``B = A[2:4]`` and ``C = A[5:8]``, the reference makes ``C``, inside
``A``, a group of its own that no name covers (so its ``_remove_duplicate_names`` and
``save_model`` raise), where this gives one group, ``A`` kept for ``B`` and ``C``.

Tensors share memory when they live on the same device in the same storage (same address and
size) and their bytes overlap; tensors on the ``meta`` device, or in an empty storage, share
nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from ..core.arrays import load_torch
from ..errors import UsageError

__all__ = [
    "changed_in_place",
    "end_ptr",
    "find_shared_tensors",
    "in_cpu_memory",
    "is_complete",
    "kept_name",
    "load_errors",
    "load_state",
    "receivable",
    "remove_duplicate_names",
    "shared_counted",
    "shared_groups",
    "storage_ptr",
    "storage_size",
]


def storage_ptr(tensor: Any) -> int:
    """The address of ``tensor``'s storage (0 for one that has none, e.g. on ``meta``)."""
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (NotImplementedError, RuntimeError):
        return 0


def storage_size(tensor: Any) -> int:
    """The bytes of ``tensor``'s storage (for a tensor without one, its own bytes)."""
    try:
        return int(tensor.untyped_storage().nbytes())
    except (NotImplementedError, RuntimeError):
        return int(tensor.nelement() * tensor.element_size())


def end_ptr(tensor: Any) -> int:
    """The address just past ``tensor``'s last element (its start for an empty one)."""
    start = int(tensor.data_ptr())
    if not tensor.nelement():
        return start
    last = sum(int(n - 1) * int(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start + (last + 1) * int(tensor.element_size())


def is_complete(tensor: Any) -> bool:
    """Whether ``tensor`` covers its whole storage, start to end (so it can stand for every
    tensor viewing that storage)."""
    return bool(
        tensor.data_ptr() == storage_ptr(tensor)
        and tensor.nelement() * tensor.element_size() == storage_size(tensor)
    )


def _overlapping(names: list[str], state: Mapping[str, Any]) -> list[set[str]]:
    """``names`` (tensors of one storage) in groups whose bytes overlap, by address: a tensor
    starting before the furthest end reached so far joins the group (the module docstring
    says how the reference differs)."""
    areas = sorted((int(state[n].data_ptr()), end_ptr(state[n]), n) for n in names)
    groups: list[set[str]] = []
    reach = -1
    for start, stop, name in areas:
        if groups and start < reach:
            groups[-1].add(name)
        else:
            groups.append({name})
        reach = max(reach, stop)
    return groups


def find_shared_tensors(state_dict: Mapping[str, Any]) -> list[set[str]]:
    """Every tensor of ``state_dict`` (the argument named as the reference names it) with
    memory of its own, in groups of the names whose bytes overlap (a group of one for a tensor
    that shares none), storage by storage in the order their first tensor comes in
    ``state_dict``."""
    by_storage: dict[tuple[Any, int, int], list[str]] = {}
    for name, tensor in state_dict.items():
        if tensor.device.type == "meta":
            continue
        pointer, size = storage_ptr(tensor), storage_size(tensor)
        if pointer and size:
            by_storage.setdefault((tensor.device, pointer, size), []).append(name)
    groups: list[set[str]] = []
    for names in by_storage.values():
        groups.extend([set(names)] if len(names) == 1 else _overlapping(names, state_dict))
    return groups


def remove_duplicate_names(
    state_dict: Mapping[str, Any],
    *,
    preferred_names: Iterable[str] | None = None,
    discard_names: Iterable[str] | None = None,
) -> defaultdict[str, list[str]]:
    """For each group of names of ``state_dict`` sharing memory: the name to keep, and the
    others (sorted), in a ``defaultdict(list)`` as the reference's (a name kept for no other
    gives ``[]``), its arguments named as there.

    The kept name covers the whole storage (:func:`is_complete`); among those, the first in
    sorted order of the ``preferred_names``, else of those not in ``discard_names``, else of
    all (:func:`kept_name`). A group (even of one) none of whose tensors covers its storage
    raises :class:`~stream_st.UsageError` (a ``RuntimeError``, as the reference raises).
    """
    preferred = set(preferred_names or ())
    discard = set(discard_names or ())
    kept: defaultdict[str, list[str]] = defaultdict(list)
    for group, complete in shared_groups(state_dict):
        keep = kept_name(complete, preferred, discard)
        if len(group) > 1:
            kept[keep] = sorted(name for name in group if name != keep)
    return kept


def shared_groups(state: Mapping[str, Any]) -> list[tuple[set[str], list[str]]]:
    """:func:`find_shared_tensors`' groups, each with its names that cover the whole storage
    (sorted); a group with none raises as :func:`remove_duplicate_names` does."""
    groups = []
    for group in find_shared_tensors(state):
        complete = sorted(name for name in group if is_complete(state[name]))
        if not complete:
            raise UsageError(
                "Error while trying to find names to remove to save state dict, but found no "
                f"suitable name to keep for saving amongst: {group}. None is covering the entire "
                "storage. Refusing to save/load the model since you could be storing much more "
                "memory than needed: save .clone()s of the tensors."
            )
        groups.append((group, complete))
    return groups


def kept_name(complete: list[str], preferred: set[str], discard: frozenset[str] | set[str]) -> str:
    """The name kept of a group whose ``complete`` names (sorted) cover its storage: the first
    of those ``preferred``, else of those not to ``discard``, else the first."""
    return next(
        iter(
            [n for n in complete if n in preferred]
            or [n for n in complete if n not in discard]
            or complete
        )
    )


def loading_their_own_way(model: Any) -> tuple[str, ...]:
    """The prefixes (``"block."``; ``""`` for the model itself) of the modules that load in
    their own way: a load pre-hook (``spectral_norm``'s), or a ``_load_from_state_dict`` of
    their own (torch's own modules', which only read older versions' layouts, aside). Their
    tensors, and those of the modules in them, go through ``load_state_dict`` as the
    reference's ``load_model`` gives them, never received in place past their code. A load
    post-hook anywhere makes it the whole model (``""``): torch tells each one the names found
    missing so far in the whole load, so every tensor goes through ``load_state_dict`` for it
    to see the reference's missing and unexpected names."""
    plain = load_torch().nn.Module._load_from_state_dict
    modules = list(model.named_modules())
    if any(module._load_state_dict_post_hooks for _, module in modules):
        return ("",)
    prefixes = []
    for name, module in modules:
        loads = type(module)._load_from_state_dict
        custom = loads is not plain and not loads.__module__.startswith("torch.nn.")
        if module._load_state_dict_pre_hooks or custom:
            prefixes.append(f"{name}." if name else "")
    return tuple(prefixes)


def receivable(model: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """Of ``state`` (``model.state_dict()``), the tensors ``load_model`` may receive in place,
    past ``load_state_dict``: each the model's own parameter or buffer of its name (the same
    memory seen alike, where a state-dict hook or a ``_save_to_state_dict`` of its own may give
    a copy, or another name), not a conjugate or negative view (whose bytes are not its
    values), of no module that loads in its own way (:func:`loading_their_own_way`). The
    others go through ``load_state_dict``, as the reference's ``load_model`` gives them."""
    own = loading_their_own_way(model)
    tensors = [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]
    memory = {name: _memory(tensor) for name, tensor in tensors}
    return {
        name: value
        for name, value in state.items()
        if isinstance(value, load_torch().Tensor)
        and not name.startswith(own)
        and not value.is_conj()
        and not value.is_neg()
        and memory.get(name) == _memory(value)
    }


def in_cpu_memory(tensors: Mapping[str, Any]) -> dict[str, Any]:
    """Of ``tensors`` (:func:`receivable`'s), those whose memory a file's bytes can be read
    straight into: on the CPU, not meta, contiguous."""
    return {
        name: tensor
        for name, tensor in tensors.items()
        if tensor.device.type == "cpu" and not tensor.is_meta and tensor.is_contiguous()
    }


def changed_in_place(tensors: Iterable[Any]) -> None:
    """Tell autograd that ``tensors`` (received in place by ``load_model``, through other
    views of their memory) changed in place, as the reference's ``copy_`` tells it: a backward
    through a graph built before the load raises, instead of using the new values."""
    bump = load_torch().autograd.graph.increment_version
    for tensor in tensors:
        bump(tensor)


def _memory(tensor: Any) -> tuple[Any, ...]:
    """Where ``tensor``'s values lie and how they are seen: two tensors alike here are one."""
    return (
        storage_ptr(tensor),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.device,
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def load_state(model: Any, tensors: dict[str, Any]) -> tuple[list[str], list[str]]:
    """``model.load_state_dict(tensors, strict=False)``: its missing and unexpected names. The
    dict has no ``_metadata``, as the reference's ``load_file`` gives none: modules read it as
    a checkpoint of no version (BatchNorm then takes one without ``num_batches_tracked``). The
    ``RuntimeError`` torch raises for tensors it cannot take (a shape that differs) is a
    :class:`~stream_st.UsageError`, a ``RuntimeError`` still, with torch's message."""
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as exc:
        if not str(exc).startswith("Error(s) in loading state_dict"):
            raise
        raise UsageError(str(exc)) from exc
    return list(missing), list(unexpected)


def shared_counted(
    state: Mapping[str, Any], in_file: Iterable[str], missing: set[str], unexpected: list[str]
) -> None:
    """Count the names of ``state`` that share memory as the reference's ``load_model`` counts
    them, in place: each name stood for by the one kept (see :func:`remove_duplicate_names`,
    the names ``in_file`` preferred) is not missing if it was, else unexpected."""
    for dropped in remove_duplicate_names(state, preferred_names=in_file).values():
        for name in dropped:
            if name in missing:
                missing.remove(name)
            else:
                unexpected.append(name)


def load_errors(model: Any, missing: set[str], unexpected: list[str]) -> str:
    """The message of a strict load that found ``missing`` or ``unexpected`` names, worded as
    torch's ``load_state_dict`` words it."""
    lines = [f"Error(s) in loading state_dict for {type(model).__name__}:"]
    if missing:
        names = ", ".join(f'"{name}"' for name in sorted(missing))
        lines.append(f"    Missing key(s) in state_dict: {names}")
    if unexpected:
        names = ", ".join(f'"{name}"' for name in sorted(unexpected))
        lines.append(f"    Unexpected key(s) in state_dict: {names}")
    return "\n".join(lines)
