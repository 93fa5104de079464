"""The ``stream-st`` command: the entry point (:mod:`.app`), the command line (:mod:`.parser`),
what each subcommand does (:mod:`.commands`), what it prints (:mod:`.output`), its network
options (:mod:`.options`), and the demo (:mod:`.demo`).

This module imports none of them until :func:`main` runs, so that an interrupt (Ctrl-C) while
they load ends the command as one during its work does, not with a traceback."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

EXIT_INTERRUPTED = 130
"""The exit status of a command interrupted by SIGINT (128 + its number, as shells report it)."""


def interrupted() -> int:
    """Say that the command was interrupted; its exit status."""
    print("stream-st: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stream-st`` command (``argv``: its arguments, else the process's);
    returns the exit status."""
    try:
        from .app import main as run
    except KeyboardInterrupt:
        return interrupted()
    return run(argv)
