"""Stub of the compiled module ``stream_st/transports/file/_held.c``: what a local file's reader
holds (a mapping, a descriptor), let go in C."""

from typing import final

@final
class Mapping:
    """A file's bytes mapped (a buffer: read-only unless mapped with ``PROT_WRITE``), unmapped
    when the last view of them is gone."""

    def __buffer__(self, flags: int, /) -> memoryview: ...
    def madvise(self, advice: int, start: int, length: int, /) -> None:
        """``madvise(advice)`` over ``length`` bytes from ``start`` (cut at the end)."""

@final
class Descriptor:
    """A descriptor held, closed when this is gone."""

    def fileno(self) -> int:
        """The descriptor held (-1 once closed)."""
    def close(self) -> None:
        """Close the descriptor now (once)."""

def map(fd: int, size: int, flags: int, prot: int, /) -> Mapping:
    """``size`` bytes of ``fd`` mapped (``mmap`` with ``flags`` and ``prot``), holding no
    descriptor; ``OSError`` where ``mmap`` fails."""

def descriptor(fd: int, /) -> Descriptor:
    """``fd`` held, closed when the object returned is gone."""
