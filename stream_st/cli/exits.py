"""The ``stream-st`` command's exit statuses, and what it says when interrupted: a module that
imports nothing of the package, so that the command's entry point can use it before anything
else is loaded."""

from __future__ import annotations

import sys

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_DIFFERENT",
    "EXIT_ERROR",
    "EXIT_INTERNAL",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "SIGNAL_GRACE",
    "interrupted",
]

EXIT_OK = 0
"""Success."""

EXIT_DIFFERENT = 1
"""Different (``diff``) or invalid (``validate``)."""

EXIT_ERROR = 2
"""An error: one line on stderr naming the URL and offset."""

EXIT_INTERNAL = 3
"""An internal error (a bug: the traceback is printed)."""

EXIT_INTERRUPTED = 130
"""Interrupted by SIGINT (Ctrl-C): 128 + its number, as shells report it."""

EXIT_BROKEN_PIPE = 141
"""The reader of the output went away (``| head``): 128 + SIGPIPE's number."""


SIGNAL_GRACE = 0.01
"""Seconds a failure waits before it is reported, for a stopping signal delivered with it (a
source ended by the same hangup) to be handled first: the event loop reads signals in its next
turns, and the signal, not the failure it caused, is what the command reports."""


def interrupted() -> int:
    """Say that the command was interrupted; its exit status."""
    print("stream-st: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED
