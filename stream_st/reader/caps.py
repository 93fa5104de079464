"""The per-reader caps on what a read may allocate: :class:`Caps` and :data:`NO_CAPS`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ..core.header import TensorInfo
from ..errors import AllocationError, UsageError

# Caps on what a read may make the reader allocate: ``max_tensor_bytes`` and ``max_total_bytes``.
# A header may declare any size, and the reader commits memory as a tensor's bytes arrive. A
# reader given caps checks the tensors it is about to read against them as soon as their header
# is known, before any of them is allocated, and refuses with AllocationError naming the tensor
# (or the total), the size declared and the cap. Sizes are the tensors' declared bytes, wherever
# they would land (fresh memory, ``into=`` memory, a mapping); a tensor not selected by
# ``include=`` is not read, so it does not count.


def _cap(name: str, value: object) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UsageError(f"{name} must be None or an integer >= 0 (bytes), got {value!r}")
    return value


@dataclass(frozen=True)
class Caps:
    """``tensor``: the most bytes one tensor read may declare; ``total``: the most all the
    tensors of one read may declare together (of every shard, for an index or manifest).
    None: no cap."""

    tensor: int | None = None
    total: int | None = None

    @classmethod
    def of(cls, max_tensor_bytes: object = None, max_total_bytes: object = None) -> Caps:
        """The caps the keywords give; :class:`~stream_st.UsageError` for a bad value."""
        return cls(
            _cap("max_tensor_bytes", max_tensor_bytes), _cap("max_total_bytes", max_total_bytes)
        )

    def check(self, tensors: Iterable[TensorInfo], source: str, before: int = 0) -> int:
        """The bytes ``tensors`` (of ``source``, to be read) declare, plus ``before`` (bytes of
        the same read already counted); :class:`~stream_st.AllocationError` if one tensor or
        the whole is over its cap. Nothing is allocated for them before this passes."""
        return self.check_total(self.tally(tensors, source, before), source)

    def tally(self, tensors: Iterable[TensorInfo], source: str, before: int = 0) -> int:
        """:meth:`check` without the total's cap: a read checked a slice of its tensors at a
        time counts them here, then checks the whole once (:meth:`check_total`)."""
        total = before
        for info in tensors:
            if self.tensor is not None and info.nbytes > self.tensor:
                raise AllocationError(
                    f"{source}: tensor {info.name!r} declares {info.nbytes} bytes, more than "
                    f"max_tensor_bytes={self.tensor} allows: refused before allocating it"
                )
            total += info.nbytes
        return total

    def check_total(self, total: int, source: str) -> int:
        """``total``, the bytes the tensors of a read declare together;
        :class:`~stream_st.AllocationError` if that is over ``max_total_bytes``."""
        if self.total is not None and total > self.total:
            raise AllocationError(
                f"{source}: the tensors to read declare {total} bytes, more than "
                f"max_total_bytes={self.total} allows: refused before allocating them"
            )
        return total


NO_CAPS = Caps()
"""A read with no cap."""


_AMBIENT: ContextVar[Caps] = ContextVar("stream_st_caps", default=NO_CAPS)


def current_caps() -> Caps:
    """The caps :func:`using_caps` set for the reads in this context (:data:`NO_CAPS` if none)."""
    return _AMBIENT.get()


@contextmanager
def using_caps(caps: Caps) -> Iterator[Caps]:
    """Every read in the ``with`` block (in this task and those it starts) given no caps of its
    own is capped by ``caps``: how the command's ``--max-tensor-bytes`` and
    ``--max-total-bytes`` reach every read a subcommand makes."""
    token = _AMBIENT.set(caps)
    try:
        yield caps
    finally:
        _AMBIENT.reset(token)
