"""Regular expressions compiled on their first use, not at import.

Compiling a pattern takes 20-300 us; the modules every load imports (the errors' secret masks,
the header parser's rarer paths) held two dozen of them, 2-3 ms of a drop-in's ~12 ms import,
most of them for errors or inputs a program may never meet.
"""

from __future__ import annotations

import re
from typing import AnyStr, Generic

__all__ = ["LazyPattern"]


class LazyPattern(Generic[AnyStr]):
    """``re.compile(source, flags)``, made the first time :attr:`compiled` is asked for (by any
    thread: two threads racing each compile it, and both results are the same pattern)."""

    __slots__ = ("_compiled", "_flags", "_source")

    def __init__(self, source: AnyStr, flags: int = 0) -> None:
        self._source: AnyStr = source
        self._flags = flags
        self._compiled: re.Pattern[AnyStr] | None = None

    @property
    def compiled(self) -> re.Pattern[AnyStr]:
        """The compiled pattern."""
        compiled = self._compiled
        if compiled is None:
            compiled = self._compiled = re.compile(self._source, self._flags)
        return compiled

    def __repr__(self) -> str:
        return f"LazyPattern({self._source!r})"
